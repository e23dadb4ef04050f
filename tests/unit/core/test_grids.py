"""Grids found for many tensors at once: a tensor is a grid exactly when its pieces are the
cells of the cuts along each dim, one each, in row-major order; expanding the cuts gives the
pieces back. The oracle is a plain product of cut lists, and check_tiling for what tiles."""
import itertools

import numpy as np
from hypothesis import given, settings, strategies as st

from paddle_dcp.core import grids
from paddle_dcp.core.boxes import check_tiling
from paddle_dcp.errors import PlanError


@st.composite
def tensor(draw):
    """(shape, boxes sorted by offsets, whether the boxes are the cells of the grid their edges
    cut: a grid split, perhaps with a box dropped, repeated or two merged)."""
    nd = draw(st.integers(0, 3))
    shape = [draw(st.integers(0, 6)) for _ in range(nd)]
    cuts = [sorted({0, n, *draw(st.lists(st.integers(0, n), max_size=3))}) for n in shape]
    boxes = []
    for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
        boxes.append(([cuts[d][i] for d, i in enumerate(cell)], [cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell)]))
    change = draw(st.sampled_from(["none", "drop", "repeat", "merge"]))
    if change == "drop" and boxes:
        boxes.pop(draw(st.integers(0, len(boxes) - 1)))
    elif change == "repeat" and boxes:
        boxes.append(boxes[draw(st.integers(0, len(boxes) - 1))])
    elif change == "merge" and nd and len(boxes) > 1:
        for i, (o, s) in enumerate(boxes):
            j = next((j for j, (o2, s2) in enumerate(boxes) if o2[0] == o[0] + s[0] and o2[1:] == o[1:] and s2[1:] == s[1:]), None)
            if j is not None:
                boxes[i] = (o, [s[0] + boxes[j][1][0]] + s[1:])
                boxes.pop(j)
                break
    boxes.sort(key=lambda b: b[0])
    return shape, boxes, boxes == _cells_of_edges(shape, boxes)


def _cells_of_edges(shape, boxes):
    """The cells of the grid cut at every edge of the boxes (and at 0 and each extent)."""
    cuts = [sorted({0, n} | {o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d, n in enumerate(shape)]
    cells = []
    for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
        cells.append(([cuts[d][i] for d, i in enumerate(cell)], [cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell)]))
    return cells


def _columns(tensors):
    width = max([len(s) for s, _, _ in tensors] + [0])
    starts, offs, shps = [0], [], []
    for shape, boxes, _ in tensors:
        for o, s in boxes:
            offs.append(o + [0] * (width - len(o)))
            shps.append(s + [0] * (width - len(s)))
        starts.append(len(offs))
    n = len(offs)
    ext = np.array([s + [0] * (width - len(s)) for s, _, _ in tensors], np.int64).reshape(len(tensors), width)
    return (np.array(starts), np.array(offs, np.int64).reshape(n, width), np.array(shps, np.int64).reshape(n, width),
            np.array([len(s) for s, _, _ in tensors]), ext, width)


def _tiles(shape, boxes):
    nd = len(shape)
    try:
        check_tiling("k", shape, np.array([o for o, _ in boxes], np.int64).reshape(len(boxes), nd),
                     np.array([s for _, s in boxes], np.int64).reshape(len(boxes), nd))
    except PlanError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.lists(tensor(), min_size=1, max_size=6))
def test_a_tensor_is_a_grid_exactly_when_its_pieces_are_its_cells_and_expanding_gives_them_back(tensors):
    starts, offs, shps, ndims, ext, width = _columns(tensors)
    found = grids.find_grids(starts, offs, shps, ndims, ext)
    for t, (shape, boxes, clean) in enumerate(tensors):
        assert bool(found.grid[t]) == clean, (shape, boxes)
        if not found.grid[t]:
            continue
        assert _tiles(shape, boxes)
        ps, o, s = grids.expand(found.cuts, np.array([t]), np.array([len(shape)]), width)
        assert [(list(o[i][: len(shape)]), list(s[i][: len(shape)])) for i in range(len(o))] == boxes


def test_cells_count_every_grid_and_a_scalar_is_one_cell():
    tensors = [([4, 6], [([0, 0], [2, 6]), ([2, 0], [2, 6])], True), ([], [([], [])], True), ([0, 3], [], True)]
    starts, offs, shps, ndims, ext, _ = _columns(tensors)
    found = grids.find_grids(starts, offs, shps, ndims, ext)
    assert found.grid.tolist() == [True, True, True]
    assert found.cuts.cells().tolist() == [2, 1, 0]
    assert [c.tolist() for c in found.cuts.of(0)] == [[0, 2, 4], [0, 6]]


def test_the_work_grows_with_the_pieces_not_with_the_tensors_times_the_pieces():
    """One numpy pass per dimension: the number of Python calls does not depend on how many
    tensors or pieces there are."""
    import sys

    def calls(n_tensors):
        tensors = [([8, 4], [([i, 0], [1, 4]) for i in range(8)], True) for _ in range(n_tensors)]
        args = _columns(tensors)[:5]
        count = 0

        def prof(frame, event, arg):
            nonlocal count
            if event in ("call", "c_call"):
                count += 1

        sys.setprofile(prof)
        try:
            grids.find_grids(*args)
        finally:
            sys.setprofile(None)
        return count

    assert calls(10_000) == calls(1_000)


@settings(max_examples=200, deadline=None)
@given(st.lists(tensor(), min_size=1, max_size=8), st.integers(1, 6))
def test_tensors_looked_at_in_runs_give_what_all_at_once_gives(tensors, chunk):
    starts, offs, shps, ndims, ext, _ = _columns(tensors)
    whole = grids.find_grids(starts, offs, shps, ndims, ext)
    saved = grids.CHUNK_PIECES
    grids.CHUNK_PIECES = chunk
    try:
        runs = grids.find_grids(starts, offs, shps, ndims, ext)
    finally:
        grids.CHUNK_PIECES = saved
    assert runs.grid.tolist() == whole.grid.tolist()
    for name in ("slot_of", "start", "values"):
        assert getattr(runs.cuts, name).tolist() == getattr(whole.cuts, name).tolist(), name
