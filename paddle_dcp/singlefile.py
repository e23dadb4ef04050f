"""One safetensors file (as :func:`paddle_dcp.save_gathered` writes it) -> a state dict, in place.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON,
then the tensors' raw little-endian bytes. The JSON maps every tensor's key to its ``dtype``
(``F32``, ``BF16``, ...), ``shape`` and ``data_offsets`` ``[begin, end)`` in bytes from the end
of the header; the optional ``__metadata__`` holds str -> str entries. ``save_gathered`` puts
the state dict's nesting and plain values there (``structure``: the skeleton of
:mod:`paddle_dcp.nested`, as JSON). The header is parsed here, not by the ``safetensors``
package, and checked as ``safetensors`` and ``docs/format.md`` check theirs before any byte of a
tensor is read: a capped size, no duplicate keys, every field of its type, byte lengths that
match shape and dtype, byte ranges inside the file that tile the data section exactly.
No pickle anywhere.

Each process reads only what it holds: the box of every dist tensor its rank holds, the whole
of plain tensors and numpy arrays, in bounded reads straight into the tensors' host memory.
"""
from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from dataclasses import dataclass

import numpy as np

from . import nested, planner
from .boxes import Box, element_span, is_contiguous
from .dtypes import DTYPE_OF_SAFETENSORS_CODE, SAFETENSORS_CODES, storage_dtype
from .errors import FormatError, MismatchError, StorageError

logger = logging.getLogger(__name__)

# safetensors' dtypes that paddle.load reads: all of the format's but complex
SAFETENSORS_DTYPES = {name: code for name, code in SAFETENSORS_CODES.items() if not name.startswith("complex")}
DTYPE_OF_CODE = DTYPE_OF_SAFETENSORS_CODE
# Codes other writers may use: their sizes let the header be checked; loading them is refused.
_OTHER_SIZES = {"U16": 2, "U32": 4, "U64": 8, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1}

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own cap
METADATA_FORMAT = "paddle_dcp.gathered"
METADATA_VERSION = "1"
_BAND_BYTES = 64 << 20  # at most this many bytes staged per read of a strided box
_MAX_READ = 1 << 30  # one pread at most (Linux caps a read near 2 GiB)
_MAX_ELEMENTS = 1 << 62


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file.

    Attributes:
        key: its name in the file.
        code: safetensors dtype code (``F32``, ``BF16``, ...).
        shape: global shape, in elements.
        begin: first byte, from the start of the file (header included), in bytes.
        nbytes: its length, in bytes.
    """

    key: str
    code: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int

    @property
    def dtype(self) -> str | None:
        """The format's dtype name, or None for a code paddle_dcp does not load."""
        return DTYPE_OF_CODE.get(self.code)


@dataclass(frozen=True)
class Header:
    """A parsed, validated safetensors header.

    Attributes:
        entries: key -> Entry, in the order of the header (tensors without elements last).
        metadata: the ``__metadata__`` entries (str -> str).
        data_start: where the data section begins, in bytes from the start of the file.
        file_bytes: the file's size, in bytes.
        structure: the nesting and plain values ``save_gathered`` stored (a skeleton of
            :mod:`paddle_dcp.nested`), None for a file of another writer.
    """

    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    file_bytes: int
    structure: dict | None = None


def _structure(metadata: dict[str, str], keys, source: str) -> dict | None:
    """The skeleton in ``__metadata__["structure"]``, checked: it parses, and its tensor leaves
    are the file's tensors."""
    text = metadata.get("structure")
    if text is None:
        return None
    try:
        skeleton = json.loads(text)
        tensor_keys = nested.tensor_keys(skeleton)
        nested.values_of(skeleton)
    except ValueError as exc:
        raise FormatError(f"{source}: the structure in __metadata__ is not JSON: {exc}") from None
    except FormatError as exc:
        raise FormatError(f"{source}: the structure in __metadata__: {exc}") from None
    if sorted(tensor_keys) != sorted(keys):
        differ = sorted(set(tensor_keys) ^ set(keys))[:5]
        raise FormatError(f"{source}: the structure in __metadata__ does not list the file's tensors (differ: {differ})")
    return skeleton


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise FormatError(f"the header names {k!r} twice")
        out[k] = v
    return out


