"""Reading a metadata file of format version 3: whole (:func:`decode`, what a tool or the
rank that serves the others reads), or the part one rank needs (:func:`read_part`, in the
three rounds of :func:`part_rounds` after :func:`read_start`). Every section, part and group of
pieces is checked against its digest before anything is taken from it.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Generator, List, Mapping, Sequence, Tuple, Union

import numpy as np
import xxhash

from . import nested
from .boxes import Box, check_entry_tiling
from .metadata import MAX_METADATA_BYTES, ColumnTensors, FileEntry, Metadata, TensorColumns, blocks_of
from .metafile_layout import (
    DTYPES, ENCODINGS, EXPLICIT, GROUP, ITEMSIZE, VERSION, Fetch, Head, Index, Layout, Rows, check_sources, layout_of, parse_files,
    parse_index, read_head, records, rows_of, section, split_part, stored_bytes,
)
from ..errors import FormatError, PlanError
from .json_text import parse_json


@dataclass(frozen=True, eq=False)
class Start:
    """What every reader of a version 3 file reads first: the head, the files, the index."""

    head: Head
    files: tuple[FileEntry, ...]
    index: Index


def read_start(fetch: Fetch, size: int, source: str = "metadata") -> Start:
    """The head, files and index of a version 3 file of ``size`` bytes, each checked against
    its digest (two reads: the head line, then both sections)."""
    head = read_head(fetch, size, source)
    (fa, fb, _, _), (ia, ib, _, _) = head.section("files"), head.section("index")
    files_b, index_b = fetch([(fa, fb), (ia, ib)])
    files = parse_files(section(head, "files", files_b, source), head, source)
    index = parse_index(section(head, "index", index_b, source), head, source)
    return Start(head, files, index)


def rows_read(start: Start, parts: Sequence[int], blobs: Sequence[bytes | memoryview], source: str) -> Rows:
    """The rows of the tensor parts ``parts`` (ascending), read as ``blobs``, each checked
    against its digest and the index."""
    if len(blobs) != len(parts):
        raise FormatError(f"{source}: {len(blobs)} parts received for {len(parts)} asked")
    index, raws = start.index, []
    for i, part in zip(parts, blobs):
        what = f"{source}: tensor part {i}"
        if xxhash.xxh3_64_intdigest(part) != int(index.digests[i]):
            raise FormatError(f"{what} does not match its digest: the file was edited or damaged")
        raw = split_part(part, int(index.packed[i]), int(index.raw[i]), what)
        first = index.first_keys[i].encode("utf-8")
        if raw.cols.shape[1] != int(index.counts[i]) or int(raw.cols[0][0]) != len(first) or not raw.keys.startswith(first):
            raise FormatError(f"{what}: its tensors are not the ones the index lists")
        raws.append(raw)
    return rows_of(raws, start.head, f"{source}: tensor parts")


# ============================================================================ whole
def decode(data: bytes | memoryview, source: str = "metadata") -> Metadata:
    """A version 3 file read whole, everything checked (the digest of every section, part and
    group included)."""
    if len(data) > MAX_METADATA_BYTES:
        raise FormatError(f"{source}: {len(data)} bytes is over the {MAX_METADATA_BYTES}-byte limit for metadata")
    view = memoryview(data)

    def fetch(ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        return [view[a:b] for a, b in ranges]

    start = read_start(fetch, len(view), source)
    head, every = start.head, list(range(len(start.index.first_keys)))
    rows = rows_read(start, every, fetch(start.index.ranges(every)), source)
    lookup = {k: t for t, k in enumerate(rows.keys)}
    check_sources(rows, lambda key: rows.described(lookup[key]) if key in lookup else None, source)
    expected = np.concatenate([[0], np.cumsum(rows.col("count"))]).astype(np.int64)
    blocks = np.concatenate([[0], np.cumsum(rows.col("blocks"))]).astype(np.int64)
    if (rows.col("first_piece") != expected[:-1]).any() or int(expected[-1]) != head.count("pieces") \
            or (rows.col("first_block") != blocks[:-1]).any() or int(blocks[-1]) != head.count("blocks"):
        raise FormatError(f"{source}: the tensors' pieces and checksums do not follow one another")
    area = {name: view[slice(*head.area(name))] for name in ("records", "boxes", "sums")}
    sel = np.arange(len(rows.keys), dtype=np.int64)
    lay = layout_of(rows, sel, lambda t: _boxes(rows, t, area["boxes"]), head.block_bytes)
    files, byte_offsets = records(area["records"], head.count("pieces"), head)
    checksums = np.frombuffer(area["sums"], dtype="<u8").astype(np.uint64)
    _check_groups(rows, sel, lay, head, area, source)
    cols = _columns(rows, sel, lay, files, byte_offsets, checksums)
    _check_pieces(rows, cols, start.files, head, source)
    structure = _structure(head, fetch, source, lookup)
    return Metadata(
        unique_id=head.doc["unique_id"], world_size=head.doc["world_size"], files=start.files,
        tensors=ColumnTensors(cols, head.block_bytes), structure=structure, block_bytes=head.block_bytes,
        checksum_algorithm=head.doc["checksum"]["algorithm"], created_by=head.doc.get("created_by", ""),
        format_version=VERSION, replicas=head.doc.get("replicas", False), digest=head.digest,
    )


def _boxes(rows: Rows, t: int, boxes: memoryview) -> np.ndarray:
    nd, count, at = int(rows.col("ndim")[t]), int(rows.col("count")[t]), int(rows.col("first_box")[t])
    return np.frombuffer(boxes, dtype="<i8", count=2 * nd * count, offset=at).reshape(count, 2 * nd).astype(np.int64)


def _check_groups(rows: Rows, sel: np.ndarray, lay: Layout, head: Head, area: Mapping[str, memoryview], source: str,
                  whole: bool = True) -> None:
    """Every group of the rows ``sel`` matches its digest: its records, its boxes (an explicit
    layout), its checksums. ``area``: the records, boxes and sums areas, or (``whole`` False)
    only one row's part of each."""
    w = head.record_width
    rec, box, sums = area["records"], area["boxes"], area["sums"]
    owner, pieces, blocks = lay.group_bounds()
    t = sel[owner]
    base = np.stack([rows.col(c)[t] for c in ("first_piece", "first_block", "first_box")]) if whole else np.zeros((3, len(t)), np.int64)
    box_w = np.where(rows.col("layout")[t] == EXPLICIT, 16 * rows.col("ndim")[t], 0)
    bounds = np.stack([(base[0] + pieces[:, 0]) * w, (base[0] + pieces[:, 1]) * w,
                       base[2] + box_w * pieces[:, 0], base[2] + box_w * pieces[:, 1],
                       8 * (base[1] + blocks[:, 0]), 8 * (base[1] + blocks[:, 1])], axis=1)
    g_index = rows.group_start[t] + pieces[:, 0] // GROUP
    want = rows.digests[g_index]
    for k, (ra, rb, ba, bb, sa, sb) in enumerate(bounds.tolist()):
        h = xxhash.xxh3_64(rec[ra:rb])
        if bb > ba:
            h.update(box[ba:bb])
        h.update(sums[sa:sb])
        if h.intdigest() != int(want[k]):
            row = int(t[k])
            raise FormatError(f"{source}: tensor {rows.keys[row]!r}: group {int(pieces[k, 0]) // GROUP} of its pieces does "
                              f"not match its digest: the file was edited or damaged")


