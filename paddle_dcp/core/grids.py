"""Pieces that form grids: found, checked and expanded for many tensors at once.

A tensor's pieces form a grid when, along every dimension, the tensor is cut at some points
(always at 0 and at its extent) and the pieces are exactly the cells of that grid, one each:
the layouts ``shard_tensor`` placements produce, however uneven. Such a layout is described by
its cut points alone (a few integers per dimension, not a box per piece), and its pieces tile
the tensor by construction. Everything here works on the pieces of all tensors together, with
numpy, in O(pieces log pieces): a job with a hundred thousand tensors pays no cost per tensor
in Python.

Cuts of many tensors are one flat array: the cuts of tensor ``t`` along dim ``d`` are
``values[start[slot] : start[slot + 1]]`` with ``slot = slot_of[t] + d`` (:class:`Cuts`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import sorting

_LIMIT = 1 << 62


@dataclass(frozen=True, eq=False)
class Cuts:
    """The cut points of many tensors (every dimension, ascending, from 0 to its extent).

    Attributes:
        slot_of: (T + 1,) int64, the first slot of each tensor (its ndim slots follow).
        start: (slots + 1,) int64, where each slot's cuts begin in ``values``.
        values: the cuts, in elements.
    """

    slot_of: np.ndarray
    start: np.ndarray
    values: np.ndarray

    def of(self, t: int) -> list[np.ndarray]:
        """Tensor ``t``'s cuts, one array per dimension."""
        lo, hi = int(self.slot_of[t]), int(self.slot_of[t + 1])
        return [self.values[self.start[s] : self.start[s + 1]] for s in range(lo, hi)]

    def cells(self) -> np.ndarray:
        """(T,) int64: how many cells each tensor's grid has (1 for a scalar; capped at 2**62)."""
        per_slot = np.diff(self.start) - 1
        return _segment_products(per_slot, self.slot_of)