def _int(value, what: str) -> int:
    if type(value) is not int or value < 0:
        raise FormatError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def parse_header(raw: bytes, file_bytes: int, source: str) -> Header:
    """Validate the JSON header ``raw`` of a file of ``file_bytes`` bytes.

    Raises:
        FormatError: anything safetensors' own reader would refuse, naming ``source``.
    """
    data_start = 8 + len(raw)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except FormatError as exc:
        raise FormatError(f"{source}: {exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{source}: the safetensors header is not UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{source}: the safetensors header must be a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError(f"{source}: __metadata__ must map str to str")
    entries: dict[str, Entry] = {}
    data_bytes = file_bytes - data_start
    spans = []
    for key, info in doc.items():
        where = f"{source}: tensor {key!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{where}: an entry must have exactly dtype, shape and data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(code, str) or (code not in DTYPE_OF_CODE and code not in _OTHER_SIZES):
            raise FormatError(f"{where}: unknown dtype {code!r}")
        if not isinstance(shape, list):
            raise FormatError(f"{where}: shape must be a list")
        shape = tuple(_int(s, f"{where}: a shape entry") for s in shape)
        count = math.prod(shape)
        if count >= _MAX_ELEMENTS:
            raise FormatError(f"{where}: shape {shape} is too large")
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise FormatError(f"{where}: data_offsets must be [begin, end]")
        begin, end = (_int(o, f"{where}: data_offsets") for o in offsets)
        size = storage_dtype(DTYPE_OF_CODE[code]).itemsize if code in DTYPE_OF_CODE else _OTHER_SIZES[code]
        if end < begin or end - begin != count * size:
            raise FormatError(
                f"{where}: data_offsets [{begin}, {end}) hold {end - begin} bytes, but {code} of shape "
                f"{list(shape)} needs {count * size}"
            )
        if end > data_bytes:
            raise FormatError(
                f"{where}: bytes [{begin}, {end}) run past the end of the data ({data_bytes} bytes): truncated file?"
            )
        entries[key] = Entry(key, code, shape, data_start + begin, end - begin)
        spans.append((begin, end, key))
    # safetensors' rule: the tensors tile the data section, no overlap, no hole, nothing after
    spans.sort()
    at = 0
    for begin, end, key in spans:
        if begin != at:
            what = "overlaps the previous tensor" if begin < at else f"leaves a hole at byte {at}"
            raise FormatError(f"{source}: tensor {key!r} starting at byte {begin} of the data {what}")
        at = end
    if at != data_bytes:
        raise FormatError(f"{source}: the tensors cover {at} bytes of data, the file holds {data_bytes}")
    for key, (code, shape) in _empty_tensors(metadata, source).items():
        if key in entries:
            raise FormatError(f"{source}: tensor {key!r} is both in the header and among the empty tensors")
        entries[key] = Entry(key, code, shape, data_start, 0)
    return Header(entries, dict(metadata), data_start, file_bytes, _structure(metadata, entries, source))


def _empty_tensors(metadata: dict[str, str], source: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensors without elements, which save_gathered lists in ``__metadata__["empty_tensors"]``
    (JSON: key -> {"dtype", "shape"}) instead of the header."""
    text = metadata.get("empty_tensors")
    if text is None:
        return {}
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, FormatError) as exc:
        raise FormatError(f"{source}: empty_tensors in __metadata__: {exc}") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{source}: empty_tensors in __metadata__ must be a JSON object")
    out = {}
    for key, info in doc.items():
        where = f"{source}: empty tensor {key!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape"} or not isinstance(info["shape"], list):
            raise FormatError(f"{where}: must have exactly dtype and shape")
        if info["dtype"] not in DTYPE_OF_CODE and info["dtype"] not in _OTHER_SIZES:
            raise FormatError(f"{where}: unknown dtype {info['dtype']!r}")
        shape = tuple(_int(x, f"{where}: a shape entry") for x in info["shape"])
        if math.prod(shape) != 0:
            raise FormatError(f"{where}: shape {list(shape)} has elements")
        out[key] = (info["dtype"], shape)
    return out


def read_header(path: str) -> Header:
    """Read and validate the header of the safetensors file ``path``.

    Raises:
        FormatError: a malformed or truncated file.
        StorageError: the file cannot be read.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            file_bytes = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path}: {len(head)} bytes, too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise FormatError(f"{path}: header of {n} bytes, more than the {MAX_HEADER_BYTES} allowed")
            if 8 + n > file_bytes:
                raise FormatError(f"{path}: header of {n} bytes in a file of {file_bytes} bytes: truncated file?")
            raw = f.read(n)
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}", path) from exc
    if len(raw) != n:
        raise FormatError(f"{path}: the header ends early: truncated file?")
    return parse_header(raw, file_bytes, path)


