"""What a metadata file of format version 3 is made of, read and checked: the codes, the head
line, packed integers and bounded decompression, the tensor rows of the parts, and where each
tensor's pieces lie (docs/format.md, "Version 3"). Writing is :mod:`.metafile_write`,
reading whole or in parts :mod:`.metafile_read`.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Tuple, Union

import numpy as np
import xxhash

from . import grids, nested, quant, ragged
from .derive import DERIVED, DERIVED_DTYPES, SOURCE_DTYPES
from .dtypes import itemsize
from ..errors import FormatError
from .metadata import _MAX_INT, CHECKSUM_ALGORITHMS, FORMAT_NAME, DigestVerdict, FileEntry, blocks_of, check_file_name, digest_matches
from .json_text import parse_json

VERSION = 3
GROUP = 32  # pieces of a tensor under one digest
MAX_HEAD = 64 << 20  # bytes of the head line
RATIO = 64  # at most this many bytes out of a compressed byte (the writer keeps to it)
PART_BYTES = 16384  # raw bytes of tensor rows per part, about
PARTS_FROM = 1 << 20  # a load reads a metadata file of at least this many bytes in parts
GRID, EXPLICIT = 0, 1
# the codes on disk: their order is the format's
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128")
ENCODINGS: tuple[str | None, ...] = (None, "int8", "int4", DERIVED)
DTYPE_CODE = {name: i for i, name in enumerate(DTYPES)}
ENCODING_CODE = {name: i for i, name in enumerate(ENCODINGS)}
DERIVED_CODE = ENCODING_CODE[DERIVED]
ITEMSIZE = np.array([itemsize(d) for d in DTYPES], dtype=np.int64)
# a tensor row: its columns, in this order
ROW = ("key_len", "src_len", "dtype", "encoding", "ndim", "layout", "count", "first_piece", "first_block", "blocks",
       "first_box")
_ROW_AT = {name: i for i, name in enumerate(ROW)}
_MAGIC = b'{"format":"paddle_dcp","format_version":3,'
_ANY_HEAD = b'{"format":"paddle_dcp","format_version":'

Fetch = Callable[[Sequence[Tuple[int, int]]], Sequence[Union[bytes, memoryview]]]  # [start, stop) ranges -> bytes


def has_head_line(data: bytes | memoryview) -> bool:
    """Whether metadata bytes start with a head line (version 3 and any later version), not
    one JSON document (versions 1 and 2, never written with a newline)."""
    if bytes(data[: len(_ANY_HEAD)]) != _ANY_HEAD:
        return False
    text = data if isinstance(data, (bytes, bytearray)) else bytes(data[:MAX_HEAD])
    return text.find(b"\n", 0, MAX_HEAD) >= 0


def is_packed(data: bytes | memoryview) -> bool:
    """Whether metadata bytes are version 3's (a head line that says so)."""
    return bytes(data[: len(_MAGIC)]) == _MAGIC


def worth_parts(size: int) -> bool:
    """Whether a load reads a metadata file of ``size`` bytes in parts rather than whole: a
    small one costs less read whole, and a whole read lets the ranks share their checks and
    name the checkpoint's keys the state dict lacks."""
    return size >= PARTS_FROM


# ============================================================================ packing
def shuffled(values: np.ndarray | Sequence[int]) -> bytes:
    """int64 values as little-endian bytes, byte-shuffled (every first byte, then every second
    byte...): small or repetitive integers then compress to almost nothing."""
    raw = np.ascontiguousarray(values, dtype="<i8").reshape(-1).view(np.uint8).reshape(-1, 8)
    return raw.T.tobytes()


def deflate(raw: bytes) -> bytes:
    packed = zlib.compress(raw, 6)
    if len(raw) > RATIO * len(packed):  # kept to the bound a reader holds it to
        packed = zlib.compress(raw, 0)
    return packed


def most_inflated(packed_len: int) -> int:
    """The most bytes the format lets ``packed_len`` compressed bytes stand for."""
    return RATIO * packed_len + 64


def inflate(packed: bytes | memoryview, raw_len: int, what: str) -> bytes:
    """``packed`` decompressed, exactly ``raw_len`` bytes, refused before any allocation when
    ``raw_len`` is more than the format allows for ``len(packed)`` bytes."""
    if type(raw_len) is not int or raw_len < 0 or raw_len > most_inflated(len(packed)):
        raise FormatError(f"{what}: {raw_len} bytes cannot come from {len(packed)} compressed bytes")
    try:
        d = zlib.decompressobj()
        raw = d.decompress(packed, raw_len)
        if d.unconsumed_tail or not d.eof or d.unused_data:
            raise FormatError(f"{what}: the compressed data is longer than the {raw_len} bytes it claims")
    except zlib.error as exc:
        raise FormatError(f"{what}: does not decompress ({exc})") from None
    if len(raw) != raw_len:
        raise FormatError(f"{what}: holds {len(raw)} bytes, claims {raw_len}")
    return raw