def _columns(rows: Rows, sel: np.ndarray, lay: Layout, files: np.ndarray, byte_offsets: np.ndarray,
             checksums: np.ndarray) -> TensorColumns:
    """Columns of the rows ``sel`` whose pieces are all known (``files``... their columns)."""
    return TensorColumns(
        keys=tuple(rows.keys[t] for t in sel.tolist()),
        dtypes=tuple(DTYPES[c] for c in rows.col("dtype")[sel].tolist()),
        shapes=tuple(rows.all_shapes(sel)),
        encodings=tuple(ENCODINGS[c] for c in rows.col("encoding")[sel].tolist()),
        sources=tuple(rows.sources[t] for t in sel.tolist()),
        piece_start=lay.piece_start, offsets=lay.offsets, extents=lay.extents, files=files, byte_offsets=byte_offsets,
        block_start=np.concatenate([[0], np.cumsum(lay.nblocks)]).astype(np.int64), checksums=checksums,
    )


def _check_pieces(rows: Rows, cols: TensorColumns, files: Sequence[FileEntry], head: Head, source: str) -> None:
    """Every piece in a listed file, inside it; the explicit layouts tiling their tensors."""
    _check_places(cols, files, source)
    replicas = bool(head.doc.get("replicas", False))
    for t in np.flatnonzero(rows.col("layout") == EXPLICIT).tolist():
        if cols.encodings[t] == "derived":
            continue
        p0, p1, nd = int(cols.piece_start[t]), int(cols.piece_start[t + 1]), len(cols.shapes[t])
        try:
            check_entry_tiling(cols.keys[t], cols.shapes[t], cols.offsets[p0:p1, :nd], cols.extents[p0:p1, :nd],
                               cols.files[p0:p1], replicas)
        except PlanError as exc:
            raise FormatError(f"{source}: {exc}") from None


