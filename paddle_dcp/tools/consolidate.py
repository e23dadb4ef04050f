"""Full (global) tensors of a checkpoint, streamed in slabs, and the single-file formats they go to.

A tensor is read as consecutive slabs of its C-order bytes, each at most :data:`SLAB_BYTES`
(a box of whole trailing rows, cut along the outer dims as :func:`boxes.split_region` does),
through the load's own planner and reader: every block read is checked against its checksum.
One slab buffer is reused for all of them, so converting a checkpoint, or a tensor larger than
memory, needs about one slab of memory, whatever the checkpoint's size.

Writers: safetensors (header from the metadata first, then every tensor's bytes), npz (numpy's
zip of ``.npy`` members, each written as a stream), and pdparams (``paddle.save``: holds each
tensor in memory, as pickle needs whole objects).
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..io import reads
from ..core.dtypes import as_bytes
from ..core import load_plan, nested
from ..io import datafile, is_url, open_output, open_storage
from ..io.local import atomic_path
from ..io.storage import open_data_files
from ..core.boxes import Box, split_region
from ..core.dtypes import bf16_to_float32, storage_dtype
from ..errors import ArgumentError, StorageError, UnsupportedError
from ..core.metadata import Metadata, TensorEntry
from ..format.safetensors import code_of, encode_header, read_arrays

logger = logging.getLogger(__name__)

SLAB_BYTES = 64 << 20  # the most bytes of a tensor held in memory at once (convert, verify)

NPZ_METADATA = "__metadata__"  # npz member holding dtypes and plain values as JSON

Progress = Callable[[int], None]  # called with the bytes just done


@dataclass(frozen=True)
class Selection:
    """What to convert: tensor keys and plain values, in checkpoint order."""

    keys: tuple[str, ...]
    values: dict[str, Any]


def select(meta: Metadata, pattern: str | None = None) -> Selection:
    """Keys and values whose flat key matches ``pattern`` (``re.search``; all when None).

    Raises:
        ArgumentError: the pattern is not a valid regular expression.
    """
    keep = key_filter(pattern)
    keys = tuple(k for k in meta.tensors if keep(k))
    values = {k: v for k, v in meta.values().items() if keep(k)}
    return Selection(keys, values)


def key_filter(pattern: str | None) -> Callable[[str], bool]:
    """Whether a key matches ``pattern`` (``re.search``; every key when None).

    Raises:
        ArgumentError: the pattern is not a valid regular expression.
    """
    try:
        rx = re.compile(pattern) if pattern is not None else None
    except re.error as exc:
        raise ArgumentError(f"{pattern!r} is not a regular expression: {exc}") from None
    return (lambda k: True) if rx is None else (lambda k: rx.search(k) is not None)


def output_dtype(dtype: str, bf16_as_float32: bool) -> str:
    return "float32" if dtype == "bfloat16" and bf16_as_float32 else dtype


def output_nbytes(entry: TensorEntry, bf16_as_float32: bool) -> int:
    return math.prod(entry.shape) * storage_dtype(output_dtype(entry.dtype, bf16_as_float32)).itemsize


class TensorReader:
    """Reads boxes and C-order slabs of a checkpoint's tensors, checksums checked.

    Args:
        path: the checkpoint directory.
        meta: its metadata (lazily parsed is fine: every box read is checked to be covered).
        slab_bytes: the most bytes of a slab; default :data:`SLAB_BYTES` at construction.
    """

    def __init__(self, path: str, meta: Metadata, slab_bytes: int | None = None):
        self.path = path
        self.meta = meta
        self.slab_bytes = max(16, int(slab_bytes if slab_bytes is not None else SLAB_BYTES))
        self.files = open_data_files(open_storage(path), meta)
        self._buf = np.empty(0, dtype=np.uint8)

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.files.close()
        self._buf = np.empty(0, dtype=np.uint8)

    def read_into(self, key: str, box: Box, out: np.ndarray) -> None:
        """Fill ``out`` (shape ``box.shape``, the storage dtype) with ``box`` of tensor ``key``."""
        entry = self.meta.tensors[key]
        self.read_pieces([load_plan.TargetPiece(key, entry.dtype, tuple(entry.shape), box)], [0], [out])

    def read_pieces(self, pieces: Sequence[load_plan.TargetPiece], slots: Sequence[int], arrays: Sequence[np.ndarray]) -> None:
        """Fill ``arrays[slots[i]]`` (shaped as the box, storage dtype) with each piece."""
        ops = load_plan.plan_reads(self.meta, pieces, max_read_bytes=self.slab_bytes, slots=slots)
        reads.execute_reads(ops, self.meta, self.files, arrays)

    def slabs(self, key: str, slab_bytes: int | None = None) -> Iterator[np.ndarray]:
        """The tensor's elements in C order, as consecutive arrays of at most ``slab_bytes``
        bytes each (views of one reused buffer: use each before asking for the next)."""
        entry = self.meta.tensors[key]
        dtype = storage_dtype(entry.dtype)
        limit = max(dtype.itemsize, int(slab_bytes or self.slab_bytes))
        whole = Box.whole(entry.shape)
        if len(self._buf) < min(limit, entry.nbytes):
            self._buf = np.empty(min(limit, entry.nbytes), dtype=np.uint8)
        for box in split_region(whole, limit // dtype.itemsize, entry.shape):
            out = self._buf[: box.volume * dtype.itemsize].view(dtype).reshape(box.shape)
            self.read_into(key, box, out)
            yield out

    def read(self, key: str) -> np.ndarray:
        """The whole tensor in a new array of its storage dtype (bfloat16 as uint16)."""
        entry = self.meta.tensors[key]
        out = np.empty(entry.shape, dtype=storage_dtype(entry.dtype))
        if out.size:
            self.read_into(key, Box.whole(entry.shape), out)
        return out


def _output_slabs(reader: TensorReader, key: str, bf16_as_float32: bool) -> Iterator[np.ndarray]:
    """Slabs converted to the output dtype; a converted slab stays within ``slab_bytes``."""
    entry = reader.meta.tensors[key]
    if entry.dtype == "bfloat16" and bf16_as_float32:
        for slab in reader.slabs(key, reader.slab_bytes // 2):
            yield bf16_to_float32(slab)
    else:
        yield from reader.slabs(key)


def output_bytes(reader: TensorReader, key: str, bf16_as_float32: bool, progress: Progress | None) -> Iterator[memoryview]:
    """The bytes of ``key``'s output slabs, each counted by ``progress`` once it is written
    (when the consumer asks for the next)."""
    return counted_bytes(_output_slabs(reader, key, bf16_as_float32), progress)


def counted_bytes(slabs: Iterator[np.ndarray], progress: Progress | None) -> Iterator[memoryview]:
    """The bytes of each slab, counted by ``progress`` once the consumer asks for the next."""
    for slab in slabs:
        yield as_bytes(slab)
        if progress:
            progress(slab.nbytes)


@contextmanager
def output_writer(out: str, header: bytes = b"") -> Iterator[datafile.DataFileWriter]:
    """The file ``out`` (a local path or a URL) being written through its storage's data
    writer, ``header`` first, no checksums or padding: it appears, complete, when the block
    ends (a rename, or the end of a multipart upload), and never when it raises."""
    writer = open_output(out, header)
    try:
        yield writer
        writer.commit()
    except BaseException:
        writer.abort()
        raise


class _WriterFile(io.RawIOBase):
    """A data writer as the write-only, unseekable file that zipfile writes to."""

    def __init__(self, writer: datafile.DataFileWriter):
        self.writer = writer

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.writer.write(view, keep=data)
        return len(view)


# ------------------------------------------------------------------ safetensors
def safetensors_header(
    meta: Metadata, selection: Selection, bf16_as_float32: bool = False
) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file holding the selection:
    tensors in selection order, back to back; plain values in ``__metadata__`` as JSON text.

    Raises:
        UnsupportedError: a dtype safetensors cannot hold (complex128), naming the key.
    """
    # each plain value as JSON text, and the nesting of what the file holds (the skeleton of
    # docs/format.md), so that paddle_dcp.load_state_dict reads the file back whole
    metadata = {k: json.dumps(v) for k, v in selection.values.items()}
    kept = set(selection.keys) | set(selection.values)
    metadata["structure"] = json.dumps(nested.restrict(meta.structure, kept), separators=(",", ":"))
    tensors = []
    for key in selection.keys:
        entry = meta.tensors[key]
        dtype = output_dtype(entry.dtype, bf16_as_float32)
        tensors.append((key, code_of(key, dtype), entry.shape, output_nbytes(entry, bf16_as_float32)))
    return encode_header(tensors, metadata)


