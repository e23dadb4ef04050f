"""Save and load plans: pure functions from what ranks hold to who writes and reads what.

Save: every rank summarises the pieces it holds (:class:`SaveSummary`); the coordinator alone
sees all summaries, writes every distinct piece once (replicas deduplicated), picks the writers
so that bytes written per rank are balanced (:func:`plan_save`), and once the ranks report
their checksums, assembles the metadata (:func:`build_metadata`). Work is vectorised over
pieces with numpy and grows as O(pieces log pieces).

Load: a rank intersects its target pieces with the saved pieces of the metadata and turns
every overlap into block-aligned byte ranges to read and regions to copy (:func:`plan_reads`),
without asking any other rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import add, sub
from typing import Sequence

import numpy as np

from . import nested
from .boxes import FEW_BOXES, Box, c_strides, check_tiling, first_overlap, meet, split_region, strided_span
from .dtypes import itemsize
from ..errors import MismatchError, PlanError
from .naming import data_file_name
from .metadata import (
    FileEntry,
    Metadata,
    PieceTable,
    SavedPiece,
    TensorEntry,
    aligned,
    blocks_of,
)


# ====================================================================== save
@dataclass(frozen=True)
class LocalPiece:
    """What one rank holds of one tensor.

    Attributes:
        key: flat state-dict key.
        dtype: the format's dtype name.
        global_shape: the whole tensor's shape, in elements.
        box: the rank's piece in global coordinates, or None when it holds none of it.
    """

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box | None


@dataclass(frozen=True, eq=False)
class SaveSummary:
    """A rank's description of its state dict for the coordinator.

    Attributes:
        rank: the global rank that sent it.
        skeleton: the nested structure; plain values only in the coordinator's own.
        dtypes / global_shapes: per tensor leaf, in the skeleton's depth-first order.
        boxes: (rows, 1 + 2 * max_ndim) int64 rows ``[present, offsets, shape]``, offsets
            and shape each padded with zeros to the summary's largest rank; one row per leaf,
            or several for a leaf held as several boxes (a flattened ShardedWeight).
        row_leaf: (rows,) int64, the leaf of every row, ascending; None when row i is leaf i.
        header_id: equal for summaries whose skeleton, dtypes and shapes are equal (lets the
            coordinator parse and check each distinct layout once).
    """

    rank: int
    skeleton: dict
    dtypes: tuple[str, ...]
    global_shapes: tuple[tuple[int, ...], ...]
    boxes: np.ndarray
    header_id: object = None
    row_leaf: np.ndarray | None = None

    @classmethod
    def from_pieces(cls, rank: int, skeleton: dict, pieces: Sequence[LocalPiece]) -> "SaveSummary":
        """From the pieces in the skeleton's tensor order: one per leaf, or a run of several of
        one key (a leaf held as several boxes)."""
        keys = nested.tensor_keys(skeleton)
        starts = [i for i, p in enumerate(pieces) if i == 0 or p.key != pieces[i - 1].key]
        if [pieces[i].key for i in starts] != keys:
            raise PlanError("local pieces are not in the skeleton's tensor order")
        firsts = [pieces[i] for i in starts]
        max_nd = max((len(p.global_shape) for p in pieces), default=0)
        boxes = np.zeros((len(pieces), 1 + 2 * max_nd), dtype=np.int64)
        for i, p in enumerate(pieces):
            if p.box is not None and p.box.volume > 0:
                nd = p.box.ndim
                boxes[i, 0] = 1
                boxes[i, 1 : 1 + nd] = p.box.offsets
                boxes[i, 1 + max_nd : 1 + max_nd + nd] = p.box.shape
        row_leaf = None
        if len(pieces) != len(keys):
            flags = np.zeros(len(pieces), dtype=np.int64)
            flags[starts] = 1
            row_leaf = np.cumsum(flags) - 1
        return cls(
            rank=rank,
            skeleton=skeleton,
            dtypes=tuple(p.dtype for p in firsts),
            global_shapes=tuple(tuple(p.global_shape) for p in firsts),
            boxes=boxes,
            row_leaf=row_leaf,
        )

    def leaves_of_rows(self) -> np.ndarray:
        """(rows,) the leaf of every row."""
        return np.arange(len(self.boxes), dtype=np.int64) if self.row_leaf is None else self.row_leaf

    def piece_box(self, i: int) -> Box | None:
        """The box of row ``i`` (None: the rank holds nothing there)."""
        row = self.boxes[i]
        if not row[0]:
            return None
        nd = len(self.global_shapes[int(self.leaves_of_rows()[i])])
        max_nd = (self.boxes.shape[1] - 1) // 2
        return Box(tuple(int(x) for x in row[1 : 1 + nd]), tuple(int(x) for x in row[1 + max_nd : 1 + max_nd + nd]))


@dataclass(frozen=True, eq=False)
class SavePlan:
    """The coordinator's decision: who writes which piece, and where in its file.

    Attributes:
        keys: every tensor key, sorted; a piece's key is ``keys[key_id]``.
        dtypes / shapes: per key.
        piece_key / piece_offsets / piece_shapes: the distinct pieces (rows), sorted by key
            then offsets.
        piece_writer: global rank that writes each piece.
        piece_leaf: the piece's row in the writer's summary (its leaf, unless the writer holds
            that leaf as several boxes).
        piece_byte_offset: where the piece starts in the writer's file, in bytes.
        writes: global rank -> summary rows it writes, ascending (the order of its file).
        file_bytes: global rank -> size of its data file, in bytes (ranks that write).
        skeleton: the merged structure (placeholders where the coordinator has no value).
        replicas: every holder of a piece writes its copy (``save_replicas``): the pieces of
            a key may repeat a box, on several writers.
    """

    keys: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    piece_key: np.ndarray
    piece_offsets: np.ndarray
    piece_shapes: np.ndarray
    piece_writer: np.ndarray
    piece_leaf: np.ndarray
    piece_nbytes: np.ndarray
    piece_byte_offset: np.ndarray
    writes: dict[int, np.ndarray]
    file_bytes: dict[int, int]
    skeleton: dict = field(default_factory=dict)
    replicas: bool = False

    @property
    def total_bytes(self) -> int:
        return int(self.piece_nbytes.sum())


def layout_offsets(nbytes: Sequence[int] | np.ndarray) -> tuple[np.ndarray, int]:
    """Byte offsets of pieces written back to back, each aligned to ALIGNMENT; and the
    file's size. Writer and coordinator both use it, so offsets need not be sent."""
    sizes = np.asarray(nbytes, dtype=np.int64)
    padded = aligned(sizes)
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64) if len(sizes) else sizes
    total = int(starts[-1] + sizes[-1]) if len(sizes) else 0
    return starts, total


