"""The checkpoint's metadata: frozen dataclasses and the JSON they are written as.

``{unique_id}.metadata`` is UTF-8 JSON (docs/format.md). Per-piece data is columnar: one
column per field and tensor, written as a JSON list when short and as ``"z:" + base64(zlib(
little-endian int64 / uint64 bytes))`` when long, so the file stays small and fast to parse at
thousands of ranks. Reading (:mod:`~paddle_dcp.core.metadata_parse`) validates everything
before anything is allocated from it: the version, names of files (plain names inside the
checkpoint directory, :func:`check_file_name`), dtypes, shapes and their products, piece boxes
(inside the tensor, tiling it exactly) and byte ranges (inside the files).
"""
from __future__ import annotations

import base64
import json
import math
import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import xxhash

from . import nested, quant
from .boxes import Box
from .derive import DERIVED
from .dtypes import itemsize
from ..errors import FormatError

FORMAT_NAME = "paddle_dcp"
FORMAT_VERSION = 1
ENCODED_VERSION = 2  # written only by a save that stores some tensor quantized (``encoding``)
SUPPORTED_VERSIONS = (1, 2, 3)  # 1 and 2: one JSON document; 3: a head line, then packed sections
JSON_VERSIONS = (1, 2)
CHECKSUM_ALGORITHMS = ("xxh3_64",)
DEFAULT_BLOCK_BYTES = 4 << 20
ALIGNMENT = 64  # bytes; every piece starts at a multiple of it in its data file
MAX_METADATA_BYTES = 1 << 30
_MAX_INT = 1 << 62
_PLAIN_COLUMN_MAX = 64
_FILE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,255}")  # fullmatch: "$" would take a final newline
_CHECKSUM = re.compile(r"[0-9a-f]{16}")
_HEX_DIGITS = re.compile(r"[0-9a-f]*")


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class PieceTable:
    """The saved pieces of one tensor, one row per piece.

    Attributes:
        offsets: (p, ndim) int64, each piece's global offset, in elements.
        shapes: (p, ndim) int64, each piece's local shape, in elements.
        files: (p,) int64, index into ``Metadata.files`` of the file holding the piece.
        byte_offsets: (p,) int64, where the piece starts in its file, in bytes.
        checksums: (sum of blocks,) uint64, xxh3_64 of every block of every piece, in piece
            order; a piece of n bytes has max(1, ceil(n / block_bytes)) blocks.
    """

    offsets: np.ndarray
    shapes: np.ndarray
    files: np.ndarray
    byte_offsets: np.ndarray
    checksums: np.ndarray

    @property
    def count(self) -> int:
        return int(self.files.shape[0])


@dataclass(frozen=True)
class FileEntry:
    """A data file of the checkpoint.

    Attributes:
        name: plain file name inside the checkpoint directory.
        nbytes: its size, in bytes.
    """

    name: str
    nbytes: int