def write_safetensors(
    path: str,
    meta: Metadata,
    out: str,
    selection: Selection,
    bf16_as_float32: bool = False,
    progress: Progress | None = None,
) -> int:
    """Write the selected full tensors to one safetensors file, one slab at a time.

    Returns:
        The output file's size, in bytes.
    """
    header = safetensors_header(meta, selection, bf16_as_float32)
    with TensorReader(path, meta) as reader, output_writer(out, header) as writer:
        for key in selection.keys:
            for data in output_bytes(reader, key, bf16_as_float32, progress):
                writer.write(data, keep=data)
        written = writer.offset
    logger.info("wrote %d tensors to %s (%d bytes)", len(selection.keys), out, written)
    return written


# ------------------------------------------------------------------ npz
def _npy_header(shape: Sequence[int], dtype: np.dtype) -> bytes:
    import io

    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    buf = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buf, d)
    except ValueError:  # a header over 64 KiB (very many dims): version 2.0 holds it
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, d)
    return buf.getvalue()


def write_npz(
    path: str,
    meta: Metadata,
    out: str,
    selection: Selection,
    bf16_as_float32: bool = False,
    progress: Progress | None = None,
) -> int:
    """Write the selected full tensors to one ``.npz`` (``np.load`` reads it without pickle).

    bfloat16 tensors are stored as their uint16 bit patterns (numpy has no bfloat16), or as
    float32 values with ``bf16_as_float32``; the member ``__metadata__`` holds a JSON text with
    every tensor's checkpoint dtype and the plain values.

    Returns:
        The output file's size, in bytes.
    """
    if NPZ_METADATA in selection.keys:
        raise UnsupportedError(f"a tensor named {NPZ_METADATA!r} collides with the npz metadata member")
    for key in selection.keys:
        _check_member_name(key)
    info = {
        "format": "paddle_dcp npz",
        "dtypes": {k: meta.tensors[k].dtype for k in selection.keys},
        "bfloat16": "float32 values" if bf16_as_float32 else "uint16 bit patterns",
        "values": {k: nested.json_plain(v) for k, v in selection.values.items()},
    }
    with TensorReader(path, meta) as reader, output_writer(out) as writer:
        try:
            with zipfile.ZipFile(_WriterFile(writer), "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for key in selection.keys:
                    entry = meta.tensors[key]
                    dtype = storage_dtype(output_dtype(entry.dtype, bf16_as_float32))
                    with zf.open(key + ".npy", "w", force_zip64=True) as member:
                        member.write(_npy_header(entry.shape, dtype))
                        for data in output_bytes(reader, key, bf16_as_float32, progress):
                            member.write(data)
                text = np.array(json.dumps(info, allow_nan=False))
                with zf.open(NPZ_METADATA + ".npy", "w") as member:
                    member.write(_npy_header(text.shape, text.dtype))
                    member.write(text.tobytes())
        except OSError as exc:
            raise StorageError(f"cannot write {out}: {exc}", out) from exc
        size = writer.offset
    logger.info("wrote %d tensors to %s (%d bytes)", len(selection.keys), out, size)
    return size


def _check_member_name(key: str) -> None:
    """Refuse a key that would make a zip member a tool could extract outside its directory
    (absolute, ``..``, backslashes, empty parts) or that holds control characters."""
    parts = key.split("/")
    if (
        not key or "\\" in key or any(p in ("", ".", "..") for p in parts)
        or any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in key)
    ):  # fmt: skip
        raise UnsupportedError(f"tensor {key!r} cannot be an npz member name (a path outside the archive, or control characters); select it out or convert to safetensors")