def _segment_products(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The product of ``values[bounds[i]:bounds[i+1]]`` for every i (1 when empty), capped."""
    n = len(bounds) - 1
    out = np.ones(n, dtype=np.int64)
    if not len(values):
        return out
    ndim = np.diff(bounds)
    for d in range(int(ndim.max()) if n else 0):
        has = ndim > d
        factor = values[bounds[:-1][has] + d]
        prod = out[has].astype(np.float64) * factor
        out[has] = np.where(prod >= _LIMIT, _LIMIT, out[has] * np.minimum(factor, _LIMIT))
    return out


@dataclass(frozen=True, eq=False)
class GridCheck:
    """What :func:`find_grids` found.

    Attributes:
        grid: (T,) bool, the tensor's pieces are exactly the cells of its cuts, one each, in
            row-major order (so they tile it); false for a tensor that must be checked another
            way (boxes that cut each other's edges, two pieces in one cell, a gap).
        cuts: every tensor's cuts (those of a tensor that is not a grid are the edges of its
            pieces, meaningless but harmless).
    """

    grid: np.ndarray
    cuts: Cuts


CHUNK_PIECES = 1 << 18  # pieces looked at together: bounds the temporary arrays (~50 MiB)


def find_grids(
    piece_start: np.ndarray,
    offsets: np.ndarray,
    shapes: np.ndarray,
    ndims: np.ndarray,
    extents: np.ndarray,
) -> GridCheck:
    """Which tensors' pieces form their grid.

    Args:
        piece_start: (T + 1,) the pieces of tensor t are rows ``piece_start[t]:piece_start[t+1]``,
            sorted by offsets (lexicographically, first dim first).
        offsets / shapes: (P, D) int64 boxes, in elements, padded with zeros past each
            tensor's ndim; every box non-empty and inside its tensor (checked by the caller).
        ndims: (T,) each tensor's number of dims (at most D).
        extents: (T, D) each tensor's shape, padded with zeros.

    Tensors are looked at in runs of about ``CHUNK_PIECES`` pieces (a tensor is never split).
    """
    piece_start = np.asarray(piece_start, dtype=np.int64)
    n_t = len(piece_start) - 1
    # the first tensor of each run: where the pieces so far pass a multiple of CHUNK_PIECES
    cuts = np.unique(np.searchsorted(piece_start[1:], np.arange(0, int(piece_start[-1]), CHUNK_PIECES), side="right"))
    bounds = np.concatenate([[0], cuts[(cuts > 0) & (cuts < n_t)], [n_t]]).tolist() if n_t else [0, 0]
    if len(bounds) <= 2:
        return _find_grids(piece_start, offsets, shapes, ndims, extents)
    found = []
    for t0, t1 in zip(bounds[:-1], bounds[1:]):
        p0, p1 = int(piece_start[t0]), int(piece_start[t1])
        found.append(_find_grids(piece_start[t0 : t1 + 1] - p0, offsets[p0:p1], shapes[p0:p1], ndims[t0:t1], extents[t0:t1]))
    return _joined(found)


def _joined(found: list[GridCheck]) -> GridCheck:
    """The checks of consecutive runs of tensors as one."""
    slot_base = np.cumsum([0] + [int(f.cuts.slot_of[-1]) for f in found])
    value_base = np.cumsum([0] + [len(f.cuts.values) for f in found])
    slot_of = np.concatenate([f.cuts.slot_of[:-1] + b for f, b in zip(found, slot_base)] + [slot_base[-1:]])
    start = np.concatenate([f.cuts.start[:-1] + b for f, b in zip(found, value_base)] + [value_base[-1:]])
    values = np.concatenate([f.cuts.values for f in found])
    return GridCheck(np.concatenate([f.grid for f in found]), Cuts(slot_of.astype(np.int64), start.astype(np.int64), values))


def _find_grids(
    piece_start: np.ndarray, offsets: np.ndarray, shapes: np.ndarray, ndims: np.ndarray, extents: np.ndarray
) -> GridCheck:
    """:func:`find_grids` of all tensors at once."""
    n_t = len(piece_start) - 1
    counts = np.diff(piece_start)
    tensor_of = np.repeat(np.arange(n_t, dtype=np.int64), counts)
    slot_of = np.concatenate([[0], np.cumsum(ndims)]).astype(np.int64)
    ok = np.ones(len(tensor_of), dtype=bool)  # per piece: one cell wide in every dim
    cell = np.zeros(len(tensor_of), dtype=np.int64)
    slot_values: list[np.ndarray] = []
    slot_ids: list[np.ndarray] = []
    width = np.ones(n_t, dtype=np.int64)  # cells so far, per tensor (capped)
    for d in range(int(ndims.max()) if n_t else 0):
        has_t = np.flatnonzero(ndims > d)
        has_p = ndims[tensor_of] > d
        if has_p.all():  # views, not copies, when every piece has this dim
            has_p = slice(None)  # type: ignore[assignment]
        t_p = tensor_of[has_p]
        lo_v = offsets[has_p, d]
        hi_v = lo_v + shapes[has_p, d]
        # every value a cut may take: each piece's edges, and 0 and the extent of the tensor
        owner = np.concatenate([t_p, t_p, has_t, has_t])
        value = np.concatenate([lo_v, hi_v, np.zeros(len(has_t), np.int64), extents[has_t, d]])
        order = sorting.lexsort((value, owner))
        o_sorted, v_sorted = owner[order], value[order]
        new = np.ones(len(order), dtype=bool)
        new[1:] = (o_sorted[1:] != o_sorted[:-1]) | (v_sorted[1:] != v_sorted[:-1])
        uid = np.cumsum(new) - 1
        ident = np.empty(len(order), dtype=np.int64)
        ident[order] = uid
        first = np.full(n_t, -1, dtype=np.int64)
        starts = np.flatnonzero(np.concatenate([[True], o_sorted[1:] != o_sorted[:-1]])) if len(order) else order
        first[o_sorted[starts]] = uid[starts]
        n = len(t_p)
        lo = ident[:n] - first[t_p]
        hi = ident[n : 2 * n] - first[t_p]
        ok[has_p] &= hi == lo + 1
        ncuts = np.bincount(o_sorted[new], minlength=n_t)
        cells_d = np.maximum(ncuts - 1, 0)
        cell[has_p] = cell[has_p] * cells_d[t_p] + lo  # wraps only past 2**62 cells: no grid then
        big = width[has_t].astype(np.float64) * cells_d[has_t] >= _LIMIT
        width[has_t] = np.where(big, _LIMIT, width[has_t] * cells_d[has_t])
        slot_values.append(v_sorted[new])
        slot_ids.append(slot_of[o_sorted[new]] + d)
    cuts = _cuts(slot_of, slot_values, slot_ids)
    cells = cuts.cells()
    grid = (counts == cells) & (cells < _LIMIT)
    # every piece one cell wide, and the cells strictly increasing (row-major order, no cell
    # twice): with as many pieces as cells, they are the grid
    bad = ~ok
    if len(cell) > 1:
        same_tensor = tensor_of[1:] == tensor_of[:-1]
        bad[1:] |= same_tensor & (cell[1:] <= cell[:-1])
    if bad.any():
        grid[np.unique(tensor_of[bad])] = False
    return GridCheck(grid, cuts)


def _cuts(slot_of: np.ndarray, values: list[np.ndarray], ids: list[np.ndarray]) -> Cuts:
    n_slots = int(slot_of[-1])
    if not values:
        return Cuts(slot_of, np.zeros(n_slots + 1, np.int64), np.zeros(0, np.int64))
    v = np.concatenate(values)
    s = np.concatenate(ids)
    order = np.argsort(s, kind="stable")  # by slot, each slot's values already ascending
    start = np.concatenate([[0], np.cumsum(np.bincount(s, minlength=n_slots))]).astype(np.int64)
    return Cuts(slot_of, start, v[order])


def expand(cuts: Cuts, tensors: np.ndarray, ndims: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every cell of the grids of ``tensors`` (indices into ``cuts``), in row-major order:
    (piece_start (len(tensors) + 1,), offsets, shapes (cells, width) int64, zero-padded).
    ``ndims``: the dims of each of ``tensors``."""
    tensors = np.asarray(tensors, dtype=np.int64)
    ndims = np.asarray(ndims, dtype=np.int64)
    per_slot = np.diff(cuts.start) - 1
    counts = cuts.cells()[tensors] if len(tensors) else np.zeros(0, np.int64)
    piece_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(piece_start[-1])
    offsets = np.zeros((total, width), dtype=np.int64)
    shapes = np.zeros((total, width), dtype=np.int64)
    owner = np.repeat(np.arange(len(tensors), dtype=np.int64), counts)
    rest = np.arange(total, dtype=np.int64) - piece_start[:-1][owner]  # row-major cell index
    for d in reversed(range(width)):
        has = ndims[owner] > d
        if not has.any():
            continue
        slot = cuts.slot_of[tensors[owner[has]]] + d
        n = per_slot[slot]
        i = rest[has] % n
        rest[has] //= n
        at = cuts.start[slot] + i
        offsets[has, d] = cuts.values[at]
        shapes[has, d] = cuts.values[at + 1] - cuts.values[at]
    return piece_start, offsets, shapes
