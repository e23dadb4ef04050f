"""Box arithmetic: intersections, paddle's chunking rule, shard boxes, spans and tilings.

Oracles: numpy marker arrays (which elements a box covers) and paddle's chunking rule written
from its definition, never the functions under test.
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paddle_dcp.core.boxes import (
    Box,
    check_tiling,
    element_span,
    flat_range_boxes,
    is_contiguous,
    shard_box,
    split_extent,
    split_region,
)
from paddle_dcp.errors import PlanError

from ..helpers import coords, fast, mesh_dims_of, meshes, placements_for, ref_box, ref_chunk, shapes

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # the layouts of scripts/bench

KEY = "layer.w"


def mark(box: Box, space) -> np.ndarray:
    a = np.zeros(space, dtype=np.int64)
    a[box.slices()] += 1
    return a


@st.composite
def boxes_in(draw, ndim, side=8):
    offsets = tuple(draw(st.integers(0, side)) for _ in range(ndim))
    shape = tuple(draw(st.integers(0, side)) for _ in range(ndim))
    return Box(offsets, shape)


@st.composite
def box_pairs(draw):
    ndim = draw(st.integers(0, 3))
    return draw(boxes_in(ndim)), draw(boxes_in(ndim))


@st.composite
def region_in(draw, array_shape):
    offsets, shape = [], []
    for n in array_shape:
        lo = draw(st.integers(0, n))
        offsets.append(lo)
        shape.append(draw(st.integers(0, n - lo)))
    return Box(tuple(offsets), tuple(shape))


# ------------------------------------------------------------------ Box
def test_box_basics():
    b = Box((1, 2), (3, 4))
    assert b.ndim == 2 and b.end == (4, 6) and b.volume == 12
    assert b.slices() == (slice(1, 4), slice(2, 6))
    assert Box.whole((5, 7)) == Box((0, 0), (5, 7))
    assert Box((2, 3), (1, 1)).relative_to(b) == Box((1, 1), (1, 1))
    assert Box((), ()).volume == 1  # a scalar is one element
    with pytest.raises(PlanError):
        Box((0,), (1, 2))


@fast(300)
@given(box_pairs())
def test_intersect_is_symmetric_and_inside_both(pair):
    a, b = pair
    ab, ba = a.intersect(b), b.intersect(a)
    assert ab == ba
    space = tuple(18 for _ in range(a.ndim))
    common = int(((mark(a, space) > 0) & (mark(b, space) > 0)).sum())
    if ab is None:
        assert common == 0
    else:
        assert a.contains(ab) and b.contains(ab)
        assert ab.volume == common > 0
        assert (mark(ab, space) <= (mark(a, space) * mark(b, space))).all()


def test_intersect_of_touching_boxes_is_none():
    assert Box((0, 0), (2, 2)).intersect(Box((2, 0), (2, 2))) is None
    assert Box((0,), (3,)).intersect(Box((1,), (0,))) is None


# ------------------------------------------------------------------ split_extent
def test_split_extent_matches_the_definition_exhaustively():
    for n in range(0, 41):
        for k in range(1, 10):
            c = -(-n // k)
            got = [split_extent(n, k, i) for i in range(k)]
            for i, (lo, size) in enumerate(got):
                want_lo, want_hi = ref_chunk(n, k, i)  # [min(i*c, n), min((i+1)*c, n))
                assert (lo, size) == (want_lo, want_hi - want_lo), (n, k, i)
            sizes = [s for _, s in got]
            nonempty = [s for s in sizes if s]
            assert sum(sizes) == n
            assert all(s == c for s in nonempty[:-1])  # only the last non-empty one is short
            first_empty = next((i for i, s in enumerate(sizes) if s == 0), k)
            assert all(s == 0 for s in sizes[first_empty:])  # empty chunks all at the end
            assert all(got[i][0] == n for i in range(first_empty, k))  # offsets clamped


@pytest.mark.parametrize(
    "n, k, sizes",
    [(7, 4, [2, 2, 2, 1]), (2, 4, [1, 1, 0, 0]), (9, 2, [5, 4]), (10, 4, [3, 3, 3, 1]), (5, 4, [2, 2, 1, 0])],
)
def test_split_extent_known_sizes(n, k, sizes):
    assert [split_extent(n, k, i)[1] for i in range(k)] == sizes


@pytest.mark.parametrize("parts, index", [(0, 0), (3, 3), (3, -1), (-1, 0)])
def test_split_extent_rejects_chunks_that_do_not_exist(parts, index):
    with pytest.raises(PlanError, match="does not exist"):
        split_extent(10, parts, index)


# ------------------------------------------------------------------ shard_box
def test_shard_box_two_mesh_dims_on_one_tensor_dim_as_paddle_does():
    # paddle: 9 rows on mesh [2, 2] with [Shard(0), Shard(0)]
    want = {(0, 0): (0, 3), (0, 1): (3, 2), (1, 0): (5, 2), (1, 1): (7, 2)}
    for coord, (offset, size) in want.items():
        b = shard_box((9, 4), (2, 2), [[0, 1], []], coord)
        assert b == Box((offset, 0), (size, 4)), coord


def test_shard_box_uneven_and_smaller_than_the_mesh():
    assert [shard_box((7,), (4,), [[0]], (r,)).shape[0] for r in range(4)] == [2, 2, 2, 1]
    assert [shard_box((2,), (4,), [[0]], (r,)).shape[0] for r in range(4)] == [1, 1, 0, 0]
    assert [shard_box((2,), (4,), [[0]], (r,)).offsets[0] for r in range(2)] == [0, 1]


def test_shard_box_replicate_and_two_tensor_dims():
    # mesh [2, 3]: Shard(1) on mesh dim 0, Replicate on mesh dim 1
    for c1 in range(3):
        assert shard_box((4, 5), (2, 3), [[], [0]], (1, c1)) == Box((0, 3), (4, 2))
    # Shard(1), Shard(0)
    assert shard_box((4, 5), (2, 3), [[1], [0]], (1, 2)) == Box((4, 3), (0, 2))
    assert shard_box((4, 5), (2, 3), [[1], [0]], (1, 1)) == Box((2, 3), (2, 2))


def test_shard_box_scalar_and_rank_mismatch():
    assert shard_box((), (2, 2), [], (1, 1)) == Box((), ())
    with pytest.raises(PlanError):
        shard_box((4, 4), (2,), [[0]], (0,))


@st.composite
def layouts(draw):
    shape = draw(shapes(max_ndim=3, max_side=11))
    mesh = draw(meshes(max_world=16))
    placements = draw(placements_for(len(mesh), len(shape)))
    return shape, mesh, placements


@fast(300)
@given(layouts())
def test_shard_boxes_tile_the_tensor_exactly(layout):
    shape, mesh, placements = layout
    dims = mesh_dims_of(placements, len(shape))
    boxes = {c: shard_box(shape, mesh, dims, c) for c in coords(mesh)}
    distinct = set()
    for c, b in boxes.items():
        want = ref_box(shape, mesh, placements, c)
        assert b.shape == want.shape, (c, b, want)
        if b.volume:
            assert b.offsets == want.offsets, (c, b, want)
            distinct.add(b)
        assert all(0 <= o and o + s <= n for o, s, n in zip(b.offsets, b.shape, shape))
    counter = np.zeros(shape, dtype=np.int64)
    for b in distinct:
        counter[b.slices()] += 1
    assert (counter == 1).all()
    # ranks that differ only along Replicate mesh dims hold the same box
    for c, b in boxes.items():
        for m, p in enumerate(placements):
            if p is None:
                other = list(c)
                other[m] = (c[m] + 1) % mesh[m]
                assert boxes[tuple(other)] == b


# ------------------------------------------------------------------ spans and splits
@st.composite
def arrays_and_regions(draw):
    array_shape = draw(shapes(max_ndim=4, max_side=6, min_ndim=1))
    return array_shape, draw(region_in(array_shape))


@fast(300)
@given(arrays_and_regions())
def test_element_span_and_is_contiguous(case):
    array_shape, region = case
    flat = np.arange(math.prod(array_shape)).reshape(array_shape)[region.slices()]
    if flat.size == 0:
        assert element_span(array_shape, region) == (0, 0)
        assert is_contiguous(array_shape, region)
        return
    first, stop = int(flat.min()), int(flat.max()) + 1
    assert element_span(array_shape, region) == (first, stop)
    assert is_contiguous(array_shape, region) == (stop - first == flat.size)


def test_is_contiguous_examples():
    assert is_contiguous((4, 5), Box((1, 0), (2, 5)))  # whole rows
    assert is_contiguous((4, 5), Box((1, 2), (1, 3)))  # part of one row
    assert not is_contiguous((4, 5), Box((1, 0), (2, 4)))  # two partial rows
    assert element_span((4, 5), Box((1, 1), (2, 2))) == (6, 13)


@fast(300)
@given(arrays_and_regions(), st.integers(1, 200))
def test_split_region_parts_fit_the_limit_and_tile_the_region(case, limit):
    array_shape, region = case
    parts = split_region(region, limit, array_shape)
    if region.volume == 0:
        assert parts == []
        return
    counter = np.zeros(array_shape, dtype=np.int64)
    for p in parts:
        assert p.volume > 0 and region.contains(p)
        first, stop = element_span(array_shape, p)
        idx = np.arange(math.prod(array_shape)).reshape(array_shape)[p.slices()]
        assert (first, stop) == (idx.min(), idx.max() + 1)
        assert stop - first <= limit
        counter[p.slices()] += 1
    want = np.zeros(array_shape, dtype=np.int64)
    want[region.slices()] = 1
    assert (counter == want).all()


def test_split_region_leaves_a_region_within_the_limit_whole():
    r = Box((1, 0), (2, 5))
    assert split_region(r, 10, (4, 5)) == [r]


# ------------------------------------------------------------------ check_tiling
def rows(boxes, ndim):
    offs = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    shps = np.array([b.shape for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    return offs, shps


def tiles(shape, boxes):
    for few in (16, 0):  # pairwise in Python, and the numpy grid / sweep paths
        check_tiling(KEY, shape, *rows(boxes, len(shape)), few=few)


def refuses(shape, boxes, match=None):
    for few in (16, 0):
        with pytest.raises(PlanError, match=match) as info:
            check_tiling(KEY, shape, *rows(boxes, len(shape)), few=few)
        assert KEY in str(info.value)


@st.composite
def guillotine_tilings(draw):
    """Random exact tilings by repeated cuts of random boxes: most are not grids."""
    shape = draw(shapes(max_ndim=3, max_side=8, min_ndim=1, allow_zero=False))
    boxes = [Box.whole(shape)]
    for _ in range(draw(st.integers(0, 12))):
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        cuttable = [d for d in range(b.ndim) if b.shape[d] >= 2]
        if not cuttable:
            continue
        d = draw(st.sampled_from(cuttable))
        at = draw(st.integers(1, b.shape[d] - 1))
        lo_shape = list(b.shape)
        lo_shape[d] = at
        hi_off, hi_shape = list(b.offsets), list(b.shape)
        hi_off[d] += at
        hi_shape[d] -= at
        boxes[i : i + 1] = [Box(b.offsets, tuple(lo_shape)), Box(tuple(hi_off), tuple(hi_shape))]
    order = draw(st.permutations(range(len(boxes))))
    return shape, [boxes[j] for j in order]


@fast(300)
@given(guillotine_tilings())
def test_check_tiling_accepts_exact_tilings(case):
    shape, boxes = case
    counter = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        counter[b.slices()] += 1
    assert (counter == 1).all()  # the generator's own check
    tiles(shape, boxes)


@fast(300)
@given(guillotine_tilings(), st.data())
def test_check_tiling_refuses_any_broken_tiling(case, data):
    shape, boxes = case
    i = data.draw(st.integers(0, len(boxes) - 1))
    b = boxes[i]
    d = data.draw(st.integers(0, len(shape) - 1))
    how = data.draw(st.sampled_from(["drop", "duplicate", "grow", "shrink", "shift", "empty"]))
    off, shp = list(b.offsets), list(b.shape)
    if how == "drop":
        broken = boxes[:i] + boxes[i + 1 :]
    elif how == "duplicate":
        broken = boxes + [b]
    elif how == "grow":
        shp[d] += 1
        broken = boxes[:i] + [Box(tuple(off), tuple(shp))] + boxes[i + 1 :]
    elif how == "shrink":
        if shp[d] < 2:
            return
        shp[d] -= 1
        broken = boxes[:i] + [Box(tuple(off), tuple(shp))] + boxes[i + 1 :]
    elif how == "shift":
        off[d] += 1
        broken = boxes[:i] + [Box(tuple(off), tuple(shp))] + boxes[i + 1 :]
    else:
        shp[d] = 0
        broken = boxes + [Box(tuple(off), tuple(shp))]
    refuses(shape, broken)


def test_check_tiling_accepts_grid_and_l_shaped_and_pinwheel_layouts():
    tiles((4, 6), [Box((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)])  # grid
    # L-shape: a full top half and two quarters below, uneven columns
    tiles((4, 4), [Box((0, 0), (2, 4)), Box((2, 0), (2, 1)), Box((2, 1), (2, 3))])
    # pinwheel: no straight cut splits it (not a guillotine tiling)
    pinwheel = [Box((0, 0), (1, 2)), Box((0, 2), (2, 1)), Box((2, 1), (1, 2)), Box((1, 0), (2, 1)), Box((1, 1), (1, 1))]
    tiles((3, 3), pinwheel)
    tiles((), [Box((), ())])  # a scalar: one piece
    tiles((0, 3), [])  # nothing to cover


def test_check_tiling_names_gap_overlap_out_of_bounds_and_empty():
    refuses((4, 4), [Box((0, 0), (2, 4))], match="gap")
    refuses((4, 4), [Box((0, 0), (3, 4)), Box((2, 0), (2, 4))], match="overlap")
    refuses((4, 4), [Box((0, 0), (2, 4)), Box((2, 0), (3, 4))], match="outside")
    refuses((4, 4), [Box((0, 0), (4, 4)), Box((1, 1), (0, 2))], match="empty")
    refuses((4, 4), [Box((-1, 0), (5, 4))])
    refuses((4,), [], match="no piece")
    refuses((), [Box((), ()), Box((), ())], match="scalar")
    refuses((), [], match="scalar")


def test_check_tiling_catches_an_overlap_that_hides_a_gap():
    # volumes add up to the whole (2 + 2 = 4) but rows 1 overlap and row 3 is missing
    refuses((4,), [Box((0,), (2,)), Box((1,), (2,))])
    refuses((3, 3), [Box((0, 0), (2, 2)), Box((1, 1), (2, 2)), Box((0, 2), (1, 1))])


def test_check_tiling_refuses_a_piece_whose_end_overflows_int64():
    big = 1 << 62  # the largest value the metadata format admits
    with pytest.raises(PlanError):
        check_tiling(KEY, (4, 4), np.array([[0, 0], [big, 0]]), np.array([[4, 4], [big, 4]]))


# ------------------------------------------------------------------ flattened ranges
@st.composite
def flat_ranges(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    stop = draw(st.integers(start, total))
    return shape, start, stop


@fast(400)
@given(flat_ranges())
def test_flat_range_boxes_cover_the_range_in_order_each_contiguous(case):
    """Oracle: numpy's own C-order numbering of the array's elements."""
    shape, start, stop = case
    numbers = np.arange(math.prod(shape)).reshape(shape)
    boxes = flat_range_boxes(shape, start, stop)
    runs = [numbers[b.slices()].reshape(-1) for b in boxes]
    got = np.concatenate(runs) if runs else np.zeros(0, np.int64)
    assert got.tolist() == list(range(start, stop))  # exactly the range, in flat order
    for run in runs:  # each box one unbroken run
        assert run.size > 0 and run.tolist() == list(range(int(run[0]), int(run[0]) + run.size))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_flat_range_mid_row_to_mid_row():
    # a (4, 5) box, elements 3 .. 17: the rest of row 0, rows 1-2, the start of row 3
    assert flat_range_boxes((4, 5), 3, 17) == [Box((0, 3), (1, 2)), Box((1, 0), (2, 5)), Box((3, 0), (1, 2))]
    assert flat_range_boxes((4, 5), 0, 20) == [Box((0, 0), (4, 5))]
    assert flat_range_boxes((4, 5), 6, 8) == [Box((1, 1), (1, 2))]
    assert flat_range_boxes((), 0, 1) == [Box((), ())]


@pytest.mark.parametrize("start, stop", [(-1, 2), (3, 2), (0, 21)])
def test_flat_range_outside_the_box_is_refused(start, stop):
    with pytest.raises(PlanError):
        flat_range_boxes((4, 5), start, stop)


@fast(200)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_flat_range_boxes_are_the_range_in_order(shape, data):
    n = int(np.prod(shape))
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    got = []
    for box in flat_range_boxes(shape, start, stop):
        first, end = element_span(shape, box) if shape else (0, 1)
        assert end - first == box.volume  # one contiguous run
        got.extend(range(first, end))
    assert got == list(range(start, stop))


def staggered(rows: int, cols: int) -> tuple[tuple[int, int], np.ndarray, np.ndarray]:
    """A (rows, 2 * cols) matrix tiled like bricks: every row cut into ``cols`` pieces, the odd
    rows shifted by one element (a half brick at each end): no grid, every row's cuts differ
    from its neighbours'."""
    offsets, shapes_ = [], []
    for r in range(rows):
        cuts = list(range(0, 2 * cols + 1, 2)) if r % 2 == 0 else [0] + list(range(1, 2 * cols, 2)) + [2 * cols]
        for a, b in zip(cuts, cuts[1:]):
            offsets.append((r, a))
            shapes_.append((1, b - a))
    return (rows, 2 * cols), np.array(offsets, np.int64), np.array(shapes_, np.int64)