# ------------------------------------------------------------------ pdparams
def write_pdparams(
    path: str,
    meta: Metadata,
    out: str,
    selection: Selection,
    bf16_as_float32: bool = False,
    progress: Progress | None = None,
) -> int:
    """Write the selected full tensors (paddle tensors, bfloat16 kept) and plain values to a
    flat dict file loadable with ``paddle.load``. pickle needs whole objects: every selected
    tensor is held in memory until the file is written.

    Returns:
        The output file's size, in bytes.
    """
    try:
        import paddle
    except ImportError as exc:
        raise UnsupportedError(f"writing pdparams needs paddle ({exc}); safetensors and npz do not") from None
    state: dict[str, Any] = {}
    with TensorReader(path, meta) as reader:
        for key in selection.keys:
            entry = meta.tensors[key]
            array = reader.read(key)
            if entry.dtype == "bfloat16" and bf16_as_float32:
                array = bf16_to_float32(array)
            state[key] = _paddle_tensor(paddle, array, output_dtype(entry.dtype, bf16_as_float32))
            if progress:
                progress(array.nbytes)
            del array
    state.update(selection.values)
    if is_url(out):  # paddle.save writes a path or a file object; the bytes go up in parts
        buf = io.BytesIO()
        paddle.save(state, buf)
        del state
        with output_writer(out) as writer:
            writer.write(buf.getbuffer())
        return writer.offset
    with atomic_path(out) as tmp:
        try:
            paddle.save(state, tmp)
        except OSError as exc:
            raise StorageError(f"cannot write {out}: {exc}", out) from exc
        size = os.path.getsize(tmp)
    logger.info("wrote %d tensors to %s (%d bytes)", len(selection.keys), out, size)
    return size