def plan_save(summaries: Sequence[SaveSummary], replicas: bool = False) -> SavePlan:
    """Deduplicate replicated pieces and balance the bytes each rank writes.

    Every distinct (key, box) is written once, by one of the ranks that hold it: pieces held by
    a single rank go to it; the others, largest first, to the holder with the fewest bytes so
    far (ties to the lowest rank). With ``replicas``, every holder writes its own copy instead
    (copies sorted by rank). The result does not depend on the order of ``summaries``.

    Raises:
        MismatchError: ranks disagree on a key's dtype, shape, or kind.
        PlanError: the distinct pieces of a key do not tile it exactly.
    """
    summaries = sorted(summaries, key=lambda s: s.rank)
    # -- distinct layouts: keys, dtypes and shapes checked once per distinct header
    key_info: dict[str, tuple[str, tuple[int, ...], int]] = {}
    layouts: dict[object, tuple[list[str], SaveSummary]] = {}
    skeleton = None
    for s in summaries:
        hid = s.header_id if s.header_id is not None else id(s)
        if hid in layouts:
            continue
        keys = nested.tensor_keys(s.skeleton)
        if len(keys) != len(s.dtypes) or len(keys) != len(s.global_shapes):
            raise PlanError(f"rank {s.rank}: summary lists {len(s.dtypes)} tensors for {len(keys)} leaves")
        layouts[hid] = (keys, s)
        skeleton = s.skeleton if skeleton is None else nested.merge(skeleton, s.skeleton)
        for key, dtype, shape in zip(keys, s.dtypes, s.global_shapes):
            seen = key_info.get(key)
            if seen is None:
                key_info[key] = (dtype, shape, s.rank)
            elif seen[0] != dtype or seen[1] != shape:
                raise MismatchError(
                    f"{key}: rank {seen[2]} holds dtype {seen[0]} shape {seen[1]}, "
                    f"rank {s.rank} holds dtype {dtype} shape {shape}"
                )
    keys_sorted = tuple(sorted(key_info))
    key_id = {k: i for i, k in enumerate(keys_sorted)}
    max_nd = max((len(info[1]) for info in key_info.values()), default=0)
    width = 1 + 2 * max_nd

    # -- one row per held piece: [key_id, offsets(max_nd), shape(max_nd)] + rank, leaf
    layout_ids = {hid: np.array([key_id[k] for k in keys], dtype=np.int64) for hid, (keys, _) in layouts.items()}
    rows, ranks, leaves = [], [], []
    for s in summaries:
        hid = s.header_id if s.header_id is not None else id(s)
        b = s.boxes
        leaf_of_row = _checked_rows(s, len(layout_ids[hid]))
        present = np.flatnonzero(b[:, 0]) if len(b) else np.zeros(0, np.int64)
        if not len(present):
            continue
        block = np.zeros((len(present), width), dtype=np.int64)
        block[:, 0] = layout_ids[hid][leaf_of_row[present]]
        nd = (b.shape[1] - 1) // 2  # the summary's own padding
        block[:, 1 : 1 + nd] = b[present, 1 : 1 + nd]
        block[:, 1 + max_nd : 1 + max_nd + nd] = b[present, 1 + nd : 1 + 2 * nd]
        rows.append(block)
        ranks.append(np.full(len(present), s.rank, dtype=np.int64))
        leaves.append(present.astype(np.int64))
    if rows:
        table = np.concatenate(rows)
        row_rank = np.concatenate(ranks)
        row_leaf = np.concatenate(leaves)
    else:
        table = np.zeros((0, width), np.int64)
        row_rank = row_leaf = np.zeros(0, np.int64)

    # -- distinct pieces, sorted by (key, offsets, shape); rows grouped per piece by rank
    order = np.lexsort((row_rank,) + tuple(table[:, c] for c in reversed(range(width))))
    t_sorted = table[order]
    new_group = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        new_group[1:] = (t_sorted[1:] != t_sorted[:-1]).any(axis=1)
    group_start = np.flatnonzero(new_group)
    uniq = t_sorted[group_start]
    counts = np.diff(np.concatenate([group_start, [len(order)]]))
    holders_rank = row_rank[order]
    holders_leaf = row_leaf[order]

    if replicas:  # every held row is a piece of its own, written by its holder
        uniq, group_start, counts = t_sorted, np.arange(len(order)), np.ones(len(order), dtype=np.int64)
    n = len(uniq)
    p_key = uniq[:, 0] if n else np.zeros(0, np.int64)
    p_off = uniq[:, 1 : 1 + max_nd]
    p_shape = uniq[:, 1 + max_nd :]
    isz = np.array([itemsize(key_info[k][0]) for k in keys_sorted], dtype=np.int64)
    nds = np.array([len(key_info[k][1]) for k in keys_sorted], dtype=np.int64)
    if n:
        masked = np.where(np.arange(max_nd)[None, :] < nds[p_key][:, None], p_shape, 1)
        p_nbytes = np.prod(masked, axis=1, dtype=np.int64) * isz[p_key]
    else:
        p_nbytes = np.zeros(0, np.int64)

    # -- tiling of every key by its distinct pieces
    bounds = np.searchsorted(p_key, np.arange(len(keys_sorted) + 1))
    for k, key in enumerate(keys_sorted):
        nd = int(nds[k])
        lo, hi = bounds[k], bounds[k + 1]
        distinct = np.flatnonzero(new_group[lo:hi]) + lo if replicas else slice(lo, hi)  # copies: one box
        check_tiling(key, key_info[key][1], p_off[distinct, :nd], p_shape[distinct, :nd])

    # -- writers: single holders first, then the rest largest first to the least loaded
    writer_pos = group_start.copy()  # position in the sorted rows of the chosen holder
    all_ranks = np.unique(holders_rank)
    dense_holders = np.searchsorted(all_ranks, holders_rank)
    dense = np.zeros(len(all_ranks), dtype=np.int64)  # bytes each holder writes so far
    single = counts == 1
    np.add.at(dense, dense_holders[group_start[single]], p_nbytes[single])
    multi = np.flatnonzero(~single)
    # largest first; ties broken by (key, offsets), which the sort of uniq already orders
    for u in multi[np.argsort(-p_nbytes[multi], kind="stable")].tolist():
        lo = group_start[u]
        hs = dense_holders[lo : lo + counts[u]]
        j = int(np.argmin(dense[hs]))  # holders are sorted by rank: ties go to the lowest
        dense[hs[j]] += p_nbytes[u]
        writer_pos[u] = lo + j
    p_writer = holders_rank[writer_pos]
    p_leaf = holders_leaf[writer_pos]

    # -- every writer's file: its pieces in leaf order, back to back (as layout_offsets)
    p_byte_offset = np.zeros(n, dtype=np.int64)
    writes: dict[int, np.ndarray] = {}
    file_bytes: dict[int, int] = {}
    if n:
        order = np.lexsort((p_leaf, p_writer))
        w_sorted = p_writer[order]
        first = np.concatenate([[0], np.flatnonzero(np.diff(w_sorted)) + 1])
        padded = aligned(p_nbytes[order])
        starts = np.cumsum(padded) - padded
        group = np.cumsum(np.isin(np.arange(n), first)) - 1  # which writer each row belongs to
        p_byte_offset[order] = starts - starts[first][group]
        last = np.concatenate([first[1:], [n]]) - 1
        ends = p_byte_offset[order][last] + p_nbytes[order][last]
        for r, lo, hi, end in zip(w_sorted[first].tolist(), first.tolist(), (last + 1).tolist(), ends.tolist()):
            writes[r] = p_leaf[order[lo:hi]]
            file_bytes[r] = end
    return SavePlan(
        keys=keys_sorted,
        dtypes=tuple(key_info[k][0] for k in keys_sorted),
        shapes=tuple(key_info[k][1] for k in keys_sorted),
        piece_key=p_key,
        piece_offsets=p_off,
        piece_shapes=p_shape,
        piece_writer=p_writer,
        piece_leaf=p_leaf,
        piece_nbytes=p_nbytes,
        piece_byte_offset=p_byte_offset,
        writes=writes,
        file_bytes=file_bytes,
        skeleton=skeleton if skeleton is not None else {"d": []},
        replicas=replicas,
    )