def counted_meets(monkeypatch) -> list:
    """A one-item list counting the calls of boxes.intervals_meet from now on (the work the
    sweeps do per piece)."""
    from paddle_dcp.core import boxes

    calls = [0]
    real = boxes.intervals_meet

    def counting(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(boxes, "intervals_meet", counting)
    return calls


@pytest.mark.parametrize("rows, cols", [(2, 5_000), (2, 50_000), (100, 1_000)])
def test_a_non_grid_layout_is_checked_with_a_bounded_number_of_comparisons_per_piece(monkeypatch, rows, cols):
    """The sweep of any matrix layout compares each piece with at most two open neighbours:
    10k and 100k staggered pieces (the layout the old sweep compared pairwise, a row at a
    time) cost at most 2 comparisons a piece, and a brick moved onto its neighbour is found."""
    calls = counted_meets(monkeypatch)
    shape, offsets, shapes_ = staggered(rows, cols)
    p = len(offsets)
    check_tiling(KEY, shape, offsets, shapes_, few=0)
    assert calls[0] <= 2 * p, (calls[0], p)
    shapes_[p // 2, 1] += 1  # grows into the next brick of its row
    shapes_[p // 2 + 2, 1] -= 1  # and a brick after it shrinks: the volumes still add up
    calls[0] = 0
    with pytest.raises(PlanError, match="overlap"):
        check_tiling(KEY, shape, offsets, shapes_, few=0)
    assert calls[0] <= 2 * p


def staggered_3d(layers: int, rows: int, cols: int) -> tuple[tuple[int, int, int], np.ndarray, np.ndarray]:
    """``layers`` copies of :func:`staggered` stacked along a first dim, each layer cut into
    two slabs along it (no grid in any two dims: the bricks of the second and third dims)."""
    shape2, o2, s2 = staggered(rows, cols)
    offsets, shapes_ = [], []
    for layer in range(layers):
        for half in (0, 1):
            offsets.append(np.column_stack([np.full(len(o2), 2 * layer + half), o2]))
            shapes_.append(np.column_stack([np.ones(len(o2), np.int64), s2]))
    return (2 * layers,) + shape2, np.concatenate(offsets), np.concatenate(shapes_)


@pytest.mark.parametrize("layers, rows, cols", [(5, 2, 500), (50, 2, 500)])
def test_a_non_grid_layout_of_three_dims_is_checked_with_a_bounded_number_of_comparisons(monkeypatch, layers, rows, cols):
    """10k and 100k pieces of a 3-dim layout that is no grid: split into leading dims and
    disjoint trailing boxes, each piece costs a bounded number of interval comparisons (the
    old sweep compared every open pair); an overlap made in one layer is found."""
    from paddle_dcp.core import boxes

    calls = counted_meets(monkeypatch)
    shape, offsets, shapes_ = staggered_3d(layers, rows, cols)
    p = len(offsets)
    assert boxes.first_overlap_nd(offsets, offsets + shapes_) is None
    check_tiling(KEY, shape, offsets, shapes_, few=0)
    assert calls[0] <= 8 * p, (calls[0], p)
    shapes_[p // 2, 2] += 1
    shapes_[p // 2 + 2, 2] -= 1
    calls[0] = 0
    with pytest.raises(PlanError, match="overlap"):
        check_tiling(KEY, shape, offsets, shapes_, few=0)
    assert calls[0] <= 8 * p


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_first_overlap_nd_agrees_with_comparing_every_pair(data):
    """Random boxes of 3 or 4 dims on a small grid of coordinates: a pair it names meets, it
    says None only when no two boxes meet (UNDECIDED is allowed: the caller then compares)."""
    from paddle_dcp.core import boxes

    ndim = data.draw(st.integers(3, 4))
    p = data.draw(st.integers(2, 12))
    lo = np.array(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim), min_size=p, max_size=p)))
    ext = np.array(data.draw(st.lists(st.lists(st.integers(1, 2), min_size=ndim, max_size=ndim), min_size=p, max_size=p)))
    hi = lo + ext
    found = boxes.first_overlap_nd(lo, hi)
    truth = boxes.first_overlap(lo.tolist(), hi.tolist())
    if found is None:
        assert truth is None, truth
    elif found is not boxes.UNDECIDED:
        i, j = found
        assert i != j and boxes.meet(lo[i], hi[i], lo[j], hi[j])
        assert truth is not None


def covered_counts(shape, lo, hi) -> np.ndarray:
    """How many boxes cover each element of a tensor of ``shape`` (the oracle, box by box)."""
    counter = np.zeros(shape, dtype=np.int64)
    for a, b in zip(lo.tolist(), hi.tolist()):
        counter[tuple(slice(x, y) for x, y in zip(a, b))] += 1
    return counter


@settings(max_examples=400, deadline=None)
@given(st.one_of(guillotine_tilings(), st.tuples(shapes(max_ndim=4, max_side=4, min_ndim=1, allow_zero=False), st.none())), st.data())
def test_untiled_point_agrees_with_counting_every_element(case, data):
    """Exact tilings, tilings with one piece moved, grown or doubled, and random boxes of 1 to 4
    dims: None exactly when every element is covered once, else an element covered 0 or 2+
    times, whether the corners are tallied at once or in runs."""
    from paddle_dcp.core import boxes

    shape, tiling = case
    if tiling is None:
        p = data.draw(st.integers(1, 10))
        lo = np.array([[data.draw(st.integers(0, n - 1)) for n in shape] for _ in range(p)], np.int64)
        hi = np.array([[data.draw(st.integers(a + 1, n)) for a, n in zip(row, shape)] for row in lo.tolist()], np.int64)
    else:
        lo = np.array([b.offsets for b in tiling], np.int64).reshape(len(tiling), len(shape))
        hi = lo + np.array([b.shape for b in tiling], np.int64).reshape(len(tiling), len(shape))
        i, d = data.draw(st.integers(0, len(lo) - 1)), data.draw(st.integers(0, len(shape) - 1))
        how = data.draw(st.sampled_from(["keep", "shift", "grow", "double"]))
        if how == "shift" and lo[i, d] > 0:
            lo[i, d] -= 1
            hi[i, d] -= 1
        elif how == "grow" and hi[i, d] < shape[d]:
            hi[i, d] += 1
        elif how == "double":
            lo, hi = np.concatenate([lo, lo[i : i + 1]]), np.concatenate([hi, hi[i : i + 1]])
    counts = covered_counts(shape, lo, hi)
    for rows in (boxes.CORNER_ROWS, 4):  # 4: tallied a dim-0 rank at a time, and one dim down
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(boxes, "CORNER_ROWS", rows)
            point = boxes.untiled_point(lo, hi, shape)
        if point is None:
            assert (counts == 1).all()
        else:
            assert counts[tuple(point.tolist())] != 1, (point, counts)


@pytest.mark.parametrize("pieces", [10_000, 100_000])
def test_a_layout_no_split_decides_is_checked_with_a_bounded_number_of_corners_per_piece(monkeypatch, pieces):
    """10k and 100k pieces of a 3-dim guillotine tiling (the layout no choice of leading dims
    decides, which the old sweep compared pairwise): every piece adds its 8 corners once, no
    pair is compared, and a piece moved by one element is found."""
    from paddle_dcp.core import boxes

    from bench.layouts import guillotine  # the benchmark's layout: its intervals nest and overlap in every dim

    shape, offsets, shapes_ = guillotine(pieces, side=1 << 20)
    assert len(offsets) == pieces
    p = len(offsets)
    assert boxes.first_overlap_nd(offsets, offsets + shapes_) is boxes.UNDECIDED
    tallied = [0]
    real = boxes._corners

    def counting(rows, *args):
        out = real(rows, *args)
        tallied[0] += len(out[0])
        return out

    monkeypatch.setattr(boxes, "_corners", counting)
    monkeypatch.setattr(boxes, "_sweep_open", lambda *a: pytest.fail("compared open pieces pairwise"))
    check_tiling(KEY, shape, offsets, shapes_, few=0)
    assert tallied[0] == 8 * (p + 1)  # the tensor's own corners too
    offsets[p // 2, 1] += 1 if offsets[p // 2, 1] + shapes_[p // 2, 1] < shape[1] else -1
    with pytest.raises(PlanError, match="overlap"):
        check_tiling(KEY, shape, offsets, shapes_, few=0)


def test_boxes_varying_in_more_dims_than_corners_are_counted_in_are_swept(monkeypatch):
    """Past CORNER_DIMS varying dims (2**dims corners a piece) the check compares open pieces:
    still exact, for a tiling that is no grid and for an overlap."""
    from paddle_dcp.core import boxes

    ndim = boxes.CORNER_DIMS + 1
    shape = (2,) * ndim
    lo = np.array([[(k >> d) & 1 for d in range(ndim)] for k in range(1 << ndim)], np.int64)  # every unit cell
    hi = lo + 1
    hi[0, 0] = 2  # cells 0 and 1 (apart in dim 0 only) as one piece: no grid
    lo, hi = np.delete(lo, 1, axis=0), np.delete(hi, 1, axis=0)
    assert boxes.untiled_point(lo, hi, shape) is boxes.UNDECIDED
    monkeypatch.setattr(boxes, "first_overlap_nd", lambda *a: boxes.UNDECIDED)  # as if no split decided
    swept = []
    real = boxes._sweep_open
    monkeypatch.setattr(boxes, "_sweep_open", lambda *a: swept.append(1) or real(*a))
    check_tiling(KEY, shape, lo, hi - lo, few=0)
    lo[3], hi[3] = lo[5], hi[5]  # two pieces of one cell (and a cell of none)
    with pytest.raises(PlanError, match="overlap"):
        check_tiling(KEY, shape, lo, hi - lo, few=0)
    assert len(swept) == 2
