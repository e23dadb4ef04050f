"""Pure parts of ShardedWeight and save_replicas support: a rank holding one key as several
boxes (a flattened range), every holder writing its copy, the metadata that records copies,
and a load choosing one copy per box. Oracles: boxes written out by hand and numpy markers."""
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.core import load_plan, save_plan
from paddle_dcp.parallel import wire
from paddle_dcp.core.boxes import Box, flat_range_boxes
from paddle_dcp.errors import FormatError, PlanError
from paddle_dcp.core.metadata import blocks_of
from paddle_dcp.core.metadata_parse import parse_metadata

from ..helpers import fast

SHAPE = (4, 5)


def flat_pieces(key, start, stop, shape=SHAPE, dtype="float32"):
    return [save_plan.LocalPiece(key, dtype, shape, b) for b in flat_range_boxes(shape, start, stop)] or [
        save_plan.LocalPiece(key, dtype, shape, None)
    ]


def summary_of(rank, per_key):
    """per_key: key -> list of LocalPiece (one key may have several)."""
    skeleton = {"d": [[k, {"t": 0}] for k in per_key] + [["step", {"v": 1}]]}
    return save_plan.SaveSummary.from_pieces(rank, skeleton, [p for ps in per_key.values() for p in ps])


def plan_of(summaries, replicas=False, wired=True):
    if wired:
        cache: dict = {}
        summaries = [wire.decode_summary(wire.encode_summary(s), s.rank, cache) for s in summaries]
    return save_plan.plan_save(summaries, replicas)


def meta_of(plan, block_bytes=64):
    sums = {}
    for r, rows in plan.writes.items():
        mine = np.flatnonzero(plan.piece_writer == r)
        n = int(blocks_of(plan.piece_nbytes[mine], block_bytes).sum())
        sums[r] = np.arange(n, dtype=np.uint64) + 1000 * r
    return save_plan.build_metadata(plan, sums, plan.skeleton, 0, 2, block_bytes)


def covered(plan, key):
    """How often every element of ``key`` is written, as a numpy marker array."""
    k = plan.keys.index(key)
    nd = len(plan.shapes[k])
    marks = np.zeros(plan.shapes[k], dtype=np.int64)
    for i in np.flatnonzero(plan.piece_key == k):
        box = Box(tuple(plan.piece_offsets[i, :nd].tolist()), tuple(plan.piece_shapes[i, :nd].tolist()))
        marks[box.slices()] += 1
    return marks


# ------------------------------------------------------------------ several boxes per key
def test_summary_with_several_rows_for_one_leaf_round_trips_the_wire():
    s = summary_of(1, {"a": flat_pieces("a", 3, 17), "b": [save_plan.LocalPiece("b", "int64", (3,), Box.whole((3,)))]})
    assert len(s.boxes) == 4 and s.row_leaf.tolist() == [0, 0, 0, 1]
    back = wire.decode_summary(wire.encode_summary(s), 1)
    assert back.row_leaf.tolist() == [0, 0, 0, 1] and np.array_equal(back.boxes, s.boxes)
    assert [back.piece_box(i) for i in range(4)] == [Box((0, 3), (1, 2)), Box((1, 0), (2, 5)), Box((3, 0), (1, 2)), Box((0,), (3,))]
    assert back.dtypes == ("float32", "int64")
    one = summary_of(0, {"b": [save_plan.LocalPiece("b", "int64", (3,), Box.whole((3,)))]})
    assert one.row_leaf is None and wire.encode_summary(one)[:4] == b"DCS1"  # unchanged message


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
    bad = save_plan.SaveSummary(0, s.skeleton, s.dtypes, s.global_shapes, np.zeros((2, 5), np.int64), row_leaf=np.array([1, 1]))
    with pytest.raises(PlanError, match="rows"):
        save_plan.plan_save([bad])


# ------------------------------------------------------------------ replicas
def replicated(world=2):
    whole = [save_plan.LocalPiece("w", "float32", SHAPE, Box.whole(SHAPE))]
    halves = [flat_pieces("h", 0, 10), flat_pieces("h", 10, 20)]
    return [summary_of(r, {"w": whole, "h": halves[r % 2]}) for r in range(world)]


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


def test_replicas_metadata_round_trips_and_without_them_is_unchanged():
    meta = meta_of(plan_of(replicated(), replicas=True))
    doc = json.loads(meta.to_json())
    assert doc["replicas"] is True and doc["tensors"]["w"]["count"] == 2
    back = parse_metadata(meta.to_json())
    assert back.replicas and back.tensors["w"].pieces.count == 2
    plain = meta_of(plan_of(replicated()))
    assert "replicas" not in json.loads(plain.to_json()) and not parse_metadata(plain.to_json()).replicas


def edit(meta, fn):
    doc = json.loads(meta.to_json())
    del doc["digest"]
    fn(doc)
    return json.dumps(doc).encode()


def test_copies_are_refused_without_the_replicas_flag_or_in_one_file():
    meta = meta_of(plan_of(replicated(), replicas=True))
    with pytest.raises(FormatError, match="overlap"):
        parse_metadata(edit(meta, lambda d: d.pop("replicas")))
    with pytest.raises(FormatError, match="same file"):
        parse_metadata(edit(meta, lambda d: d["tensors"]["w"].__setitem__("file", [0, 0])))
    with pytest.raises(FormatError, match="replicas"):
        parse_metadata(edit(meta, lambda d: d.__setitem__("replicas", 1)))


def test_a_copy_that_only_overlaps_is_refused_even_with_replicas():
    meta = meta_of(plan_of(replicated(), replicas=True))

    def shift(d):  # second copy of w one row shorter: not an equal box, so it overlaps
        d["tensors"]["w"]["shapes"] = [4, 5, 3, 5]

    with pytest.raises(FormatError, match="overlap"):
        parse_metadata(edit(meta, shift))


def test_a_load_reads_one_copy_from_a_file_it_can_read():
    meta = parse_metadata(meta_of(plan_of(replicated(), replicas=True)).to_json())
    target = load_plan.TargetPiece("w", "float32", SHAPE, Box((1, 0), (2, 5)))
    for readable, file in (([True, False], 0), ([False, True], 1), (None, 0), ([False, False], 0)):
        ops = load_plan.plan_reads(meta, [target], readable=None if readable is None else np.array(readable))
        assert {op.file for op in ops} == {file}, (readable, ops)
        marks = np.zeros(SHAPE, np.int64)
        for op in ops:
            for seg in op.segments:
                for cp in seg.copies:
                    marks[Box(tuple(a + b for a, b in zip(cp.region_in_target.offsets, (1, 0))), cp.region_in_target.shape).slices()] += 1
        assert marks[1:3].tolist() == [[1] * 5] * 2 and marks.sum() == 10
