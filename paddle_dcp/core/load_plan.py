"""Load plans: a pure function from the pieces a rank must fill to the byte ranges it reads.

A rank intersects its target pieces with the saved pieces of the metadata and turns every
overlap into block-aligned byte ranges to read and regions to copy (:func:`plan_reads`),
without asking any other rank; :func:`restrict` cuts the metadata down to what one rank needs.
A target of a derived tensor (:mod:`~paddle_dcp.core.derive`) reads its source's pieces, its
copies cast to the derived tensor's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import add, sub
from typing import Sequence, Tuple

import numpy as np

from . import nested, quant, ragged, sorting
from .boxes import FEW_BOXES, Box, c_strides, check_tiling, first_overlap, meet, split_region, strided_span
from ..errors import MismatchError, PlanError
from .metadata import Metadata, PieceTable, SavedPiece, TensorEntry, blocks_of


@dataclass(frozen=True)
class TargetPiece:
    """What one rank must fill of one tensor: its local piece, in global coordinates."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True)
class Copy:
    """Copy ``region_in_saved`` of a saved piece into ``region_in_target`` of target ``target``
    (cast to ``dtype`` on the way when given: a derived tensor read from its source)."""

    target: int
    region_in_saved: Box
    region_in_target: Box
    dtype: str | None = None


@dataclass(frozen=True)
class Segment:
    """The bytes [start, stop) of one saved piece inside a read: whole checksum blocks (of a
    piece stored with an encoding, they hold the whole encoded blocks of its copies' regions)."""

    piece: SavedPiece
    start: int  # in the file, in bytes
    stop: int
    copies: tuple[Copy, ...]


@dataclass(frozen=True)
class ReadOp:
    """One read of the byte range [start, stop) of file ``file``, then its copies.

    Attributes:
        direct: the read is exactly one copy of a contiguous region into a contiguous region
            of its target, so the bytes may land straight in the target's memory.
    """

    file: int
    start: int
    stop: int
    segments: tuple[Segment, ...]
    direct: bool = False

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def check_targets(meta: Metadata, targets: Sequence[TargetPiece]) -> None:
    """Raise MismatchError naming the key and both sides when a target's dtype or global shape
    differs from the checkpoint's."""
    for t in targets:
        entry = meta.tensors[t.key]
        if tuple(entry.shape) != tuple(t.global_shape):
            raise MismatchError(
                f"{t.key}: checkpoint has shape {tuple(entry.shape)}, state_dict has {tuple(t.global_shape)}"
            )
        if entry.dtype != t.dtype:
            raise MismatchError(f"{t.key}: checkpoint has dtype {entry.dtype}, state_dict has {t.dtype}")


def stored_target(meta: Metadata, t: TargetPiece) -> tuple[TargetPiece, str | None]:
    """The target whose pieces fill ``t``: ``t`` itself, or for a derived tensor the same box of
    its source (the dtype the copies cast to is then the second value; else None)."""
    entry = meta.tensors[t.key]
    if not entry.derived or entry.source is None:
        return t, None
    source = meta.tensors[entry.source]
    return TargetPiece(source.key, source.dtype, tuple(source.shape), t.box), entry.dtype


def overlapping_pieces(entry: TensorEntry, box: Box) -> np.ndarray:
    """Rows of ``entry``'s pieces that overlap ``box`` (in_global), ascending."""
    p = entry.pieces
    if box.ndim == 0:
        return np.arange(p.count)
    if p.count <= FEW_BOXES:
        lo, hi = box.offsets, box.end
        hits = [
            i
            for i, (o, s) in enumerate(zip(p.offsets.tolist(), p.shapes.tolist()))
            if meet(o, [a + n for a, n in zip(o, s)], lo, hi)
        ]
        return np.array(hits, dtype=np.int64)
    low = np.maximum(p.offsets, np.asarray(box.offsets, dtype=np.int64))
    high = np.minimum(p.offsets + p.shapes, np.asarray(box.end, dtype=np.int64))
    return np.flatnonzero((high > low).all(axis=1))


