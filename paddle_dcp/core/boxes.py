"""Boxes in a tensor's index space: the shard arithmetic of save and load.

A :class:`Box` is a hyper-rectangle ``offsets .. offsets + shape`` in elements. Variables say
which space a box lives in: ``in_global`` (the whole tensor), ``in_saved`` (relative to a saved
piece), ``in_target`` (relative to a rank's local piece).
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from operator import add, mul, sub
from typing import Sequence

import numpy as np

from ..errors import FormatError, PlanError


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of elements.

    Attributes:
        offsets: first index in every dimension, in elements.
        shape: extent in every dimension, in elements (0 allowed: an empty box).
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise PlanError(f"box offsets {self.offsets} and shape {self.shape} differ in rank")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Box":
        shape = tuple(int(s) for s in shape)
        return cls((0,) * len(shape), shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(map(add, self.offsets, self.shape))

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: "Box") -> "Box | None":
        """The common part of two boxes in the same space, or None when it is empty."""
        lo = tuple(map(max, self.offsets, other.offsets))
        shape = tuple(map(sub, map(min, self.end, other.end), lo))
        if shape and min(shape) <= 0:
            return None
        return Box(lo, shape)

    def contains(self, other: "Box") -> bool:
        return all(a <= b for a, b in zip(self.offsets, other.offsets)) and all(
            a >= b for a, b in zip(self.end, other.end)
        )

    def relative_to(self, origin: "Box") -> "Box":
        """This box expressed in the coordinates of ``origin`` (which must contain it)."""
        return Box(tuple(map(sub, self.offsets, origin.offsets)), self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))


def split_extent(extent: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, size) of chunk ``index`` when ``extent`` is cut into ``parts`` chunks.

    Paddle's rule: every chunk has ceil(extent / parts) elements, except the last non-empty one
    which holds the rest; chunks past the end are empty (offset clamped to ``extent``).
    """
    if parts <= 0 or not 0 <= index < parts:
        raise PlanError(f"chunk {index} of {parts} does not exist")
    step = -(-extent // parts)
    lo = min(index * step, extent)
    return lo, min(step, extent - lo)


def shard_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    mesh_dims_of_tensor_dim: Sequence[Sequence[int]],
    coord: Sequence[int],
) -> Box:
    """The box one rank holds of a tensor sharded over a process mesh.

    Args:
        global_shape: the tensor's shape, in elements.
        mesh_shape: size of every mesh dimension.
        mesh_dims_of_tensor_dim: for every tensor dim, the mesh dims that shard it, in the
            order they split it (outermost first); empty for an unsharded dim. Replicate and
            Partial mesh dims appear nowhere.
        coord: the rank's coordinate in the mesh.

    Returns:
        The rank's box in the global tensor (possibly empty, when a split runs out).
    """
    if len(mesh_dims_of_tensor_dim) != len(global_shape):
        raise PlanError(
            f"{len(mesh_dims_of_tensor_dim)} shard lists for a tensor of rank {len(global_shape)}"
        )
    offsets, shape = [], []
    for extent, mesh_dims in zip(global_shape, mesh_dims_of_tensor_dim):
        lo, size = 0, int(extent)
        for mesh_dim in mesh_dims:
            sub_lo, size = split_extent(size, int(mesh_shape[mesh_dim]), int(coord[mesh_dim]))
            lo += sub_lo
        offsets.append(lo)
        shape.append(size)
    return Box(tuple(offsets), tuple(shape))


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides in elements of a C-order array of ``shape``."""
    strides, acc = [], 1
    for extent in reversed(shape):
        strides.append(acc)
        acc *= int(extent)
    return tuple(reversed(strides))


def element_span(shape: Sequence[int], region: Box) -> tuple[int, int]:
    """[first, last + 1) flat element indices of ``region`` inside a C-order array of ``shape``."""
    if region.volume == 0:
        return 0, 0
    return strided_span(region.offsets, region.shape, c_strides(shape))


def strided_span(offsets: Sequence[int], shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int]:
    """[first, last + 1) flat element indices of the non-empty region ``offsets`` + ``shape``
    of an array with element ``strides`` (:func:`c_strides` of its shape)."""
    first = sum(map(mul, offsets, strides))
    return first, first + sum(map(mul, shape, strides)) - sum(strides) + 1


def is_contiguous(shape: Sequence[int], region: Box) -> bool:
    """True when ``region`` occupies one unbroken run of a C-order array of ``shape``."""
    first, stop = element_span(shape, region)
    return stop - first == region.volume


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes that elements [start, stop) of the C-order flattening of an array of
    ``shape`` make up, in flat order, each one contiguous run (at most 2 * ndim - 1 of them).

    A flattened shard (paddle's ``ShardedWeight`` with ``flattened_range``) is such a run of
    its box; the boxes are in that box's coordinates (``in_saved`` of the box).

    Raises:
        PlanError: the range is not inside the array.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise PlanError(f"flat range [{start}, {stop}) is not inside an array of shape {shape} ({total} elements)")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    if len(shape) == 1:
        return [Box((start,) + (0,) * (len(shape) - 1), (stop - start,) + shape[1:])]
    first, last = start // inner, stop // inner  # rows holding the first and the stop element

    def within(row: int, lo: int, hi: int) -> list[Box]:
        return [Box((row,) + b.offsets, (1,) + b.shape) for b in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return within(first, start % inner, stop % inner)
    boxes = []
    if start % inner:
        boxes += within(first, start % inner, inner)
        first += 1
    if last > first:
        boxes.append(Box((first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:]))
    if stop % inner:
        boxes += within(last, 0, stop % inner)
    return boxes


def split_region(region: Box, max_elements: int, array_shape: Sequence[int]) -> list[Box]:
    """Cut ``region`` into parts whose span in a C-order array of ``array_shape`` (the array
    the region lives in) is at most ``max_elements``; cuts go along the outermost dims first."""
    if region.volume == 0:
        return []
    first, stop = element_span(array_shape, region)
    if stop - first <= max_elements:
        return [region]
    d = next(i for i, extent in enumerate(region.shape) if extent > 1)
    stride = math.prod(array_shape[d + 1:])
    k = max(1, max_elements // stride)
    parts: list[Box] = []
    for start in range(0, region.shape[d], k):
        offsets, shape = list(region.offsets), list(region.shape)
        offsets[d] += start
        shape[d] = min(k, region.shape[d] - start)
        parts.extend(split_region(Box(tuple(offsets), tuple(shape)), max_elements, array_shape))
    return parts


FEW_BOXES = 16  # up to this many boxes, plain Python beats numpy's cost per call


def meet(lo_a: Sequence[int], hi_a: Sequence[int], lo_b: Sequence[int], hi_b: Sequence[int]) -> bool:
    """True when the boxes [lo_a, hi_a) and [lo_b, hi_b) share an element (plain Python)."""
    return all(max(a, b) < min(c, d) for a, b, c, d in zip(lo_a, lo_b, hi_a, hi_b))


def first_overlap(los: Sequence[Sequence[int]], his: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of boxes [los[k], his[k]) that share an element, or None;
    pairwise in plain Python (for the few boxes most tensors have)."""
    for i in range(len(los)):
        for j in range(i + 1, len(los)):
            if meet(los[i], his[i], los[j], his[j]):
                return i, j
    return None


