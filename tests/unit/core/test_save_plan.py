"""Save plans: dedup, balance, order independence, refusals, and the file layout.

Oracles: the set of boxes every rank holds (from paddle's chunking rule written by hand, see
helpers.ref_box) and numpy slices of the global arrays, compared bit for bit.
"""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.core import nested, save_plan
from paddle_dcp.parallel import wire
from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import MismatchError, PlanError
from paddle_dcp.core.metadata import ALIGNMENT

from ..helpers import ITEMSIZE, arrays_for, fast, layouts, rank_states
from .replicas import covered, flat_pieces, plan_of, replicated, summary_of


def summary(rank: int, pieces) -> save_plan.SaveSummary:
    """A summary of (key, dtype, global_shape, box or None) pieces; keys are top-level."""
    skeleton = {"d": [[key, {"t": 0}] for key, *_ in pieces]}
    local = [save_plan.LocalPiece(k, d, tuple(g), b) for k, d, g, b in pieces]
    return save_plan.SaveSummary.from_pieces(rank, skeleton, local)


def through_wire(summaries):
    cache: dict = {}
    return [wire.decode_summary(wire.encode_summary(s), s.rank, cache) for s in summaries]


def plan_rows(plan):
    """(key, offsets, shape) -> row index of every planned piece."""
    out = {}
    for i, k in enumerate(plan.piece_key.tolist()):
        nd = len(plan.shapes[k])
        row = (plan.keys[k], tuple(plan.piece_offsets[i, :nd].tolist()), tuple(plan.piece_shapes[i, :nd].tolist()))
        assert row not in out, f"piece {row} planned twice"
        out[row] = i
    return out


def assert_same_plan(a, b):
    assert (a.keys, a.dtypes, a.shapes) == (b.keys, b.dtypes, b.shapes)
    for f in ("piece_key", "piece_offsets", "piece_shapes", "piece_writer", "piece_leaf", "piece_nbytes",
              "piece_byte_offset"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.writes.keys() == b.writes.keys()
    assert all(np.array_equal(a.writes[r], b.writes[r]) for r in a.writes)
    assert a.file_bytes == b.file_bytes
    assert a.skeleton == b.skeleton


# ------------------------------------------------------------------ plan_save
@fast(150)
@given(layouts(max_world=16), st.booleans(), st.randoms(use_true_random=False))
def test_plan_save_writes_each_distinct_piece_once_by_a_holder_in_any_order(layout, via_wire, rnd):
    shape, dtypes, mesh, placements = layout
    arrays = arrays_for(shape, dtypes, 0)
    ranks = rank_states(arrays, dtypes, mesh, placements, {"step": 1}, via_wire=via_wire)
    summaries = [s for _, _, s in ranks]
    plan = save_plan.plan_save(summaries)

    holders: dict[tuple, set[int]] = {}
    for r, (_, pieces, _) in enumerate(ranks):
        for p in pieces:
            if p.box.volume > 0:
                holders.setdefault((p.key, p.box.offsets, p.box.shape), set()).add(r)
    rows = plan_rows(plan)
    assert set(rows) == set(holders)  # every distinct piece, once
    for row, i in rows.items():
        writer, leaf = int(plan.piece_writer[i]), int(plan.piece_leaf[i])
        assert writer in holders[row]  # by a rank that holds it
        p = ranks[writer][1][leaf]
        assert (p.key, p.box.offsets, p.box.shape) == row  # leaf is the writer's own piece
        key, _, shp = row
        assert plan.piece_nbytes[i] == math.prod(shp) * ITEMSIZE[dtypes[key.split(".")[1]]]
    # each writer's file: its leaves ascending, back to back at 64-byte boundaries
    for r, leaves in plan.writes.items():
        assert (np.diff(leaves) > 0).all()
        idx = [i for i in range(len(plan.piece_key)) if plan.piece_writer[i] == r]
        idx.sort(key=lambda i: plan.piece_leaf[i])
        assert [int(plan.piece_leaf[i]) for i in idx] == leaves.tolist()
        at = 0
        for i in idx:
            start = int(plan.piece_byte_offset[i])
            assert start % ALIGNMENT == 0 and at <= start < at + ALIGNMENT
            at = start + int(plan.piece_nbytes[i])
        assert plan.file_bytes[r] == at
    assert set(plan.writes) == set(plan.piece_writer.tolist())
    # the order writers report their checksums in: writer by writer, each its file's order
    in_order = plan.file_order
    assert sorted(in_order.tolist()) == list(range(len(plan.piece_key)))
    assert plan.piece_writer[in_order].tolist() == sorted(plan.piece_writer.tolist())
    assert plan.piece_leaf[in_order].tolist() == [x for r in sorted(plan.writes) for x in plan.writes[r].tolist()]

    shuffled = list(summaries)
    rnd.shuffle(shuffled)
    assert_same_plan(plan, save_plan.plan_save(shuffled))
    assert_same_plan(plan, save_plan.plan_save(through_wire(shuffled)))


@fast(200)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.integers(1, 9))
def test_plan_save_balances_fully_replicated_pieces_within_the_largest_piece(sizes, world):
    pieces = [(f"k{i}", "uint8", (n,), Box.whole((n,))) for i, n in enumerate(sizes)]
    plan = save_plan.plan_save([summary(r, pieces) for r in range(world)])
    per_rank = np.zeros(world, dtype=np.int64)
    np.add.at(per_rank, plan.piece_writer, plan.piece_nbytes)
    assert per_rank.sum() == sum(sizes)  # each piece written once
    assert per_rank.max() - per_rank.min() <= max(sizes)