class Reader:
    """Sequential reads of a decompressed buffer, each checked to lie inside it."""

    def __init__(self, buf: bytes | memoryview, what: str):
        self.buf, self.at, self.what = memoryview(buf), 0, what

    def take(self, n: int) -> memoryview:
        if n < 0 or n > len(self.buf) - self.at:
            raise FormatError(f"{self.what}: truncated ({n} bytes wanted, {len(self.buf) - self.at} left)")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def count(self) -> int:
        """A u64 count, at most the bytes left (every entry costs at least a byte)."""
        (n,) = np.frombuffer(self.take(8), dtype="<u8").tolist()
        if n > len(self.buf) - self.at:
            raise FormatError(f"{self.what}: claims {n} entries, more than its bytes can hold")
        return int(n)

    def ints(self, count: int) -> np.ndarray:
        if count < 0 or count > (len(self.buf) - self.at) // 8:
            raise FormatError(f"{self.what}: truncated ({count} integers wanted)")
        raw = np.frombuffer(self.take(count * 8), dtype=np.uint8).reshape(8, count)
        return np.ascontiguousarray(raw.T).view("<i8").reshape(count).astype(np.int64)

    def u64(self, count: int) -> np.ndarray:
        if count < 0 or count > (len(self.buf) - self.at) // 8:
            raise FormatError(f"{self.what}: truncated ({count} digests wanted)")
        return np.frombuffer(self.take(count * 8), dtype="<u8").astype(np.uint64)

    def done(self) -> None:
        if self.at != len(self.buf):
            raise FormatError(f"{self.what}: {len(self.buf) - self.at} bytes left over")


def names(blob: bytes, lengths: np.ndarray, what: str) -> list[str]:
    """The UTF-8 names of ``lengths`` bytes each, back to back in ``blob``."""
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{what}: a name is not UTF-8") from None
    ends = np.cumsum(lengths).tolist()
    starts = [0] + ends[:-1]
    if len(text) == len(blob):  # ASCII: characters are bytes
        return [text[a:b] for a, b in zip(starts, ends)]
    try:
        return [blob[a:b].decode("utf-8") for a, b in zip(starts, ends)]
    except UnicodeDecodeError:
        raise FormatError(f"{what}: a name is cut inside a UTF-8 character") from None