def _checked_rows(s: SaveSummary, leaves: int) -> np.ndarray:
    """The leaf of every row of ``s``, checked: each leaf has a run of rows, in order."""
    row_leaf = s.leaves_of_rows()
    steps = np.diff(row_leaf)
    if len(row_leaf) != len(s.boxes) or (
        len(row_leaf) and (row_leaf[0] != 0 or row_leaf[-1] != leaves - 1 or ((steps != 0) & (steps != 1)).any())
    ) or (not len(row_leaf) and leaves):
        raise PlanError(f"rank {s.rank}: summary rows do not map onto its {leaves} leaves")
    return row_leaf




def build_metadata(
    plan: SavePlan,
    checksums: dict[int, np.ndarray],
    structure: dict,
    unique_id: int,
    world_size: int,
    block_bytes: int,
    created_by: str = "",
    generation: int = 0,
) -> Metadata:
    """Assemble the metadata once every writer reported its checksums.

    Args:
        plan: the save plan.
        checksums: writer rank -> uint64 checksums of its pieces, in file order.
        structure: the skeleton with plain values filled in.
    """
    writers = sorted(plan.file_bytes)
    files = tuple(FileEntry(data_file_name(r, unique_id, generation), plan.file_bytes[r]) for r in writers)
    n = len(plan.piece_key)
    nblocks = blocks_of(plan.piece_nbytes, block_bytes) if n else np.zeros(0, np.int64)
    # reports arrive writer by writer, each in leaf (= file) order: where each piece's
    # checksums start in their concatenation
    order = np.lexsort((plan.piece_leaf, plan.piece_writer))
    start_in_report = np.zeros(n, dtype=np.int64)
    start_in_report[order] = np.cumsum(nblocks[order]) - nblocks[order]
    expected = np.zeros(len(writers), dtype=np.int64)
    np.add.at(expected, np.searchsorted(writers, plan.piece_writer), nblocks)
    for r, want in zip(writers, expected.tolist()):
        got = len(checksums.get(r, ()))
        if got != want:
            raise PlanError(f"rank {r} reported {got} checksums, expected {want}")
    all_sums = (
        np.concatenate([np.asarray(checksums[r], dtype=np.uint64) for r in writers]) if writers else np.zeros(0, np.uint64)
    )
    piece_file = np.searchsorted(writers, plan.piece_writer).astype(np.int64)
    bounds = np.searchsorted(plan.piece_key, np.arange(len(plan.keys) + 1))
    tensors = {}
    for k, key in enumerate(plan.keys):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        nd = len(plan.shapes[k])
        nb = nblocks[lo:hi]
        total = int(nb.sum())
        idx = np.repeat(start_in_report[lo:hi] - np.concatenate([[0], np.cumsum(nb)[:-1]]), nb) + np.arange(total)
        table = PieceTable(
            offsets=np.ascontiguousarray(plan.piece_offsets[lo:hi, :nd]),
            shapes=np.ascontiguousarray(plan.piece_shapes[lo:hi, :nd]),
            files=piece_file[lo:hi],
            byte_offsets=plan.piece_byte_offset[lo:hi].copy(),
            checksums=all_sums[idx] if total else np.zeros(0, np.uint64),
        )
        tensors[key] = TensorEntry(key, plan.dtypes[k], plan.shapes[k], table, block_bytes)
    return Metadata(
        unique_id=unique_id,
        world_size=world_size,
        files=files,
        tensors=tensors,
        structure=structure,
        block_bytes=block_bytes,
        created_by=created_by,
        replicas=plan.replicas,
    )