def test_plan_save_ties_go_to_the_lowest_rank_and_single_holders_write_their_own():
    shared = ("w", "float32", (4,), Box.whole((4,)))
    plan = save_plan.plan_save([summary(2, [shared, ("a", "uint8", (3,), Box.whole((3,)))]), summary(1, [shared])])
    rows = plan_rows(plan)
    assert plan.piece_writer[rows[("w", (0,), (4,))]] == 1
    assert plan.piece_writer[rows[("a", (0,), (3,))]] == 2


def test_plan_save_of_ranks_holding_different_keys_merges_their_structure():
    s0 = summary(0, [("a", "float32", (2,), Box.whole((2,)))])
    s1 = summary(1, [("b", "int64", (3,), Box.whole((3,)))])
    plan = save_plan.plan_save([s1, s0])
    assert plan.keys == ("a", "b")
    assert nested.tensor_keys(plan.skeleton) == ["a", "b"]
    assert plan.writes[0].tolist() == [0] and plan.writes[1].tolist() == [0]


@pytest.mark.parametrize(
    "other, words",
    [
        (("w", "float64", (4, 4)), ["float32", "float64"]),
        (("w", "float32", (4, 5)), ["(4, 4)", "(4, 5)"]),
    ],
)
@pytest.mark.parametrize("via_wire", [False, True])
def test_plan_save_refuses_ranks_that_disagree_on_dtype_or_shape(other, words, via_wire):
    key, dtype, g = other
    summaries = [
        summary(0, [("w", "float32", (4, 4), Box((0, 0), (2, 4)))]),
        summary(1, [(key, dtype, g, Box((2, 0), (2, 4)))]),
    ]
    if via_wire:
        summaries = through_wire(summaries)
    with pytest.raises(MismatchError) as info:
        save_plan.plan_save(summaries)
    message = str(info.value)
    for w in ["w", "rank 0", "rank 1", *words]:
        assert w in message, (w, message)


@pytest.mark.parametrize(
    "boxes, words",
    [
        ([Box((0,), (3,)), Box((4,), (2,))], ["gap"]),  # row 3 missing
        ([Box((0,), (4,)), Box((2,), (4,))], ["overlap"]),
        ([Box((0,), (3,)), Box((1,), (2,)), Box((3,), (3,))], ["overlap"]),
        ([None, None], ["no piece"]),
    ],
)
def test_plan_save_refuses_pieces_that_do_not_tile(boxes, words):
    summaries = [summary(r, [("layer.w", "float32", (6,), b)]) for r, b in enumerate(boxes)]
    with pytest.raises(PlanError) as info:
        save_plan.plan_save(summaries)
    assert "layer.w" in str(info.value)
    for w in words:
        assert w in str(info.value)


