"""The safetensors format: the one strict reader of its header, and the one writer of it.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON,
then the tensors' raw little-endian bytes. The JSON maps every tensor's name to its ``dtype``
(``F32``, ``BF16``, ``I64``, ...), ``shape`` and ``data_offsets`` ``[begin, end)`` in bytes
from the end of the header; the optional ``__metadata__`` holds str -> str entries.

Every file paddle_dcp reads in this format goes through :func:`parse_header`, checked as the
``safetensors`` library and ``docs/format.md`` check theirs before any byte of a tensor is read:
a capped size, UTF-8 JSON, no duplicate names, every field of its type, a known dtype, byte
lengths that match shape and dtype, byte ranges inside the file that tile the data section
exactly (no overlap, no hole, nothing after). Every header paddle_dcp writes comes from
:func:`encode_header`. No pickle anywhere. Pure: stdlib and numpy.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Mapping

import numpy as np

from ..core import nested
from ..core.dtypes import DTYPE_OF_SAFETENSORS_CODE, SAFETENSORS_CODES, storage_dtype
from ..errors import FormatError, StorageError, UnsupportedError
from ..core.json_text import parse_json

# safetensors' dtypes that paddle.load reads: all of the format's but complex
SAFETENSORS_DTYPES = {name: code for name, code in SAFETENSORS_CODES.items() if not name.startswith("complex")}
DTYPE_OF_CODE = DTYPE_OF_SAFETENSORS_CODE
# Codes other writers may use: their sizes let the header be checked; loading them is refused.
_OTHER_SIZES = {"U16": 2, "U32": 4, "U64": 8, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1}

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own cap
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
            :mod:`paddle_dcp.core.nested`), None for a file of another writer.
    """

    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    file_bytes: int
    structure: dict | None = None


def _structure(metadata: dict[str, str], keys: Iterable[str], source: str) -> dict | None:
    """The skeleton in ``__metadata__["structure"]``, checked: it parses, and its tensor leaves
    are the file's tensors."""
    text = metadata.get("structure")
    if text is None:
        return None
    skeleton = parse_json(text, source, "the structure in __metadata__")
    try:
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


def no_duplicates(what: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json.loads`` object_pairs_hook that refuses a name given twice in one object:
    FormatError "{what} names 'k' twice"."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = {}
        for k, v in pairs:
            if k in out:
                raise FormatError(f"{what} names {k!r} twice")
            out[k] = v
        return out

    return hook


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise FormatError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    """A shape of at most 64 dims, each entry and the product below 2**62 (with a zero entry
    too: no later arithmetic on an entry can overflow)."""
    if not isinstance(value, list) or len(value) > 64:
        raise FormatError(f"{where}: shape must be a list of at most 64 integers")
    shape = tuple(_int(s, f"{where}: a shape entry") for s in value)
    if any(s >= _MAX_ELEMENTS for s in shape) or math.prod(shape) >= _MAX_ELEMENTS:
        raise FormatError(f"{where}: shape {list(shape)[:8]} is too large")
    return shape


def parse_header(raw: bytes, file_bytes: int, source: str) -> Header:
    """Validate the JSON header ``raw`` of a file of ``file_bytes`` bytes.

    Raises:
        FormatError: anything safetensors' own reader would refuse, naming ``source``.
    """
    data_start = 8 + len(raw)
    doc = parse_json(raw, source, "the safetensors header", no_duplicates("the header"))
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
        shape = _shape(shape, where)
        count = math.prod(shape)
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
    doc = parse_json(text, source, "empty_tensors in __metadata__", no_duplicates("the header"))
    if not isinstance(doc, dict):
        raise FormatError(f"{source}: empty_tensors in __metadata__ must be a JSON object")
    out = {}
    for key, info in doc.items():
        where = f"{source}: empty tensor {key!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape"}:
            raise FormatError(f"{where}: must have exactly dtype and shape")
        if not isinstance(info["dtype"], str) or (info["dtype"] not in DTYPE_OF_CODE and info["dtype"] not in _OTHER_SIZES):
            raise FormatError(f"{where}: unknown dtype {info['dtype']!r}")
        shape = _shape(info["shape"], where)
        if math.prod(shape) != 0:
            raise FormatError(f"{where}: shape {list(shape)} has elements")
        out[key] = (info["dtype"], shape)
    return out


