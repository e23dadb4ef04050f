"""Save plans: a pure function from what every rank holds to who writes which piece where.

Every rank summarises the pieces it holds (:class:`SaveSummary`); the coordinator alone sees
all summaries, writes every distinct piece once (replicas deduplicated), picks the writers so
that bytes written per rank are balanced (:func:`plan_save`), and once the ranks report their
checksums, assembles the metadata (:func:`build_metadata`). Work is vectorised over pieces
with numpy and grows as O(pieces log pieces).
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Tuple

import numpy as np

from . import nested, ragged, sorting
from . import grids
from .boxes import Box, check_tiling
from .compress import Policy
from .grids import GridCheck
from .derive import DERIVED, check_sources
from .dtypes import DTYPE_NAMES, itemsize
from ..errors import MismatchError, PlanError
from .naming import data_file_name
from .metadata import (
    ENCODED_VERSION, FORMAT_VERSION, ColumnTensors, FileEntry, Metadata, TensorColumns, aligned, blocks_of, stored_nbytes,
)


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
        outline / keys: its skeleton as :func:`~paddle_dcp.core.nested.runs_of` takes it
            apart (runs of tensor leaves, and the tensor keys depth first); plain values only in
            the coordinator's own.
        dtype_codes: (leaves,) int64, each tensor leaf's dtype, an index into ``DTYPE_NAMES``.
        shapes / ndims: (leaves, width) int64 global shapes, zero-padded, and their ranks.
        boxes: (rows, 1 + 2 * max_ndim) int64 (or, decoded into a coordinator's table of
            every rank's rows, int32 when every value fits) rows ``[present, offsets, shape]``, offsets
            and shape each padded with zeros to the summary's largest rank; one row per leaf,
            or several for a leaf held as several boxes (a flattened ShardedWeight).
        row_leaf: (rows,) int64, the leaf of every row, ascending; None when row i is leaf i.
        header_id: equal for summaries whose skeleton, dtypes and shapes are equal (lets the
            coordinator parse and check each distinct layout once).
        derived: (master weight key, parameter key) of every tensor the rank found to derive
            (:func:`paddle_dcp.core.derive.find_sources`), sorted.
    """

    rank: int
    outline: dict
    keys: tuple[str, ...]
    dtype_codes: np.ndarray
    shapes: np.ndarray
    ndims: np.ndarray
    boxes: np.ndarray
    header_id: object = None
    row_leaf: np.ndarray | None = None
    derived: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(
        cls, rank: int, skeleton: dict, dtypes: Sequence[str], global_shapes: Sequence[Sequence[int]], boxes: np.ndarray,
        header_id: object = None, row_leaf: np.ndarray | None = None, derived: tuple[tuple[str, str], ...] = (),
    ) -> "SaveSummary":
        """From a skeleton and its leaves' dtypes and global shapes."""
        outline, keys = nested.runs_of(skeleton)
        width = max((len(g) for g in global_shapes), default=0)
        shapes = np.zeros((len(global_shapes), width), dtype=np.int64)
        for i, g in enumerate(global_shapes):
            shapes[i, : len(g)] = g
        codes = np.array([DTYPE_NAMES.index(d) for d in dtypes], dtype=np.int64)
        ndims = np.array([len(g) for g in global_shapes], dtype=np.int64)
        return cls(rank, outline, tuple(keys), codes, shapes, ndims, boxes, header_id, row_leaf, derived)

    @classmethod
    def from_pieces(
        cls, rank: int, skeleton: dict, pieces: Sequence[LocalPiece], derived: Mapping[str, str] | None = None
    ) -> "SaveSummary":
        """From the pieces in the skeleton's tensor order: one per leaf, or a run of several of
        one key (a leaf held as several boxes); ``derived``: master weight -> parameter key."""
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
        return cls.of(rank, skeleton, [p.dtype for p in firsts], [tuple(p.global_shape) for p in firsts], boxes,
                      row_leaf=row_leaf, derived=tuple(sorted((derived or {}).items())))

    @property
    def skeleton(self) -> dict:
        """The skeleton, put back together (what a rank that asks a helper for its part sent)."""
        return nested.from_runs(self.outline, self.keys)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(DTYPE_NAMES[c] for c in self.dtype_codes.tolist())

    @property
    def global_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(row[:n]) for row, n in zip(self.shapes.tolist(), self.ndims.tolist()))

    def leaves_of_rows(self) -> np.ndarray:
        """(rows,) the leaf of every row."""
        return np.arange(len(self.boxes), dtype=np.int64) if self.row_leaf is None else self.row_leaf

    def piece_box(self, i: int) -> Box | None:
        """The box of row ``i`` (None: the rank holds nothing there)."""
        row = self.boxes[i]
        if not row[0]:
            return None
        nd = int(self.ndims[int(self.leaves_of_rows()[i])])
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
        encodings: per key, the encoding its pieces are stored in (None: raw bytes;
            ``"derived"``: none are stored).
        sources: per key, the key a derived tensor is read from (None for the others).
        piece_writer: global rank that writes each piece.
        piece_leaf: the piece's row in the writer's summary (its leaf, unless the writer holds
            that leaf as several boxes).
        piece_nbytes: the piece's stored bytes.
        piece_byte_offset: where the piece starts in the writer's file, in bytes.
        writes: global rank -> summary rows it writes, ascending (the order of its file).
        file_bytes: global rank -> size of its data file, in bytes (ranks that write).
        skeleton: the merged structure (placeholders where the coordinator has no value).
        replicas: every holder of a piece writes its copy (``save_replicas``): the pieces of
            a key may repeat a box, on several writers.
        grids: which keys' pieces are exactly the cells of their cuts, and the cuts
            (:mod:`~paddle_dcp.core.grids`; None with ``replicas``).
        static: what this plan's saves share, kept by what builds their metadata (the places
            of the skeleton's plain values) and by its writer (:mod:`~paddle_dcp.core.metafile_write`).
        file_order: the pieces in the order the writers report their checksums (by writer,
            each in its file's order); None: sorted when the metadata is built.
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
    encodings: tuple[str | None, ...] = ()
    sources: tuple[str | None, ...] = ()
    grids: GridCheck | None = None
    static: dict = field(default_factory=dict)
    file_order: np.ndarray | None = None

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


def plan_save(summaries: Sequence[SaveSummary], replicas: bool = False, compress: Policy | None = None) -> SavePlan:
    """Deduplicate replicated pieces and balance the bytes each rank writes.

    Every distinct (key, box) is written once, by one of the ranks that hold it: pieces held by
    a single rank go to it; the others, largest first, to the holder with the fewest bytes so
    far (ties to the lowest rank). With ``replicas``, every holder writes its own copy instead
    (copies sorted by rank). The result does not depend on the order of ``summaries``. The
    keys ``compress`` names are stored in its encodings: their pieces' stored sizes; the keys it
    derives are not stored at all (no pieces), their parameters as the ranks found them.

    Raises:
        MismatchError: ranks disagree on a key's dtype, shape, or kind, or on the parameter of
            a key to derive (:func:`paddle_dcp.core.derive.check_sources`).
        PlanError: the distinct pieces of a key do not tile it exactly.
    """
    summaries = sorted(summaries, key=lambda s: s.rank)
    known, layout_ids, layouts, skeleton = _distinct_layouts(summaries)
    keys_sorted = known.keys
    dtypes = tuple(DTYPE_NAMES[c] for c in known.dtype_codes.tolist())
    key_id = {k: i for i, k in enumerate(keys_sorted)}
    max_nd = int(known.ndims.max()) if len(keys_sorted) else 0
    key, table, row_rank, row_leaf = _held_rows(summaries, layout_ids, max_nd)
    encodings = tuple(compress.encoding_of(k, d) if compress else None for k, d in zip(keys_sorted, dtypes))
    derived = [k for k, e in zip(keys_sorted, encodings) if e == DERIVED]
    # ranks with one header found the same (layouts: one summary of each distinct header)
    sources = check_sources(((s.rank, dict(s.derived)) for s in layouts.values()), known.info(), derived) if derived else {}
    if derived:  # their pieces are not written: the plan has none
        keep = ~np.isin(key, [key_id[k] for k in derived])
        key, table, row_rank, row_leaf = key[keep], table[keep], row_rank[keep], row_leaf[keep]
    pieces = _distinct_pieces(key, table, row_rank, row_leaf, max_nd, replicas)
    del key, table, row_rank, row_leaf  # every held row: the largest arrays of the plan
    p_key, p_shape = pieces.uniq[:, 0], pieces.uniq[:, 1 + max_nd :]
    p_nbytes = _piece_nbytes(p_key, p_shape, known.ndims, list(zip(dtypes, encodings)))
    grid = _check_tilings(known, pieces, max_nd, replicas, set(derived))
    p_writer, p_leaf = _pick_writers(pieces, p_nbytes)
    p_byte_offset, writes, file_bytes, file_order = _file_layouts(p_writer, p_leaf, p_nbytes)
    return SavePlan(
        keys=keys_sorted,
        dtypes=dtypes,
        shapes=tuple(map(tuple, (row[:n] for row, n in zip(known.shapes.tolist(), known.ndims.tolist())))),
        piece_key=p_key,
        piece_offsets=pieces.uniq[:, 1 : 1 + max_nd],
        piece_shapes=p_shape,
        piece_writer=p_writer,
        piece_leaf=p_leaf,
        piece_nbytes=p_nbytes,
        piece_byte_offset=p_byte_offset,
        writes=writes,
        file_bytes=file_bytes,
        skeleton=skeleton,
        replicas=replicas,
        encodings=encodings,
        sources=tuple(sources.get(k) for k in keys_sorted),
        grids=grid,
        file_order=file_order,
    )


@dataclass(frozen=True, eq=False)
class DistinctPieces:
    """Every distinct piece of a state dict spread over ranks, and the ranks that hold it:
    what a policy other than :func:`plan_save`'s picks its senders from (a gathered save's,
    :func:`paddle_dcp.parallel.gather_plan.plan_gather`). Made by :func:`distinct_pieces`, with
    the checks of a save's plan: the ranks agree on every key's dtype and shape, and each key's
    distinct pieces tile it.

    Attributes:
        keys / dtypes / shapes: every key, sorted, with its dtype and global shape.
        piece_key: (pieces,) each piece's key (an index into ``keys``); pieces sorted by key,
            then offsets.
        offsets / extents: (pieces, max_nd) each piece's box, zero-padded past its key's ndim.
        holder_start / holder_count: where each piece's holders start in ``holders``, how many.
        holders: the holding ranks of every piece, ascending, piece after piece.
    """

    keys: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    piece_key: np.ndarray
    offsets: np.ndarray
    extents: np.ndarray
    holder_start: np.ndarray
    holder_count: np.ndarray
    holders: np.ndarray

    def position(self, key: str) -> int:
        """The index of ``key`` in ``keys`` (KeyError when no rank holds it)."""
        k = bisect.bisect_left(self.keys, key)
        if k == len(self.keys) or self.keys[k] != key:
            raise KeyError(key)
        return k

    def of(self, k: int) -> list[tuple[Box, list[int]]]:
        """Key ``k``'s pieces, by offsets: (box, its holders)."""
        lo, hi = np.searchsorted(self.piece_key, [k, k + 1]).tolist()
        nd = len(self.shapes[k])
        return [
            (Box(tuple(self.offsets[i, :nd].tolist()), tuple(self.extents[i, :nd].tolist())),
             self.holders[self.holder_start[i] : self.holder_start[i] + self.holder_count[i]].tolist())
            for i in range(lo, hi)
        ]


def distinct_pieces(summaries: Sequence[SaveSummary]) -> DistinctPieces:
    """The distinct pieces of ``summaries`` and their holders, found and checked as
    :func:`plan_save` finds and checks them (it is the same code).

    Raises:
        MismatchError: ranks disagree on a key's dtype, shape, or kind.
        PlanError: the distinct pieces of a key do not tile it exactly.
    """
    summaries = sorted(summaries, key=lambda s: s.rank)
    known, layout_ids, _, _ = _distinct_layouts(summaries)
    max_nd = int(known.ndims.max()) if len(known.keys) else 0
    pieces = _distinct_pieces(*_held_rows(summaries, layout_ids, max_nd), max_nd, False)
    _check_tilings(known, pieces, max_nd, False)
    return DistinctPieces(
        keys=known.keys,
        dtypes=tuple(DTYPE_NAMES[c] for c in known.dtype_codes.tolist()),
        shapes=tuple(known.shape(k) for k in range(len(known.keys))),
        piece_key=pieces.uniq[:, 0],
        offsets=pieces.uniq[:, 1 : 1 + max_nd],
        extents=pieces.uniq[:, 1 + max_nd :],
        holder_start=pieces.group_start,
        holder_count=pieces.counts,
        holders=pieces.row_rank[pieces.order].astype(np.int64),
    )


def gather_senders(distinct: DistinctPieces, keys: Sequence[str], root: int) -> dict[str, list[tuple[int, Box]]]:
    """A gathered save's holder policy over the distinct pieces (where :func:`plan_save`'s is
    the writers'): one sender per piece of each of ``keys``, in that order, the gathering rank
    ``root`` when it holds the piece, else the holder that has sent the fewest elements so far
    (the lowest rank on a tie)."""
    sent: dict[int, int] = {}
    chosen: dict[str, list[tuple[int, Box]]] = {}
    for key in keys:
        out = []
        for box, who in distinct.of(distinct.position(key)):
            r = root if root in who else min(who, key=lambda x: (sent.get(x, 0), x))
            if r != root:
                sent[r] = sent.get(r, 0) + box.volume
            out.append((r, box))
        chosen[key] = out
    return chosen


def _piece_nbytes(p_key: np.ndarray, p_shape: np.ndarray, nds: np.ndarray, stored: Sequence[tuple]) -> np.ndarray:
    """Stored bytes of every piece (rows of ``p_shape``, padded to the largest rank), its
    key's (dtype, encoding) in ``stored``."""
    if not len(p_key):
        return np.zeros(0, np.int64)
    nd = nds[p_key]
    elements = np.ones(len(p_key), dtype=np.int64)
    for c in range(p_shape.shape[1]):  # a column at a time: no (pieces, width) temporary
        elements *= np.where(nd > c, p_shape[:, c], 1)
    nbytes = elements * np.array([itemsize(dtype) for dtype, _ in stored], dtype=np.int64)[p_key]
    for k, (dtype, encoding) in enumerate(stored):
        if encoding is not None:  # pieces are sorted by key: one slice each
            lo, hi = np.searchsorted(p_key, [k, k + 1]).tolist()
            nbytes[lo:hi] = stored_nbytes(elements[lo:hi], dtype, encoding)
    return nbytes


_KeyInfo = Mapping[str, Tuple[str, Tuple[int, ...], int]]  # key -> (dtype, shape, first rank)


@dataclass(frozen=True, eq=False)
class _Keys:
    """Every key of a save, sorted, and what the ranks agree it is.

    Attributes:
        keys: sorted.
        dtype_codes / ndims / shapes: per key (shapes zero-padded to the largest rank).
        first_rank: per key, the lowest rank that holds it.
    """

    keys: tuple[str, ...]
    dtype_codes: np.ndarray
    ndims: np.ndarray
    shapes: np.ndarray
    first_rank: np.ndarray

    def dtype(self, k: int) -> str:
        return DTYPE_NAMES[int(self.dtype_codes[k])]

    def shape(self, k: int) -> tuple[int, ...]:
        return tuple(self.shapes[k, : self.ndims[k]].tolist())

    def info(self) -> _KeyInfo:
        """key -> (dtype, shape, first rank), made when asked (a save that derives tensors)."""
        return {key: (self.dtype(k), self.shape(k), int(self.first_rank[k])) for k, key in enumerate(self.keys)}


def _distinct_layouts(
    summaries: Sequence[SaveSummary],
) -> tuple[_Keys, dict[object, np.ndarray], dict[object, SaveSummary], dict]:
    """Keys, dtypes and shapes checked together, each distinct header's once, and the
    skeletons' union: (the keys, header -> the sorted position of each of its keys, header ->
    a summary of it, the merged skeleton). A header costs its outline's nodes and, per key, a
    dict lookup; the ranks' agreement on every key's dtype and shape is one numpy pass."""
    index: dict[str, int] = {}
    layouts: dict[object, SaveSummary] = {}
    first_ids: dict[object, np.ndarray] = {}
    union = nested.SkeletonUnion()
    for s in summaries:
        hid = s.header_id if s.header_id is not None else id(s)
        if hid in layouts:
            continue
        if len(s.keys) != len(s.dtype_codes) or len(s.keys) != len(s.shapes):
            raise PlanError(f"rank {s.rank}: summary lists {len(s.dtype_codes)} tensors for {len(s.keys)} leaves")
        union.add(s.outline, s.keys)
        setdefault = index.setdefault
        first_ids[hid] = np.array([setdefault(k, len(index)) for k in s.keys], dtype=np.int64)
        layouts[hid] = s
    keys = _agreed_keys(index, layouts, first_ids)
    order = np.array([index[k] for k in keys.keys], dtype=np.int64)
    remap = np.empty(len(index), dtype=np.int64)
    remap[order] = np.arange(len(order))
    return keys, {hid: remap[ids] for hid, ids in first_ids.items()}, layouts, union.result()


def _agreed_keys(index: dict[str, int], layouts: dict[object, SaveSummary], ids: dict[object, np.ndarray]) -> _Keys:
    """Every key, sorted, with its dtype and shape, which every rank must agree on (else a
    MismatchError naming the key, both ranks and both sides)."""
    summaries = list(layouts.values())
    width = max((s.shapes.shape[1] for s in summaries), default=0)
    all_ids = np.concatenate([ids[h] for h in layouts]) if layouts else np.zeros(0, np.int64)
    codes = np.concatenate([s.dtype_codes for s in summaries]) if summaries else np.zeros(0, np.int64)
    ndims = np.concatenate([s.ndims for s in summaries]) if summaries else np.zeros(0, np.int64)
    shapes = np.concatenate([np.pad(s.shapes, ((0, 0), (0, width - s.shapes.shape[1]))) for s in summaries]) \
        if summaries else np.zeros((0, width), np.int64)
    ranks = np.concatenate([np.full(len(s.keys), s.rank, np.int64) for s in summaries]) if summaries else np.zeros(0, np.int64)
    first = np.full(len(index), -1, dtype=np.int64)
    first[all_ids[::-1]] = np.arange(len(all_ids))[::-1]  # (layouts in rank order) each key's first holder
    f = first[all_ids]
    bad = np.flatnonzero((codes != codes[f]) | (ndims != ndims[f]) | (shapes != shapes[f]).any(axis=1))
    if len(bad):
        i, j = int(f[bad[0]]), int(bad[0])
        key = next(k for k, v in index.items() if v == int(all_ids[j]))
        shape = lambda r: tuple(shapes[r, : ndims[r]].tolist())  # noqa: E731
        raise MismatchError(
            f"{key}: rank {int(ranks[i])} holds dtype {DTYPE_NAMES[codes[i]]} shape {shape(i)}, "
            f"rank {int(ranks[j])} holds dtype {DTYPE_NAMES[codes[j]]} shape {shape(j)}"
        )
    keys_sorted = tuple(sorted(index))
    at = first[np.array([index[k] for k in keys_sorted], dtype=np.int64)] if keys_sorted else np.zeros(0, np.int64)
    return _Keys(keys_sorted, codes[at], ndims[at], shapes[at], ranks[at])


def _held_rows(
    summaries: Sequence[SaveSummary], layout_ids: dict[object, np.ndarray], max_nd: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One row per held piece: its key id; its box row ``[present, offsets(max_nd),
    shape(max_nd)]``; the rank holding it and its row in that rank's summary (every summary's
    rows at once, not copied when every row holds a piece and they lie in one table)."""
    if not summaries:
        return np.zeros(0, np.int64), np.zeros((0, 1 + 2 * max_nd), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    hids = [s.header_id if s.header_id is not None else id(s) for s in summaries]
    counts = np.array([len(s.boxes) for s in summaries], dtype=np.int64)
    _check_rows(summaries, counts, np.array([len(layout_ids[h]) for h in hids], dtype=np.int64))
    # keys, ranks and rows as int32 when they fit (always, but for absurd ranks): the three
    # columns as long as every held row take half the memory
    keys = max((int(ids.max()) + 1 for ids in layout_ids.values() if len(ids)), default=0)
    small = np.int32 if max(summaries[-1].rank, int(counts.max()), keys) < 2**31 else np.int64
    total = int(counts.sum())
    rows = np.arange(total, dtype=small)
    np.subtract(rows, np.repeat((np.cumsum(counts) - counts).astype(small), counts), out=rows)
    key = np.concatenate([layout_ids[h] if s.row_leaf is None else layout_ids[h][s.row_leaf]
                          for s, h in zip(summaries, hids)], dtype=small, casting="unsafe")
    table = _padded_boxes(summaries, total, max_nd)
    held = table[:, 0] != 0
    ranks = np.repeat(np.array([s.rank for s in summaries], dtype=small), counts)
    if held.all():
        return key, table, ranks, rows
    return key[held], table[held], ranks[held], rows[held]


def _padded_boxes(summaries: Sequence[SaveSummary], total: int, max_nd: int) -> np.ndarray:
    """Every summary's box rows ``[present, offsets, shape]`` end to end, padded to ``max_nd``
    (int32 values kept so when every summary's are: they are widened piece by piece, in
    :func:`_distinct_pieces`)."""
    width = 1 + 2 * max_nd
    held = [s.boxes for s in summaries if len(s.boxes)]
    if all(b.shape[1] == width for b in held):
        narrow = held and all(b.dtype == np.int32 for b in held)
        return ragged.joined(held).astype(np.int32 if narrow else np.int64, copy=False) if held \
            else np.zeros((0, width), np.int64)
    table = np.zeros((total, width), dtype=np.int64)
    p0 = 0
    for b in held:
        nd = (b.shape[1] - 1) // 2
        table[p0 : p0 + len(b), : 1 + nd] = b[:, : 1 + nd]
        table[p0 : p0 + len(b), 1 + max_nd : 1 + max_nd + nd] = b[:, 1 + nd :]
        p0 += len(b)
    return table


@dataclass(frozen=True, eq=False)
class _Pieces:
    """The distinct pieces, sorted by (key, offsets, shape), and their holders.

    Attributes:
        uniq: (pieces, 1 + 2 * max_nd) rows ``[key_id, offsets, shape]``.
        group_start / counts: where each piece's holders start in the sorted rows, how many.
        new_group: per sorted row, true where a distinct box starts.
        order: per sorted row, its held row (sorted rows: the held rows grouped by piece,
            each group by rank).
        row_rank / row_leaf: per held row, its holder and its row in the holder's summary.
    """

    uniq: np.ndarray
    group_start: np.ndarray
    counts: np.ndarray
    new_group: np.ndarray
    order: np.ndarray
    row_rank: np.ndarray
    row_leaf: np.ndarray


def _distinct_pieces(
    key: np.ndarray, table: np.ndarray, row_rank: np.ndarray, row_leaf: np.ndarray, max_nd: int, replicas: bool
) -> _Pieces:
    """Group the held rows (``key`` ids, ``table`` box rows) by piece, each group by rank; with
    ``replicas`` every held row is a piece of its own, written by its holder."""
    width = 1 + 2 * max_nd
    # the rows come in rank order (_held_rows): a stable sort keeps each piece's holders so;
    # the shape columns, first: a key's offsets usually decide them
    columns = tuple(table[:, c] for c in reversed(range(1, width))) + (key,)
    order, new_group = sorting.groups(columns, dependent=max_nd)
    group_start = np.flatnonzero(new_group)
    counts = np.diff(np.concatenate([group_start, [len(order)]]))
    if replicas:
        group_start, counts = np.arange(len(order)), np.ones(len(order), dtype=np.int64)
    first = order[group_start]
    uniq = np.empty((len(first), width), dtype=np.int64)  # int64 from here on, whatever the table's
    uniq[:, 0] = key[first]
    for c in range(1, width):
        uniq[:, c] = table[first, c]
    return _Pieces(uniq, group_start, counts, new_group, order, row_rank, row_leaf)


def _check_tilings(
    known: _Keys, pieces: _Pieces, max_nd: int, replicas: bool,
    skip: set[str] = frozenset(),  # type: ignore[assignment]
) -> GridCheck | None:
    """Raise PlanError unless the distinct pieces of every key (but those of ``skip``, which
    are not written) tile it exactly. The grids of all keys are checked together
    (:func:`~paddle_dcp.core.grids.find_grids`); a key whose pieces are not its grid is checked
    alone (:func:`~paddle_dcp.core.boxes.check_tiling`, which also words every error). Returns
    the grids found (None with ``replicas``: the pieces then repeat boxes)."""
    p_key = pieces.uniq[:, 0]
    distinct = np.flatnonzero(pieces.new_group) if replicas else slice(None)  # copies: one box
    d_key = p_key[distinct]
    d_off = pieces.uniq[distinct, 1 : 1 + max_nd]
    d_shape = pieces.uniq[distinct, 1 + max_nd :]
    nds = known.ndims
    shapes = known.shapes[:, :max_nd] if known.shapes.shape[1] >= max_nd else np.pad(
        known.shapes, ((0, 0), (0, max_nd - known.shapes.shape[1])))
    bounds = np.searchsorted(d_key, np.arange(len(known.keys) + 1))
    inside = _inside(d_key, d_off, d_shape, shapes, nds)
    found = grids.find_grids(bounds, d_off, d_shape, nds, shapes)
    suspect = ~found.grid
    suspect[np.unique(d_key[~inside])] = True
    for k in np.flatnonzero(suspect).tolist():
        key = known.keys[k]
        if key in skip:
            continue
        lo, hi, nd = bounds[k], bounds[k + 1], int(nds[k])
        check_tiling(key, known.shape(k), d_off[lo:hi, :nd], d_shape[lo:hi, :nd])
    return None if replicas else found


def _inside(p_key: np.ndarray, offsets: np.ndarray, shapes: np.ndarray, extents: np.ndarray, nds: np.ndarray) -> np.ndarray:
    """(P,) bool: the piece is non-empty and inside its tensor (dims past its ndim ignored)."""
    nd = nds[p_key]
    bad = np.zeros(len(p_key), dtype=bool)
    for c in range(offsets.shape[1]):  # a column at a time: no (pieces, width) temporaries
        limit, offset, shape = extents[p_key, c], offsets[:, c], shapes[:, c]
        # compared without forming offset + shape, which could wrap around
        bad |= (nd > c) & ((offset < 0) | (shape <= 0) | (shape > limit) | (offset > limit - shape))
    return ~bad


def _pick_writers(pieces: _Pieces, p_nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The writer of every piece and its row in the writer's summary: single holders first,
    then the rest largest first to the least loaded holder (ties to the lowest rank)."""
    group_start, counts = pieces.group_start, pieces.counts
    order = pieces.order
    ranks, dense = _dense(pieces.row_rank)  # per held row
    single = counts == 1
    loads = np.zeros(len(ranks), dtype=np.int64)  # bytes each holder writes so far
    np.add.at(loads, dense[order[group_start[single]]], p_nbytes[single])
    multi = np.flatnonzero(~single)
    # largest first; ties broken by (key, offsets), which the sort of uniq already orders
    multi = multi[np.argsort(-p_nbytes[multi], kind="stable")]
    m_counts, sizes = counts[multi], p_nbytes[multi]
    holders = dense[order[ragged.indices(group_start[multi], m_counts)]]  # sorted by rank in each
    sets = _holder_sets(holders, m_counts)
    pick = _greedy_by_set(holders, m_counts, sizes, loads, sets) if sets is not None \
        else _greedy(holders, m_counts, sizes, loads)
    writer_pos = group_start.copy()  # position in the sorted rows of the chosen holder
    writer_pos[multi] += pick
    row = order[writer_pos]
    return pieces.row_rank[row], pieces.row_leaf[row]


def _dense(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values ascending, each value's index among them), for non-negative ranks
    by a lookup table when they are few enough, else by a sort."""
    if len(values) and values.min() >= 0 and values.max() < 4 * len(values) + 1024:
        present = np.zeros(int(values.max()) + 1, dtype=bool)
        present[values] = True
        index = np.cumsum(present) - 1
        return np.flatnonzero(present), index[values]
    distinct, inverse = np.unique(values, return_inverse=True)
    return distinct, inverse.astype(np.int64, copy=False)


def _greedy(holders: np.ndarray, counts: np.ndarray, sizes: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Give each piece in turn (``counts`` of the ``holders`` each, end to end, ascending) to
    its least loaded holder, the lowest on a tie; ``loads`` (per holder) grows. Returns the
    position of each piece's writer among its holders."""
    load = loads.tolist()
    hs, pick = holders.tolist(), []
    lo = 0
    for n, size in zip(counts.tolist(), sizes.tolist()):
        held = [load[h] for h in hs[lo : lo + n]]
        j = held.index(min(held))
        load[hs[lo + j]] += size
        pick.append(j)
        lo += n
    loads[:] = load
    return np.array(pick, dtype=np.int64)


def _holder_sets(holders: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
    """Each piece's holder set (``counts`` of the ascending ``holders`` each, end to end) as
    the first piece with the same holders; None when some piece lists a holder twice (or,
    never seen, two different sets hash alike)."""
    if not len(counts):
        return np.zeros(0, dtype=np.int64)
    piece = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if (np.diff(holders)[np.diff(piece) == 0] <= 0).any():
        return None
    mixed = holders.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    mixed ^= mixed >> np.uint64(29)
    start = np.cumsum(counts) - counts
    sig = np.add.reduceat(mixed * np.uint64(0xBF58476D1CE4E5B9), start) ^ counts.astype(np.uint64)
    _, first, inverse = np.unique(sig, return_index=True, return_inverse=True)
    rep = first[inverse.reshape(-1)].astype(np.int64)  # lowest piece with the same signature
    same = (counts == counts[rep]).all() and (holders == holders[ragged.indices(start[rep], counts)]).all()
    return rep if same else None


def _greedy_by_set(
    holders: np.ndarray, counts: np.ndarray, sizes: np.ndarray, loads: np.ndarray, sets: np.ndarray
) -> np.ndarray:
    """What :func:`_greedy` returns, with each holder set's holders on a heap (least loaded,
    then lowest, on top) instead of a scan: a holder that another set's piece loaded since
    is found stale when it comes up and pushed back with its load."""
    start = (np.cumsum(counts) - counts).tolist()
    load = loads.tolist()
    heaps: dict[int, tuple[list, list]] = {}
    pick = []
    for s, size in zip(sets.tolist(), sizes.tolist()):
        if s not in heaps:
            members = holders[start[s] : start[s] + int(counts[s])].tolist()
            heap = [(load[h], j) for j, h in enumerate(members)]
            heapq.heapify(heap)
            heaps[s] = (heap, members)
        heap, members = heaps[s]
        while heap[0][0] != load[members[heap[0][1]]]:  # stale: loads only grow
            heapq.heapreplace(heap, (load[members[heap[0][1]]], heap[0][1]))
        was, j = heap[0]
        load[members[j]] = was + size
        heapq.heapreplace(heap, (was + size, j))
        pick.append(j)
    loads[:] = load
    return np.array(pick, dtype=np.int64)


def _file_layouts(
    p_writer: np.ndarray, p_leaf: np.ndarray, p_nbytes: np.ndarray
) -> tuple[np.ndarray, dict[int, np.ndarray], dict[int, int], np.ndarray]:
    """Every writer's file: its pieces in leaf order, back to back (as layout_offsets). Returns
    each piece's byte offset, writer -> its rows in file order, writer -> its file's size, and
    the pieces by writer and file order."""
    n = len(p_writer)
    p_byte_offset = np.zeros(n, dtype=np.int64)
    writes: dict[int, np.ndarray] = {}
    file_bytes: dict[int, int] = {}
    if not n:
        return p_byte_offset, writes, file_bytes, np.zeros(0, np.int64)
    order = sorting.lexsort((p_leaf, p_writer))
    w_sorted = p_writer[order]
    first = np.concatenate([[0], np.flatnonzero(np.diff(w_sorted)) + 1])
    padded = aligned(p_nbytes[order])
    starts = np.cumsum(padded) - padded
    group = np.repeat(np.arange(len(first)), np.diff(np.append(first, n)))  # which writer each row belongs to
    p_byte_offset[order] = starts - starts[first][group]
    last = np.concatenate([first[1:], [n]]) - 1
    ends = p_byte_offset[order][last] + p_nbytes[order][last]
    for r, lo, hi, end in zip(w_sorted[first].tolist(), first.tolist(), (last + 1).tolist(), ends.tolist()):
        writes[r] = p_leaf[order[lo:hi]]
        file_bytes[r] = end
    return p_byte_offset, writes, file_bytes, order


def _check_rows(summaries: Sequence[SaveSummary], counts: np.ndarray, leaves: np.ndarray) -> None:
    """Raise PlanError unless each summary maps each of its ``leaves`` to a run of its rows
    (``counts``), in order."""
    if all(s.row_leaf is None for s in summaries):  # a row per leaf
        bad = np.flatnonzero(counts != leaves).tolist()
    else:
        bad = _rows_off_leaves(summaries, counts, leaves)
    if bad:
        raise PlanError(f"rank {summaries[bad[0]].rank}: summary rows do not map onto its {int(leaves[bad[0]])} leaves")


def _rows_off_leaves(summaries: Sequence[SaveSummary], counts: np.ndarray, leaves: np.ndarray) -> list[int]:
    """The summaries whose rows do not map onto their leaves, in runs, in order."""
    per = [s.leaves_of_rows() for s in summaries]
    bad = [i for i, (r, n) in enumerate(zip(per, counts.tolist())) if len(r) != n]
    row_leaf = np.concatenate(per).astype(np.int64) if per else np.zeros(0, np.int64)
    start = np.cumsum(counts) - counts
    full = np.flatnonzero(counts > 0)
    wrong = np.zeros(len(counts), dtype=bool)
    if not bad:
        wrong[counts == 0] = leaves[counts == 0] > 0
        wrong[full] = (row_leaf[start[full]] != 0) | (row_leaf[start[full] + counts[full] - 1] != leaves[full] - 1)
        steps = np.diff(row_leaf)
        jumps = np.flatnonzero((steps != 0) & (steps != 1)) + 1  # rows where a leaf does not follow on
        owner = np.searchsorted(start, jumps, side="right") - 1
        wrong[owner[start[owner] != jumps]] = True  # not a summary's first row
        bad = np.flatnonzero(wrong).tolist()
    return bad


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
    order = plan.file_order if plan.file_order is not None else sorting.lexsort((plan.piece_leaf, plan.piece_writer))
    start_in_report = np.zeros(n, dtype=np.int64)
    start_in_report[order] = np.cumsum(nblocks[order]) - nblocks[order]
    expected = np.bincount(np.searchsorted(writers, plan.piece_writer), weights=nblocks, minlength=len(writers)).astype(np.int64)
    for r, want in zip(writers, expected.tolist()):
        got = len(checksums.get(r, ()))
        if got != want:
            raise PlanError(f"rank {r} reported {got} checksums, expected {want}")
    all_sums = (
        np.concatenate([np.asarray(checksums[r], dtype=np.uint64) for r in writers]) if writers else np.zeros(0, np.uint64)
    )
    block_start = np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int64)
    total = int(block_start[-1])
    # the checksums in piece order: each piece's run, taken from where its writer reported it
    idx = np.repeat(start_in_report - block_start[:-1], nblocks) + np.arange(total, dtype=np.int64)
    k = len(plan.keys)
    columns = TensorColumns(
        keys=plan.keys,
        dtypes=plan.dtypes,
        shapes=plan.shapes,
        encodings=plan.encodings or (None,) * k,
        sources=plan.sources or (None,) * k,
        piece_start=np.searchsorted(plan.piece_key, np.arange(k + 1)).astype(np.int64),
        offsets=plan.piece_offsets,
        extents=plan.piece_shapes,
        files=np.searchsorted(writers, plan.piece_writer).astype(np.int64),
        byte_offsets=plan.piece_byte_offset,
        block_start=block_start,
        checksums=all_sums[idx] if total else np.zeros(0, np.uint64),
        grid=plan.grids,
        static=plan.static,
    )
    return Metadata(
        unique_id=unique_id,
        world_size=world_size,
        files=files,
        tensors=ColumnTensors(columns, block_bytes),
        structure=structure,
        block_bytes=block_bytes,
        created_by=created_by,
        replicas=plan.replicas,
        format_version=ENCODED_VERSION if any(plan.encodings) else FORMAT_VERSION,
    )