def test_build_metadata_refuses_a_wrong_number_of_checksums():
    plan = save_plan.plan_save([summary(0, [("w", "uint8", (200,), Box.whole((200,)))])])
    with pytest.raises(PlanError, match="rank 0 reported 1 checksums, expected 4"):
        save_plan.build_metadata(plan, {0: np.zeros(1, np.uint64)}, plan.skeleton, 0, 1, 64)


def test_metadata_puts_each_writers_checksums_on_its_pieces_with_or_without_the_plans_file_order():
    # three writers of a piece of 4 blocks (key a) and one of 2 (key b) each, of 64 bytes; a
    # writer reports its sums in its file's order: b's row comes after a's in its summary
    summaries = [summary(r, [("a", "uint8", (3, 200), Box((r, 0), (1, 200))),
                             ("b", "uint8", (3, 70), Box((r, 0), (1, 70)))]) for r in range(3)]
    plan = save_plan.plan_save(summaries)
    sums = {r: np.arange(6, dtype=np.uint64) + np.uint64(100 * r) for r in range(3)}
    for p in (plan, dataclasses.replace(plan, file_order=None)):
        meta = save_plan.build_metadata(p, sums, p.skeleton, 0, 3, 64)
        for key, blocks in (("a", [0, 1, 2, 3]), ("b", [4, 5])):
            pieces = meta.tensors[key].pieces
            writers = [int(meta.files[f].name.split("_")[0]) for f in pieces.files.tolist()]
            assert writers == [0, 1, 2]  # a writer per row of the key
            assert pieces.checksums.tolist() == [100 * r + b for r in range(3) for b in blocks]


def test_layout_offsets_align_every_piece():
    starts, total = save_plan.layout_offsets([1, 64, 65, 0, 3])
    assert starts.tolist() == [0, 64, 128, 256, 256] and total == 259
    starts, total = save_plan.layout_offsets([])
    assert len(starts) == 0 and total == 0


# ------------------------------------------------------------------ several boxes per key, and replicas
def test_pieces_of_one_key_must_be_one_run_in_skeleton_order():
    skeleton = {"d": [["a", {"t": 0}], ["b", {"t": 0}]]}
    a, b = flat_pieces("a", 0, 7), flat_pieces("b", 0, 20)
    with pytest.raises(PlanError):
        save_plan.SaveSummary.from_pieces(0, skeleton, [a[0], b[0], a[1]])


@fast(150)
@given(st.integers(0, 20), st.integers(0, 20))
def test_stage2_flat_ranges_on_two_ranks_tile_the_tensor_exactly_once(cut, dp_cut):
    """Rank 0 holds [0, cut), rank 1 [cut, 20) of one key; a second key replicated on both
    (same range on both: its boxes are deduplicated to one writer)."""
    s0 = summary_of(0, {"w": flat_pieces("w", 0, cut), "r": flat_pieces("r", 0, dp_cut)})
    s1 = summary_of(1, {"w": flat_pieces("w", cut, 20), "r": flat_pieces("r", 0, dp_cut)})
    if dp_cut != 20:  # r is not covered: a gap
        with pytest.raises(PlanError):
            plan_of([s0, s1])
        return
    plan = plan_of([s0, s1])
    assert (covered(plan, "w") == 1).all() and (covered(plan, "r") == 1).all()
    assert plan_of([s1, s0]).piece_writer.tolist() == plan.piece_writer.tolist()
    # every writer's rows name pieces of its own summary, in its order
    for r, s in ((0, s0), (1, s1)):
        mine = np.flatnonzero(plan.piece_writer == r)
        for i in mine.tolist():
            nd = 2
            got = Box(tuple(plan.piece_offsets[i, :nd].tolist()), tuple(plan.piece_shapes[i, :nd].tolist()))
            assert s.piece_box(int(plan.piece_leaf[i])) == got


def test_overlapping_flat_ranges_are_refused():
    s0 = summary_of(0, {"w": flat_pieces("w", 0, 12)})
    s1 = summary_of(1, {"w": flat_pieces("w", 10, 20)})
    with pytest.raises(PlanError, match="w"):
        plan_of([s0, s1])


def test_a_summary_whose_rows_do_not_map_onto_its_leaves_is_refused():
    s = summary_of(0, {"w": flat_pieces("w", 0, 20)})
    bad = save_plan.SaveSummary.of(0, s.skeleton, s.dtypes, s.global_shapes, np.zeros((2, 5), np.int64), row_leaf=np.array([1, 1]))
    with pytest.raises(PlanError, match="rows"):
        save_plan.plan_save([bad])