def width(largest: int) -> int:
    """Bytes of a little-endian field that holds every value up to ``largest``."""
    return max(1, (int(largest).bit_length() + 7) // 8)


def check_ints(values: np.ndarray, lo: int, hi: int, what: str) -> None:
    if len(values) and (int(values.min()) < lo or int(values.max()) > hi):
        raise FormatError(f"{what} out of range [{lo}, {hi}]")


def check_int(value: Any, what: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise FormatError(f"{what} must be an integer in [{lo}, {hi}], found {str(value)[:40]!r}")
    return value


# ============================================================================ the head
@dataclass(frozen=True)
class Head:
    """A version 3 head, validated: the fields and where the rest lies (offsets from the start
    of the file)."""

    doc: dict
    body: int  # where the body starts
    size: int  # the file's size
    digest: DigestVerdict

    def section(self, name: str) -> tuple[int, int, int, int]:
        """(start, stop, raw length, digest) of a section."""
        at, n, raw, digest = self.doc["sections"][name]
        return self.body + at, self.body + at + n, raw, int(digest, 16)

    def area(self, name: str) -> tuple[int, int]:
        at, n = self.doc["areas"][name]
        return self.body + at, self.body + at + n

    def count(self, name: str) -> int:
        return self.doc["counts"][name]

    @property
    def record_width(self) -> int:
        return self.doc["widths"]["file"] + self.doc["widths"]["offset"]

    @property
    def block_bytes(self) -> int:
        return self.doc["checksum"]["block_bytes"]


def read_head(fetch: Fetch, size: int, source: str) -> Head:
    """The head of a version 3 file of ``size`` bytes, read through ``fetch`` (a first 64 KiB,
    more only for a longer head line)."""
    want = min(size, 1 << 16)
    data = bytes(fetch([(0, want)])[0])
    while b"\n" not in data and want < min(size, MAX_HEAD):
        want = min(size, MAX_HEAD, want * 4)
        data = bytes(fetch([(0, want)])[0])
    end = data.find(b"\n")
    if end < 0:
        raise FormatError(f"{source}: no head line in its first {want} bytes")
    return parse_head(data[:end], size, source)


def parse_head(line: bytes, size: int, source: str) -> Head:
    """The head line, parsed and checked: every field of its type, every section and area
    inside the file, and the head's own digest (a mismatch is an error at once: all the rest
    is trusted through it)."""
    doc = parse_json(line, source, "the head line")
    if digest_matches(line, doc) is not True:
        raise FormatError(f"{source}: the metadata's head does not match its digest: the file was edited or damaged")
    head = Head(doc, len(line) + 1, size, DigestVerdict(True, source))
    try:
        _check_head(head)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise FormatError(f"{source}: malformed metadata head ({type(exc).__name__}: {exc})") from None
    except FormatError as exc:
        raise FormatError(f"{source}: {exc}") from None
    return head


def _check_head(head: Head) -> None:
    doc = head.doc
    if doc.get("format") != FORMAT_NAME or doc.get("format_version") != VERSION:
        raise FormatError("not a paddle_dcp version 3 metadata head")
    check_int(doc["unique_id"], "unique_id")
    check_int(doc["world_size"], "world_size", 1, 1 << 24)
    if not isinstance(doc.get("created_by", ""), str):
        raise FormatError("created_by must be a string")
    if doc["checksum"]["algorithm"] not in CHECKSUM_ALGORITHMS:
        raise FormatError(f"unknown checksum algorithm {str(doc['checksum']['algorithm'])[:40]!r}")
    check_int(doc["checksum"]["block_bytes"], "checksum.block_bytes", 64, 1 << 30)
    body = head.size - head.body
    for name in ("tensors", "pieces", "blocks", "files", "parts"):
        check_int(doc["counts"][name], f"counts.{name}", 0, body)  # each costs the file a byte at least
    for name in ("file", "offset"):
        check_int(doc["widths"][name], f"widths.{name}", 1, 8)
    for name in ("files", "structure", "index"):
        at, n, raw, digest = doc["sections"][name]
        check_int(at, f"{name}.offset", 0, body)
        check_int(n, f"{name}.length", 0, body - at)
        check_int(raw, f"{name}.raw", 0, most_inflated(n))
        if not (isinstance(digest, str) and len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)):
            raise FormatError(f"{name}: the digest must be 16 lowercase hex digits")
    for name in ("parts", "records", "boxes", "sums"):
        at, n = doc["areas"][name]
        check_int(at, f"{name}.offset", 0, body)
        check_int(n, f"{name}.length", 0, body - at)
    if doc["areas"]["records"][1] != doc["counts"]["pieces"] * head.record_width:
        raise FormatError("the records area does not hold one record per piece")
    if doc["areas"]["sums"][1] != 8 * doc["counts"]["blocks"]:
        raise FormatError("the sums area does not hold one checksum per block")
    if type(doc.get("replicas", False)) is not bool:
        raise FormatError("replicas must be true or false")
    _check_outline(doc["outline"], doc["holders"])


def _check_outline(outline: Any, holders: Any) -> None:
    for path, tag, node in nested.walk(outline):
        if tag in ("v", "f"):
            nested.decode_value(node, nested.flat_key(path))
        elif tag == "x":
            raise FormatError(f"value {nested.flat_key(path)!r} has no value")
    if not isinstance(holders, list) or not all(
        isinstance(p, list) and len(p) <= 64 and all(type(c) in (str, int) for c in p) for p in holders
    ):
        raise FormatError("holders must be a list of paths")


def section(head: Head, name: str, packed: bytes | memoryview, source: str) -> bytes:
    """A section's bytes, checked against the head's digest, decompressed."""
    _, _, raw, digest = head.section(name)
    if xxhash.xxh3_64_intdigest(packed) != digest:
        raise FormatError(f"{source}: section {name} does not match its digest: the file was edited or damaged")
    return inflate(packed, raw, f"{source}: section {name}")


def parse_files(raw: bytes, head: Head, source: str) -> tuple[FileEntry, ...]:
    r = Reader(raw, f"{source}: files")
    n = r.count()
    if n != head.count("files"):
        raise FormatError(f"{source}: {n} files listed, the head says {head.count('files')}")
    sizes = r.ints(n)
    check_ints(sizes, 0, _MAX_INT, f"{source}: a file's size")
    lengths = r.ints(n)
    check_ints(lengths, 1, 255, f"{source}: a file name's length")
    found = names(bytes(r.take(int(lengths.sum()))), lengths, f"{source}: files")
    r.done()
    joined = "".join(n + "\n" for n in found)
    if not _PLAIN_NAMES.fullmatch(joined) or joined.count("\n") != len(found) or len(set(found)) != len(found):
        seen: set[str] = set()
        for name in found:  # name the first bad one
            check_file_name(name, f"{source}: file")
            if name in seen:
                raise FormatError(f"{source}: file {name!r} is listed twice")
            seen.add(name)
    return tuple(FileEntry(name, nbytes) for name, nbytes in zip(found, sizes.tolist()))


# every name as check_file_name takes one, each followed by a newline: one match for thousands
_PLAIN_NAMES = re.compile(r"(?:(?!\.\.|\.\n)[A-Za-z0-9_.\-]{1,255}\n)*")


@dataclass(frozen=True, eq=False)
class Index:
    """The directory of the tensor parts."""

    first_keys: list[str]
    offsets: np.ndarray  # (parts + 1,) absolute
    packed: np.ndarray  # bytes of each part's compressed rows (its digests follow them)
    raw: np.ndarray
    digests: np.ndarray
    counts: np.ndarray  # tensors per part

    def ranges(self, parts: Sequence[int]) -> list[tuple[int, int]]:
        return [(int(self.offsets[i]), int(self.offsets[i + 1])) for i in parts]


def parse_index(raw: bytes, head: Head, source: str) -> Index:
    r = Reader(raw, f"{source}: index")
    n = r.count()
    if n != head.count("parts"):
        raise FormatError(f"{source}: the index lists {n} parts, the head says {head.count('parts')}")
    key_len, sizes, packed, raws, counts = r.ints(5 * n).reshape(5, n)
    digests = r.u64(n)
    check_ints(key_len, 0, len(raw), f"{source}: a first key's length")
    check_ints(sizes, 1, _MAX_INT, f"{source}: a part's length")
    check_ints(packed, 1, _MAX_INT, f"{source}: a part's compressed length")
    check_ints(counts, 1, _MAX_INT, f"{source}: a part's tensor count")
    if (packed > sizes).any():
        raise FormatError(f"{source}: a part's compressed rows are longer than the part")
    first_keys = names(bytes(r.take(int(key_len.sum()))), key_len, f"{source}: index")
    r.done()
    if any(a >= b for a, b in zip(first_keys, first_keys[1:])):
        raise FormatError(f"{source}: the index's parts are not in key order")
    start, stop = head.area("parts")
    offsets = start + np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if int(offsets[-1]) != stop:
        raise FormatError(f"{source}: the parts take {int(offsets[-1]) - start} bytes, the head says {stop - start}")
    if int(counts.sum()) != head.count("tensors"):
        raise FormatError(f"{source}: the parts hold {int(counts.sum())} tensors, the head says {head.count('tensors')}")
    return Index(first_keys, offsets, packed, raws, digests, counts)


# ============================================================================ tensor rows
@dataclass(frozen=True, eq=False)
class Rows:
    """Tensor rows of one or more parts, validated (:func:`rows_of`)."""

    keys: list[str]
    sources: list[str | None]
    cols: np.ndarray  # (len(ROW), n)
    shape_start: np.ndarray  # (n + 1,) into shapes
    shapes: np.ndarray
    cuts: grids.Cuts  # over these rows (a scalar or an explicit row has no slots)
    group_start: np.ndarray  # (n + 1,) into digests
    digests: np.ndarray

    def col(self, name: str) -> np.ndarray:
        return self.cols[_ROW_AT[name]]

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.shapes[self.shape_start[i] : self.shape_start[i + 1]].tolist())

    def all_shapes(self, sel: np.ndarray) -> list[tuple[int, ...]]:
        """The shapes of the rows ``sel``, as tuples (made a dim count at a time)."""
        ndim = self.col("ndim")[sel]
        out: list[tuple[int, ...]] = [()] * len(sel)
        for d in np.unique(ndim).tolist():
            at = np.flatnonzero(ndim == d)
            starts = self.shape_start[sel[at]]
            if not d:
                continue  # scalars: () already
            table = self.shapes[(starts[:, None] + np.arange(d)).reshape(-1)].reshape(len(at), d)
            for i, shape in zip(at.tolist(), map(tuple, table.tolist())):
                out[i] = shape
        return out

    def take(self, rows: Sequence[int]) -> "Rows":
        """Only the rows ``rows`` (ascending), renumbered 0..len(rows)-1: what a reader keeps
        of the parts it read."""
        sel = np.asarray(rows, dtype=np.int64)
        ndim = self.col("ndim")[sel]
        shape_idx = ragged.indices(self.shape_start[sel], ndim)
        slots = self.cuts.slot_of[sel + 1] - self.cuts.slot_of[sel]
        slot_idx = ragged.indices(self.cuts.slot_of[sel], slots)
        per_slot = self.cuts.start[slot_idx + 1] - self.cuts.start[slot_idx]
        value_idx = ragged.indices(self.cuts.start[slot_idx], per_slot)
        groups = self.group_start[sel + 1] - self.group_start[sel]
        group_idx = ragged.indices(self.group_start[sel], groups)
        starts = lambda n: np.concatenate([[0], np.cumsum(n)]).astype(np.int64)  # noqa: E731
        return Rows(
            keys=[self.keys[i] for i in sel.tolist()], sources=[self.sources[i] for i in sel.tolist()],
            cols=self.cols[:, sel], shape_start=starts(ndim), shapes=self.shapes[shape_idx],
            cuts=grids.Cuts(starts(slots), starts(per_slot), self.cuts.values[value_idx]),
            group_start=starts(groups), digests=self.digests[group_idx],
        )

    def described(self, i: int) -> tuple[int, int, tuple]:
        """(encoding code, dtype code, shape): what a derived tensor's source is checked by."""
        return int(self.col("encoding")[i]), int(self.col("dtype")[i]), self.shape(i)