# ====================================================================== load
@dataclass(frozen=True)
class TargetPiece:
    """What one rank must fill of one tensor: its local piece, in global coordinates."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True)
class Copy:
    """Copy ``region_in_saved`` of a saved piece into ``region_in_target`` of target ``target``."""

    target: int
    region_in_saved: Box
    region_in_target: Box


@dataclass(frozen=True)
class Segment:
    """The bytes [start, stop) of one saved piece inside a read: whole checksum blocks."""

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
    lo = np.maximum(p.offsets, np.asarray(box.offsets, dtype=np.int64))
    hi = np.minimum(p.offsets + p.shapes, np.asarray(box.end, dtype=np.int64))
    return np.flatnonzero((hi > lo).all(axis=1))


def pick_replicas(entry: TensorEntry, rows: np.ndarray, readable: np.ndarray | None = None) -> np.ndarray:
    """One copy of every distinct box among the pieces ``rows``: the lowest row in a file with
    ``readable[file]`` true, else the lowest row. Boxes that only overlap stay (and fail the
    overlap check as usual)."""
    if len(rows) < 2:
        return rows
    p = entry.pieces
    boxes = np.concatenate([p.offsets[rows], p.shapes[rows]], axis=1)
    far = np.zeros(len(rows), dtype=bool) if readable is None else ~np.asarray(readable, dtype=bool)[p.files[rows]]
    order = np.lexsort((rows, far) + tuple(boxes[:, c] for c in reversed(range(boxes.shape[1]))))
    b = boxes[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (b[1:] != b[:-1]).any(axis=1)
    return np.sort(rows[order[first]])


def _check_disjoint(entry: TensorEntry, box: Box, rows: np.ndarray) -> None:
    """Raise PlanError when two of the pieces ``rows`` overlap inside ``box``. With their
    volumes inside the box adding up to the box's, this proves they cover it exactly, whether
    or not the whole tensor's tiling was checked (lazily parsed metadata)."""
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
    for a in range(len(rows) - 1):
        both = (np.maximum(lo[a], lo[a + 1 :]) < np.minimum(hi[a], hi[a + 1 :])).all(axis=1)
        if both.any():
            b = a + 1 + int(np.flatnonzero(both)[0])
            raise PlanError(
                f"{entry.key}: saved pieces at offsets {tuple(p.offsets[rows[a]].tolist())} and "
                f"{tuple(p.offsets[rows[b]].tolist())} overlap"
            )


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
    blocks of that piece; a segment larger than ``max_read_bytes`` is cut along the region's
    outer dims; neighbouring segments of one file less than ``coalesce_gap`` bytes apart are
    merged into one read of at most ``max_read_bytes`` (many small pieces, one syscall);
    exact segments of at least ``direct_min_bytes`` stay alone so they can land in place.
    Copies name target ``i`` by ``slots[i]`` when given (the caller's own numbering), else by i.
    Of a piece saved in several copies (``meta.replicas``), one is read: the first in a file
    this rank can read (``readable[file]``), else the first.

    Raises:
        MismatchError: a target's shape or dtype differs from the checkpoint's.
        PlanError: the checkpoint's pieces do not cover a target exactly.
    """
    check_targets(meta, targets)
    block = meta.block_bytes
    max_read_bytes = max(max_read_bytes, 2 * block + 64)
    if slots is not None and len(slots) != len(targets):
        raise ValueError(f"{len(slots)} slots for {len(targets)} targets")
    segments: list[tuple[int, int, int, Segment, bool, bool]] = []
    starts_cache: dict[str, np.ndarray] = {}
    for ti, t in enumerate(targets):
        slot = ti if slots is None else slots[ti]
        entry = meta.tensors[t.key]
        tbox = t.box
        if 0 in tbox.shape:  # an empty target reads nothing
            continue
        isz = entry.itemsize
        starts = starts_cache.get(t.key)
        if starts is None:
            starts = starts_cache[t.key] = entry.block_starts()
        hits = overlapping_pieces(entry, tbox)
        if meta.replicas:
            hits = pick_replicas(entry, hits, readable)
        if len(hits) == 1:
            piece = entry.piece(int(hits[0]), starts)
            if piece.box == tbox and piece.nbytes <= max_read_bytes - 2 * block:
                # the target is exactly one saved piece (a load into the layout that saved, or
                # a scalar): one exact segment, no arithmetic on regions
                whole = Box((0,) * tbox.ndim, tbox.shape)
                seg = Segment(piece, piece.byte_offset, piece.byte_offset + piece.nbytes, (Copy(slot, whole, whole),))
                segments.append((piece.file, seg.start, seg.stop, seg, True, piece.nbytes >= direct_min_bytes))
                continue
        _check_disjoint(entry, tbox, hits)
        max_elems = max(1, (max_read_bytes - 2 * block) // isz)
        t_strides = c_strides(tbox.shape)
        covered = 0
        for i in hits.tolist():
            piece = entry.piece(i, starts)
            pbox = piece.box
            overlap = pbox.intersect(tbox)
            if overlap is None:
                continue
            covered += overlap.volume
            in_saved = overlap.relative_to(pbox)
            in_target = overlap.relative_to(tbox)
            p_strides = c_strides(pbox.shape)
            first, stop = strided_span(in_saved.offsets, in_saved.shape, p_strides)
            if stop - first <= max_elems:
                parts = [(in_saved, in_target, first, stop)]
            else:  # cut along the outer dims into reads of at most max_read_bytes
                parts = []
                for part in split_region(in_saved, max_elems, pbox.shape):
                    shift = tuple(map(sub, part.offsets, in_saved.offsets))
                    part_in_target = Box(tuple(map(add, in_target.offsets, shift)), part.shape)
                    parts.append((part, part_in_target, *strided_span(part.offsets, part.shape, p_strides)))
            for part, part_in_target, first, stop in parts:
                b0 = (first * isz) // block * block
                b1 = min(-(-(stop * isz) // block) * block, piece.nbytes)
                seg = Segment(
                    piece=piece,
                    start=piece.byte_offset + b0,
                    stop=piece.byte_offset + b1,
                    copies=(Copy(slot, part, part_in_target),),
                )
                exact = b0 == first * isz and b1 == stop * isz and stop - first == part.volume
                if exact:
                    t_first, t_stop = strided_span(part_in_target.offsets, part.shape, t_strides)
                    exact = t_stop - t_first == part.volume
                alone = exact and (b1 - b0) >= direct_min_bytes
                segments.append((piece.file, seg.start, seg.stop, seg, exact, alone))
        if covered != tbox.volume:
            raise PlanError(
                f"{t.key}: the checkpoint's pieces cover {covered} of the {tbox.volume} elements "
                f"of the target box {tbox}"
            )
    segments.sort(key=lambda s: (s[0], s[1]))
    ops: list[ReadOp] = []
    group: list[tuple[int, int, int, Segment, bool, bool]] = []

    def flush():
        if not group:
            return
        f, start = group[0][0], group[0][1]
        stop = max(g[2] for g in group)
        direct = len(group) == 1 and group[0][4]
        ops.append(ReadOp(f, start, stop, tuple(g[3] for g in group), direct))
        group.clear()

    for item in segments:
        if group:
            f0, start0 = group[0][0], group[0][1]
            stop0 = max(g[2] for g in group)
            if (
                item[0] != f0
                or item[1] > stop0 + coalesce_gap
                or item[1] < stop0  # two targets reading the same blocks: keep them apart
                or max(stop0, item[2]) - start0 > max_read_bytes
                or group[0][5]
                or item[5]
            ):
                flush()
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
    k = np.arange(len(piece_of)) - np.repeat(np.cumsum(nblocks) - nblocks, nblocks)
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


# ====================================================================== keys
def mw_compatible_name(key: str) -> str | None:
    """The other spelling of an optimizer master weight's key, as paddle.distributed's
    ``mw_name_compatibility`` maps them: ``opt.master_weights.w`` <-> ``opt.w_fp32_master_0``."""
    parts = key.split(".")
    if "master_weights" in parts:
        parts.remove("master_weights")
        return ".".join(parts) + "_fp32_master_0"
    if parts[-1].endswith("_fp32_master_0"):
        parts[-1] = parts[-1][: -len("_fp32_master_0")]
        parts.insert(1, "master_weights")
        return ".".join(parts)
    return None


@dataclass(frozen=True)
class KeyMatch:
    """How a state dict's keys meet a checkpoint's.

    Attributes:
        source: state-dict key -> checkpoint key to load it from.
        missing: state-dict keys the checkpoint lacks (left untouched).
        unexpected: checkpoint keys the state dict lacks (not loaded).
    """

    source: dict[str, str]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def match_keys(wanted: Sequence[str], available: Sequence[str], mw_name_compatibility: bool = True) -> KeyMatch:
    """Pair state-dict keys with checkpoint keys, trying the master-weight spelling of a key
    the checkpoint lacks when ``mw_name_compatibility`` is on."""
    have = set(available)
    source, missing = {}, []
    for key in wanted:
        if key in have:
            source[key] = key
            continue
        alt = mw_compatible_name(key) if mw_name_compatibility else None
        if alt is not None and alt in have:
            source[key] = alt
        else:
            missing.append(key)
    used = set(source.values())
    unexpected = tuple(k for k in available if k not in used)
    return KeyMatch(source, tuple(missing), unexpected)


def restrict(
    meta: Metadata, targets: Sequence[TargetPiece], tensor_keys: Sequence[str] = (), plain: Sequence[tuple] = ()
) -> Metadata:
    """The part of ``meta`` a rank with these targets needs: the pieces that overlap them
    (with their checksums and files), the plain subtrees at the paths ``plain``, and, with no pieces, the
    tensors of ``tensor_keys`` it holds nothing of (so it knows the checkpoint has them). Its
    size grows with that rank's pieces, not with the job; sent to ranks that cannot read the
    metadata file.

    Raises:
        MismatchError: a target's shape or dtype differs from the checkpoint's.
    """
    check_targets(meta, targets)
    # tensors the rank has keys for but holds nothing of stay listed (with no pieces), so it
    # knows they exist in the checkpoint
    rows: dict[str, set[int]] = {k: set() for k in tensor_keys if k in meta.tensors}
    for t in targets:
        entry = meta.tensors[t.key]
        hit = overlapping_pieces(entry, t.box) if t.box.volume or t.box.ndim == 0 else np.zeros(0, np.int64)
        rows.setdefault(t.key, set()).update(hit.tolist())
    used_files = sorted({int(meta.tensors[k].pieces.files[i]) for k, idx in rows.items() for i in idx})
    new_index = {f: i for i, f in enumerate(used_files)}
    tensors = {}
    for key, idx in rows.items():
        entry = meta.tensors[key]
        sel = np.array(sorted(idx), dtype=np.int64)
        starts = entry.block_starts()
        blocks = (
            np.concatenate([np.arange(starts[i], starts[i + 1]) for i in sel]) if len(sel) else np.zeros(0, np.int64)
        )
        p = entry.pieces
        table = PieceTable(
            offsets=p.offsets[sel],
            shapes=p.shapes[sel],
            files=np.array([new_index[int(f)] for f in p.files[sel]], dtype=np.int64),
            byte_offsets=p.byte_offsets[sel],
            checksums=p.checksums[blocks],
        )
        tensors[key] = TensorEntry(key, entry.dtype, entry.shape, table, entry.block_bytes)
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


@dataclass(frozen=True)
class Reconciled:
    """How a state dict meets a checkpoint (see :func:`reconcile`).

    Attributes:
        match: the tensors' pairing.
        missing: state-dict keys (tensors and plain values) the checkpoint lacks.
        unexpected: checkpoint keys the state dict lacks (not loaded).
        plain: the checkpoint's subtrees without tensors that a load puts into the state dict
            whole, as (path, skeleton node).
    """

    match: KeyMatch
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    plain: tuple[tuple[tuple, dict], ...]


def reconcile(
    tensor_keys: Sequence[str],
    skeleton: dict,
    saved_tensors: Sequence[str],
    saved_structure: dict,
    mw_name_compatibility: bool = True,
    where: str = "checkpoint",
) -> Reconciled:
    """How a state dict (its tensors' flat keys and its skeleton) meets a checkpoint's tensors
    and structure. Tensors pair by key (master-weight spelling too). Each largest subtree of
    the checkpoint that holds no tensor is restored whole where the state dict has that path and
    holds no tensor there, whatever it holds (a list of another length, None, a dict); a plain
    value of the state dict inside no such subtree is missing.

    Raises:
        MismatchError: a key that is a tensor on one side and a plain value on the other.
    """
    match = match_keys(list(tensor_keys), list(saved_tensors), mw_name_compatibility)
    saved_nodes = nested.node_paths(saved_structure)
    holds_tensor = {nested.flat_key(path): holds for path, holds in saved_nodes.items() if path}
    for key in match.missing:
        if not holds_tensor.get(key, True):
            raise MismatchError(f"{key}: the {where} holds a plain value here, the state_dict a tensor")
    target_nodes = nested.node_paths(skeleton)
    tensors = set(saved_tensors)
    plain, unexpected, restored = [], [], set()
    for path, node in nested.plain_subtrees(saved_structure):
        if path not in target_nodes:
            unexpected.append(nested.flat_key(path))
        elif not target_nodes[path]:
            plain.append((path, node))
            restored.add(path)
    missing = list(match.missing)
    for path, tag, _ in nested.walk(skeleton):
        if tag == "t":
            continue
        key = nested.flat_key(path)
        if key in tensors:
            raise MismatchError(f"{key}: the {where} holds a tensor here, the state_dict a plain value")
        if not any(path[:i] in restored for i in range(1, len(path) + 1)):
            missing.append(key)
    return Reconciled(match, tuple(missing), tuple(match.unexpected) + tuple(unexpected), tuple(plain))


def missing_message(missing: Sequence[str], where: str) -> str:
    """The error of a strict load whose state dict has keys the checkpoint lacks."""
    shown = ", ".join(missing[:20])
    more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
    return (
        f"{len(missing)} key(s) of the state_dict are not in {where}: {shown}{more}. A load "
        f"leaves no tensor of a state dict unloaded silently; pass strict=False to leave these "
        f"keys unchanged (with a warning), or check the checkpoint and the key names"
    )