def test_save_replicas_writes_every_holders_copy_and_the_default_one():
    once, every = plan_of(replicated()), plan_of(replicated(), replicas=True)
    assert (covered(once, "w") == 1).all() and (covered(every, "w") == 2).all()
    assert (covered(every, "h") == 1).all()  # held once: written once either way
    w = every.keys.index("w")
    assert sorted(every.piece_writer[every.piece_key == w].tolist()) == [0, 1]
    assert every.file_bytes[0] == every.file_bytes[1] and sum(every.file_bytes.values()) > sum(once.file_bytes.values())


def test_replicas_still_check_the_tiling():
    s0 = summary_of(0, {"w": flat_pieces("w", 0, 12)})
    s1 = summary_of(1, {"w": flat_pieces("w", 10, 20)})
    with pytest.raises(PlanError):
        plan_of([s0, s1], replicas=True)


def test_keys_a_policy_compresses_are_planned_at_their_stored_sizes():
    from paddle_dcp.core.compress import policy_of

    pieces = lambda r: [  # noqa: E731 - two ranks, rows of a (9, 70) float32, a (600,) bfloat16 replicated, int64 plain
        ("a", "float32", (9, 70), Box((5 * r, 0), (5 - r, 70))),
        ("b", "bfloat16", (600,), Box.whole((600,))),
        ("c", "int64", (3,), Box.whole((3,))),
    ]
    policy = policy_of({"a": "int8", "b|c": "int4"})
    plan = save_plan.plan_save([summary(r, pieces(r)) for r in (0, 1)], compress=policy)
    assert dict(zip(plan.keys, plan.encodings)) == {"a": "int8", "b": "int4", "c": None}
    # whole blocks of 256 elements: 264 bytes each in int8, 136 in int4 (docs/format.md)
    want = {("a", 0): 2 * 264, ("a", 5): 2 * 264, ("b", 0): 3 * 136, ("c", 0): 24}
    got = {(plan.keys[k], int(o[0])): int(n) for k, o, n in zip(plan.piece_key, plan.piece_offsets, plan.piece_nbytes)}
    assert got == want
    for r, rows in plan.writes.items():  # each file's size: its pieces, each at a multiple of 64
        mine = np.flatnonzero(plan.piece_writer == r)
        end = max(int(plan.piece_byte_offset[i] + plan.piece_nbytes[i]) for i in mine)
        assert plan.file_bytes[r] == end and all(plan.piece_byte_offset[i] % ALIGNMENT == 0 for i in mine)
    assert save_plan.plan_save([summary(r, pieces(r)) for r in (0, 1)]).encodings == (None, None, None)


def test_keys_a_policy_derives_get_no_pieces_and_their_parameter_as_the_ranks_found_it():
    from paddle_dcp.core.compress import policy_of

    pieces = lambda r: [  # noqa: E731 - two ranks: a bfloat16 parameter by rows, its master weight by columns
        ("p", "bfloat16", (6, 8), Box((3 * r, 0), (3, 8))),
        ("p.w_0", "float32", (6, 8), Box((0, 4 * r), (6, 4))),
        ("q", "float32", (5,), Box.whole((5,))),
    ]
    policy = policy_of({r"\.w_0$": "derived"})
    summaries = through_wire([
        save_plan.SaveSummary.from_pieces(r, {"d": [[k, {"t": 0}] for k, *_ in pieces(r)]},
                                          [save_plan.LocalPiece(k, d, g, b) for k, d, g, b in pieces(r)], {"p.w_0": "p"})
        for r in (0, 1)
    ])  # fmt: skip
    assert [s.derived for s in summaries] == [(("p.w_0", "p"),)] * 2  # the wire carries what each rank found
    plan = save_plan.plan_save(summaries, compress=policy)
    assert dict(zip(plan.keys, plan.encodings)) == {"p": None, "p.w_0": "derived", "q": None}
    assert dict(zip(plan.keys, plan.sources)) == {"p": None, "p.w_0": "p", "q": None}
    assert sorted(plan.keys[k] for k in plan.piece_key.tolist()) == ["p", "p", "q"]  # none of p.w_0's
    assert sum(plan.file_bytes.values()) <= 6 * 8 * 2 + 5 * 4 + 2 * 64
    meta = save_plan.build_metadata(plan, {r: np.zeros(1 + (r == 0), np.uint64) for r in plan.file_bytes}, {"d": []}, 0, 2, 1 << 20)
    entry = meta.tensors["p.w_0"]
    assert (entry.encoding, entry.source, entry.pieces.count, meta.format_version) == ("derived", "p", 0, 2)
    with pytest.raises(MismatchError, match="no rank found its parameter"):  # a rank must say
        save_plan.plan_save([summary(r, pieces(r)) for r in (0, 1)], compress=policy)