def read_header(path: str) -> Header:
    """Read and validate the header of the local safetensors file ``path`` (the command
    line's tools; a load reads headers through its storage, with :func:`header_from`).

    Raises:
        FormatError: a malformed or truncated file.
        StorageError: the file cannot be read, or is not a regular file (a FIFO, a device).
    """
    with _open_regular(path) as f:
        return _header_of(f, os.fspath(path))


@contextmanager
def _open_regular(path: str) -> Iterator[BinaryIO]:
    """``path`` opened for reading, checked to be a regular file (O_NONBLOCK: a FIFO is
    refused at once, never waited on); what is read and mapped is the file checked."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}", path) from exc
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StorageError(f"{path} is not a regular file: refused", path)
        yield f


def _header_of(f: BinaryIO, path: str) -> Header:
    try:
        return header_from(lambda start, n: os.pread(f.fileno(), n, start), os.fstat(f.fileno()).st_size, path)
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}", path) from exc


def header_from(read: Callable[[int, int], bytes], file_bytes: int, source: str) -> Header:
    """Read and validate the header of a safetensors file of ``file_bytes`` bytes whose bytes
    ``read(start, length)`` returns (fewer at its end), named ``source`` in messages.

    Raises:
        FormatError: a malformed or truncated file.
    """
    head = read(0, 8)
    if len(head) < 8:
        raise FormatError(f"{source}: {len(head)} bytes, too short for a safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{source}: header of {n} bytes, more than the {MAX_HEADER_BYTES} allowed")
    if 8 + n > file_bytes:
        raise FormatError(f"{source}: header of {n} bytes in a file of {file_bytes} bytes: truncated file?")
    raw = read(8, n)
    if len(raw) != n:
        raise FormatError(f"{source}: the header ends early: truncated file?")
    return parse_header(raw, file_bytes, source)


def read_arrays(path: str) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as read-only arrays mapped from it (bfloat16 as uint16
    bit patterns; ``__metadata__`` left out), after :func:`read_header` checked the header.

    Raises:
        FormatError: a malformed header, or a dtype paddle_dcp does not load.
        StorageError: the file cannot be read.
    """
    with _open_regular(path) as f:
        header = _header_of(f, os.fspath(path))
        out = {}
        for key, e in header.entries.items():
            if e.dtype is None:
                raise FormatError(f"{path}: tensor {key!r} has dtype {e.code}, which paddle_dcp does not load")
            dtype = storage_dtype(e.dtype)
            if e.nbytes == 0:
                out[key] = np.zeros(e.shape, dtype=dtype)
                continue
            out[key] = np.memmap(f, dtype=dtype, mode="r", offset=e.begin, shape=(e.nbytes // dtype.itemsize,)).reshape(e.shape)
    return out


# ---------------------------------------------------------------------- writing
Tensor = tuple  # (name, code, shape, nbytes): a tensor of a header, its bytes back to back


def encode_header(tensors: Iterable[Tensor], metadata: Mapping[str, str] | None = None, align: int = 8) -> bytes:
    """The 8-byte length and the JSON header of a file whose data section holds ``tensors``
    (name, safetensors dtype code, shape, bytes) back to back, in this order; the JSON is
    padded with spaces so that the data starts at a multiple of ``align`` bytes.

    Raises:
        UnsupportedError: a tensor named ``__metadata__`` or two tensors of one name.
    """
    doc: dict = {}
    if metadata is not None:
        doc["__metadata__"] = dict(metadata)
    at = 0
    for name, code, shape, nbytes in tensors:
        if name == "__metadata__":
            raise UnsupportedError("a tensor named '__metadata__' cannot be stored in safetensors")
        if name in doc:
            raise UnsupportedError(f"two tensors named {name!r} in one safetensors file")
        doc[name] = {"dtype": code, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw


def code_of(key: str, dtype: str) -> str:
    """The safetensors dtype code of the format's dtype ``dtype``.

    Raises:
        UnsupportedError: safetensors has no code for it (complex128), naming ``key``.
    """
    code = SAFETENSORS_CODES.get(dtype)
    if code is None:
        raise UnsupportedError(f"{key}: safetensors cannot hold dtype {dtype} (supported: {', '.join(SAFETENSORS_CODES)})")
    return code
