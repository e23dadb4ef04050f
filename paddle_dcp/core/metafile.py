"""The metadata file of format version 3: a JSON head line, then packed sections that a reader
may read whole or in parts (docs/format.md, "Version 3").

Versions 1 and 2 wrote every tensor's entry into one JSON document: at a hundred thousand
tensors and a million pieces that is a hundred megabytes every rank reads and parses whole.
Version 3 holds the same content in a form whose cost grows with what is used:

* the head (the first line, JSON): the checkpoint's fields, its plain values (``outline``) and
  where everything else lies, under its own digest;
* the ``files``, ``structure`` and ``index`` sections, zlib-compressed, each under a digest the
  head holds: the data files, the full nesting, the directory of the tensor parts;
* the tensor parts, sorted by key, zlib-compressed, each under a digest the index holds: per
  tensor its dtype, shape, encoding, where its pieces lie and their layout: the cuts of its grid
  (:mod:`~paddle_dcp.core.grids`), or for any other layout the boxes stored with the pieces;
* the pieces area: every tensor's pieces in groups of 32, a group being the pieces' records
  (file and byte offset, fixed width), their boxes when the layout is not a grid, and their
  block checksums, under a digest the tensor's row holds.

A rank that loads a few hundred tensors of a large checkpoint reads the head, the files, the
index, the parts that hold its keys and the groups that hold its pieces (:func:`read_part`);
a tool reads everything (:func:`decode`). Every number the file claims is checked against the
bytes there are before anything is allocated from it.
"""
from __future__ import annotations

import bisect
import json
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, List, Mapping, Sequence, Tuple, Union

import numpy as np
import xxhash

from . import grids, nested, quant
from .boxes import Box, check_entry_tiling
from .derive import DERIVED, DERIVED_DTYPES, SOURCE_DTYPES
from .dtypes import itemsize
from ..errors import FormatError, PlanError
from .metadata import (
    _MAX_INT,
    CHECKSUM_ALGORITHMS,
    FORMAT_NAME,
    MAX_METADATA_BYTES,
    ColumnTensors,
    DigestVerdict,
    FileEntry,
    Metadata,
    TensorColumns,
    blocks_of,
    check_file_name,
    digest_matches,
    with_digest,
)

VERSION = 3
GROUP = 32  # pieces of a tensor under one digest
MAX_HEAD = 64 << 20  # bytes of the head line
RATIO = 64  # at most this many bytes out of a compressed byte (the writer keeps to it)
PART_BYTES = 8192  # raw bytes of tensor rows per part, about
GRID, EXPLICIT = 0, 1
# the codes on disk: their order is the format's
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128")
ENCODINGS: tuple[str | None, ...] = (None, "int8", "int4", DERIVED)
_DTYPE_CODE = {name: i for i, name in enumerate(DTYPES)}
_ENCODING_CODE = {name: i for i, name in enumerate(ENCODINGS)}
_ITEMSIZE = np.array([itemsize(d) for d in DTYPES], dtype=np.int64)
_MAGIC = b'{"format":"paddle_dcp","format_version":3,'
_ROW_COLUMNS = 9  # key_len, src_len, dtype, encoding, ndim, layout, count, data_start, data_len

Fetch = Callable[[Sequence[Tuple[int, int]]], Sequence[Union[bytes, memoryview]]]  # [start, stop) ranges -> their bytes
GroupFetch = Callable[[int, int, int], Union[bytes, memoryview]]  # (row, start, stop in the pieces area) -> bytes
_Group = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # offsets .. checksums


_ANY_HEAD = b'{"format":"paddle_dcp","format_version":'


def has_head_line(data: bytes | memoryview) -> bool:
    """Whether metadata bytes start with a head line (version 3 and any later version), not
    one JSON document (versions 1 and 2, never written with a newline)."""
    if bytes(data[: len(_ANY_HEAD)]) != _ANY_HEAD:
        return False
    text = data if isinstance(data, (bytes, bytearray)) else bytes(data[:MAX_HEAD])
    return text.find(b"\n", 0, MAX_HEAD) >= 0


def is_packed(data: bytes | memoryview) -> bool:
    """Whether metadata bytes are version 3's (a head line that says so) rather than one JSON
    document (versions 1 and 2)."""
    return bytes(data[: len(_MAGIC)]) == _MAGIC


# ============================================================================ packing
def _shuffled(values: np.ndarray) -> bytes:
    """int64 values as little-endian bytes, byte-shuffled (every first byte, then every second
    byte...): small or repetitive integers then compress to almost nothing."""
    raw = np.ascontiguousarray(values, dtype="<i8").view(np.uint8).reshape(-1, 8)
    return raw.T.tobytes()


def _deflate(raw: bytes) -> bytes:
    packed = zlib.compress(raw, 6)
    if len(raw) > RATIO * len(packed):  # kept to the bound a reader holds it to
        packed = zlib.compress(raw, 0)
    return packed


def _inflate(packed: bytes | memoryview, raw_len: int, what: str) -> bytes:
    """``packed`` decompressed, exactly ``raw_len`` bytes, refused before any allocation when
    ``raw_len`` is more than the format allows for ``len(packed)`` bytes."""
    if type(raw_len) is not int or raw_len < 0 or raw_len > RATIO * len(packed) + 64:
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


class _Reader:
    """Sequential reads of a decompressed buffer, each checked to lie inside it."""

    def __init__(self, buf: bytes, what: str):
        self.buf, self.at, self.what = memoryview(buf), 0, what

    def take(self, n: int) -> memoryview:
        if n < 0 or n > len(self.buf) - self.at:
            raise FormatError(f"{self.what}: truncated ({n} bytes wanted, {len(self.buf) - self.at} left)")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def count(self, limit: int) -> int:
        (n,) = np.frombuffer(self.take(8), dtype="<u8").tolist()
        if n > limit:
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

    def strings(self, lengths: np.ndarray) -> list[str]:
        if len(lengths) and (lengths < 0).any():
            raise FormatError(f"{self.what}: a negative name length")
        total = int(lengths.sum()) if len(lengths) else 0
        blob = bytes(self.take(total))
        try:
            text = blob.decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.what}: a name is not UTF-8") from None
        ends = np.cumsum(lengths).tolist()
        starts = [0] + ends[:-1]
        if len(text) == total:  # ASCII: characters are bytes
            return [text[a:b] for a, b in zip(starts, ends)]
        try:
            return [blob[a:b].decode("utf-8") for a, b in zip(starts, ends)]
        except UnicodeDecodeError:
            raise FormatError(f"{self.what}: a name is cut inside a UTF-8 character") from None

    def done(self) -> None:
        if self.at != len(self.buf):
            raise FormatError(f"{self.what}: {len(self.buf) - self.at} bytes left over")