def _moe_summaries(n_ranks: int, dense: int, experts: int) -> list[save_plan.SaveSummary]:
    """A mixture-of-experts layout: every rank holds ``dense`` tensors (each split by rank along
    dim 0) and its own ``experts`` expert tensors, whole; every rank's layout differs."""
    out = []
    for r in range(n_ranks):
        keys = [f"model.d{i}" for i in range(dense)] + [f"model.e{r}.{j}" for j in range(experts)]
        pieces = [save_plan.LocalPiece(k, "float32", (n_ranks, 4), Box((r, 0), (1, 4))) for k in keys[:dense]]
        pieces += [save_plan.LocalPiece(k, "bfloat16", (8, 4), Box((0, 0), (8, 4))) for k in keys[dense:]]
        skeleton = {"d": [["model", {"d": [[k[6:], {"t": 0}] for k in keys]}], ["step", {"x": 0}]]}
        out.append(save_plan.SaveSummary.from_pieces(r, skeleton, pieces))
    return [wire.decode_summary(wire.encode_summary(s), s.rank, {}) for s in out]


def _plan_calls(summaries) -> int:
    from .metadata_cases import calls_of

    return calls_of(lambda: save_plan.plan_save(summaries))


def test_planning_work_grows_with_the_pieces_held_not_with_tensors_times_ranks():
    """The coordinator's work at ten times the tensors (expert tensors, every rank's layout
    its own) and at ten times the ranks: calls grow at most ten-fold, as the pieces do (a step
    costing tensors x ranks would grow a hundred-fold)."""
    base = _plan_calls(_moe_summaries(8, dense=20, experts=125))  # 1,020 tensors
    more_tensors = _plan_calls(_moe_summaries(8, dense=20, experts=1250))  # 10,020 tensors
    more_ranks = _plan_calls(_moe_summaries(80, dense=20, experts=125))  # ten times the ranks and pieces
    assert more_tensors <= 10.5 * base
    assert more_ranks <= 10.5 * base


def test_ranks_that_disagree_on_a_keys_shape_are_named_with_both_sides_among_many():
    summaries = _moe_summaries(4, dense=3, experts=2)
    bad = save_plan.SaveSummary.of(3, summaries[3].skeleton, summaries[3].dtypes,
                                   [(4, 5)] + list(summaries[3].global_shapes[1:]), summaries[3].boxes)
    with pytest.raises(MismatchError, match=r"model\.d0: rank 0 holds dtype float32 shape \(4, 4\), rank 3 holds dtype "
                                            r"float32 shape \(4, 5\)"):
        save_plan.plan_save(summaries[:3] + [bad])


@pytest.mark.parametrize("bad_rank", [0, 1, 2])
@pytest.mark.parametrize("row_leaf,ok", [
    ([0, 1, 2], True), ([0, 0, 1, 2], True), ([0, 1, 1, 2, 2], True),
    ([1, 1, 2], False),  # the first row is not the first leaf's
    ([0, 1, 1], False),  # the last leaf has no row
    ([0, 2, 2], False),  # leaf 1 skipped
    ([0, 1, 0, 2], False),  # back to leaf 0
])
def test_every_summarys_rows_are_checked_to_map_onto_its_leaves(bad_rank, row_leaf, ok):
    """Among three ranks (the others well formed, holding nothing), the one whose rows do not
    run over its leaves in order is named, wherever it stands."""
    full = summary_of(9, {k: flat_pieces(k, 0, 20) for k in "abc"})

    def empty(rank, leaves):
        return save_plan.SaveSummary.of(rank, full.skeleton, full.dtypes, full.global_shapes,
                                        np.zeros((len(leaves), 5), np.int64), row_leaf=np.array(leaves))

    others = [summary_of(r, {k: flat_pieces(k, 0, 20) for k in "abc"}) if r == 0 else empty(r, [0, 1, 2])
              for r in range(3) if r != bad_rank]
    summaries = others + [empty(bad_rank, row_leaf)]
    if bad_rank == 0:  # the pieces held by another rank
        summaries = [summary_of(1, {k: flat_pieces(k, 0, 20) for k in "abc"}), empty(2, [0, 1, 2]), empty(0, row_leaf)]
    if ok:
        save_plan.plan_save(summaries)
    else:
        with pytest.raises(PlanError, match=f"rank {bad_rank}: summary rows do not map onto its 3 leaves"):
            save_plan.plan_save(summaries)