def _pread_into(fd: int, offset: int, out: np.ndarray, path: str) -> None:
    """Fill the uint8 array ``out`` from ``offset`` of the file ``fd``."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc}", path) from exc
        if n == 0:
            raise FormatError(f"{path}: the file ends at byte {offset + done}, its header says more: truncated?")
        done += n


class _Reader:
    """Reads boxes of a file's tensors into C-contiguous arrays, staging at most one band."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path
        self._stage = np.empty(0, dtype=np.uint8)

    def stage(self, nbytes: int) -> np.ndarray:
        if len(self._stage) < nbytes:
            self._stage = np.empty(nbytes, dtype=np.uint8)
        return self._stage[:nbytes]

    def read_box(self, base: int, shape: tuple[int, ...], box: Box, out: np.ndarray) -> None:
        """``out`` (shape ``box.shape``, C order) <- ``box`` of the C-order tensor of ``shape``
        whose bytes start at ``base``."""
        if box.volume == 0:
            return
        itemsize = out.dtype.itemsize
        if is_contiguous(shape, box):
            first, _ = element_span(shape, box)
            _pread_into(self.fd, base + first * itemsize, out.reshape(-1).view(np.uint8), self.path)
            return
        row = math.prod(shape[1:]) * itemsize  # bytes of one index of dim 0
        lo, hi = box.offsets[0], box.end[0]
        if row > _BAND_BYTES:  # one row is too big to stage: go down a dimension
            inner = Box(box.offsets[1:], box.shape[1:])
            for i in range(lo, hi):
                self.read_box(base + i * row, shape[1:], inner, out[i - lo])
            return
        rows = max(1, _BAND_BYTES // row)
        rest = (slice(None),) + box.slices()[1:]
        for a in range(lo, hi, rows):
            b = min(a + rows, hi)
            band = self.stage((b - a) * row)
            _pread_into(self.fd, base + a * row, band, self.path)
            out[a - lo : b - lo] = band.view(out.dtype).reshape((b - a,) + tuple(shape[1:]))[rest]


def load_file(
    state_dict: dict, path: str, offload: bool = False, mw_name_compatibility: bool = True, strict: bool = True
) -> None:
    """Fill a (nested) state dict in place from one safetensors file.

    ``paddle_dcp.load_state_dict(state_dict, path)`` comes here when ``path`` is a file. The
    tensors of the state dict may be plain paddle tensors, numpy arrays, or dist tensors
    (each process reads the box its rank holds; Partial targets receive the value at coordinate
    0 of their partial mesh dims and 0 (SUM) / 1 (PROD) / the value (others) elsewhere, as a
    load from a checkpoint directory does). Nothing is exchanged between processes. Plain values
    are set from the structure ``save_gathered`` stored; a file from another writer has none,
    and its keys are the state dict's flat keys (``model.fc1.weight``).

    Args:
        state_dict: nested dicts / lists / tuples of tensors and plain values.
        path: the file.
        offload: put every loaded tensor in CPU memory (see :func:`paddle_dcp.load_state_dict`).
        mw_name_compatibility: load ``master_weights.X`` from ``X_fp32_master_0`` and back.
        strict: a state-dict key the file lacks raises MismatchError; ``False`` warns.

    Raises:
        MismatchError: a shape or dtype differs (the message names the key and both), or a
            key is a tensor on one side and a plain value on the other.
        FormatError: a malformed or truncated file.
        StorageError: the file cannot be read.
    """
    from .device import TargetBuffer
    from .placements import describe, is_tensor, rewrap

    path = os.fspath(path)
    started = time.perf_counter()
    header = read_header(path)
    flat = nested.flatten(state_dict, is_tensor)
    rank = _rank(flat)
    held = [describe(k, v, rank) for k, v in flat.tensors.items()]

    structure = header.structure if header.structure is not None else {"d": []}
    keys = planner.reconcile(
        list(flat.tensors), flat.skeleton, list(header.entries), structure, mw_name_compatibility, "file"
    )
    match = keys.match
    if keys.missing and strict:
        raise MismatchError(planner.missing_message(keys.missing, path))
    if keys.missing:
        logger.warning("keys of the state_dict not found in %s (left unchanged): %s", path, list(keys.missing))
    if keys.unexpected:
        logger.warning("keys of %s not in the state_dict (not loaded): %s", path, list(keys.unexpected))

    work = []  # every check before any byte moves
    for h in held:
        source = match.source.get(h.piece.key)
        if source is None:
            continue
        entry = header.entries[source]
        if entry.dtype is None:
            raise MismatchError(f"{h.piece.key}: the file holds dtype {entry.code}, which paddle_dcp does not load")
        if entry.dtype != h.piece.dtype or entry.shape != h.piece.global_shape:
            raise MismatchError(
                f"{h.piece.key}: the file has {entry.dtype} of shape {entry.shape}, "
                f"the state_dict {h.piece.dtype} of shape {h.piece.global_shape}"
            )
        if h.local is not None and h.piece.box is not None:
            work.append((h, entry))

    nbytes = 0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise StorageError(f"cannot open {path}: {exc}", path) from exc
    try:
        reader = _Reader(fd, path)
        for h, entry in work:
            value = flat.tensors[h.piece.key]
            if isinstance(h.local, np.ndarray):
                if not h.local.flags.c_contiguous or not h.local.flags.writeable:
                    raise MismatchError(f"{h.piece.key}: numpy arrays loaded in place must be C-contiguous and writable")
                buffer, array = None, h.local.view(storage_dtype(h.piece.dtype))
            else:
                buffer = TargetBuffer(h.local, offload, rewrap(value))
                array = buffer.array
            fill = _partial_fill(h)
            if fill is None:
                reader.read_box(entry.begin, entry.shape, h.piece.box, array)
                nbytes += array.nbytes
            elif buffer is not None:
                buffer.fill(fill)
            if buffer is not None:
                buffer.finish()
                if buffer.replacement is not None:
                    nested.set_tensor(state_dict, flat.paths[h.piece.key], buffer.replacement)
    finally:
        os.close(fd)
    for value_path, node in keys.plain:
        nested.assign_subtree(state_dict, value_path, node)
    logger.info("loaded %d tensors (%d bytes) from %s in %.3f s", len(work), nbytes, path, time.perf_counter() - started)


def _rank(flat: nested.Flat) -> int:
    """This process's global rank when the state dict holds dist tensors, else 0."""
    if all(isinstance(v, np.ndarray) or not v.is_dist() for v in flat.tensors.values()):
        return 0
    import paddle.distributed as dist

    return dist.get_rank()


def _partial_fill(h) -> int | None:
    """For a Partial target off coordinate 0 of a partial mesh dim: 0 (SUM) or 1 (PROD) instead
    of the value (the rule of docs/loading.md); None to load the value."""
    for mesh_dim, reduce_type in h.partial:
        if h.mesh_coord[mesh_dim] != 0 and reduce_type in ("sum", "prod"):
            return 0 if reduce_type == "sum" else 1
    return None