@dataclass(frozen=True)
class SavedPiece:
    """One saved piece of a tensor, as a load needs it."""

    key: str
    index: int  # row in the tensor's PieceTable
    box: Box  # in_global
    file: int
    byte_offset: int
    nbytes: int  # stored bytes in its file (its logical bytes unless the tensor has an encoding)
    first_block: int  # index of its first checksum in PieceTable.checksums
    nblocks: int


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """A tensor of the checkpoint: global shape, dtype and saved pieces.

    Attributes:
        dtype: the tensor's dtype (a load fills tensors of it, whatever the encoding).
        encoding: None: every piece is stored as its raw bytes; else the name of the
            :mod:`~paddle_dcp.core.quant` encoding every piece is stored in (its stored bytes
            then differ from its logical bytes: :meth:`stored_nbytes`), or ``"derived"``: no
            piece is stored, the tensor is ``source`` cast to ``dtype``
            (:mod:`~paddle_dcp.core.derive`).
        source: the key of the tensor a derived one is read from (same shape; None unless
            ``encoding`` is ``"derived"``).
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    pieces: PieceTable
    block_bytes: int
    encoding: str | None = None
    source: str | None = None

    @property
    def derived(self) -> bool:
        """No piece of it is stored: a load reads ``source`` and casts it."""
        return self.encoding == DERIVED

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Logical bytes of the whole tensor (its elements in its dtype)."""
        return math.prod(self.shape) * self.itemsize

    def stored_nbytes(self, elements: Any) -> Any:
        """Stored bytes of a piece of ``elements`` elements (an int or an int64 array)."""
        return stored_nbytes(elements, self.dtype, self.encoding)

    def piece_nbytes(self) -> np.ndarray:
        """(p,) stored bytes of every piece (computed once)."""
        nbytes = self.__dict__.get("_nbytes")
        if nbytes is None:
            p = self.pieces
            nbytes = _frozen(self.stored_nbytes(np.multiply.reduce(p.shapes, axis=1, dtype=np.int64)))
            object.__setattr__(self, "_nbytes", nbytes)
        return nbytes

    def block_starts(self) -> np.ndarray:
        """(p + 1,) index of every piece's first checksum, then the total (computed once)."""
        starts = self.__dict__.get("_starts")
        if starts is None:
            nblocks = blocks_of(self.piece_nbytes(), self.block_bytes)
            starts = _frozen(np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int64))
            object.__setattr__(self, "_starts", starts)
        return starts

    def piece(self, i: int, starts: np.ndarray | None = None) -> SavedPiece:
        p = self.pieces
        starts = self.block_starts() if starts is None else starts
        box = Box(tuple(p.offsets[i].tolist()), tuple(p.shapes[i].tolist()))
        return SavedPiece(
            key=self.key,
            index=i,
            box=box,
            file=int(p.files[i]),
            byte_offset=int(p.byte_offsets[i]),
            nbytes=self.stored_nbytes(box.volume),
            first_block=int(starts[i]),
            nblocks=int(starts[i + 1] - starts[i]),
        )


@dataclass(frozen=True, eq=False)
class TensorColumns:
    """Every tensor of a checkpoint and its saved pieces as columns: what a save builds and
    the packed format stores, without an object per tensor or per piece.

    Attributes:
        keys: every tensor key, sorted (tensor ``t`` is ``keys[t]``).
        dtypes / shapes / encodings / sources: per tensor (see :class:`TensorEntry`).
        piece_start: (T + 1,) int64, the pieces of tensor ``t`` are rows
            ``piece_start[t]:piece_start[t + 1]`` of the piece columns.
        offsets / extents: (P, D) int64, each piece's global offset and local shape, in
            elements, padded with zeros past its tensor's ndim (D: the largest ndim).
        files: (P,) int64, index into ``Metadata.files``.
        byte_offsets: (P,) int64, where each piece starts in its file, in bytes.
        block_start: (P + 1,) int64, the checksums of piece ``p`` are
            ``checksums[block_start[p]:block_start[p + 1]]``.
        checksums: (B,) uint64.
        grid: which tensors' pieces are the cells of their grids, and the cuts, when known
            (:class:`paddle_dcp.core.grids.GridCheck`; a save plan finds them).
        static: where a writer keeps what the saves of one plan share (its plan's), or None.
    """

    keys: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    encodings: tuple[str | None, ...]
    sources: tuple[str | None, ...]
    piece_start: np.ndarray
    offsets: np.ndarray
    extents: np.ndarray
    files: np.ndarray
    byte_offsets: np.ndarray
    block_start: np.ndarray
    checksums: np.ndarray
    grid: Any = None
    static: dict | None = None

    def __post_init__(self) -> None:
        for column in (self.piece_start, self.offsets, self.extents, self.files, self.byte_offsets, self.block_start,
                       self.checksums):
            _frozen(column)  # so every entry's views are read-only as they are taken

    def entry(self, t: int, block_bytes: int) -> TensorEntry:
        """Tensor ``t``'s entry: views of the columns, its checksum starts known."""
        p0, p1 = int(self.piece_start[t]), int(self.piece_start[t + 1])
        nd = len(self.shapes[t])
        b0, b1 = int(self.block_start[p0]), int(self.block_start[p1])
        pieces = PieceTable(
            offsets=self.offsets[p0:p1, :nd],
            shapes=self.extents[p0:p1, :nd],
            files=self.files[p0:p1],
            byte_offsets=self.byte_offsets[p0:p1],
            checksums=self.checksums[b0:b1],
        )
        entry = TensorEntry(
            self.keys[t], self.dtypes[t], self.shapes[t], pieces, block_bytes, self.encodings[t], self.sources[t]
        )
        object.__setattr__(entry, "_starts", _frozen(self.block_start[p0 : p1 + 1] - b0))
        return entry