def test_a_summary_with_more_leaves_of_rows_than_rows_is_refused():
    full = summary_of(0, {k: flat_pieces(k, 0, 20) for k in "abc"})
    bad = save_plan.SaveSummary.of(1, full.skeleton, full.dtypes, full.global_shapes,
                                   np.zeros((2, 5), np.int64), row_leaf=np.array([0, 1, 2]))
    with pytest.raises(PlanError, match="rank 1: summary rows"):
        save_plan.plan_save([full, bad])


def greedy_oracle(groups, sizes, loads):
    """Each piece in turn to its least loaded holder, the first (lowest) on a tie."""
    loads, picks = list(loads), []
    for holders, size in zip(groups, sizes):
        j = min(range(len(holders)), key=lambda i: (loads[holders[i]], i))
        loads[holders[j]] += size
        picks.append(j)
    return picks, loads


@fast(300)
@given(st.data())
def test_writers_picked_by_holder_set_equal_one_scan_per_piece(data):
    """Holder sets drawn from a few (equal, nested, overlapping, disjoint), so pieces of one
    set load holders of another between its turns."""
    world = data.draw(st.integers(1, 12))
    family = data.draw(st.lists(st.sets(st.integers(0, world - 1), min_size=1), min_size=1, max_size=5))
    groups = [sorted(family[i]) for i in data.draw(st.lists(st.integers(0, len(family) - 1), max_size=40))]
    sizes = data.draw(st.lists(st.integers(0, 50), min_size=len(groups), max_size=len(groups)))
    start = data.draw(st.lists(st.integers(0, 60), min_size=world, max_size=world))
    holders = np.array([h for g in groups for h in g], dtype=np.int64)
    counts = np.array([len(g) for g in groups], dtype=np.int64)
    sets = save_plan._holder_sets(holders, counts)
    assert sets is not None
    assert [groups[s] for s in sets.tolist()] == groups  # each piece's set: a piece with its holders
    loads = np.array(start, dtype=np.int64)
    picks = save_plan._greedy_by_set(holders, counts, np.array(sizes, dtype=np.int64), loads, sets)
    want, want_loads = greedy_oracle(groups, sizes, start)
    assert picks.tolist() == want and loads.tolist() == want_loads
    scanned = np.array(start, dtype=np.int64)
    assert save_plan._greedy(holders, counts, np.array(sizes, dtype=np.int64), scanned).tolist() == want


def test_holder_sets_refuse_a_holder_listed_twice():
    assert save_plan._holder_sets(np.array([0, 1, 1, 2]), np.array([3, 1])) is None


@pytest.mark.parametrize("values", [[3, 0, 3, 7], [5], [10**9, 2, 10**9], [-4, 1, -4, 0]])
def test_dense_ids_of_ranks_by_table_or_by_sort(values):
    """Few small ranks take the lookup table, sparse or negative ones the sort."""
    distinct, index = save_plan._dense(np.array(values, dtype=np.int64))
    want = sorted(set(values))
    assert distinct.tolist() == want and index.tolist() == [want.index(v) for v in values]


def test_a_summary_of_one_row_per_leaf_with_a_row_missing_is_refused():
    full = summary_of(0, {k: flat_pieces(k, 0, 20) for k in "abc"})
    short = save_plan.SaveSummary.of(1, full.skeleton, full.dtypes, full.global_shapes, np.zeros((2, 3), np.int64))
    with pytest.raises(PlanError, match="rank 1: summary rows do not map onto its 3 leaves"):
        save_plan.plan_save([full, short])