def _paddle_tensor(paddle, array: np.ndarray, dtype: str):
    tensor = paddle.to_tensor(array, place=paddle.CPUPlace())
    if dtype == "bfloat16" and tensor.dtype != paddle.bfloat16:
        tensor = tensor.view(paddle.bfloat16)
    return tensor


WRITERS = {"safetensors": write_safetensors, "npz": write_npz, "pdparams": write_pdparams}


def convert(
    path: str,
    meta: Metadata,
    out: str,
    to: str,
    selection: Selection,
    bf16_as_float32: bool = False,
    progress: Progress | None = None,
) -> int:
    """Write the selected full tensors of a checkpoint to ``out`` in format ``to``
    (``safetensors``, ``npz`` or ``pdparams``); the file appears only once complete.

    Returns:
        The output file's size, in bytes.

    Raises:
        ArgumentError: an unknown format.
        UnsupportedError: a dtype or a name the format cannot hold.
        FormatError / IntegrityError / StorageError: a damaged checkpoint or an I/O failure.
    """
    writer = WRITERS.get(to)
    if writer is None:
        raise ArgumentError(f"unknown output format {to!r}; choose one of {', '.join(WRITERS)}")
    for key in selection.keys:  # every entry validated before the output is created
        meta.tensors[key]
    return writer(path, meta, out, selection, bf16_as_float32, progress)


def selected_bytes(meta: Metadata, selection: Selection, bf16_as_float32: bool = False) -> int:
    """Bytes of tensor data a conversion of ``selection`` writes."""
    return sum(output_nbytes(meta.tensors[k], bf16_as_float32) for k in selection.keys)


# import-paddle reads paddle's safetensors rank files through the one strict reader
read_safetensors = read_arrays