def _check_places(cols: TensorColumns, files: Sequence[FileEntry], source: str) -> None:
    """Every piece of ``cols`` in a listed file, its stored bytes inside it."""
    n = len(cols.files)
    if not n:
        return
    if ((cols.files < 0) | (cols.files >= len(files))).any():
        raise FormatError(f"{source}: a piece names a file index outside the file list")
    owner = np.repeat(np.arange(len(cols.keys)), np.diff(cols.piece_start))
    code = np.array([DTYPES.index(d) for d in cols.dtypes], dtype=np.int64)
    enc = np.array([ENCODINGS.index(e) for e in cols.encodings], dtype=np.int64)
    ndim = np.array([len(s) for s in cols.shapes], dtype=np.int64)
    nbytes = stored_bytes(code[owner], enc[owner], cols.extents, ndim[owner])
    sizes = np.array([f.nbytes for f in files], dtype=np.int64)
    bad = (cols.byte_offsets < 0) | (cols.byte_offsets > sizes[cols.files] - nbytes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise FormatError(f"{source}: tensor {cols.keys[int(owner[i])]!r}: a piece reads {int(nbytes[i])} bytes from "
                          f"offset {int(cols.byte_offsets[i])}, past the end of its file ({int(sizes[cols.files[i]])} bytes)")


def _structure(head: Head, fetch: Fetch, source: str, lookup: Mapping[str, int]) -> dict:
    """The full structure: the section's skeleton, its placeholders filled from the outline's
    values; its tensor leaves are the tensors."""
    a, b, _, _ = head.section("structure")
    blank = parse_json(section(head, "structure", fetch([(a, b)])[0], source), source, "the structure")
    try:
        structure, keys = nested.filled_with_keys(blank, nested.values_of(head.doc["outline"]))
    except FormatError as exc:
        raise FormatError(f"{source}: the structure: {exc}") from None
    if len(keys) != len(lookup) or not all(k in lookup for k in keys):
        raise FormatError(f"{source}: structure and tensors disagree on keys ({len(keys)} leaves, {len(lookup)} tensors)")
    return structure


# ============================================================================ in parts
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
    """The reads of a part of the file, in exactly three rounds (each yields the absolute byte
    ranges it needs, possibly none, and is sent their bytes; ranks that read through another
    rank go in step): the tensor parts that would hold the keys of ``wanted``; the parts of the
    sources of the derived tensors found; the groups of every found tensor's pieces that
    overlap its boxes (of a derived tensor, its source's, for the same boxes; of a layout that
    is not a grid, all of them). Each is checked against its digest. Keys the checkpoint lacks
    are left out; a key with no box is listed without pieces. Returns a subset
    (``Metadata.subset``) whose ``structure`` is the checkpoint's outline (its plain values;
    ``holders``: which of its containers hold tensors)."""
    head = start.head
    found: dict[str, tuple[Rows, int]] = {}
    boxes: dict[str, list[Box]] = {k: list(v) for k, v in wanted.items()}
    parts = _parts_of(start.index, boxes, found)
    _found_in(start, parts, (yield from _read(start.index.ranges(parts))), list(boxes), found, source)
    derived = [(k, src) for k in sorted(found) if (src := found[k][0].sources[found[k][1]]) is not None]
    for key, src in derived:  # a derived tensor reads its source's pieces for its boxes
        boxes.setdefault(src, []).extend(boxes.get(key, []))
    later = [s for _, s in derived if s not in found]
    parts = _parts_of(start.index, later, found)
    _found_in(start, parts, (yield from _read(start.index.ranges(parts))), later, found, source)
    for key in list(found):
        rows, t = found[key]
        check_sources(rows, lambda k: found[k][0].described(found[k][1]) if k in found else None, source, only=[t])
    keys = sorted(found)
    plan = _PiecePlan(head, found, keys, boxes)
    got = yield from _read(plan.ranges())
    cols = plan.columns(got, source)
    _check_places(cols, start.files, source)
    return Metadata(
        unique_id=head.doc["unique_id"], world_size=head.doc["world_size"], files=start.files,
        tensors=ColumnTensors(cols, head.block_bytes), structure=head.doc["outline"],
        block_bytes=head.block_bytes, checksum_algorithm=head.doc["checksum"]["algorithm"],
        created_by=head.doc.get("created_by", ""), format_version=VERSION, subset=True,
        replicas=head.doc.get("replicas", False), digest=head.digest,
        holders=frozenset(tuple(p) for p in head.doc["holders"]),
    )


def _read(ranges: Sequence[tuple[int, int]]) -> Generator[List[Tuple[int, int]], List[Union[bytes, memoryview]], list]:
    """One round: ``ranges`` asked for with the ones that touch merged (the records and the
    checksums of neighbouring groups lie back to back), their bytes cut apart again."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    merged: list[list[int]] = []
    where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(ranges)
    for i in order:
        a, b = ranges[i]
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
        where[i] = (len(merged) - 1, a - merged[-1][0], b - merged[-1][0])
    blobs = yield [(a, b) for a, b in merged]
    if len(blobs) != len(merged):
        raise FormatError(f"{len(blobs)} byte ranges received for {len(merged)} asked")
    return [memoryview(blobs[m])[a:b] for m, a, b in where]


def _parts_of(index: Index, keys: Any, found: Mapping) -> list[int]:
    """The parts that would hold ``keys`` not found yet, ascending."""
    return sorted({i for i in (bisect.bisect_right(index.first_keys, k) - 1 for k in keys if k not in found) if i >= 0})


def _found_in(start: Start, parts: Sequence[int], blobs: Sequence[bytes | memoryview], keys: Sequence[str],
              found: dict, source: str) -> None:
    """Add to ``found`` (key -> (the rows read, its row)) every one of ``keys`` the parts hold."""
    if not parts:
        return
    rows = rows_read(start, parts, blobs, source)
    at = {k: t for t, k in enumerate(rows.keys)}
    hits = sorted({at[k] for k in keys if k in at and k not in found})
    kept = rows.take(hits)  # the parts' other rows are not kept
    for i, t in enumerate(hits):
        found[rows.keys[t]] = (kept, i)


class _Grid:
    """The pieces of one grid tensor, found from its cuts as they are asked for: a piece's box
    from its cell's index; its checksums from the count every piece has when the smallest and
    the largest cell have as many blocks (the cells of a split are a few sizes), else from every
    piece's, counted once."""

    def __init__(self, rows: Rows, t: int, block_bytes: int):
        self.cuts = rows.cuts.of(t)
        self.dims = [len(c) - 1 for c in self.cuts]
        self.k: int | None = None
        self.cum: np.ndarray | None = None
        ext = _extreme_cells(self.cuts)
        if ext is not None:
            code, enc = int(rows.col("dtype")[t]), int(rows.col("encoding")[t])
            nd = len(self.cuts)
            if enc:
                cells = np.array(ext, dtype=np.int64).reshape(2, nd)
                k = blocks_of(stored_bytes(np.full(2, code), np.full(2, enc), cells, np.full(2, nd)), block_bytes).tolist()
            else:
                item = int(ITEMSIZE[code])
                k = [max(1, -(-math.prod(cell) * item // block_bytes)) for cell in ext]
            self.k = k[0] if k[0] == k[1] else None
        if self.k is None:
            lay = layout_of(rows, np.array([t]), None, block_bytes)
            self.cum = np.concatenate([[0], np.cumsum(lay.nblocks)]).astype(np.int64)

    def boxes(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, shapes) of pieces ``idx`` (row-major cells)."""
        idx = idx.copy()
        offsets = np.zeros((len(idx), len(self.cuts)), np.int64)
        extents = np.zeros_like(offsets)
        for d in reversed(range(len(self.cuts))):
            i = idx % self.dims[d]
            idx //= self.dims[d]
            offsets[:, d] = self.cuts[d][i]
            extents[:, d] = self.cuts[d][i + 1] - self.cuts[d][i]
        return offsets, extents

    def blocks(self, p0: int, p1: int) -> tuple[int, int]:
        """Checksums [lo, hi) of pieces [p0, p1), counted from the tensor's first."""
        if self.cum is None:
            return p0 * int(self.k or 0), p1 * int(self.k or 0)
        return int(self.cum[p0]), int(self.cum[p1])

    def nblocks(self, idx: np.ndarray) -> np.ndarray:
        """Checksums of each of pieces ``idx``."""
        if self.cum is None:
            return np.full(len(idx), int(self.k or 0), dtype=np.int64)
        return self.cum[idx + 1] - self.cum[idx]

    def groups(self, boxes: Sequence[Box]) -> np.ndarray:
        """The groups whose pieces overlap ``boxes``."""
        found: set[int] = set()
        for box in boxes:
            if box.ndim != len(self.cuts):
                continue  # a target of another shape: check_targets names the mismatch
            spans = []
            for c, lo, n in zip(self.cuts, box.offsets, box.shape):
                i0 = max(0, bisect.bisect_right(c, lo) - 1)
                spans.append(range(i0, min(len(c) - 1, bisect.bisect_left(c, lo + n))))
            if math.prod([len(r) for r in spans]) <= 4096:
                for cell in itertools.product(*spans):
                    at = 0
                    for i, n in zip(cell, self.dims):
                        at = at * n + i
                    found.add(at // GROUP)
            else:
                mesh = np.meshgrid(*[np.arange(r.start, r.stop, dtype=np.int64) for r in spans], indexing="ij")
                found.update((np.ravel_multi_index([m.reshape(-1) for m in mesh], self.dims) // GROUP).tolist())
        return np.array(sorted(found), dtype=np.int64)


def _extreme_cells(cuts: Sequence[np.ndarray]) -> tuple[list[int], list[int]] | None:
    """The extents of a grid's smallest and largest cell (None when a dimension has no cell)."""
    small, large = [], []
    for c in cuts:
        if len(c) < 2:
            return None
        if len(c) <= 64:
            v = c.tolist()
            gaps = [b - a for a, b in zip(v, v[1:])]
            small.append(min(gaps))
            large.append(max(gaps))
        else:
            g = np.diff(c)
            small.append(int(g.min()))
            large.append(int(g.max()))
    return small, large


class _PiecePlan:
    """The groups of pieces a part read takes, and the columns it makes of them."""

    def __init__(self, head: Head, found: Mapping[str, tuple[Rows, int]], keys: Sequence[str], boxes: Mapping):
        self.head, self.found, self.keys = head, found, list(keys)
        self.grids: dict[str, _Grid] = {}
        self.groups: dict[str, np.ndarray] = {}
        for key in keys:
            rows, t = found[key]
            count = int(rows.col("count")[t])
            if not count:
                self.groups[key] = np.zeros(0, np.int64)
            elif rows.col("layout")[t] == EXPLICIT:
                self.groups[key] = np.arange(-(-count // GROUP), dtype=np.int64)
            else:
                grid = self.grids[key] = _Grid(rows, t, head.block_bytes)
                self.groups[key] = grid.groups(boxes.get(key, []))

    def ranges(self) -> list[tuple[int, int]]:
        """Every range read: of each wanted group of a grid, its records and checksums; of an
        explicit layout, all its records, boxes and checksums."""
        out = []
        r0, b0, s0 = (self.head.area(n)[0] for n in ("records", "boxes", "sums"))
        w = self.head.record_width
        for key in self.keys:
            rows, t = self.found[key]
            gs = self.groups[key]
            if not len(gs):
                continue
            fp, fb, fx = (int(rows.col(c)[t]) for c in ("first_piece", "first_block", "first_box"))
            count, nd = int(rows.col("count")[t]), int(rows.col("ndim")[t])
            if key not in self.grids:
                out += [(r0 + fp * w, r0 + (fp + count) * w), (b0 + fx, b0 + fx + 16 * nd * count),
                        (s0 + 8 * fb, s0 + 8 * (fb + int(rows.col("blocks")[t])))]
                continue
            grid = self.grids[key]
            for g in gs.tolist():
                p0, p1 = g * GROUP, min((g + 1) * GROUP, count)
                lo, hi = grid.blocks(p0, p1)
                out += [(r0 + (fp + p0) * w, r0 + (fp + p1) * w), (s0 + 8 * (fb + lo), s0 + 8 * (fb + hi))]
        return out

    def columns(self, got: Sequence[bytes | memoryview], source: str) -> TensorColumns:
        """The columns of the pieces read (``got``: the bytes of :meth:`ranges`, in order):
        every group's digest checked, the records and checksums of all decoded at once."""
        it = iter(got)
        recs: list[Any] = []
        sums: list[Any] = []
        boxes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # offsets, extents, nblocks per key
        for key in self.keys:
            rows, t = self.found[key]
            gs, count, nd = self.groups[key], int(rows.col("count")[t]), int(rows.col("ndim")[t])
            if not len(gs):
                boxes.append((np.zeros((0, nd), np.int64), np.zeros((0, nd), np.int64), np.zeros(0, np.int64)))
            elif key not in self.grids:
                rec, box, sm = next(it), next(it), next(it)
                boxes.append(self._explicit(rows, t, rec, box, sm, count, nd, source))
                recs.append(rec)
                sums.append(sm)
            else:
                grid, pieces = self.grids[key], []
                for g in gs.tolist():
                    rec, sm = next(it), next(it)
                    _check_digest(rows, t, g, rec, sm, source)
                    recs.append(rec)
                    sums.append(sm)
                    pieces.append(np.arange(g * GROUP, min((g + 1) * GROUP, count), dtype=np.int64))
                idx = np.concatenate(pieces)
                boxes.append((*grid.boxes(idx), grid.nblocks(idx)))
        counts = [len(b[2]) for b in boxes]
        files, offs = records(b"".join(recs), sum(counts), self.head)
        return self._assemble(boxes, counts, files, offs, np.frombuffer(b"".join(sums), dtype="<u8").astype(np.uint64))

    def _explicit(self, rows: Rows, t: int, rec: Any, box: Any, sums: Any, count: int, nd: int, source: str) -> tuple:
        one = np.array([t])
        ex = layout_of(rows, one, lambda _: np.frombuffer(box, dtype="<i8").reshape(count, 2 * nd).astype(np.int64),
                       self.head.block_bytes)
        area = {"records": memoryview(rec), "boxes": memoryview(box), "sums": memoryview(sums)}
        _check_groups(rows, one, ex, self.head, area, source, whole=False)
        return ex.offsets[:, :nd], ex.extents[:, :nd], ex.nblocks

    def _assemble(self, boxes: Sequence[tuple], counts: Sequence[int], files: np.ndarray, offs: np.ndarray,
                  checksums: np.ndarray) -> TensorColumns:
        info = [self.found[k] for k in self.keys]
        width = max((len(r.shape(t)) for r, t in info), default=0)
        piece_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        offsets = np.zeros((int(piece_start[-1]), width), np.int64)
        extents = np.zeros_like(offsets)
        for (o, x, _), p0 in zip(boxes, piece_start.tolist()):
            offsets[p0 : p0 + len(o), : o.shape[1]] = o
            extents[p0 : p0 + len(o), : o.shape[1]] = x
        nblocks = np.concatenate([b[2] for b in boxes]) if boxes else np.zeros(0, np.int64)
        return TensorColumns(
            keys=tuple(self.keys),
            dtypes=tuple(DTYPES[int(r.col("dtype")[t])] for r, t in info),
            shapes=tuple(r.shape(t) for r, t in info),
            encodings=tuple(ENCODINGS[int(r.col("encoding")[t])] for r, t in info),
            sources=tuple(r.sources[t] for r, t in info),
            piece_start=piece_start, offsets=offsets, extents=extents, files=files, byte_offsets=offs,
            block_start=np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int64), checksums=checksums,
        )


def _check_digest(rows: Rows, t: int, g: int, rec: Any, sums: Any, source: str) -> None:
    """Group ``g`` of row ``t``'s pieces (its records and checksums) matches its digest."""
    h = xxhash.xxh3_64(rec)
    h.update(sums)
    if h.intdigest() != int(rows.digests[rows.group_start[t] + g]):
        raise FormatError(f"{source}: tensor {rows.keys[t]!r}: group {g} of its pieces does not match its digest: "
                          f"the file was edited or damaged")