def first_overlap_2d(offsets: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """A pair of indices of boxes [offsets, ends) of 1 or 2 dims that share an element, or
    None, in O(p log p): a sweep along dim 0 keeps the boxes the sweep line crosses sorted by
    where they start in dim 1. While no two of them overlap, their dim-1 intervals are
    disjoint, so a box that joins can only meet its two neighbours in that order
    (:func:`intervals_meet`, called at most twice per box)."""
    p = len(offsets)
    if offsets.shape[1] == 1:  # a vector: every box spans [0, 1) of a second dim
        offsets = np.column_stack([offsets, np.zeros(p, np.int64)])
        ends = np.column_stack([ends, np.ones(p, np.int64)])
    x0, x1 = offsets[:, 0].tolist(), ends[:, 0].tolist()
    y0, y1 = offsets[:, 1].tolist(), ends[:, 1].tolist()
    by_start = sorted(range(p), key=x0.__getitem__)
    by_end = sorted(range(p), key=x1.__getitem__)
    keys: list[tuple[int, int]] = []  # (dim-1 start, index) of the open boxes, sorted
    gone = 0
    for i in by_start:
        while gone < p and x1[by_end[gone]] <= x0[i]:  # half-open: a box ending here is closed
            j = by_end[gone]
            gone += 1
            at = bisect.bisect_left(keys, (y0[j], j))
            if at < len(keys) and keys[at][1] == j:
                del keys[at]
        at = bisect.bisect_left(keys, (y0[i], i))
        for n in (at - 1, at):
            if 0 <= n < len(keys):
                j = keys[n][1]
                if intervals_meet(y0[i], y1[i], y0[j], y1[j]):
                    return (j, i) if j < i else (i, j)
        keys.insert(at, (y0[i], i))
    return None


UNDECIDED = "undecided"  # first_overlap_nd's answer when its split cannot tell
SPLITS = 16  # pairs of dimensions first_overlap_nd tries as the leading two


def _alike(offsets: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per dim, whether every box [offsets, ends) spans it alike (such a dim tells no box
    from another)."""
    return (offsets == offsets[0]).all(axis=0) & (ends == ends[0]).all(axis=0)


def first_overlap_nd(offsets: np.ndarray, ends: np.ndarray) -> "tuple[int, int] | None | str":
    """A pair of indices of boxes [offsets, ends) of any number of dims that share an element,
    None, or :data:`UNDECIDED`, in O(p log p) for each of at most :data:`SPLITS` tries.
    Dimensions every box spans alike are left out (they tell no box from another); with 2 or
    fewer left, :func:`first_overlap_2d` decides. Else two dimensions lead and the others trail:
    when the distinct trailing boxes are pairwise disjoint (decided the same way, recursively),
    boxes of different trailing boxes never meet and those of one trailing box meet exactly when
    their leading two dims do. UNDECIDED: no pair of leading dims made the trailing boxes
    disjoint (the caller falls back to comparing boxes that are open together)."""
    p = len(offsets)
    varying = np.flatnonzero(~_alike(offsets, ends))
    if not len(varying):
        return (0, 1) if p > 1 else None
    o, e = offsets[:, varying], ends[:, varying]
    if len(varying) <= 2:
        return first_overlap_2d(o, e)
    for lead in itertools.islice(itertools.combinations(range(len(varying)), 2), SPLITS):
        found = _split_overlap(o, e, list(lead))
        if found is not UNDECIDED:
            return found
    return UNDECIDED


def _split_overlap(offsets: np.ndarray, ends: np.ndarray, lead: list) -> "tuple[int, int] | None | str":
    """:func:`first_overlap_nd` with dims ``lead`` leading, the rest trailing."""
    rest = [d for d in range(offsets.shape[1]) if d not in lead]
    tails, inverse = np.unique(np.concatenate([offsets[:, rest], ends[:, rest]], axis=1), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    if len(tails) > 1 and first_overlap_nd(tails[:, : len(rest)], tails[:, len(rest) :]) is not None:
        return UNDECIDED  # two trailing boxes meet (or cannot be told apart): this split cannot decide
    order = np.argsort(inverse, kind="stable")
    for group in np.split(order, np.flatnonzero(np.diff(inverse[order])) + 1):
        if len(group) > 1:
            pair = first_overlap_2d(offsets[group][:, lead], ends[group][:, lead])
            if pair is not None:
                i, j = int(group[pair[0]]), int(group[pair[1]])
                return (min(i, j), max(i, j))
    return None


CORNER_DIMS = 9  # untiled_point's cost per box is 2**dims (its corners): paddle's most dims; beyond, a sweep
CORNER_ROWS = 1 << 18  # corners untiled_point tallies at once, about (dims + 2) * 8 bytes each


def untiled_point(offsets: np.ndarray, ends: np.ndarray, global_shape: Sequence[int]) -> "np.ndarray | None | str":
    """For boxes [offsets, ends) inside a tensor of ``global_shape``: None when they tile it
    exactly, else an index that not exactly one box covers; :data:`UNDECIDED` when the boxes
    vary in more than :data:`CORNER_DIMS` dims. O(p 2**d log p) for boxes varying in d dims.

    The indicator of a half-open box is the signed sum, over its 2**d corners, of the indicator
    of the orthant at the corner (every index at or above it); the sign is -1 for each
    coordinate taken from the box's end. Orthants of distinct corners are linearly independent
    (one contains another's corner only when that corner is above it), so the boxes tile the
    tensor exactly when their signed corners, added up, are the tensor's own. Where they are
    not, the sum's lowest corner (least coordinate sum) is an index it covers 0 or 2+ times.
    Dimensions every box spans alike are left out: they cannot tell boxes apart."""
    same = _alike(offsets, ends)
    varying = np.flatnonzero(~same)
    shape = np.asarray(global_shape, dtype=np.int64)
    point = offsets[0].copy()
    outside = np.flatnonzero(same & ((offsets[0] != 0) | (ends[0] != shape)))
    if len(outside):  # the boxes all leave out the same part of this dim
        d = int(outside[0])
        point[d] = 0 if offsets[0, d] > 0 else ends[0, d]
        return point
    if len(varying) > CORNER_DIMS:
        return UNDECIDED
    if not len(varying):
        return None if len(offsets) == 1 else point
    cuts, lo, hi = [], [], []
    for d in varying.tolist():  # each dim's coordinates as ranks among its distinct ones
        c = np.unique(np.concatenate([offsets[:, d], ends[:, d], [0, shape[d]]]))
        cuts.append(c)
        lo.append(np.searchsorted(c, np.append(offsets[:, d], 0)))  # the tensor itself last,
        hi.append(np.searchsorted(c, np.append(ends[:, d], shape[d])))  # counted with sign -1
    sign = np.ones(len(offsets) + 1, np.int64)
    sign[-1] = -1
    left = _odd_corners(np.stack(lo, axis=1), np.stack(hi, axis=1), sign)
    if left is None:
        return None
    point[varying] = [c[i] for c, i in zip(cuts, left.tolist())]
    return point


def _odd_corners(lo: np.ndarray, hi: np.ndarray, sign: np.ndarray) -> np.ndarray | None:
    """The lowest corner (as ranks) whose signed count over boxes [lo, hi) with signs ``sign``
    is not zero, or None. Corners of different dim-0 ranks never cancel, so the boxes are
    tallied a run of dim-0 ranks at a time (a box's low corners where it starts, its high ones
    where it ends), each run within :data:`CORNER_ROWS` corners; a single rank with more is
    the same question one dim down, about the faces of the boxes that start or end there."""
    n, k = lo.shape
    if k == 1:
        return _lowest_nonzero(np.concatenate([lo, hi]), np.concatenate([sign, -sign]))
    per_box = 1 << (k - 1)
    by_lo, by_hi = np.argsort(lo[:, 0], kind="stable"), np.argsort(hi[:, 0], kind="stable")
    los, his = lo[by_lo, 0], hi[by_hi, 0]
    ranks = np.unique(np.concatenate([los, his]))
    load = (np.searchsorted(los, ranks, "right") + np.searchsorted(his, ranks, "right")) * per_box
    best, start = None, 0
    while start < len(ranks):
        base = int(load[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(load, base + CORNER_ROWS, "right")))
        first, last = ranks[start], ranks[stop - 1]
        a = by_lo[np.searchsorted(los, first) : np.searchsorted(los, last, "right")]
        b = by_hi[np.searchsorted(his, first) : np.searchsorted(his, last, "right")]
        at = np.concatenate([lo[a, 0], hi[b, 0]])
        rest_lo, rest_hi = np.concatenate([lo[a, 1:], lo[b, 1:]]), np.concatenate([hi[a, 1:], hi[b, 1:]])
        signs = np.concatenate([sign[a], -sign[b]])
        if stop - start == 1 and len(at) * per_box > CORNER_ROWS:
            face = _odd_corners(rest_lo, rest_hi, signs)
            found = None if face is None else np.concatenate([[first], face])
        else:
            found = _lowest_nonzero(*_corners(at, rest_lo, rest_hi, signs))
        if found is not None and (best is None or found.sum() < best.sum()):
            best = found
        start = stop
    return best


def _corners(first: np.ndarray, lo: np.ndarray, hi: np.ndarray, sign: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The signed corners of boxes whose dim-0 coordinate is ``first`` and whose other dims
    span [lo, hi) (signs ``sign``): every choice of start or end in those dims."""
    n, r = lo.shape
    corners = np.empty((n << r, r + 1), np.int64)
    weights = np.empty(n << r, np.int64)
    for m in range(1 << r):
        block = slice(m * n, (m + 1) * n)
        corners[block, 0] = first
        for d in range(r):
            corners[block, d + 1] = (hi if (m >> d) & 1 else lo)[:, d]
        weights[block] = -sign if bin(m).count("1") % 2 else sign
    return corners, weights


def _lowest_nonzero(corners: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
    """Of the corners whose weights do not add up to zero, the one of least coordinate sum."""
    if not len(corners):
        return None
    rows = np.ascontiguousarray(corners).view(np.dtype((np.void, corners.itemsize * corners.shape[1]))).ravel()
    _, first, group = np.unique(rows, return_index=True, return_inverse=True)
    total = np.bincount(group.reshape(-1), weights=weights, minlength=len(first))  # exact: sums of +-1 under 2**53
    odd = np.flatnonzero(total)
    if not len(odd):
        return None
    found = corners[first[odd]]
    return found[int(np.argmin(found.sum(axis=1)))]


def intervals_meet(a0: int, a1: int, b0: int, b1: int) -> bool:
    """Whether [a0, a1) and [b0, b1) share a point."""
    return max(a0, b0) < min(a1, b1)


def check_tiling(
    key: str,
    global_shape: Sequence[int],
    offsets: np.ndarray,
    shapes: np.ndarray,
    require_cover: bool = True,
    few: int = FEW_BOXES,
) -> None:
    """Raise PlanError unless the boxes (rows of ``offsets`` / ``shapes``) tile the tensor
    exactly: every box inside it, no two overlapping, their volumes adding up to the whole
    (the last only when ``require_cover``: a subset of a checkpoint's pieces may leave gaps).

    Up to ``few`` boxes are compared pair by pair in plain Python (cheaper than numpy's cost
    per call for the few pieces most tensors have). More run in O(p log p) for grid layouts
    (the only kind a save from placements produces) and for any layout of 1 or 2 dims
    (:func:`first_overlap_2d`) and for layouts of more dims that two of them split into
    disjoint trailing boxes (:func:`first_overlap_nd`); the others whose volumes add up to the
    whole are decided by counting corners (:func:`untiled_point`, O(p 2**d log p) for boxes
    varying in d <= :data:`CORNER_DIMS` dims). Only a subset's boxes (``require_cover`` False
    and volumes short of the whole) of 3 or more dims that no split decides, or boxes varying
    in more dims, fall back to a sweep along dim 0 that compares each box with those open.
    """
    global_shape, offsets, shapes = check_inside(key, global_shape, offsets, shapes)
    p, ndim = shapes.shape
    total = math.prod(global_shape)
    if ndim == 0:
        if require_cover and p != 1:
            raise PlanError(f"{key}: a scalar must be saved as exactly one piece, found {p}")
        return
    if p == 0:
        if total == 0 or not require_cover:
            return
        raise PlanError(f"{key}: no piece covers this tensor of shape {global_shape}")
    if p <= few:
        los = offsets.tolist()
        pair = first_overlap(los, [[a + n for a, n in zip(o, s)] for o, s in zip(los, shapes.tolist())])
        if pair is not None:
            raise PlanError(f"{key}: pieces at offsets {tuple(los[pair[0]])} and {tuple(los[pair[1]])} overlap")
        covered = sum(math.prod(s) for s in shapes.tolist())
        if require_cover and covered != total:
            raise PlanError(f"{key}: pieces cover {covered} of {total} elements, leaving a gap")
        return
    ends = offsets + shapes
    volumes = np.prod(shapes, axis=1, dtype=np.int64)
    covered = int(volumes.sum())
    grid = _grid_cells(offsets, ends, global_shape)
    if grid is not None:
        cells, distinct = grid
        if distinct != p:
            raise PlanError(f"{key}: two pieces cover the same elements (overlap)")
        if require_cover and covered != total:
            raise PlanError(f"{key}: pieces cover {covered} of {total} elements, leaving a gap")
        return
    found = first_overlap_2d(offsets, ends) if ndim <= 2 else first_overlap_nd(offsets, ends)
    if found != UNDECIDED:  # any layout of a vector or a matrix, and most of more dims: O(p log p)
        if isinstance(found, tuple):
            i, j = found
            raise PlanError(f"{key}: pieces at offsets {tuple(offsets[i].tolist())} and {tuple(offsets[j].tolist())} overlap")
        if require_cover and covered != total:
            raise PlanError(f"{key}: pieces cover {covered} of {total} elements, leaving a gap")
        return
    if covered > total:  # disjoint boxes inside the tensor cover at most all of it
        raise PlanError(f"{key}: pieces cover {covered} elements of a tensor of {total}: some overlap")
    if covered == total:  # any layout of up to CORNER_DIMS varying dims: counting corners decides
        point = untiled_point(offsets, ends, global_shape)
        if point is None:
            return
        if isinstance(point, np.ndarray):  # else UNDECIDED
            _untiled(key, offsets, ends, point)
    elif require_cover:
        raise PlanError(f"{key}: pieces cover {covered} of {total} elements, leaving a gap")
    # left: boxes of a subset (no cover to count) or varying in more than CORNER_DIMS dims
    _sweep_open(key, offsets, ends)


def _sweep_open(key: str, offsets: np.ndarray, ends: np.ndarray) -> None:
    """Raise PlanError naming two boxes that overlap: a sweep along dim 0 that compares each box
    with those still open (pairwise where many are open at once)."""
    p, ndim = offsets.shape
    order = np.lexsort(tuple(offsets[:, d] for d in reversed(range(ndim))))
    o, e = offsets[order], ends[order]
    open_idx: list[int] = []
    for i in range(p):
        open_idx = [j for j in open_idx if e[j, 0] > o[i, 0]]
        if open_idx:
            js = np.asarray(open_idx)
            lo = np.maximum(o[js], o[i])
            hi = np.minimum(e[js], e[i])
            hit = (hi > lo).all(1)
            if hit.any():
                j = int(js[np.flatnonzero(hit)[0]])
                raise PlanError(
                    f"{key}: pieces at offsets {tuple(o[j].tolist())} and {tuple(o[i].tolist())} overlap"
                )
        open_idx.append(i)


def _untiled(key: str, offsets: np.ndarray, ends: np.ndarray, point: np.ndarray) -> None:
    """Raise the PlanError of an index that not exactly one piece covers."""
    at = tuple(point.tolist())
    holders = np.flatnonzero(((offsets <= point) & (point < ends)).all(axis=1))
    if len(holders) >= 2:
        i, j = holders[:2].tolist()
        raise PlanError(f"{key}: pieces at offsets {tuple(offsets[i].tolist())} and {tuple(offsets[j].tolist())} overlap (at {at})")
    raise PlanError(f"{key}: no piece covers the element at {at}, though the pieces' sizes add up to the tensor's: some overlap")


def check_inside(
    key: str, global_shape: Sequence[int], offsets: np.ndarray, shapes: np.ndarray
) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """Raise PlanError unless every box is non-empty and inside the tensor (a scalar: at most
    one piece); returns (global shape, offsets, shapes) as a tuple and int64 arrays."""
    global_shape = tuple(int(s) for s in global_shape)
    offsets = np.asarray(offsets, dtype=np.int64)
    shapes = np.asarray(shapes, dtype=np.int64)
    if offsets.ndim != 2 or offsets.shape != shapes.shape or offsets.shape[1] != len(global_shape):
        raise PlanError(f"{key}: piece boxes do not match a tensor of rank {len(global_shape)}")
    p, ndim = shapes.shape
    if ndim == 0:
        if p > 1:
            raise PlanError(f"{key}: a scalar must be saved as exactly one piece, found {p}")
        return global_shape, offsets, shapes
    limit = np.asarray(global_shape, dtype=np.int64)
    # compared without forming offsets + shapes first, which could wrap around
    bad = ((offsets < 0) | (shapes <= 0) | (shapes > limit) | (offsets > limit - shapes)).any(1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(
            f"{key}: piece at offset {tuple(offsets[i].tolist())} with shape "
            f"{tuple(shapes[i].tolist())} is empty or outside the tensor's shape {global_shape}"
        )
    return global_shape, offsets, shapes


def _grid_cells(offsets: np.ndarray, ends: np.ndarray, global_shape: Sequence[int]) -> tuple[int, int] | None:
    """When every box is one cell of the grid cut by all boxes' edges (the layouts placements
    produce), (number of cells, number of distinct cells hit); else None. Distinct cells mean
    no overlap; as many cells as boxes, with volumes adding up, mean exact tiling."""
    p, ndim = offsets.shape
    cells = 1
    cell_index = np.zeros(p, dtype=np.int64)
    for d in range(ndim):
        cuts = np.unique(np.concatenate([offsets[:, d], ends[:, d], [0, global_shape[d]]]))
        lo = np.searchsorted(cuts, offsets[:, d])
        hi = np.searchsorted(cuts, ends[:, d])
        if not (hi == lo + 1).all():
            return None
        cells *= len(cuts) - 1
        if cells > (1 << 62):
            return None
        cell_index = cell_index * (len(cuts) - 1) + lo
    return cells, len(np.unique(cell_index))


def check_entry_tiling(
    key: str,
    shape: tuple[int, ...],
    offsets: np.ndarray,
    shapes: np.ndarray,
    files: np.ndarray,
    replicas: bool,
    require_cover: bool = True,
) -> None:
    """The pieces of a tensor tile it; with ``replicas``, its distinct boxes do (the copies of
    one box lying in different files). Raises PlanError or FormatError naming the key."""
    if replicas:
        first = distinct_boxes(key, offsets, shapes, files)
        offsets, shapes = offsets[first], shapes[first]
    check_tiling(key, shape, offsets, shapes, require_cover=require_cover)


def distinct_boxes(key: str, offsets: np.ndarray, shapes: np.ndarray, files: np.ndarray) -> np.ndarray:
    """Rows of the first copy of every distinct box (ascending); raises FormatError when two
    copies of one box lie in the same file (a replica is a holder's own copy)."""
    if not len(files):
        return np.zeros(0, np.int64)
    boxes = np.concatenate([offsets, shapes], axis=1)
    _, first, group = np.unique(boxes, axis=0, return_index=True, return_inverse=True)
    pairs = np.unique(np.stack([group.reshape(-1), files], axis=1), axis=0)
    if len(pairs) != len(files):
        raise FormatError(f"tensor {key!r}: two copies of one piece in the same file")
    return np.sort(first)