def _width(largest: int) -> int:
    """Bytes of a little-endian field that holds every value up to ``largest``."""
    return max(1, (int(largest).bit_length() + 7) // 8)


def _check_ints(values: np.ndarray, lo: int, hi: int, what: str) -> None:
    if len(values) and (int(values.min()) < lo or int(values.max()) > hi):
        raise FormatError(f"{what} out of range [{lo}, {hi}]")


# ============================================================================ writing
def columns_of(meta: Metadata) -> TensorColumns:
    """``meta``'s tensors as columns, sorted by key, each tensor's pieces by their boxes (as a
    save plans them): the columns themselves when the metadata was built from them."""
    if isinstance(meta.tensors, ColumnTensors) and list(meta.tensors.columns.keys) == sorted(meta.tensors.columns.keys):
        return meta.tensors.columns
    keys = sorted(meta.tensors)
    entries = [meta.tensors[k] for k in keys]
    width = max((len(e.shape) for e in entries), default=0)
    offsets, extents, files, byte_offsets, sums, counts, nblocks = [], [], [], [], [], [], []
    for e in entries:
        p = e.pieces
        nd = len(e.shape)
        order = np.lexsort(tuple(p.files[None, :]) + tuple(p.shapes.T[::-1]) + tuple(p.offsets.T[::-1])) if p.count else np.zeros(0, np.int64)
        starts = e.block_starts()
        pad = lambda a: np.pad(a[order].reshape(p.count, nd), ((0, 0), (0, width - nd)))  # noqa: E731
        offsets.append(pad(p.offsets))
        extents.append(pad(p.shapes))
        files.append(p.files[order])
        byte_offsets.append(p.byte_offsets[order])
        sums.append(np.concatenate([p.checksums[starts[i] : starts[i + 1]] for i in order.tolist()]) if p.count else p.checksums[:0])
        counts.append(p.count)
        nblocks.append(np.diff(starts)[order])
    cat = lambda parts, shape: np.concatenate(parts) if parts else np.zeros(shape, np.int64)  # noqa: E731
    return TensorColumns(
        keys=tuple(keys),
        dtypes=tuple(e.dtype for e in entries),
        shapes=tuple(tuple(e.shape) for e in entries),
        encodings=tuple(e.encoding for e in entries),
        sources=tuple(e.source for e in entries),
        piece_start=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        offsets=cat(offsets, (0, width)).astype(np.int64),
        extents=cat(extents, (0, width)).astype(np.int64),
        files=cat(files, (0,)).astype(np.int64),
        byte_offsets=cat(byte_offsets, (0,)).astype(np.int64),
        block_start=np.concatenate([[0], np.cumsum(cat(nblocks, (0,)))]).astype(np.int64),
        checksums=cat(sums, (0,)).astype(np.uint64),
    )


def encode(meta: Metadata, grid: grids.GridCheck | None = None) -> bytes:
    """``meta`` as a version 3 file. ``grid``: :func:`~paddle_dcp.core.grids.find_grids` of
    its pieces when the caller has it (else it is found here)."""
    cols = columns_of(meta)
    grid = grid if grid is not None else cols.grid
    n_t, n_p = len(cols.keys), len(cols.files)
    ndims = np.array([len(s) for s in cols.shapes], dtype=np.int64)
    if meta.replicas or n_p == 0:  # copies repeat boxes: no grid
        kind = np.full(n_t, EXPLICIT, dtype=np.int64)
        cuts = None
    else:
        if grid is None:
            grid = grids.find_grids(cols.piece_start, cols.offsets, cols.extents, ndims, _extents(cols, ndims))
        kind = np.where(grid.grid, GRID, EXPLICIT).astype(np.int64)
        cuts = grid.cuts
    wf = _width(int(cols.files.max()) if n_p else 0)
    wo = _width(int(cols.byte_offsets.max()) if n_p else 0)
    area, data_start, data_len, digests = _pieces_area(cols, kind, ndims, wf, wo)
    parts, index = _tensor_parts(cols, kind, ndims, cuts, data_start, data_len, digests)
    files_raw = _files_raw(meta.files)
    structure_raw = json.dumps(meta.structure, separators=(",", ":"), allow_nan=False).encode()
    index_raw = _index_raw(index)
    body: list[bytes] = []
    at = 0
    sections: dict[str, list] = {}
    for name, raw in (("files", files_raw), ("structure", structure_raw), ("index", index_raw)):
        packed = _deflate(raw)
        sections[name] = [at, len(packed), len(raw), f"{xxhash.xxh3_64_intdigest(packed):016x}"]
        body.append(packed)
        at += len(packed)
    areas = {"parts": [at, sum(len(p) for p in parts)], "pieces": [at + sum(len(p) for p in parts), len(area)]}
    body.extend(parts)
    body.append(area)
    outline, holders = outline_of(meta.structure)
    head = {
        "format": FORMAT_NAME,
        "format_version": VERSION,
        "unique_id": meta.unique_id,
        "world_size": meta.world_size,
        "created_by": meta.created_by,
        "checksum": {"algorithm": meta.checksum_algorithm, "block_bytes": meta.block_bytes},
        "counts": {"tensors": n_t, "pieces": n_p, "blocks": len(cols.checksums), "files": len(meta.files),
                   "parts": len(parts)},
        "widths": {"file": wf, "offset": wo},
        "outline": outline,
        "holders": holders,
        "sections": sections,
        "areas": areas,
    }
    if meta.replicas:
        head["replicas"] = True
    line = with_digest(json.dumps(head, separators=(",", ":"), allow_nan=False).encode())
    return line + b"\n" + b"".join(body)


def _extents(cols: TensorColumns, ndims: np.ndarray) -> np.ndarray:
    out = np.zeros((len(cols.keys), cols.offsets.shape[1]), dtype=np.int64)
    for d in range(out.shape[1]):
        has = np.flatnonzero(ndims > d)
        out[has, d] = [cols.shapes[t][d] for t in has.tolist()]
    return out


def _piece_nbytes(cols: TensorColumns, ndims: np.ndarray) -> np.ndarray:
    """Stored bytes of every piece of the columns."""
    counts = np.diff(cols.piece_start)
    tensor_of = np.repeat(np.arange(len(cols.keys)), counts)
    used = np.arange(cols.extents.shape[1])[None, :] < ndims[tensor_of][:, None]
    elements = np.prod(np.where(used, cols.extents, 1), axis=1, dtype=np.int64)
    codes = np.array([_DTYPE_CODE[d] for d in cols.dtypes], dtype=np.int64)
    nbytes = elements * _ITEMSIZE[codes][tensor_of]
    for t in [t for t, e in enumerate(cols.encodings) if e is not None]:
        lo, hi = int(cols.piece_start[t]), int(cols.piece_start[t + 1])
        nbytes[lo:hi] = _stored(elements[lo:hi], cols.dtypes[t], cols.encodings[t])
    return nbytes


def _stored(elements: np.ndarray, dtype: str, encoding: str | None) -> np.ndarray:
    if encoding is None:
        return elements * itemsize(dtype)
    if encoding == DERIVED:
        return elements * 0
    return -(-elements // quant.BLOCK) * quant.encoding(encoding).block_bytes


def _groups(piece_start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every group of every tensor: (first piece, end piece, owning tensor), in file order."""
    counts = np.diff(piece_start)
    ngroups = -(-counts // GROUP)
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), ngroups)
    g_in = np.arange(int(ngroups.sum()), dtype=np.int64) - np.repeat(np.cumsum(ngroups) - ngroups, ngroups)
    first = piece_start[:-1][owner] + g_in * GROUP
    end = np.minimum(first + GROUP, piece_start[1:][owner])
    return first, end, owner


def _pieces_area(
    cols: TensorColumns, kind: np.ndarray, ndims: np.ndarray, wf: int, wo: int
) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    """The pieces area: every group's records, boxes (explicit layouts) and checksums, tensor
    by tensor; each tensor's (start, length) in it, and every group's digest."""
    n_p = len(cols.files)
    w = wf + wo
    records = np.concatenate(
        [np.ascontiguousarray(cols.files, "<i8").view(np.uint8).reshape(n_p, 8)[:, :wf],
         np.ascontiguousarray(cols.byte_offsets, "<i8").view(np.uint8).reshape(n_p, 8)[:, :wo]], axis=1)
    counts = np.diff(cols.piece_start)
    tensor_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    box_len = np.where(kind[tensor_of] == EXPLICIT, 16 * ndims[tensor_of], 0)  # bytes of a piece's box
    sums_len = 8 * np.diff(cols.block_start)
    g_first, g_end, g_owner = _groups(cols.piece_start)
    piece_len = w + box_len + sums_len
    cum = np.concatenate([[0], np.cumsum(piece_len)])
    g_len = cum[g_end] - cum[g_first]
    g_at = np.concatenate([[0], np.cumsum(g_len)]).astype(np.int64)
    area = np.zeros(int(g_at[-1]), dtype=np.uint8)
    # within its group: the records, then the boxes, then the checksums, each piece after piece
    group_of = np.repeat(np.arange(len(g_first), dtype=np.int64), g_end - g_first)
    in_group = np.arange(n_p, dtype=np.int64) - g_first[group_of]
    base = g_at[group_of]
    count_g = (g_end - g_first)[group_of]
    box_cum = np.concatenate([[0], np.cumsum(box_len)])
    sums_cum = np.concatenate([[0], np.cumsum(sums_len)])
    rec_at = base + in_group * w
    box_at = base + count_g * w + (box_cum[:-1] - box_cum[g_first[group_of]])
    group_box_len = box_cum[g_end] - box_cum[g_first]
    sums_at = base + count_g * w + group_box_len[group_of] + (sums_cum[:-1] - sums_cum[g_first[group_of]])
    if n_p:
        area[(rec_at[:, None] + np.arange(w)).reshape(-1)] = records.reshape(-1)
        explicit = np.flatnonzero(box_len)
        for nd in np.unique(ndims[tensor_of[explicit]]).tolist():
            sel = explicit[ndims[tensor_of[explicit]] == nd]
            boxes = np.concatenate([cols.offsets[sel, :nd], cols.extents[sel, :nd]], axis=1).astype("<i8")
            area[(box_at[sel][:, None] + np.arange(16 * nd)).reshape(-1)] = boxes.view(np.uint8).reshape(-1)
        sums = np.ascontiguousarray(cols.checksums, "<u8").view(np.uint8)
        n_blocks = np.diff(cols.block_start)
        block_piece = np.repeat(np.arange(n_p, dtype=np.int64), n_blocks)
        block_at = sums_at[block_piece] + 8 * (np.arange(len(cols.checksums)) - cols.block_start[:-1][block_piece])
        area[(block_at[:, None] + np.arange(8)).reshape(-1)] = sums
    data = area.tobytes()
    view = memoryview(data)
    digests = np.array([xxhash.xxh3_64_intdigest(view[a:b]) for a, b in zip(g_at[:-1].tolist(), g_at[1:].tolist())],
                       dtype=np.uint64)
    t_groups = np.concatenate([[0], np.cumsum(-(-counts // GROUP))]).astype(np.int64)
    data_start = g_at[t_groups[:-1]]
    data_len = g_at[t_groups[1:]] - data_start
    return data, data_start, data_len, digests


def _tensor_parts(
    cols: TensorColumns,
    kind: np.ndarray,
    ndims: np.ndarray,
    cuts: grids.Cuts | None,
    data_start: np.ndarray,
    data_len: np.ndarray,
    digests: np.ndarray,
) -> tuple[list[bytes], list[tuple[str, int, int, int, int]]]:
    """The tensor rows cut into parts of about PART_BYTES raw bytes: (the compressed parts,
    per part (first key, compressed length, raw length, digest, tensors))."""
    n_t = len(cols.keys)
    keys_b = [k.encode("utf-8") for k in cols.keys]
    srcs_b = [(s or "").encode("utf-8") for s in cols.sources]
    counts = np.diff(cols.piece_start)
    ngroups = -(-counts // GROUP)
    g_start = np.concatenate([[0], np.cumsum(ngroups)]).astype(np.int64)
    grid_t = kind == GRID
    cut_counts, ncuts_start, cut_gaps, gaps_start = _cut_columns(cuts, grid_t, ndims)
    cut_ints = np.diff(ncuts_start) + np.diff(gaps_start)
    row_bytes = (np.array([len(k) + len(s) for k, s in zip(keys_b, srcs_b)], dtype=np.int64)
                 + 8 * (_ROW_COLUMNS + ndims + cut_ints + ngroups))
    cum = np.cumsum(row_bytes)
    bounds = [0]
    while bounds[-1] < n_t:  # at least one tensor a part
        at = bounds[-1]
        base = int(cum[at - 1]) if at else 0
        bounds.append(max(at + 1, int(np.searchsorted(cum, base + PART_BYTES, side="right"))))
    bounds[-1] = n_t
    dtype_codes = np.array([_DTYPE_CODE[d] for d in cols.dtypes], dtype=np.int64)
    enc_codes = np.array([_ENCODING_CODE[e] for e in cols.encodings], dtype=np.int64)
    shapes_flat = np.array([x for s in cols.shapes for x in s], dtype=np.int64)
    shape_start = np.concatenate([[0], np.cumsum(ndims)]).astype(np.int64)
    parts, index = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if lo == hi:
            continue
        rows = np.stack([
            np.array([len(k) for k in keys_b[lo:hi]], np.int64), np.array([len(s) for s in srcs_b[lo:hi]], np.int64),
            dtype_codes[lo:hi], enc_codes[lo:hi], ndims[lo:hi], kind[lo:hi], counts[lo:hi],
            data_start[lo:hi], data_len[lo:hi],
        ]).reshape(-1)
        shape = shapes_flat[shape_start[lo] : shape_start[hi]]
        ncuts = cut_counts[ncuts_start[lo] : ncuts_start[hi]]
        deltas = cut_gaps[gaps_start[lo] : gaps_start[hi]]
        raw = b"".join([
            np.array([hi - lo], "<u8").tobytes(), _shuffled(rows), _shuffled(shape),
            np.array([len(ncuts)], "<u8").tobytes(), _shuffled(ncuts),
            np.array([len(deltas)], "<u8").tobytes(), _shuffled(deltas),
            b"".join(keys_b[lo:hi]), b"".join(srcs_b[lo:hi]),
            np.ascontiguousarray(digests[g_start[lo] : g_start[hi]], "<u8").tobytes(),
        ])
        packed = _deflate(raw)
        parts.append(packed)
        index.append((cols.keys[lo], len(packed), len(raw), xxhash.xxh3_64_intdigest(packed), hi - lo))
    return parts, index


def _cut_columns(cuts: grids.Cuts | None, grid_t: np.ndarray, ndims: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every grid tensor's dims: how many cuts each has, and the gaps between successive cuts
    (the first cut is 0); with where each tensor's cut counts and gaps start: (ncuts,
    ncuts_start (T + 1,), gaps, gaps_start (T + 1,))."""
    n_t = len(grid_t)
    slots_per = np.where(grid_t, ndims, 0)
    ncuts_start = np.concatenate([[0], np.cumsum(slots_per)]).astype(np.int64)
    if cuts is None or not grid_t.any():
        return np.zeros(0, np.int64), ncuts_start, np.zeros(0, np.int64), np.zeros(n_t + 1, np.int64)
    t_of_slot = np.repeat(np.arange(n_t), slots_per)
    slots = cuts.slot_of[t_of_slot] + (np.arange(len(t_of_slot)) - ncuts_start[t_of_slot])
    ncuts = (cuts.start[slots + 1] - cuts.start[slots]).astype(np.int64)
    gaps_all = np.diff(cuts.values)
    first = cuts.start[slots]
    n_gaps = ncuts - 1
    owner = np.repeat(np.arange(len(slots)), n_gaps)
    take = np.repeat(first, n_gaps) + (np.arange(int(n_gaps.sum())) - np.repeat(np.cumsum(n_gaps) - n_gaps, n_gaps))
    gaps = gaps_all[take].astype(np.int64) if len(take) else np.zeros(0, np.int64)
    per_t = np.bincount(t_of_slot[owner], minlength=n_t) if len(owner) else np.zeros(n_t, np.int64)
    gaps_start = np.concatenate([[0], np.cumsum(per_t)]).astype(np.int64)
    return ncuts, ncuts_start, gaps, gaps_start


def _files_raw(files: Sequence[FileEntry]) -> bytes:
    names = [f.name.encode("utf-8") for f in files]
    return b"".join([
        np.array([len(files)], "<u8").tobytes(),
        _shuffled(np.array([f.nbytes for f in files], np.int64)),
        _shuffled(np.array([len(n) for n in names], np.int64)),
        b"".join(names),
    ])


def _index_raw(index: Sequence[tuple[str, int, int, int, int]]) -> bytes:
    keys = [k.encode("utf-8") for k, *_ in index]
    ints = np.array([[len(k), n, raw, count] for k, (_, n, raw, _, count) in zip(keys, index)], np.int64).T.reshape(-1)
    return b"".join([
        np.array([len(index)], "<u8").tobytes(), _shuffled(ints),
        np.array([d for *_, d, _ in index], "<u8").tobytes(), b"".join(keys),
    ])


def outline_of(structure: dict) -> tuple[dict, list[list]]:
    """What a reader of some tensors needs of the nesting: the structure without the tensors
    of its dicts (nor the dicts that hold only tensors), lists and tuples kept whole (their
    tensors as ``{"t": 0}``, their tensor-only containers empty), and the paths of the
    containers kept that hold tensors (:attr:`Metadata.holders`)."""
    holders: list[list] = []

    def visit(node: dict, path: list) -> tuple[bool, dict | None]:
        tag = nested.kind(node)
        if tag == "t":
            return True, None
        if tag not in ("d", "l", "u"):
            return False, node
        items = node[tag] if tag != "d" else [c for _, c in node["d"]]
        names = [k for k, _ in node["d"]] if tag == "d" else list(range(len(items)))
        seen = [visit(c, path + [k]) for k, c in zip(names, items)]
        holds = any(h for h, _ in seen)
        if not holds:
            return False, node
        if tag == "d":
            kept = [[k, o] for k, (_, o) in zip(names, seen) if o is not None]
            if not kept and path:
                return True, None
            out: dict = {"d": kept}
        else:
            out = {tag: [o if o is not None else ({"t": 0} if nested.kind(c) == "t" else {nested.kind(c): []})
                         for c, (_, o) in zip(items, seen)]}
            for k, c, (h, o) in zip(names, items, seen):
                if o is None and nested.kind(c) != "t":
                    holders.append(path + [k])
        if path:
            holders.append(path)
        return True, out

    _, outline = visit(structure, [])
    return outline or {"d": []}, sorted(holders, key=lambda p: [str(c) for c in p])


# ============================================================================ reading
@dataclass(frozen=True)
class _Head:
    """A version 3 head, validated: the fields and where the rest lies (offsets from the start
    of the file)."""

    doc: dict
    body: int  # where the body starts
    size: int  # the file's size
    digest: DigestVerdict

    def section(self, name: str) -> tuple[int, int, int, int]:
        """(start, stop, raw length, digest) of a section."""
        at, n, raw, digest = self.doc["sections"][name]
        return self.body + at, self.body + at + n, raw, digest

    def area(self, name: str) -> tuple[int, int]:
        at, n = self.doc["areas"][name]
        return self.body + at, self.body + at + n

    def count(self, name: str) -> int:
        return self.doc["counts"][name]

    @property
    def record_width(self) -> int:
        return self.doc["widths"]["file"] + self.doc["widths"]["offset"]


def read_head(fetch: Fetch, size: int, source: str) -> _Head:
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


def parse_head(line: bytes, size: int, source: str) -> _Head:
    """The head line, parsed and checked: every field of its type, every section and area
    inside the file, the head's own digest (a mismatch is an error: all else is trusted
    through it)."""
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise FormatError(f"{source}: the head line is not valid JSON ({exc})") from None
    matches = digest_matches(line, doc)
    if matches is not True:
        raise FormatError(f"{source}: the metadata's head does not match its digest: the file was edited or damaged")
    try:
        head = _Head(doc, len(line) + 1, size, DigestVerdict(True, source))
        _check_head(head)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise FormatError(f"{source}: malformed metadata head ({type(exc).__name__}: {exc})") from None
    return head


def _int(value: Any, what: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise FormatError(f"{what} must be an integer in [{lo}, {hi}], found {str(value)[:40]!r}")
    return value


def _check_head(head: _Head) -> None:
    doc = head.doc
    if doc.get("format") != FORMAT_NAME or doc.get("format_version") != VERSION:
        raise FormatError("not a paddle_dcp version 3 metadata head")
    _int(doc["unique_id"], "unique_id")
    _int(doc["world_size"], "world_size", 1, 1 << 24)
    if not isinstance(doc.get("created_by", ""), str):
        raise FormatError("created_by must be a string")
    if doc["checksum"]["algorithm"] not in CHECKSUM_ALGORITHMS:
        raise FormatError(f"unknown checksum algorithm {str(doc['checksum']['algorithm'])[:40]!r}")
    _int(doc["checksum"]["block_bytes"], "checksum.block_bytes", 64, 1 << 30)
    body = head.size - head.body
    for name in ("tensors", "pieces", "blocks", "files", "parts"):
        _int(doc["counts"][name], f"counts.{name}", 0, body)  # each costs the file a byte at least
    for name in ("file", "offset"):
        _int(doc["widths"][name], f"widths.{name}", 1, 8)
    for name in ("files", "structure", "index"):
        at, n, raw, digest = doc["sections"][name]
        _int(at, f"{name}.offset", 0, body)
        _int(n, f"{name}.length", 0, body - at)
        _int(raw, f"{name}.raw", 0, RATIO * n + 64)
        if not (isinstance(digest, str) and len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)):
            raise FormatError(f"{name}: the digest must be 16 lowercase hex digits")
    for name in ("parts", "pieces"):
        at, n = doc["areas"][name]
        _int(at, f"{name}.offset", 0, body)
        _int(n, f"{name}.length", 0, body - at)
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


def _section(head: _Head, name: str, raw_bytes: bytes | memoryview, source: str) -> bytes:
    _, _, raw, digest = head.section(name)
    if f"{xxhash.xxh3_64_intdigest(raw_bytes):016x}" != digest:
        raise FormatError(f"{source}: section {name} does not match its digest: the file was edited or damaged")
    return _inflate(raw_bytes, raw, f"{source}: section {name}")


def _parse_files(raw: bytes, head: _Head, source: str) -> tuple[FileEntry, ...]:
    r = _Reader(raw, f"{source}: files")
    n = r.count(len(raw))
    if n != head.count("files"):
        raise FormatError(f"{source}: {n} files listed, the head says {head.count('files')}")
    sizes = r.ints(n)
    _check_ints(sizes, 0, _MAX_INT, f"{source}: a file's size")
    names = r.strings(r.ints(n))
    r.done()
    files, seen = [], set()
    for name, nbytes in zip(names, sizes.tolist()):
        check_file_name(name, f"{source}: file")
        if name in seen:
            raise FormatError(f"{source}: file {name!r} is listed twice")
        seen.add(name)
        files.append(FileEntry(name, nbytes))
    return tuple(files)


@dataclass(frozen=True, eq=False)
class _Index:
    first_keys: list[str]
    offsets: np.ndarray  # (parts + 1,) absolute
    raw: np.ndarray
    digests: np.ndarray
    counts: np.ndarray  # tensors per part
    tensor_start: np.ndarray  # (parts + 1,) ordinal of each part's first tensor


def _parse_index(raw: bytes, head: _Head, source: str) -> _Index:
    r = _Reader(raw, f"{source}: index")
    n = r.count(len(raw))
    if n != head.count("parts"):
        raise FormatError(f"{source}: the index lists {n} parts, the head says {head.count('parts')}")
    ints = r.ints(4 * n).reshape(4, n)
    digests = r.u64(n)
    lengths, sizes, raws, counts = ints
    _check_ints(sizes, 1, _MAX_INT, f"{source}: a part's length")
    _check_ints(counts, 1, _MAX_INT, f"{source}: a part's tensor count")
    first_keys = r.strings(lengths)
    r.done()
    if any(a >= b for a, b in zip(first_keys, first_keys[1:])):
        raise FormatError(f"{source}: the index's parts are not in key order")
    start, stop = head.area("parts")
    offsets = start + np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if int(offsets[-1]) != stop:
        raise FormatError(f"{source}: the parts take {int(offsets[-1]) - start} bytes, the head says {stop - start}")
    tensor_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if int(tensor_start[-1]) != head.count("tensors"):
        raise FormatError(f"{source}: the parts hold {int(tensor_start[-1])} tensors, the head says {head.count('tensors')}")
    return _Index(first_keys, offsets, raws, digests, counts, tensor_start)


@dataclass(frozen=True, eq=False)
class _Rows:
    """Tensor rows of one or more parts, validated (see :func:`_parse_part`)."""

    keys: list[str]
    sources: list[str | None]
    dtype: np.ndarray
    encoding: np.ndarray
    ndim: np.ndarray
    kind: np.ndarray
    count: np.ndarray
    data_start: np.ndarray
    data_len: np.ndarray
    shape_start: np.ndarray  # (n + 1,) into shapes
    shapes: np.ndarray
    cuts: grids.Cuts  # over these rows (a scalar or an explicit row has no slots)
    group_start: np.ndarray  # (n + 1,) into digests
    digests: np.ndarray

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.shapes[self.shape_start[i] : self.shape_start[i + 1]].tolist())


@dataclass(frozen=True, eq=False)
class _RawPart:
    """One part cut into its fields, their lengths checked (values are checked together with
    the other parts', :func:`_rows_of`)."""

    rows: np.ndarray  # (_ROW_COLUMNS, n)
    shapes: np.ndarray
    ncuts: np.ndarray
    deltas: np.ndarray
    keys: bytes
    sources: bytes
    digests: np.ndarray


def _split_part(raw: bytes, what: str) -> _RawPart:
    r = _Reader(raw, what)
    n = r.count(len(raw))
    rows = r.ints(_ROW_COLUMNS * n).reshape(_ROW_COLUMNS, n)
    ndim, count = rows[4], rows[6]
    _check_ints(ndim, 0, 64, f"{what}: a tensor's ndim")
    _check_ints(count, 0, _MAX_INT, f"{what}: a piece count")
    _check_ints(rows[0], 0, len(raw), f"{what}: a key's length")
    _check_ints(rows[1], 0, len(raw), f"{what}: a source's length")
    shapes = r.ints(int(ndim.sum()))
    ncuts = r.ints(r.count(len(raw)))
    deltas = r.ints(r.count(len(raw)))
    keys = bytes(r.take(int(rows[0].sum())))
    sources = bytes(r.take(int(rows[1].sum())))
    digests = r.u64(int((-(-count // GROUP)).sum()))
    r.done()
    return _RawPart(rows, shapes, ncuts, deltas, keys, sources, digests)


def _rows_of(raws: Sequence[_RawPart], head: _Head, what: str) -> _Rows:
    """The tensor rows of ``raws`` (parts in key order), every field checked: codes, shapes,
    layouts (a grid's cuts ascending from 0 to the extent, as many cells as pieces), derived
    and encoded entries, places inside the pieces area, keys strictly ascending."""
    rows = np.concatenate([p.rows for p in raws], axis=1) if raws else np.zeros((_ROW_COLUMNS, 0), np.int64)
    key_len, src_len, dtype, enc, ndim, kind, count, data_start, data_len = rows
    _check_ints(dtype, 0, len(DTYPES) - 1, f"{what}: a dtype code")
    _check_ints(enc, 0, len(ENCODINGS) - 1, f"{what}: an encoding code")
    _check_ints(kind, GRID, EXPLICIT, f"{what}: a layout code")
    _check_ints(count, 0, head.count("pieces"), f"{what}: a piece count")
    area = head.doc["areas"]["pieces"][1]
    _check_ints(data_start, 0, area, f"{what}: where a tensor's pieces start")
    _check_ints(data_len, 0, area, f"{what}: the length of a tensor's pieces")
    if len(data_start) and (data_start > area - data_len).any():
        raise FormatError(f"{what}: a tensor's pieces lie past the end of the pieces area")
    shapes = np.concatenate([p.shapes for p in raws]) if raws else np.zeros(0, np.int64)
    _check_ints(shapes, 0, _MAX_INT, f"{what}: a shape entry")
    shape_start = np.concatenate([[0], np.cumsum(ndim)]).astype(np.int64)
    keys = _names(b"".join(p.keys for p in raws), key_len, what)
    sources = [s or None for s in _names(b"".join(p.sources for p in raws), src_len, what)]
    if any(a >= b for a, b in zip(keys, keys[1:])):
        raise FormatError(f"{what}: tensor keys are not in order")
    ncuts = np.concatenate([p.ncuts for p in raws]) if raws else np.zeros(0, np.int64)
    deltas = np.concatenate([p.deltas for p in raws]) if raws else np.zeros(0, np.int64)
    cuts = _row_cuts(kind, ndim, shapes, shape_start, ncuts, deltas, count, keys, what)
    _check_rows(keys, sources, dtype, enc, ndim, kind, count, shapes, shape_start, what)
    digests = np.concatenate([p.digests for p in raws]).astype(np.uint64) if raws else np.zeros(0, np.uint64)
    return _Rows(keys, sources, dtype, enc, ndim, kind, count, data_start, data_len, shape_start, shapes, cuts,
                 np.concatenate([[0], np.cumsum(-(-count // GROUP))]).astype(np.int64), digests)


def _names(blob: bytes, lengths: np.ndarray, what: str) -> list[str]:
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


def _row_cuts(kind: np.ndarray, ndim: np.ndarray, shapes: np.ndarray, shape_start: np.ndarray, ncuts: np.ndarray,
              deltas: np.ndarray, count: np.ndarray, keys: Sequence[str], what: str) -> grids.Cuts:
    """The grid rows' cuts, as :class:`~paddle_dcp.core.grids.Cuts` over all rows (other rows
    have no slots), checked: each dim's cuts ascend from 0 to its extent, the cells are the
    pieces."""
    slots_per = np.where(kind == GRID, ndim, 0)
    if int(slots_per.sum()) != len(ncuts):
        raise FormatError(f"{what}: {len(ncuts)} cut counts for {int(slots_per.sum())} grid dims")
    _check_ints(ncuts, 1, _MAX_INT, f"{what}: a dim's cut count")
    if int((ncuts - 1).sum()) != len(deltas):
        raise FormatError(f"{what}: {len(deltas)} cut gaps for {int((ncuts - 1).sum())}")
    _check_ints(deltas, 1, _MAX_INT, f"{what}: a gap between cuts")
    slot_of = np.concatenate([[0], np.cumsum(slots_per)]).astype(np.int64)
    grid_rows = np.flatnonzero(kind == GRID)
    extents = np.concatenate([shapes[shape_start[t] : shape_start[t + 1]] for t in grid_rows.tolist()]) \
        if len(grid_rows) else np.zeros(0, np.int64)
    start = np.concatenate([[0], np.cumsum(ncuts)]).astype(np.int64)
    gaps = np.zeros(int(start[-1]), dtype=np.int64)  # each slot: 0, then its gaps
    later = np.ones(len(gaps), dtype=bool)
    later[start[:-1]] = False
    gaps[later] = deltas
    # each dim's cuts summed as floats first: past 2**62 they are refused (the exact running
    # sum below may wrap across dims, which the differences within a dim undo)
    if len(gaps) and (np.add.reduceat(gaps.astype(np.float64), start[:-1]) > _MAX_INT).any():
        raise FormatError(f"{what}: grid cuts past 2**62")
    running = np.cumsum(gaps)
    values = running - np.repeat(running[start[:-1]], ncuts) if len(gaps) else gaps
    last = values[start[1:] - 1] if len(ncuts) else values
    bad_slot = np.flatnonzero((last != extents) | (last < 0))
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


def _check_rows(keys: Sequence[str], sources: Sequence[str | None], dtype: np.ndarray, enc: np.ndarray, ndim: np.ndarray,
                kind: np.ndarray, count: np.ndarray, shapes: np.ndarray, shape_start: np.ndarray, what: str) -> None:
    """Shapes' products bounded; encodings on dtypes they hold; derived entries as the format
    says (their sources are checked once both rows are known: :func:`_check_sources`)."""
    n = len(keys)
    volume = np.ones(n, dtype=np.float64)
    for d in range(int(ndim.max()) if n else 0):
        has = ndim > d
        volume[has] *= shapes[shape_start[:-1][has] + d]
    if n and (volume * 16 > _MAX_INT).any():
        t = int(np.flatnonzero(volume * 16 > _MAX_INT)[0])
        raise FormatError(f"{what}: tensor {keys[t]!r}: shape has too many elements")
    scalar_many = (ndim == 0) & (count > 1)
    if scalar_many.any():
        raise FormatError(f"{what}: tensor {keys[int(np.flatnonzero(scalar_many)[0])]!r}: a scalar is one piece")
    for t in np.flatnonzero(enc != 0).tolist():
        name, dt, key = ENCODINGS[int(enc[t])], DTYPES[int(dtype[t])], keys[t]
        holds = DERIVED_DTYPES if name == DERIVED else quant.ENCODABLE
        if dt not in holds:
            raise FormatError(f"{what}: tensor {key!r}: encoding {name!r} cannot hold dtype {dt}; it holds {', '.join(holds)}")
        if name == DERIVED and count[t]:
            raise FormatError(f"{what}: tensor {key!r} (derived) is stored too ({int(count[t])} pieces): a derived tensor has none")
    for t, src in enumerate(sources):
        if (src is not None) != (int(enc[t]) == _ENCODING_CODE[DERIVED]):
            raise FormatError(f"{what}: tensor {keys[t]!r}: a source belongs to a derived tensor, and only to one")


def _check_sources(rows: _Rows, describe: Callable[[str], tuple[int, int, tuple] | None], what: str,
                   only: Sequence[int] | None = None) -> None:
    """Every derived row's source (of the rows ``only``, else all) is another tensor of the
    checkpoint, stored, float16 or bfloat16, of the same shape. ``describe(key)``: (encoding
    code, dtype code, shape) of a tensor of the checkpoint, or None."""
    derived = np.flatnonzero(rows.encoding == _ENCODING_CODE[DERIVED]).tolist()
    for t in derived if only is None else [t for t in only if rows.encoding[t] == _ENCODING_CODE[DERIVED]]:
        key, src = rows.keys[t], rows.sources[t]
        info = describe(src) if src is not None else None
        tag = f"{what}: tensor {key!r} (derived)"
        if src == key or (info is not None and info[0] == _ENCODING_CODE[DERIVED]):
            raise FormatError(f"{tag}: its source {str(src)[:200]!r} is derived itself (a chain or a cycle)")
        if info is None:
            raise FormatError(f"{tag}: its source {str(src)[:200]!r} is not a tensor of the checkpoint")
        if DTYPES[info[1]] not in SOURCE_DTYPES:
            raise FormatError(f"{tag}: its source {str(src)[:200]!r} is {DTYPES[info[1]]}; a tensor derives "
                              f"from {' or '.join(SOURCE_DTYPES)}")
        if info[2] != rows.shape(t):
            raise FormatError(f"{tag}: shape {rows.shape(t)}, its source {str(src)[:200]!r} has shape {info[2]}")


def _described(rows: _Rows, t: int | None) -> tuple[int, int, tuple] | None:
    return None if t is None else (int(rows.encoding[t]), int(rows.dtype[t]), rows.shape(t))


@dataclass
class _Decoded:
    """Pieces of some rows, decoded, in the rows' order (see :func:`_decode_rows`)."""

    piece_start: np.ndarray
    offsets: np.ndarray
    extents: np.ndarray
    files: np.ndarray
    byte_offsets: np.ndarray
    block_start: np.ndarray
    checksums: np.ndarray


def _stored_bytes(rows: _Rows, tensor_of: np.ndarray, extents: np.ndarray) -> np.ndarray:
    """Stored bytes of pieces of the rows ``tensor_of`` (their extents zero-padded)."""
    nd = rows.ndim[tensor_of]
    used = np.arange(extents.shape[1])[None, :] < nd[:, None]
    elements = np.prod(np.where(used, extents, 1), axis=1, dtype=np.int64)
    nbytes = elements * _ITEMSIZE[rows.dtype[tensor_of]]
    for code in np.unique(rows.encoding[tensor_of]).tolist():
        if code:
            sel = rows.encoding[tensor_of] == code
            nbytes[sel] = _stored(elements[sel], DTYPES[0], ENCODINGS[code])
    return nbytes


def _decode_rows(rows: _Rows, sel: np.ndarray, groups: Sequence[np.ndarray], fetch_group: GroupFetch,
                 head: _Head, block_bytes: int, what: str, layouts: Mapping | None = None) -> _Decoded:
    """The pieces of rows ``sel`` in their groups ``groups[i]`` (group numbers of row
    ``sel[i]``, ascending); ``fetch_group(row, start, stop)``: the bytes [start, stop) of the
    pieces area (relative to it), which this checks against the group's digest."""
    w = head.record_width
    wf = head.doc["widths"]["file"]
    width = int(rows.ndim[sel].max()) if len(sel) else 0
    out_counts, offs, exts, fil, byt, nblk, sums = [], [], [], [], [], [], []
    if layouts is None:
        grid_sel = sel[rows.kind[sel] == GRID]
        layouts = {(id(rows), t): lay for t, lay in _grid_layouts(rows, grid_sel, w, block_bytes, width).items()} \
            if len(grid_sel) else {}
    for i, t in enumerate(sel.tolist()):
        count = int(rows.count[t])
        for g in groups[i].tolist():
            if not 0 <= g < -(-count // GROUP):
                raise FormatError(f"{what}: tensor {rows.keys[t]!r} has no group {g}")
        if rows.kind[t] == GRID and count:
            lay = layouts[(id(rows), t)]
            if lay.total != int(rows.data_len[t]):
                raise FormatError(f"{what}: tensor {rows.keys[t]!r}: its pieces take {int(rows.data_len[t])} bytes, "
                                  f"its grid {lay.total}")
            got = [_grid_group(rows, t, g, lay, fetch_group, w, wf, what) for g in groups[i].tolist()]
        elif count:
            got = _explicit_groups(rows, t, groups[i], fetch_group, w, wf, block_bytes, what)
        else:
            got = []
        for o, e, f, b, nb, s in got:
            offs.append(o)
            exts.append(e)
            fil.append(f)
            byt.append(b)
            nblk.append(nb)
            sums.append(s)
        out_counts.append(sum(len(g[2]) for g in got))
    cat = lambda a, shape, dt=np.int64: np.concatenate(a).astype(dt) if a else np.zeros(shape, dt)  # noqa: E731
    nblocks = cat(nblk, (0,))
    return _Decoded(
        piece_start=np.concatenate([[0], np.cumsum(out_counts)]).astype(np.int64),
        offsets=cat([_pad(o, width) for o in offs], (0, width)),
        extents=cat([_pad(e, width) for e in exts], (0, width)),
        files=cat(fil, (0,)), byte_offsets=cat(byt, (0,)),
        block_start=np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int64),
        checksums=cat(sums, (0,), np.uint64),
    )


def _pad(a: np.ndarray, width: int) -> np.ndarray:
    return a if a.shape[1] == width else np.pad(a, ((0, 0), (0, width - a.shape[1])))


@dataclass(frozen=True, eq=False)
class _GridLayout:
    """Where the groups of one grid tensor lie in its part of the pieces area."""

    offsets: np.ndarray  # (count, ndim) every piece's box
    extents: np.ndarray
    nblocks: np.ndarray  # (count,)
    group_at: np.ndarray  # (groups + 1,) bytes from the tensor's start
    total: int


def _grid_layouts(rows: _Rows, sel: np.ndarray, w: int, block_bytes: int, width: int) -> dict[int, _GridLayout]:
    """The layouts of the grid rows ``sel``, computed together."""
    piece_start, offsets, extents = grids.expand(rows.cuts, sel, rows.ndim[sel], width)
    owner = np.repeat(sel, np.diff(piece_start))
    nblocks = blocks_of(_stored_bytes(rows, owner, extents), block_bytes) if len(owner) else np.zeros(0, np.int64)
    piece_len = w + 8 * nblocks
    cum = np.concatenate([[0], np.cumsum(piece_len)]).astype(np.int64)
    out = {}
    for i, t in enumerate(sel.tolist()):
        p0, p1 = int(piece_start[i]), int(piece_start[i + 1])
        firsts = np.append(np.arange(p0, p1, GROUP), p1)
        nd = int(rows.ndim[t])
        out[t] = _GridLayout(offsets[p0:p1, :nd], extents[p0:p1, :nd], nblocks[p0:p1], cum[firsts] - cum[p0],
                             int(cum[p1] - cum[p0]))
    return out


def _grid_group(rows: _Rows, t: int, g: int, lay: _GridLayout, fetch_group: GroupFetch, w: int, wf: int, what: str) -> _Group:
    """Group ``g`` of grid row ``t``: (offsets, extents, files, byte offsets, nblocks, checksums)."""
    start = int(rows.data_start[t])
    a, b = int(lay.group_at[g]), int(lay.group_at[g + 1])
    data = _checked_group(rows, t, g, fetch_group(t, start + a, start + b), what)
    p0, p1 = g * GROUP, min((g + 1) * GROUP, int(rows.count[t]))
    m = p1 - p0
    files, byte_offsets = _records(data[: m * w], m, w, wf)
    nb = lay.nblocks[p0:p1]
    sums = np.frombuffer(data, dtype="<u8", count=int(nb.sum()), offset=m * w).astype(np.uint64)
    return lay.offsets[p0:p1], lay.extents[p0:p1], files, byte_offsets, nb, sums


def _explicit_groups(rows: _Rows, t: int, groups: np.ndarray, fetch_group: GroupFetch, w: int, wf: int, block_bytes: int,
                     what: str) -> list[_Group]:
    """The groups of explicit row ``t`` (its boxes stored with its pieces): every group is read,
    each one's length known only once its boxes are."""
    start, length, count, nd = int(rows.data_start[t]), int(rows.data_len[t]), int(rows.count[t]), int(rows.ndim[t])
    data = fetch_group(t, start, start + length)
    out, at = [], 0
    wanted = set(groups.tolist())
    one = np.array([t], dtype=np.int64)
    for g in range(-(-count // GROUP)):
        m = min(GROUP, count - g * GROUP)
        head_len = m * (w + 16 * nd)
        if at + head_len > length:
            raise FormatError(f"{what}: tensor {rows.keys[t]!r}: its pieces run past their {length} bytes")
        boxes = np.frombuffer(data, dtype="<i8", count=2 * nd * m, offset=at + m * w).reshape(m, 2 * nd).astype(np.int64)
        offsets, extents = boxes[:, :nd], boxes[:, nd:]
        _inside(rows, t, offsets, extents, what)
        nb = blocks_of(_stored_bytes(rows, np.repeat(one, m), extents), block_bytes) if m else np.zeros(0, np.int64)
        end = at + head_len + 8 * int(nb.sum())
        if end > length:
            raise FormatError(f"{what}: tensor {rows.keys[t]!r}: its pieces run past their {length} bytes")
        group = _checked_group(rows, t, g, data[at:end], what)
        if g in wanted:
            files, byte_offsets = _records(group[: m * w], m, w, wf)
            sums = np.frombuffer(group, dtype="<u8", count=int(nb.sum()), offset=head_len).astype(np.uint64)
            out.append((offsets, extents, files, byte_offsets, nb, sums))
        at = end
    if at != length:
        raise FormatError(f"{what}: tensor {rows.keys[t]!r}: {length - at} bytes past its last piece")
    return out


def _inside(rows: _Rows, t: int, offsets: np.ndarray, extents: np.ndarray, what: str) -> None:
    limit = np.array(rows.shape(t), dtype=np.int64)
    bad = ((offsets < 0) | (extents <= 0) | (extents > limit) | (offsets > limit - extents)).any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise FormatError(f"{what}: tensor {rows.keys[t]!r}: piece at offset {tuple(offsets[i].tolist())} with shape "
                          f"{tuple(extents[i].tolist())} is empty or outside the tensor's shape {rows.shape(t)}")


def _checked_group(rows: _Rows, t: int, g: int, data: memoryview | bytes, what: str) -> memoryview:
    if xxhash.xxh3_64_intdigest(data) != int(rows.digests[rows.group_start[t] + g]):
        raise FormatError(f"{what}: tensor {rows.keys[t]!r}: group {g} of its pieces does not match its digest: "
                          f"the file was edited or damaged")
    return memoryview(data)


def _records(data: memoryview, m: int, w: int, wf: int) -> tuple[np.ndarray, np.ndarray]:
    """(files, byte offsets) of ``m`` fixed-width records."""
    raw = np.frombuffer(data, dtype=np.uint8, count=m * w).reshape(m, w)
    wide = np.zeros((m, 16), dtype=np.uint8)
    wide[:, :wf] = raw[:, :wf]
    wide[:, 8 : 8 + w - wf] = raw[:, wf:]
    both = wide.view("<u8").astype(np.int64)
    if m and ((both < 0).any()):
        raise FormatError("a record's file or byte offset is past 2**63")
    return both[:, 0], both[:, 1]


def _gather(area: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """(n, width) the bytes at ``starts`` of ``area`` (uint8)."""
    if not len(starts):
        return np.zeros((0, width), dtype=np.uint8)
    if len(area) < width or int(starts.max()) > len(area) - width or int(starts.min()) < 0:
        raise FormatError("a piece's record or checksum lies past the end of the pieces area")
    windows = np.lib.stride_tricks.sliding_window_view(area, width)  # no copy: a view per byte
    return windows[starts]


def _grid_all(rows: _Rows, sel: np.ndarray, area: np.ndarray, w: int, wf: int, block_bytes: int, width: int,
              what: str) -> tuple[np.ndarray, ...]:
    """Every piece of the grid rows ``sel``, vectorized (a whole read): (per-row piece counts'
    starts, offsets, extents, files, byte offsets, nblocks, checksums, every group's [start,
    stop) in the area with its digest's index)."""
    piece_start, offsets, extents = grids.expand(rows.cuts, sel, rows.ndim[sel], width)
    counts = np.diff(piece_start)
    owner_i = np.repeat(np.arange(len(sel), dtype=np.int64), counts)
    owner = sel[owner_i]
    n = len(owner)
    nblocks = blocks_of(_stored_bytes(rows, owner, extents), block_bytes) if n else np.zeros(0, np.int64)
    piece_len = w + 8 * nblocks
    cum = np.concatenate([[0], np.cumsum(piece_len)]).astype(np.int64)
    total = cum[piece_start[1:]] - cum[piece_start[:-1]]
    bad = np.flatnonzero(total != rows.data_len[sel])
    if len(bad):
        t = int(sel[bad[0]])
        raise FormatError(f"{what}: tensor {rows.keys[t]!r}: its pieces take {int(rows.data_len[t])} bytes, its grid "
                          f"{int(total[bad[0]])}")
    local = np.arange(n, dtype=np.int64) - piece_start[:-1][owner_i]
    first = piece_start[:-1][owner_i] + (local // GROUP) * GROUP
    m = np.minimum(GROUP, counts[owner_i] - (local // GROUP) * GROUP)
    base = rows.data_start[owner] + (cum[first] - cum[piece_start[:-1][owner_i]])
    rec = _gather(area, base + (local % GROUP) * w, w)
    wide = np.zeros((n, 16), dtype=np.uint8)
    wide[:, :wf] = rec[:, :wf]
    wide[:, 8 : 8 + w - wf] = rec[:, wf:]
    both = wide.view("<u8").reshape(n, 2)
    if n and (both >= np.uint64(1 << 63)).any():
        raise FormatError(f"{what}: a record's file or byte offset is past 2**63")
    sums_cum = np.concatenate([[0], np.cumsum(8 * nblocks)]).astype(np.int64)
    sums_at = base + m * w + (sums_cum[:-1] - sums_cum[first])
    block_piece = np.repeat(np.arange(n, dtype=np.int64), nblocks)
    block_in = np.arange(int(nblocks.sum()), dtype=np.int64) - np.repeat(sums_cum[:-1] // 8, nblocks)
    sums = _gather(area, sums_at[block_piece] + 8 * block_in, 8).view("<u8").reshape(-1).astype(np.uint64)
    heads = np.flatnonzero(local % GROUP == 0)
    g_start = base[heads]
    g_stop = g_start + cum[np.minimum(heads + GROUP, piece_start[1:][owner_i[heads]])] - cum[heads]
    g_digest = rows.group_start[owner[heads]] + local[heads] // GROUP
    return (piece_start, offsets, extents, both[:, 0].astype(np.int64), both[:, 1].astype(np.int64), nblocks, sums,
            g_start, g_stop, g_digest)


def decode(data: bytes | memoryview, source: str = "metadata") -> Metadata:
    """A version 3 file read whole, everything validated (the digests of every section, part
    and group included): what a tool, or the rank that serves the others, reads."""
    if len(data) > MAX_METADATA_BYTES:
        raise FormatError(f"{source}: {len(data)} bytes is over the {MAX_METADATA_BYTES}-byte limit for metadata")
    view = memoryview(data)
    fetch = lambda ranges: [view[a:b] for a, b in ranges]  # noqa: E731
    head = read_head(fetch, len(view), source)
    files = _parse_files(_read_section(head, "files", fetch, source), head, source)
    index = _parse_index(_read_section(head, "index", fetch, source), head, source)
    every = list(range(len(index.first_keys)))
    rows = _rows_checked(head, index, every, fetch(_part_ranges(index, every)), source)
    lookup = {k: t for t, k in enumerate(rows.keys)}
    _check_sources(rows, lambda key: _described(rows, lookup.get(key)), source)
    structure = _structure(head, fetch, source, lookup)
    block_bytes = head.doc["checksum"]["block_bytes"]
    a0, a1 = head.area("pieces")
    expected = np.concatenate([[0], np.cumsum(rows.data_len)]).astype(np.int64)
    if (rows.data_start != expected[:-1]).any() or int(expected[-1]) != a1 - a0:
        raise FormatError(f"{source}: the tensors' pieces do not lie back to back in the pieces area")
    cols = _all_pieces(rows, head, np.frombuffer(view[a0:a1], dtype=np.uint8), view[a0:a1], block_bytes, source)
    _check_pieces(rows, cols, files, head, source)
    return Metadata(
        unique_id=head.doc["unique_id"], world_size=head.doc["world_size"], files=files,
        tensors=ColumnTensors(cols, block_bytes), structure=structure, block_bytes=block_bytes,
        checksum_algorithm=head.doc["checksum"]["algorithm"], created_by=head.doc.get("created_by", ""),
        format_version=VERSION, replicas=head.doc.get("replicas", False), digest=head.digest,
    )


def _read_section(head: _Head, name: str, fetch: Fetch, source: str) -> bytes:
    a, b, _, _ = head.section(name)
    return _section(head, name, fetch([(a, b)])[0], source)


def _rows_checked(head: _Head, index: _Index, parts: Sequence[int], blobs: Sequence[bytes | memoryview], source: str) -> _Rows:
    """The rows of the tensor parts ``parts`` (ascending), read as ``blobs``, each checked
    against its digest and the index."""
    raws = []
    for i, packed in zip(parts, blobs):
        what = f"{source}: tensor part {i}"
        if xxhash.xxh3_64_intdigest(packed) != int(index.digests[i]):
            raise FormatError(f"{what} does not match its digest: the file was edited or damaged")
        raw = _split_part(_inflate(packed, int(index.raw[i]), what), what)
        first = index.first_keys[i].encode("utf-8")
        if raw.rows.shape[1] != int(index.counts[i]) or int(raw.rows[0][0]) != len(first) or not raw.keys.startswith(first):
            raise FormatError(f"{what}: its tensors are not the ones the index lists")
        raws.append(raw)
    return _rows_of(raws, head, f"{source}: tensor parts")


def _structure(head: _Head, fetch: Fetch, source: str, lookup: Mapping[str, int]) -> dict:
    try:
        structure = json.loads(_read_section(head, "structure", fetch, source))
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise FormatError(f"{source}: the structure is not valid JSON ({exc})") from None
    leaves = 0
    for path, tag, node in nested.walk(structure):
        key = nested.flat_key(path)
        if tag == "t":
            leaves += 1
            if key not in lookup:
                raise FormatError(f"{source}: structure and tensors disagree on key {key!r}")
        elif tag in ("v", "f"):
            nested.decode_value(node, key)
        elif tag == "x":
            raise FormatError(f"{source}: value {key!r} has no value")
    if leaves != len(lookup):
        raise FormatError(f"{source}: structure and tensors disagree on keys ({leaves} leaves, {len(lookup)} tensors)")
    return structure


def _all_pieces(rows: _Rows, head: _Head, area: np.ndarray, view: memoryview, block_bytes: int, source: str) -> TensorColumns:
    """Every piece of every row: the grid rows together, the others one by one."""
    w, wf = head.record_width, head.doc["widths"]["file"]
    width = int(rows.ndim.max()) if len(rows.keys) else 0
    counts = rows.count
    piece_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if int(piece_start[-1]) != head.count("pieces"):
        raise FormatError(f"{source}: the tensors hold {int(piece_start[-1])} pieces, the head says {head.count('pieces')}")
    n = int(piece_start[-1])
    offsets = np.zeros((n, width), np.int64)
    extents = np.zeros((n, width), np.int64)
    files = np.zeros(n, np.int64)
    byte_offsets = np.zeros(n, np.int64)
    nblocks = np.zeros(n, np.int64)
    grid_rows = np.flatnonzero(rows.kind == GRID)
    (ps, g_off, g_ext, g_files, g_bytes, g_nb, g_sums, g_start, g_stop, g_digest) = _grid_all(
        rows, grid_rows, area, w, wf, block_bytes, width, source)
    at = piece_start[grid_rows][np.repeat(np.arange(len(grid_rows)), np.diff(ps))] + (
        np.arange(int(ps[-1])) - np.repeat(ps[:-1], np.diff(ps)))
    offsets[at], extents[at], files[at], byte_offsets[at], nblocks[at] = g_off, g_ext, g_files, g_bytes, g_nb
    for a, b, d in zip(g_start.tolist(), g_stop.tolist(), g_digest.tolist()):
        if xxhash.xxh3_64_intdigest(view[a:b]) != int(rows.digests[d]):
            t = int(np.searchsorted(rows.group_start, d, side="right") - 1)
            raise FormatError(f"{source}: tensor {rows.keys[t]!r}: group {d - int(rows.group_start[t])} of its pieces "
                              f"does not match its digest: the file was edited or damaged")
    explicit: dict[int, list[np.ndarray]] = {}
    fetch_group = lambda t, a, b: view[a:b]  # noqa: E731
    for t in np.flatnonzero(rows.kind == EXPLICIT).tolist():
        got = _explicit_groups(rows, t, np.arange(-(-int(counts[t]) // GROUP)), fetch_group, w, wf, block_bytes, source)
        p0 = int(piece_start[t])
        for o, e, f, b, nb, s in got:
            m = len(f)
            nd = o.shape[1]
            offsets[p0 : p0 + m, :nd], extents[p0 : p0 + m, :nd] = o, e
            files[p0 : p0 + m], byte_offsets[p0 : p0 + m], nblocks[p0 : p0 + m] = f, b, nb
            explicit.setdefault(t, []).append(s)
            p0 += m
    block_start = np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int64)
    if int(block_start[-1]) != head.count("blocks"):
        raise FormatError(f"{source}: the pieces hold {int(block_start[-1])} checksums, the head says {head.count('blocks')}")
    checksums = np.zeros(int(block_start[-1]), dtype=np.uint64)
    g_blocks = np.repeat(block_start[at], g_nb) + (np.arange(int(g_nb.sum())) - np.repeat(np.cumsum(g_nb) - g_nb, g_nb))
    checksums[g_blocks] = g_sums
    for t, chunks in explicit.items():
        b0 = int(block_start[piece_start[t]])
        s = np.concatenate(chunks)
        checksums[b0 : b0 + len(s)] = s
    return TensorColumns(
        keys=tuple(rows.keys), dtypes=tuple(DTYPES[c] for c in rows.dtype.tolist()),
        shapes=tuple(rows.shape(t) for t in range(len(rows.keys))),
        encodings=tuple(ENCODINGS[c] for c in rows.encoding.tolist()), sources=tuple(rows.sources),
        piece_start=piece_start, offsets=offsets, extents=extents, files=files, byte_offsets=byte_offsets,
        block_start=block_start, checksums=checksums,
    )


def _check_pieces(rows: _Rows, cols: TensorColumns, files: Sequence[FileEntry], head: _Head, source: str) -> None:
    """Every piece in a listed file, inside it; the explicit layouts tiling their tensors."""
    n = len(cols.files)
    if n and ((cols.files < 0) | (cols.files >= len(files))).any():
        raise FormatError(f"{source}: a piece names a file index outside the file list")
    if n:
        owner = np.repeat(np.arange(len(rows.keys)), np.diff(cols.piece_start))
        nbytes = _stored_bytes(rows, owner, cols.extents)
        sizes = np.array([f.nbytes for f in files], dtype=np.int64)
        bad = (cols.byte_offsets < 0) | (cols.byte_offsets > sizes[cols.files] - nbytes)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise FormatError(f"{source}: tensor {rows.keys[int(owner[i])]!r}: a piece reads {int(nbytes[i])} bytes from "
                              f"offset {int(cols.byte_offsets[i])}, past the end of its file ({int(sizes[cols.files[i]])} bytes)")
    replicas = bool(head.doc.get("replicas", False))
    for t in np.flatnonzero((rows.kind == EXPLICIT) & (rows.encoding != _ENCODING_CODE[DERIVED])).tolist():
        p0, p1, nd = int(cols.piece_start[t]), int(cols.piece_start[t + 1]), int(rows.ndim[t])
        try:
            check_entry_tiling(rows.keys[t], rows.shape(t), cols.offsets[p0:p1, :nd], cols.extents[p0:p1, :nd],
                               cols.files[p0:p1], replicas)
        except PlanError as exc:
            raise FormatError(f"{source}: {exc}") from None


# ============================================================================ reading in parts
@dataclass(frozen=True, eq=False)
class Start:
    """What every reader of a version 3 file reads first: the head, the files, the index."""

    head: _Head
    files: tuple[FileEntry, ...]
    index: _Index


def read_start(fetch: Fetch, size: int, source: str = "metadata") -> Start:
    """The head, files and index of a version 3 file of ``size`` bytes, each checked against
    its digest (two reads: the head line, then both sections)."""
    head = read_head(fetch, size, source)
    (fa, fb, _, _), (ia, ib, _, _) = head.section("files"), head.section("index")
    files_b, index_b = fetch([(fa, fb), (ia, ib)])
    files = _parse_files(_section(head, "files", files_b, source), head, source)
    index = _parse_index(_section(head, "index", index_b, source), head, source)
    return Start(head, files, index)


Rounds = Generator[List[Tuple[int, int]], List[Union[bytes, memoryview]], Metadata]


def read_part(fetch: Fetch, size: int, wanted: Mapping[str, Sequence[Box]], source: str = "metadata") -> Metadata:
    """The part of a version 3 file that a rank with these targets needs, read through
    ``fetch`` (absolute byte ranges): :func:`read_start`, then :func:`part_rounds`."""
    rounds = part_rounds(read_start(fetch, size, source), wanted, source)
    request = next(rounds)
    while True:
        try:
            request = rounds.send(list(fetch(request)))
        except StopIteration as stop:
            return stop.value


def part_rounds(start: Start, wanted: Mapping[str, Sequence[Box]], source: str = "metadata") -> Rounds:
    """The reads of a part of the file, as exactly three rounds (each yields the absolute byte
    ranges it needs, possibly none, and is sent their bytes; ranks that read through another
    rank go in step): the tensor parts that would hold the keys of ``wanted``; the parts of the
    sources of the derived tensors found; every found tensor's groups of pieces that overlap
    its boxes (a derived tensor: its source's, for the same boxes). Each is checked against its
    digest. Keys the checkpoint lacks are left out; a key with no box is listed with no
    piece. Returns a subset (``Metadata.subset``) whose ``structure`` is the checkpoint's
    outline (its plain values; ``holders``: which of its containers hold tensors too)."""
    head, index = start.head, start.index
    found: dict[str, tuple[_Rows, int]] = {}
    boxes: dict[str, list[Box]] = {k: list(v) for k, v in wanted.items()}
    parts = _parts_of(index, boxes, found)
    _found_in(head, index, parts, (yield _part_ranges(index, parts)), list(boxes), found, source)
    derived = [(k, src) for k in sorted(found) if (src := found[k][0].sources[found[k][1]]) is not None]
    for key, src in derived:  # a derived tensor reads its source's pieces for its boxes
        boxes.setdefault(src, []).extend(boxes.get(key, []))
    wanted_sources = [s for _, s in derived if s not in found]
    parts = _parts_of(index, wanted_sources, found)
    _found_in(head, index, parts, (yield _part_ranges(index, parts)), wanted_sources, found, source)
    for key in list(found):
        rows, t = found[key]
        _check_sources(rows, lambda k: _described(*found[k]) if k in found else None, source, only=[t])
    keys = sorted(found)
    layouts = _layouts_of(head, found, keys)
    groups = {k: _groups_for(found[k][0], found[k][1], boxes.get(k, []), head) for k in keys}
    ranges, where = _group_ranges(head, found, groups, layouts)
    blobs = yield ranges
    data = {at: bytes(blob) for at, blob in zip(where, blobs)}
    block_bytes = head.doc["checksum"]["block_bytes"]
    def fetch_group(key: str) -> GroupFetch:
        return lambda t, a, b: data[(key, a)][: b - a]

    decoded = [_decode_rows(found[k][0], np.array([found[k][1]]), [groups[k]], fetch_group(k), head, block_bytes, source,
                            layouts) for k in keys]
    return Metadata(
        unique_id=head.doc["unique_id"], world_size=head.doc["world_size"], files=start.files,
        tensors=ColumnTensors(_subset_columns(keys, found, decoded), block_bytes), structure=head.doc["outline"],
        block_bytes=block_bytes, checksum_algorithm=head.doc["checksum"]["algorithm"],
        created_by=head.doc.get("created_by", ""), format_version=VERSION, subset=True,
        replicas=head.doc.get("replicas", False), digest=head.digest,
        holders=frozenset(tuple(p) for p in head.doc["holders"]),
    )


def _parts_of(index: _Index, keys: Iterable[str], found: Mapping) -> list[int]:
    """The parts that would hold ``keys`` not found yet, ascending."""
    return sorted({i for i in (bisect.bisect_right(index.first_keys, k) - 1 for k in keys if k not in found) if i >= 0})


def _part_ranges(index: _Index, parts: Sequence[int]) -> list[tuple[int, int]]:
    return [(int(index.offsets[i]), int(index.offsets[i + 1])) for i in parts]


def _found_in(head: _Head, index: _Index, parts: Sequence[int], blobs: Sequence[bytes | memoryview], keys: Sequence[str],
              found: dict, source: str) -> None:
    """Add to ``found`` (key -> (the rows read, its row)) every one of ``keys`` that the parts
    read (``blobs``) hold."""
    if not parts:
        return
    if len(blobs) != len(parts):
        raise FormatError(f"{source}: {len(blobs)} parts received for {len(parts)} asked")
    rows = _rows_checked(head, index, parts, blobs, source)
    at = {k: t for t, k in enumerate(rows.keys)}
    for key in keys:
        if key in at and key not in found:
            found[key] = (rows, at[key])


def _layouts_of(head: _Head, found: Mapping[str, tuple[_Rows, int]], keys: Sequence[str]) -> dict:
    """The layouts of the grid tensors among ``keys``, computed together per set of rows read,
    by (id of the rows, row)."""
    by_rows: dict[int, tuple[_Rows, list[int]]] = {}
    for k in keys:
        rows, t = found[k]
        if rows.kind[t] == GRID and rows.count[t]:
            by_rows.setdefault(id(rows), (rows, []))[1].append(t)
    out = {}
    block_bytes = head.doc["checksum"]["block_bytes"]
    for rid, (rows, ts) in by_rows.items():
        sel = np.array(sorted(set(ts)), dtype=np.int64)
        for t, lay in _grid_layouts(rows, sel, head.record_width, block_bytes, int(rows.ndim[sel].max())).items():
            out[(rid, t)] = lay
    return out


def _groups_for(rows: _Rows, t: int, boxes: Sequence[Box], head: _Head) -> np.ndarray:
    """The groups of row ``t`` whose pieces may overlap ``boxes`` (every group of a layout that
    is not a grid)."""
    count = int(rows.count[t])
    if not count:
        return np.zeros(0, np.int64)
    if rows.kind[t] == EXPLICIT:
        return np.arange(-(-count // GROUP), dtype=np.int64)
    cuts = rows.cuts.of(t)
    cells: list[np.ndarray] = []
    for box in boxes:
        if box.ndim != len(cuts):
            continue  # a target of another rank: check_targets names the mismatch
        ranges = []
        for c, lo, n in zip(cuts, box.offsets, box.shape):
            i0 = max(0, int(np.searchsorted(c, lo, side="right")) - 1)
            i1 = min(len(c) - 1, int(np.searchsorted(c, lo + n, side="left")))
            ranges.append(np.arange(i0, i1, dtype=np.int64))
        if any(not len(r) for r in ranges):
            continue
        dims = [len(c) - 1 for c in cuts]
        grid = np.meshgrid(*ranges, indexing="ij") if ranges else []
        cells.append(np.ravel_multi_index([g.reshape(-1) for g in grid], dims) if ranges else np.zeros(1, np.int64))
    if not cells:
        return np.zeros(0, np.int64)
    return np.unique(np.concatenate(cells) // GROUP)


def _group_ranges(head: _Head, found: Mapping[str, tuple[_Rows, int]], groups: Mapping[str, np.ndarray],
                  layouts: Mapping) -> tuple[list[tuple[int, int]], list[tuple[str, int]]]:
    """The absolute byte ranges of every group wanted, and each one's (key, start in the pieces
    area); a tensor that is not a grid is one range, all its groups."""
    a0, _ = head.area("pieces")
    ranges, where = [], []
    for key, gs in groups.items():
        rows, t = found[key]
        if not len(gs):
            continue
        start = int(rows.data_start[t])
        if rows.kind[t] == EXPLICIT:
            bounds = [(start, start + int(rows.data_len[t]))]
        else:
            lay = layouts[(id(rows), t)]
            if lay.total != int(rows.data_len[t]):
                raise FormatError(f"tensor {key!r}: its pieces take {int(rows.data_len[t])} bytes, its grid {lay.total}")
            bounds = [(start + int(lay.group_at[g]), start + int(lay.group_at[g + 1])) for g in gs.tolist()]
        for a, b in bounds:
            ranges.append((a0 + a, a0 + b))
            where.append((key, a))
    return ranges, where


def _subset_columns(keys: Sequence[str], found: Mapping[str, tuple[_Rows, int]], decoded: Sequence[_Decoded]) -> TensorColumns:
    width = max((int(found[k][0].ndim[found[k][1]]) for k in keys), default=0)
    pad = lambda a: a if a.shape[1] == width else np.pad(a, ((0, 0), (0, width - a.shape[1])))  # noqa: E731
    cat = lambda arrays, shape, dt=np.int64: np.concatenate(arrays).astype(dt) if arrays else np.zeros(shape, dt)  # noqa: E731
    counts = [len(d.files) for d in decoded]
    nblocks = [np.diff(d.block_start) for d in decoded]
    info = [found[k] for k in keys]
    return TensorColumns(
        keys=tuple(keys),
        dtypes=tuple(DTYPES[int(r.dtype[t])] for r, t in info),
        shapes=tuple(r.shape(t) for r, t in info),
        encodings=tuple(ENCODINGS[int(r.encoding[t])] for r, t in info),
        sources=tuple(r.sources[t] for r, t in info),
        piece_start=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        offsets=cat([pad(d.offsets) for d in decoded], (0, width)),
        extents=cat([pad(d.extents) for d in decoded], (0, width)),
        files=cat([d.files for d in decoded], (0,)),
        byte_offsets=cat([d.byte_offsets for d in decoded], (0,)),
        block_start=np.concatenate([[0], np.cumsum(cat(nblocks, (0,)))]).astype(np.int64),
        checksums=cat([d.checksums for d in decoded], (0,), np.uint64),
    )