@dataclass(frozen=True, eq=False)
class RawPart:
    """One part cut into its fields, their lengths checked (values are checked together with
    the other parts', :func:`rows_of`)."""

    cols: np.ndarray
    shapes: np.ndarray
    ncuts: np.ndarray
    gaps: np.ndarray
    keys: bytes
    sources: bytes
    digests: np.ndarray


def split_part(part: bytes | memoryview, packed_len: int, raw_len: int, what: str) -> RawPart:
    """A part's bytes: its compressed rows (``packed_len`` bytes, ``raw_len`` once inflated),
    then the digests of its tensors' groups."""
    r = Reader(inflate(memoryview(part)[:packed_len], raw_len, what), what)
    n = r.count()
    cols = r.ints(len(ROW) * n).reshape(len(ROW), n)
    ndim, count = cols[ROW.index("ndim")], cols[ROW.index("count")]
    check_ints(ndim, 0, 64, f"{what}: a tensor's ndim")
    check_ints(count, 0, _MAX_INT, f"{what}: a piece count")
    check_ints(cols[0], 0, raw_len, f"{what}: a key's length")
    check_ints(cols[1], 0, raw_len, f"{what}: a source's length")
    shapes = r.ints(int(ndim.sum()))
    ncuts = r.ints(r.count())
    gaps = r.ints(r.count())
    keys = bytes(r.take(int(cols[0].sum())))
    sources = bytes(r.take(int(cols[1].sum())))
    r.done()
    d = Reader(memoryview(part)[packed_len:], what)
    digests = d.u64(int((-(-count // GROUP)).sum()))
    d.done()
    return RawPart(cols, shapes, ncuts, gaps, keys, sources, digests)


def rows_of(raws: Sequence[RawPart], head: Head, what: str) -> Rows:
    """The tensor rows of ``raws`` (parts in key order), every field checked: codes, shapes,
    layouts (a grid's cuts ascending from 0 to the extent, as many cells as pieces), derived
    and encoded entries, places inside the areas, keys strictly ascending."""
    cols = np.concatenate([p.cols for p in raws], axis=1) if raws else np.zeros((len(ROW), 0), np.int64)
    c = dict(zip(ROW, cols))
    keys = names(b"".join(p.keys for p in raws), c["key_len"], what)
    n = len(keys)
    each = np.arange(n)
    _in_range(c["dtype"], each, keys, 0, len(DTYPES) - 1, what, "dtype code")
    _in_range(c["encoding"], each, keys, 0, len(ENCODINGS) - 1, what, "encoding code")
    _in_range(c["layout"], each, keys, GRID, EXPLICIT, what, "layout code")
    _in_range(c["count"], each, keys, 0, head.count("pieces"), what, "piece count")
    _check_span(c["first_piece"], c["count"], head.count("pieces"), f"{what}: a tensor's pieces")
    _check_span(c["first_block"], c["blocks"], head.count("blocks"), f"{what}: a tensor's checksums")
    boxes = np.where(c["layout"] == EXPLICIT, 16 * c["ndim"] * c["count"], 0)
    _check_span(c["first_box"], boxes, head.doc["areas"]["boxes"][1], f"{what}: a tensor's boxes")
    if len(cols[0]) and (c["blocks"] < c["count"]).any():
        raise FormatError(f"{what}: a tensor has fewer checksums than pieces")
    shapes = np.concatenate([p.shapes for p in raws]) if raws else np.zeros(0, np.int64)
    _in_range(shapes, np.repeat(each, c["ndim"]), keys, 0, _MAX_INT, what, "shape entry")
    shape_start = np.concatenate([[0], np.cumsum(c["ndim"])]).astype(np.int64)
    sources = [s or None for s in names(b"".join(p.sources for p in raws), c["src_len"], what)]
    if any(a >= b for a, b in zip(keys, keys[1:])):
        raise FormatError(f"{what}: tensor keys are not in order")
    ncuts = np.concatenate([p.ncuts for p in raws]) if raws else np.zeros(0, np.int64)
    gaps = np.concatenate([p.gaps for p in raws]) if raws else np.zeros(0, np.int64)
    cuts = _row_cuts(c, shapes, shape_start, ncuts, gaps, keys, what)
    _check_rows(keys, sources, c, shapes, shape_start, what)
    digests = np.concatenate([p.digests for p in raws]).astype(np.uint64) if raws else np.zeros(0, np.uint64)
    return Rows(keys, sources, cols, shape_start, shapes, cuts,
                np.concatenate([[0], np.cumsum(-(-c["count"] // GROUP))]).astype(np.int64), digests)


def _in_range(values: np.ndarray, owner: np.ndarray, keys: Sequence[str], lo: int, hi: int, what: str, name: str) -> None:
    """Raise FormatError naming the tensor (``keys[owner[i]]``) of the first value out of
    [lo, hi]."""
    bad = np.flatnonzero((values < lo) | (values > hi)) if len(values) else values
    if len(bad):
        i = int(bad[0])
        raise FormatError(f"{what}: tensor {keys[int(owner[i])]!r}: {name} {int(values[i])} out of range [{lo}, {hi}]")


def _check_span(first: np.ndarray, n: np.ndarray, total: int, what: str) -> None:
    check_ints(first, 0, total, what)
    if len(first) and (first > total - n).any():
        raise FormatError(f"{what} lie past the end of their area")


def _row_cuts(c: dict, shapes: np.ndarray, shape_start: np.ndarray, ncuts: np.ndarray, gaps: np.ndarray,
              keys: Sequence[str], what: str) -> grids.Cuts:
    """The grid rows' cuts, as :class:`~paddle_dcp.core.grids.Cuts` over all rows (other rows
    have no slots), checked: each dim's cuts ascend from 0 to its extent, the cells are the
    pieces."""
    kind, ndim, count = c["layout"], c["ndim"], c["count"]
    slots_per = np.where(kind == GRID, ndim, 0)
    if int(slots_per.sum()) != len(ncuts):
        raise FormatError(f"{what}: {len(ncuts)} cut counts for {int(slots_per.sum())} grid dims")
    check_ints(ncuts, 1, _MAX_INT, f"{what}: a dim's cut count")
    if int((ncuts - 1).sum()) != len(gaps):
        raise FormatError(f"{what}: {len(gaps)} cut gaps for {int((ncuts - 1).sum())}")
    check_ints(gaps, 1, _MAX_INT, f"{what}: a gap between cuts")
    slot_of = np.concatenate([[0], np.cumsum(slots_per)]).astype(np.int64)
    on_grid = np.repeat(kind == GRID, ndim)
    extents = shapes[on_grid]
    start = np.concatenate([[0], np.cumsum(ncuts)]).astype(np.int64)
    values = np.zeros(int(start[-1]), dtype=np.int64)  # each slot: 0, then its gaps
    later = np.ones(len(values), dtype=bool)
    later[start[:-1]] = False
    values[later] = gaps
    # each dim's cuts summed as floats first: past 2**62 they are refused (the exact running
    # sum may wrap across dims, which the differences within a dim undo)
    if len(values) and (np.add.reduceat(values.astype(np.float64), start[:-1]) > _MAX_INT).any():
        raise FormatError(f"{what}: grid cuts past 2**62")
    running = np.cumsum(values)
    if len(values):
        values = running - np.repeat(running[start[:-1]], ncuts)
    last = values[start[1:] - 1] if len(ncuts) else values
    bad_slot = np.flatnonzero(last != extents)
    if len(bad_slot):
        bad = int(np.searchsorted(slot_of, int(bad_slot[0]), side="right") - 1)
        raise FormatError(f"{what}: tensor {keys[bad]!r}: its grid's cuts do not end at its shape")
    cuts = grids.Cuts(slot_of, start, values)
    cells = cuts.cells()
    bad = (kind == GRID) & (cells != count)
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        raise FormatError(f"{what}: tensor {keys[t]!r}: {int(count[t])} pieces for a grid of {int(cells[t])} cells")
    return cuts


def _check_rows(keys: Sequence[str], sources: Sequence[str | None], c: dict, shapes: np.ndarray, shape_start: np.ndarray,
                what: str) -> None:
    """Shapes' products bounded; encodings on dtypes they hold; derived entries as the format
    says (their sources are checked once both rows are known: :func:`check_sources`)."""
    n, ndim, count, enc, dtype = len(keys), c["ndim"], c["count"], c["encoding"], c["dtype"]
    volume = np.ones(n, dtype=np.float64)
    for d in range(int(ndim.max()) if n else 0):
        has = ndim > d
        volume[has] *= shapes[shape_start[:-1][has] + d]
    if n and (volume * 16 > _MAX_INT).any():
        t = int(np.flatnonzero(volume * 16 > _MAX_INT)[0])
        raise FormatError(f"{what}: tensor {keys[t]!r}: shape has too many elements")
    for t in np.flatnonzero(enc != 0).tolist():
        name, dt, key = ENCODINGS[int(enc[t])], DTYPES[int(dtype[t])], keys[t]
        holds = DERIVED_DTYPES if name == DERIVED else quant.ENCODABLE
        if dt not in holds:
            raise FormatError(f"{what}: tensor {key!r}: encoding {name!r} cannot hold dtype {dt}; it holds {', '.join(holds)}")
        if name == DERIVED and count[t]:
            raise FormatError(f"{what}: tensor {key!r} (derived) is stored too ({int(count[t])} pieces): a derived tensor has none")
    for t, src in enumerate(sources):
        if (src is not None) != (int(enc[t]) == DERIVED_CODE):
            raise FormatError(f"{what}: tensor {keys[t]!r}: a source belongs to a derived tensor, and only to one")


def check_sources(rows: Rows, describe: Callable[[str], tuple[int, int, tuple] | None], what: str,
                  only: Sequence[int] | None = None) -> None:
    """Every derived row's source (of the rows ``only``, else all) is another tensor of the
    checkpoint, stored, float16 or bfloat16, of the same shape. ``describe(key)``: (encoding
    code, dtype code, shape) of a tensor of the checkpoint, or None."""
    derived = np.flatnonzero(rows.col("encoding") == DERIVED_CODE).tolist()
    for t in derived if only is None else [t for t in only if rows.col("encoding")[t] == DERIVED_CODE]:
        key, src = rows.keys[t], rows.sources[t]
        info = describe(src) if src is not None else None
        tag = f"{what}: tensor {key!r} (derived)"
        if src == key or (info is not None and info[0] == DERIVED_CODE):
            raise FormatError(f"{tag}: its source {str(src)[:200]!r} is derived itself (a chain or a cycle)")
        if info is None:
            raise FormatError(f"{tag}: its source {str(src)[:200]!r} is not a tensor of the checkpoint")
        if DTYPES[info[1]] not in SOURCE_DTYPES:
            raise FormatError(f"{tag}: its source {str(src)[:200]!r} is {DTYPES[info[1]]}; a tensor derives "
                              f"from {' or '.join(SOURCE_DTYPES)}")
        if info[2] != rows.shape(t):
            raise FormatError(f"{tag}: shape {rows.shape(t)}, its source {str(src)[:200]!r} has shape {info[2]}")


# ============================================================================ pieces
def stored_bytes(dtype: np.ndarray, encoding: np.ndarray, extents: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Stored bytes of pieces: their elements (``extents`` zero-padded past ``ndim``) times the
    dtype's size, or the whole encoded blocks of an encoding (none for a derived tensor)."""
    used = np.arange(extents.shape[1])[None, :] < ndim[:, None]
    elements = np.prod(np.where(used, extents, 1), axis=1, dtype=np.int64)
    nbytes = elements * ITEMSIZE[dtype]
    for code in np.unique(encoding).tolist():
        if code:
            sel = encoding == code
            name = ENCODINGS[code]
            nbytes[sel] = 0 if name == DERIVED else -(-elements[sel] // quant.BLOCK) * quant.encoding(str(name)).block_bytes
    return nbytes


@dataclass(frozen=True, eq=False)
class Layout:
    """Some rows' pieces, their boxes known (a grid's from its cuts, an explicit layout's from
    the boxes area): per row, the pieces ``piece_start[i]:piece_start[i + 1]``."""

    rows: np.ndarray  # the rows (ascending)
    piece_start: np.ndarray
    offsets: np.ndarray
    extents: np.ndarray
    nblocks: np.ndarray  # per piece

    def group_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every group of every row, in order: (its row's index i, its first piece and end
        piece, counted from the row's first, as (groups, 2)), and its checksums [lo, hi)
        counted from the row's first (groups, 2)."""
        counts = np.diff(self.piece_start)
        ngroups = -(-counts // GROUP)
        owner = np.repeat(np.arange(len(counts), dtype=np.int64), ngroups)
        g_in = ragged.positions(ngroups)
        p0 = g_in * GROUP
        p1 = np.minimum(p0 + GROUP, counts[owner])
        cum = np.concatenate([[0], np.cumsum(self.nblocks)]).astype(np.int64)
        base = self.piece_start[:-1][owner]
        b_first = cum[base]
        return owner, np.stack([p0, p1], axis=1), np.stack([cum[base + p0] - b_first, cum[base + p1] - b_first], axis=1)

    def group_blocks(self, i: int, g: int) -> tuple[int, int]:
        """Checksums [lo, hi) of group ``g`` of the ``i``-th row, counted from its first."""
        p0 = int(self.piece_start[i])
        a, b = p0 + g * GROUP, min(p0 + (g + 1) * GROUP, int(self.piece_start[i + 1]))
        before = int(self.nblocks[p0:a].sum())
        return before, before + int(self.nblocks[a:b].sum())


def layout_of(rows: Rows, sel: np.ndarray, boxes: Callable[[int], np.ndarray] | None, block_bytes: int) -> Layout:
    """The pieces of rows ``sel``: grids expanded together; an explicit row's boxes from
    ``boxes(row)`` ((count, 2 * ndim): offsets, then shapes), checked to lie inside the tensor.
    Each row's checksum count is checked against its pieces'."""
    width = int(rows.col("ndim")[sel].max()) if len(sel) else 0
    kind = rows.col("layout")[sel]
    grid_rows = sel[kind == GRID]
    g_start, g_off, g_ext = grids.expand(rows.cuts, grid_rows, rows.col("ndim")[grid_rows], width)
    counts = rows.col("count")[sel]
    piece_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    offsets = np.zeros((int(piece_start[-1]), width), np.int64)
    extents = np.zeros_like(offsets)
    at_grid = np.flatnonzero(kind == GRID)
    if len(at_grid):
        dest = np.repeat(piece_start[at_grid], np.diff(g_start)) + (np.arange(int(g_start[-1])) - np.repeat(g_start[:-1], np.diff(g_start)))
        offsets[dest], extents[dest] = g_off, g_ext
    for i in np.flatnonzero(kind == EXPLICIT).tolist():
        t, nd, p0 = int(sel[i]), int(rows.col("ndim")[sel[i]]), int(piece_start[i])
        b = boxes(t) if boxes is not None and counts[i] else np.zeros((0, 2 * nd), np.int64)
        _check_inside(rows, t, b[:, :nd], b[:, nd:])
        offsets[p0 : p0 + len(b), :nd], extents[p0 : p0 + len(b), :nd] = b[:, :nd], b[:, nd:]
    owner = np.repeat(sel, counts)
    nblocks = blocks_of(stored_bytes(rows.col("dtype")[owner], rows.col("encoding")[owner], extents,
                                     rows.col("ndim")[owner]), block_bytes) if len(owner) else np.zeros(0, np.int64)
    cum = np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int64)
    per_row = cum[piece_start[1:]] - cum[piece_start[:-1]]
    bad = np.flatnonzero(per_row != rows.col("blocks")[sel])
    if len(bad):
        t = int(sel[bad[0]])
        raise FormatError(f"tensor {rows.keys[t]!r}: its pieces have {int(per_row[bad[0]])} checksums, its row says "
                          f"{int(rows.col('blocks')[t])}")
    return Layout(sel, piece_start, offsets, extents, nblocks)


def _check_inside(rows: Rows, t: int, offsets: np.ndarray, extents: np.ndarray) -> None:
    limit = np.array(rows.shape(t), dtype=np.int64)
    bad = ((offsets < 0) | (extents <= 0) | (extents > limit) | (offsets > limit - extents)).any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise FormatError(f"tensor {rows.keys[t]!r}: piece at offset {tuple(offsets[i].tolist())} with shape "
                          f"{tuple(extents[i].tolist())} is empty or outside the tensor's shape {rows.shape(t)}")


def records(data: bytes | memoryview, n: int, head: Head) -> tuple[np.ndarray, np.ndarray]:
    """(files, byte offsets) of ``n`` fixed-width records."""
    w, wf = head.record_width, head.doc["widths"]["file"]
    raw = np.frombuffer(data, dtype=np.uint8, count=n * w).reshape(n, w)
    wide = np.zeros((n, 16), dtype=np.uint8)
    wide[:, :wf] = raw[:, :wf]
    wide[:, 8 : 8 + w - wf] = raw[:, wf:]
    both = wide.view("<u8").reshape(n, 2)
    if n and (both >= np.uint64(1 << 63)).any():
        raise FormatError("a record's file or byte offset is past 2**63")
    return both[:, 0].astype(np.int64), both[:, 1].astype(np.int64)