class ColumnTensors(Mapping):
    """The tensor entries of :class:`TensorColumns`, key -> :class:`TensorEntry`, each made
    when first asked for (a load uses a few hundred of a checkpoint's hundred thousand)."""

    def __init__(self, columns: TensorColumns, block_bytes: int):
        self.columns, self._block_bytes = columns, block_bytes
        self._index: dict[str, int] | None = None
        self._done: dict[str, TensorEntry] = {}

    def index(self) -> dict[str, int]:
        """Key -> its tensor's position in the columns."""
        if self._index is None:
            self._index = {k: t for t, k in enumerate(self.columns.keys)}
        return self._index

    def __getitem__(self, key: str) -> TensorEntry:
        entry = self._done.get(key)
        if entry is None:
            entry = self._done[key] = self.columns.entry(self.index()[key], self._block_bytes)
        return entry

    def __contains__(self, key: object) -> bool:
        return key in self.index()

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns.keys)

    def __len__(self) -> int:
        return len(self.columns.keys)


def stored_nbytes(elements: Any, dtype: str, encoding: str | None) -> Any:
    """Stored bytes of pieces of ``elements`` elements (an int or an int64 array) of ``dtype``:
    their raw bytes, or with ``encoding`` the whole blocks of :mod:`~paddle_dcp.core.quant`
    (a derived tensor stores none)."""
    if encoding is None:
        return elements * itemsize(dtype)
    if encoding == DERIVED:
        return elements * 0
    enc = quant.encoding(encoding)
    if isinstance(elements, np.ndarray):
        return -(-elements // quant.BLOCK) * enc.block_bytes
    return enc.nbytes(elements)


def aligned(offset: Any, alignment: int = ALIGNMENT) -> Any:
    """The first multiple of ``alignment`` at or after ``offset`` (an int or an int array):
    where a piece written after ``offset`` bytes of its file starts."""
    return offset + (-offset % alignment)


def blocks_of(nbytes: np.ndarray | int, block_bytes: int) -> np.ndarray:
    """Number of checksum blocks of pieces of ``nbytes`` (at least one, even when empty)."""
    return np.maximum(1, -(-np.asarray(nbytes, dtype=np.int64) // block_bytes))


@dataclass(frozen=True)
class DigestVerdict:
    """What parsing found of a metadata file's digest (the xxh3_64 of its other bytes).

    Attributes:
        matches: True (it matches), False (the file was edited or damaged after it was
            written), None (no digest: built in memory, or a file written without one).
        source: the file, as errors name it.
    """

    matches: bool | None = None
    source: str = "metadata"


@dataclass(frozen=True, eq=False)
class Metadata:
    """Everything a load needs to know about a checkpoint but its tensor bytes.

    Attributes:
        unique_id: the checkpoint's id; its metadata file is ``{unique_id}.metadata``.
        world_size: number of ranks that saved it.
        files: the data files, referenced by index from the pieces.
        tensors: flat key -> TensorEntry.
        structure: the nested skeleton (see :mod:`paddle_dcp.core.nested`), plain values included.
        block_bytes: size of a checksum block, in bytes.
        checksum_algorithm: name of the checksum of every block.
        created_by: the writer's name and version.
        format_version: the version of this format.
        subset: only some pieces of some tensors, as one rank needs them (sent between ranks
            when a rank cannot read the metadata file; never written to disk).
        replicas: saved with ``save_replicas``: a piece may have several copies (rows with
            exactly equal boxes, each in another file); any one of them may be read.
        digest: what parsing found of the file's digest (never written: ``to_json`` computes
            a new one).
        holders: paths of containers of ``structure`` that hold tensors this metadata does
            not list (a part of a version 3 file, whose ``structure`` is the checkpoint's plain
            values alone: :func:`paddle_dcp.core.metafile.read_part`).
    """

    unique_id: int
    world_size: int
    files: tuple[FileEntry, ...]
    tensors: Mapping[str, TensorEntry]
    structure: dict
    block_bytes: int = DEFAULT_BLOCK_BYTES
    checksum_algorithm: str = "xxh3_64"
    created_by: str = ""
    format_version: int = FORMAT_VERSION
    subset: bool = False
    replicas: bool = False
    digest: DigestVerdict = DigestVerdict()
    holders: frozenset = frozenset()

    def values(self) -> dict[str, Any]:
        """Flat key -> plain (non-tensor) value saved in the checkpoint."""
        return nested.values_of(self.structure)

    def check_digest(self) -> None:
        """Raise FormatError when the file's digest does not match its bytes: the metadata was
        edited or damaged after it was written (checked after the structure, so a malformed
        file is named for what is malformed). Files without a digest pass."""
        if self.digest.matches is False:
            raise FormatError(
                f"{self.digest.source}: the metadata's digest does not match its contents: the file was edited "
                f"or damaged after it was written"
            )

    def prefetch(self, keys: Iterable[str]) -> None:
        """Parse and validate the entries of ``keys`` now, in one vectorised pass (a load
        uses a few hundred entries at once); any entry that pass cannot take is parsed, and
        any error worded, on first use."""
        if isinstance(self.tensors, LazyTensors):  # a dict's entries are parsed already
            self.tensors.prefetch(keys)

    def validate(self) -> "Metadata":
        """Parse and validate every tensor entry now (they are otherwise checked on first use)."""
        for key in self.tensors:
            self.tensors[key]
        return self

    @property
    def nbytes(self) -> int:
        """Logical bytes of all tensors."""
        return sum(t.nbytes for t in self.tensors.values())

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> bytes:
        tensors = {}
        encoded = False
        for key, t in self.tensors.items():
            p = t.pieces
            entry = tensors[key] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "count": p.count,
                "offsets": _encode_column(p.offsets),
                "shapes": _encode_column(p.shapes),
                "file": _encode_column(p.files),
                "byte_offset": _encode_column(p.byte_offsets),
                "checksums": _encode_column(p.checksums, hex_digits=True),
            }
            if t.encoding is not None:  # absent otherwise: plain checkpoints keep version 1's bytes
                entry["encoding"] = t.encoding
                encoded = True
            if t.source is not None:
                entry["source"] = t.source
        doc = {
            "format": FORMAT_NAME,
            "format_version": max(self.format_version, ENCODED_VERSION) if encoded else self.format_version,
            "unique_id": self.unique_id,
            "world_size": self.world_size,
            "created_by": self.created_by,
            "checksum": {"algorithm": self.checksum_algorithm, "block_bytes": self.block_bytes},
            "files": [{"name": f.name, "bytes": f.nbytes} for f in self.files],
            "structure": self.structure,
            "tensors": tensors,
        }
        if self.replicas:  # absent otherwise: a save without replicas has no such member
            doc["replicas"] = True
        if self.subset:
            doc["subset"] = True
            if self.holders:
                doc["holders"] = [list(path) for path in sorted(self.holders, key=lambda p: [str(c) for c in p])]
        return with_digest(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())


_DIGEST_HEAD = b',"digest":"'
_DIGEST_LEN = len(_DIGEST_HEAD) + 16 + 2


def with_digest(body: bytes) -> bytes:
    """A JSON object's bytes with a last member ``"digest"``: the xxh3_64 (hex) of the bytes
    of the object without it."""
    digest = xxhash.xxh3_64_hexdigest(body).encode()
    return body[:-1] + _DIGEST_HEAD + digest + b'"}'


def digest_matches(data: bytes, doc: Any) -> bool | None:
    """True: the digest matches; False: it does not; None: the file has none."""
    if not isinstance(doc, dict) or "digest" not in doc:
        return None
    tail = data.rstrip()
    if len(tail) < _DIGEST_LEN or tail[-_DIGEST_LEN:-18] != _DIGEST_HEAD or not tail.endswith(b'"}'):
        return False
    body = tail[:-_DIGEST_LEN] + b"}"
    return xxhash.xxh3_64_hexdigest(body).encode() == tail[-18:-2]


# -------------------------------------------------------------------- columns
def _encode_column(a: np.ndarray, hex_digits: bool = False) -> list | str:
    flat = np.ascontiguousarray(a).reshape(-1)
    if flat.size <= _PLAIN_COLUMN_MAX:
        if hex_digits:
            return [f"{int(x):016x}" for x in flat]
        return [int(x) for x in flat]
    dtype = "<u8" if hex_digits else "<i8"
    raw = flat.astype(dtype, copy=False).tobytes()
    return "z:" + base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


# -------------------------------------------------------------------- parsing
def check_file_name(name: Any, what: str = "file name") -> str:
    """A data file's name: a plain name that stays inside the checkpoint directory."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name in (".", "..") or name.startswith(".."):
        raise FormatError(
            f"{what} {str(name)[:80]!r} is not a plain file name inside the checkpoint directory"
        )
    return name


def check_member_name(name: Any, what: str = "file name") -> str:
    """A name a storage opens in its directory: any name that stays inside it (no separator, no
    NUL, not "." or ".."; at most 255 bytes). The names a checkpoint's metadata gives are plainer
    still (:func:`check_file_name`); a file the caller names (a single safetensors file) may be
    called anything its file system allows."""
    if (
        not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
        or "\0" in name or len(name.encode("utf-8", "surrogateescape")) > 255
    ):
        raise FormatError(f"{what} {str(name)[:80]!r} is not a plain file name inside the checkpoint directory")
    return name


class LazyTensors(Mapping):
    """Tensor entries parsed and validated the first time each is used: a rank that loads a few
    hundred tensors of a checkpoint with thousands pays for those alone. Nothing is read or
    allocated from an entry before it has been validated."""

    def __init__(
        self,
        docs: dict,
        parse: Callable[[str, Any], TensorEntry],
        parse_many: Callable[[list[str]], dict[str, TensorEntry]] | None = None,
    ):
        self._docs, self._parse = docs, parse
        self._done: dict[str, TensorEntry] = {}
        self._parse_many = parse_many

    def prefetch(self, keys: Iterable[str]) -> None:
        """Parse and validate the entries ``keys`` now, together (see metadata_parse._parse_many)."""
        todo = [k for k in dict.fromkeys(keys) if k in self._docs and k not in self._done]
        if todo and self._parse_many is not None:
            self._done.update(self._parse_many(todo))

    @property
    def parsed_count(self) -> int:
        """How many entries have been parsed so far."""
        return len(self._done)

    def __getitem__(self, key: str) -> TensorEntry:
        entry = self._done.get(key)
        if entry is None:
            entry = self._done[key] = self._parse(key, self._docs[key])
        return entry

    def __contains__(self, key: object) -> bool:
        return key in self._docs

    def __iter__(self) -> Iterator[str]:
        return iter(self._docs)

    def __len__(self) -> int:
        return len(self._docs)