def pick_replicas(entry: TensorEntry, rows: np.ndarray, readable: np.ndarray | None = None) -> np.ndarray:
    """One copy of every distinct box among the pieces ``rows``: the lowest row in a file with
    ``readable[file]`` true, else the lowest row. Boxes that only overlap stay (and fail the
    overlap check as usual)."""
    if len(rows) < 2:
        return rows
    p = entry.pieces
    boxes = np.concatenate([p.offsets[rows], p.shapes[rows]], axis=1)
    far = np.zeros(len(rows), dtype=bool) if readable is None else ~np.asarray(readable, dtype=bool)[p.files[rows]]
    order = sorting.lexsort((rows, far) + tuple(boxes[:, c] for c in reversed(range(boxes.shape[1]))))
    b = boxes[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (b[1:] != b[:-1]).any(axis=1)
    return np.sort(rows[order[first]])


def _check_disjoint(entry: TensorEntry, box: Box, rows: np.ndarray) -> None:
    """Raise PlanError when two of the pieces ``rows`` overlap inside ``box``. With their
    volumes inside the box adding up to the box's, this proves they cover it exactly, whether
    or not the whole tensor's tiling was checked (lazily parsed metadata); pieces short of the
    box are left to the caller, which refuses them for their cover."""
    if len(rows) < 2 or box.ndim == 0:
        return
    p = entry.pieces
    if len(rows) <= FEW_BOXES:
        offs, shps = p.offsets[rows].tolist(), p.shapes[rows].tolist()
        los = [[max(a, b) for a, b in zip(o, box.offsets)] for o in offs]
        his = [[min(a + n, c) for a, n, c in zip(o, s, box.end)] for o, s in zip(offs, shps)]
        pair = first_overlap(los, his)
        if pair is not None:
            raise PlanError(
                f"{entry.key}: saved pieces at offsets {tuple(offs[pair[0]])} and {tuple(offs[pair[1]])} overlap"
            )
        return
    lo = np.maximum(p.offsets[rows], np.asarray(box.offsets, dtype=np.int64))
    hi = np.minimum(p.offsets[rows] + p.shapes[rows], np.asarray(box.end, dtype=np.int64))
    if int(np.prod(np.maximum(hi - lo, 0), axis=1, dtype=np.int64).sum()) < box.volume:
        return  # short of the box: the caller refuses the load (their cover) without a search
    try:  # O(p log p) for the grids placements make (a load onto far fewer ranks meets thousands)
        check_tiling(entry.key, box.shape, lo - np.asarray(box.offsets, dtype=np.int64), hi - lo, require_cover=False)
        return
    except PlanError:
        pass  # some pieces overlap: found pair by pair, to name them by their offsets
    a, b = _overlapping_pair(lo, hi)
    raise PlanError(
        f"{entry.key}: saved pieces at offsets {tuple(p.offsets[rows[a]].tolist())} and "
        f"{tuple(p.offsets[rows[b]].tolist())} overlap"
    )


def _overlapping_pair(lo: np.ndarray, hi: np.ndarray) -> tuple[int, int]:
    """The first two of the boxes [lo, hi) that overlap (some do), pair by pair."""
    for a in range(len(lo) - 1):
        both = (np.maximum(lo[a], lo[a + 1 :]) < np.minimum(hi[a], hi[a + 1 :])).all(axis=1)
        if both.any():
            return a, a + 1 + int(np.flatnonzero(both)[0])
    raise PlanError("pieces said to overlap do not")


def plan_reads(
    meta: Metadata,
    targets: Sequence[TargetPiece],
    max_read_bytes: int = 32 << 20,
    coalesce_gap: int = 1 << 16,
    direct_min_bytes: int = 1 << 20,
    slots: Sequence[int] | None = None,
    readable: np.ndarray | None = None,
) -> list[ReadOp]:
    """The reads that fill every target piece exactly, sorted by file and offset.

    Each overlap of a target with a saved piece becomes a segment covering whole checksum
    blocks of that piece (of a tensor stored with an encoding: the whole encoded blocks, with
    their scales, that the overlap's elements lie in, rounded out to checksum blocks); a segment larger than ``max_read_bytes`` is cut along the region's
    outer dims; neighbouring segments of one file less than ``coalesce_gap`` bytes apart are
    merged into one read of at most ``max_read_bytes`` (many small pieces, one syscall);
    exact segments of at least ``direct_min_bytes`` stay alone so they can land in place.
    Copies name target ``i`` by ``slots[i]`` when given (the caller's own numbering), else by i.
    Of a piece saved in several copies (``meta.replicas``), one is read: the first in a file
    this rank can read (``readable[file]``), else the first. A derived tensor's target reads
    its source's pieces, never straight into the target (its copies cast).

    Raises:
        MismatchError: a target's shape or dtype differs from the checkpoint's.
        PlanError: the checkpoint's pieces do not cover a target exactly.
    """
    check_targets(meta, targets)
    max_read_bytes = max(max_read_bytes, 2 * meta.block_bytes + 64)
    if slots is not None and len(slots) != len(targets):
        raise ValueError(f"{len(slots)} slots for {len(targets)} targets")
    segments: list[_Found] = []
    starts_cache: dict[str, np.ndarray] = {}
    for ti, target in enumerate(targets):
        if 0 in target.box.shape:  # an empty target reads nothing
            continue
        t, cast_to = stored_target(meta, target)
        starts = starts_cache.get(t.key)
        if starts is None:
            starts = starts_cache[t.key] = meta.tensors[t.key].block_starts()
        slot = ti if slots is None else slots[ti]
        segments.extend(_target_segments(meta, t, slot, starts, max_read_bytes, direct_min_bytes, readable, cast_to))
    return _coalesce(segments, coalesce_gap, max_read_bytes)


_FIRST = np.zeros(1, dtype=np.int64)
_FIRST.flags.writeable = False

# a segment found: (file, start, stop, segment, exact, alone); ``exact``: one contiguous
# region into a contiguous region; ``alone``: exact and large enough to be read by itself
_Found = Tuple[int, int, int, Segment, bool, bool]


def _target_segments(
    meta: Metadata,
    t: TargetPiece,
    slot: int,
    starts: np.ndarray,
    max_read_bytes: int,
    direct_min_bytes: int,
    readable: np.ndarray | None,
    cast_to: str | None = None,
) -> list[_Found]:
    """The segments that fill target ``t`` (copies named ``slot``, cast to ``cast_to`` when
    given), checked to cover it."""
    block = meta.block_bytes
    entry = meta.tensors[t.key]
    tbox = t.box
    isz = entry.itemsize
    # a tensor saved whole (most of a many-tensor checkpoint): its one piece, whether or not it
    # meets the target (the cover check below refuses one that does not)
    hits = _FIRST if entry.pieces.count == 1 else overlapping_pieces(entry, tbox)
    if meta.replicas:
        hits = pick_replicas(entry, hits, readable)
    plain = entry.encoding is None and cast_to is None  # its bytes are the target's
    if len(hits) == 1 and plain:
        piece = entry.piece(int(hits[0]), starts)
        if piece.box == tbox and piece.nbytes <= max_read_bytes - 2 * block:
            # the target is exactly one saved piece (a load into the layout that saved, or
            # a scalar): one exact segment, no arithmetic on regions
            whole = Box((0,) * tbox.ndim, tbox.shape)
            seg = Segment(piece, piece.byte_offset, piece.byte_offset + piece.nbytes, (Copy(slot, whole, whole),))
            return [(piece.file, seg.start, seg.stop, seg, True, piece.nbytes >= direct_min_bytes)]
    _check_disjoint(entry, tbox, hits)
    if entry.encoding is None:
        max_elems = max(1, (max_read_bytes - 2 * block) // isz)
    else:  # a read's elements are decoded to float32 in one scratch array of at most a read's size
        max_elems = max(1, (max_read_bytes - 2 * block - 2 * quant.encoding(entry.encoding).block_bytes) // 4)
    t_strides = c_strides(tbox.shape)
    found: list[_Found] = []
    covered = 0
    for i in hits.tolist():
        piece = entry.piece(i, starts)
        pbox = piece.box
        overlap = pbox.intersect(tbox)
        if overlap is None:
            continue
        covered += overlap.volume
        for part, part_in_target, first, stop in _parts(overlap, pbox, tbox, max_elems):
            lo, hi = _stored_range(entry.encoding, isz, first, stop)
            b0 = lo // block * block
            b1 = min(-(-hi // block) * block, piece.nbytes)
            seg = Segment(
                piece=piece,
                start=piece.byte_offset + b0,
                stop=piece.byte_offset + b1,
                copies=(Copy(slot, part, part_in_target, cast_to),),
            )
            exact = plain and b0 == lo and b1 == hi and stop - first == part.volume
            if exact:
                t_first, t_stop = strided_span(part_in_target.offsets, part.shape, t_strides)
                exact = t_stop - t_first == part.volume
            alone = exact and (b1 - b0) >= direct_min_bytes
            found.append((piece.file, seg.start, seg.stop, seg, exact, alone))
    if covered != tbox.volume:
        raise PlanError(
            f"{t.key}: the checkpoint's pieces cover {covered} of the {tbox.volume} elements "
            f"of the target box {tbox}"
        )
    return found


def _stored_range(encoding: str | None, isz: int, first: int, stop: int) -> tuple[int, int]:
    """[start, stop) in a piece's stored bytes of its elements ``first`` .. ``stop``: their
    raw bytes, or the whole encoded blocks they lie in."""
    if encoding is None:
        return first * isz, stop * isz
    return quant.byte_range(encoding, first, stop - first)


def _parts(overlap: Box, pbox: Box, tbox: Box, max_elems: int) -> list[tuple[Box, Box, int, int]]:
    """The overlap of a saved piece ``pbox`` and a target ``tbox`` as (region in saved, region
    in target, first and stop element in the saved piece), cut along the outer dims into parts
    of at most ``max_elems`` elements of span."""
    in_saved = overlap.relative_to(pbox)
    in_target = overlap.relative_to(tbox)
    p_strides = c_strides(pbox.shape)
    first, stop = strided_span(in_saved.offsets, in_saved.shape, p_strides)
    if stop - first <= max_elems:
        return [(in_saved, in_target, first, stop)]
    parts = []
    for part in split_region(in_saved, max_elems, pbox.shape):
        shift = tuple(map(sub, part.offsets, in_saved.offsets))
        part_in_target = Box(tuple(map(add, in_target.offsets, shift)), part.shape)
        parts.append((part, part_in_target, *strided_span(part.offsets, part.shape, p_strides)))
    return parts


def _coalesce(segments: list[_Found], coalesce_gap: int, max_read_bytes: int) -> list[ReadOp]:
    """Sort the segments by file and offset and merge neighbours into reads."""
    segments.sort(key=lambda s: (s[0], s[1]))
    ops: list[ReadOp] = []
    group: list[_Found] = []
    stop = 0  # the group's end: the largest stop of its segments, kept as they join

    def flush() -> None:
        if not group:
            return
        direct = len(group) == 1 and group[0][4]
        ops.append(ReadOp(group[0][0], group[0][1], stop, tuple(g[3] for g in group), direct))
        group.clear()

    for item in segments:
        if group and (
            item[0] != group[0][0]
            or item[1] > stop + coalesce_gap
            or item[1] < stop  # two targets reading the same blocks: keep them apart
            or max(stop, item[2]) - group[0][1] > max_read_bytes
            or group[0][5]
            or item[5]
        ):
            flush()
        stop = max(stop, item[2]) if group else item[2]
        group.append(item)
    flush()
    return ops


def plan_shared_checks(
    meta: Metadata, keys: Sequence[str], index: int, count: int, max_read_bytes: int = 32 << 20
) -> list[ReadOp]:
    """Rank ``index`` of ``count``'s share of checking every checksum block of the tensors
    ``keys``: ranks that all read from the same tensors of one shared checkpoint check each
    block once between them instead of once per rank that reads from it (a reshard reads
    parts of many blocks on every rank).

    The blocks of every piece of those tensors, in file and offset order, are cut into
    ``count`` runs of about equal bytes; rank ``index`` gets the run that holds the middle of
    each of its blocks. Returns read ops (segments without copies) of whole blocks, at most
    ``max_read_bytes`` each, sorted by file and offset. O(pieces) with numpy.
    """
    block = meta.block_bytes
    entries = [meta.tensors[k] for k in sorted(set(keys))]
    if not entries or count < 1:
        return []
    sizes = [e.pieces.count for e in entries]
    which = np.repeat(np.arange(len(entries)), sizes)  # entry of every piece
    row = np.concatenate([np.arange(n) for n in sizes])
    files = np.concatenate([e.pieces.files for e in entries])
    starts = np.concatenate([e.pieces.byte_offsets for e in entries])
    nbytes = np.concatenate([e.piece_nbytes() for e in entries])
    order = np.lexsort((starts, files))
    which, row, files, starts, nbytes = which[order], row[order], files[order], starts[order], nbytes[order]
    nblocks = blocks_of(nbytes, block)
    # every block: its piece (position in ``order``), its index in the piece, its length
    piece_of = np.repeat(np.arange(len(order)), nblocks)
    k = ragged.positions(nblocks)
    length = np.minimum(block, nbytes[piece_of] - k * block)
    total = int(length.sum())
    before = np.cumsum(length) - length
    if total:
        owner = np.minimum(count - 1, ((2 * before + length) * count) // (2 * total))
    else:  # only empty pieces: one block each, dealt out in turn
        owner = np.arange(len(length)) % count
    mine = np.flatnonzero(owner == index)
    if not len(mine):
        return []
    # consecutive blocks of one piece make one segment of at most max_blocks blocks
    cut = np.ones(len(mine), dtype=bool)
    cut[1:] = (np.diff(mine) != 1) | (np.diff(piece_of[mine]) != 0)
    run_id = np.cumsum(cut) - 1
    run_first = np.flatnonzero(cut)
    max_blocks = max(1, max_read_bytes // block)
    cut |= (np.arange(len(mine)) - run_first[run_id]) % max_blocks == 0
    heads = np.flatnonzero(cut)
    tails = np.append(heads[1:], len(mine)) - 1
    segments: list[tuple[int, int, int, Segment]] = []
    block_starts: dict[int, np.ndarray] = {}
    for pos, first, last in zip(piece_of[mine[heads]].tolist(), k[mine[heads]].tolist(), k[mine[tails]].tolist()):
        e = int(which[pos])
        entry = entries[e]
        if e not in block_starts:
            block_starts[e] = entry.block_starts()
        piece = entry.piece(int(row[pos]), block_starts[e])
        seg_start = piece.byte_offset + first * block
        seg_stop = min(piece.byte_offset + (last + 1) * block, piece.byte_offset + piece.nbytes)
        segments.append((piece.file, seg_start, seg_stop, Segment(piece, seg_start, seg_stop, ())))
    ops: list[ReadOp] = []
    group: list[tuple[int, int, int, Segment]] = []
    for item in segments:
        if group and (item[0] != group[0][0] or item[1] < group[-1][2] or item[2] - group[0][1] > max_read_bytes):
            ops.append(ReadOp(group[0][0], group[0][1], group[-1][2], tuple(g[3] for g in group)))
            group = []
        group.append(item)
    if group:
        ops.append(ReadOp(group[0][0], group[0][1], group[-1][2], tuple(g[3] for g in group)))
    return ops



def restrict(
    meta: Metadata, targets: Sequence[TargetPiece], tensor_keys: Sequence[str] = (), plain: Sequence[tuple] = ()
) -> Metadata:
    """The part of ``meta`` a rank with these targets needs: the pieces that overlap them
    (with their checksums and files), the plain subtrees at the paths ``plain``, and, with no pieces, the
    tensors of ``tensor_keys`` it holds nothing of (so it knows the checkpoint has them). A
    derived tensor comes with its source, and the source's pieces that overlap its targets. Its
    size grows with that rank's pieces, not with the job; sent to ranks that cannot read the
    metadata file.

    Raises:
        MismatchError: a target's shape or dtype differs from the checkpoint's.
    """
    check_targets(meta, targets)
    # tensors the rank has keys for but holds nothing of stay listed (with no pieces), so it
    # knows they exist in the checkpoint
    rows: dict[str, set[int]] = {k: set() for k in tensor_keys if k in meta.tensors}
    for target in targets:
        rows.setdefault(target.key, set())
        t, _ = stored_target(meta, target)
        entry = meta.tensors[t.key]
        hit = overlapping_pieces(entry, t.box) if t.box.volume or t.box.ndim == 0 else np.zeros(0, np.int64)
        rows.setdefault(t.key, set()).update(hit.tolist())
    for key in list(rows):  # a derived tensor is read from its source: the part lists both
        source = meta.tensors[key].source
        if source is not None:
            rows.setdefault(source, set())
    used_files = sorted({int(meta.tensors[k].pieces.files[i]) for k, idx in rows.items() for i in idx})
    new_index = {f: i for i, f in enumerate(used_files)}
    tensors = {key: _restricted_entry(meta.tensors[key], idx, new_index) for key, idx in rows.items()}
    return Metadata(
        unique_id=meta.unique_id,
        world_size=meta.world_size,
        files=tuple(meta.files[f] for f in used_files),
        tensors=tensors,
        structure=nested.restrict(meta.structure, set(tensors), frozenset(plain)),
        block_bytes=meta.block_bytes,
        checksum_algorithm=meta.checksum_algorithm,
        created_by=meta.created_by,
        subset=True,
        replicas=meta.replicas,
    )


def _restricted_entry(entry: TensorEntry, rows: set[int], new_index: dict[int, int]) -> TensorEntry:
    """``entry`` with only its pieces ``rows`` (and their checksums), files renumbered."""
    sel = np.array(sorted(rows), dtype=np.int64)
    starts = entry.block_starts()
    blocks = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in sel]) if len(sel) else np.zeros(0, np.int64)
    p = entry.pieces
    table = PieceTable(
        offsets=p.offsets[sel],
        shapes=p.shapes[sel],
        files=np.array([new_index[int(f)] for f in p.files[sel]], dtype=np.int64),
        byte_offsets=p.byte_offsets[sel],
        checksums=p.checksums[blocks],
    )
    return TensorEntry(entry.key, entry.dtype, entry.shape, table, entry.block_bytes, entry.encoding, entry.source)