def test_summaries_decoded_together_are_planned_without_copying_their_rows(monkeypatch):
    """The coordinator's every held row lies in one table, which the plan groups as it is."""
    per_rank = [summary_of(r, {k: flat_pieces(k, 0, 10) if r % 2 else flat_pieces(k, 10, 20) for k in "abc"}) for r in range(4)]
    decoded = wire.decode_summaries([s.rank for s in per_rank], [wire.encode_summary(s) for s in per_rank])
    seen = []
    real = save_plan._distinct_pieces
    monkeypatch.setattr(save_plan, "_distinct_pieces", lambda key, table, *a: seen.append(table) or real(key, table, *a))
    plan = save_plan.plan_save(decoded)
    assert np.shares_memory(seen[0], decoded[0].boxes) and np.shares_memory(seen[0], decoded[-1].boxes)
    assert np.array_equal(plan.piece_writer, save_plan.plan_save(per_rank).piece_writer)


# ------------------------------------------------------------------ distinct_pieces
def test_distinct_pieces_lists_each_box_once_with_its_holders_ascending_in_any_order():
    """What a gathered save chooses its senders from: w's row blocks each held by two ranks,
    b by all four, c by rank 3 alone (the oracle: the boxes written out here)."""
    w = lambda r: ("w", "float32", (4, 3), Box((2 * (r % 2), 0), (2, 3)))  # noqa: E731
    b = ("b", "int64", (2,), Box.whole((2,)))
    held = [summary(r, [w(r), b] + ([("c", "bfloat16", (5,), Box.whole((5,)))] if r == 3 else [])) for r in range(4)]
    for order in (held, held[::-1], [held[2], held[0], held[3], held[1]]):
        found = save_plan.distinct_pieces(order)
        assert found.keys == ("b", "c", "w") and found.dtypes == ("int64", "bfloat16", "float32")
        assert found.shapes == ((2,), (5,), (4, 3))
        assert found.of(0) == [(Box((0,), (2,)), [0, 1, 2, 3])]
        assert found.of(1) == [(Box((0,), (5,)), [3])]
        assert found.of(2) == [(Box((0, 0), (2, 3)), [0, 2]), (Box((2, 0), (2, 3)), [1, 3])]
        assert [found.position(k) for k in ("b", "c", "w")] == [0, 1, 2]
    with pytest.raises(KeyError):
        found.position("a")


def test_distinct_pieces_checks_what_a_save_plan_checks():
    ok = summary(0, [("w", "float32", (4,), Box((0,), (2,)))])
    with pytest.raises(MismatchError, match="w"):
        save_plan.distinct_pieces([ok, summary(1, [("w", "float64", (4,), Box((2,), (2,)))])])
    with pytest.raises(PlanError, match="w"):
        save_plan.distinct_pieces([ok, summary(1, [("w", "float32", (4,), Box((1,), (3,)))])])


def test_gather_senders_take_the_gathering_ranks_own_pieces_then_the_least_loaded_holder():
    """A gathered save's policy over the same distinct pieces: the gathering rank sends
    nothing it holds; each other piece goes, in the keys' order, to the holder that has sent
    the fewest elements so far (ties to the lowest rank)."""
    halves = [Box((0,), (4,)), Box((4,), (4,))]
    ranks = {
        0: [("a", "float32", (8,), halves[0])],  # the gathering rank: half of a
        1: [("a", "float32", (8,), halves[1]), ("b", "float32", (6,), Box.whole((6,))), ("c", "int64", (2,), Box.whole((2,)))],
        2: [("a", "float32", (8,), halves[1]), ("b", "float32", (6,), Box.whole((6,))), ("c", "int64", (2,), Box.whole((2,)))],
    }
    distinct = save_plan.distinct_pieces([summary(r, p) for r, p in ranks.items()])
    chosen = save_plan.gather_senders(distinct, ["a", "b", "c"], root=0)
    assert chosen["a"] == [(0, halves[0]), (1, halves[1])]  # its own half; the other: a tie, rank 1
    assert chosen["b"] == [(2, Box.whole((6,)))]  # rank 1 has sent 4 elements, rank 2 none
    assert chosen["c"] == [(1, Box.whole((2,)))]  # 4 against 6: rank 1
