"""Save plans (dedup, balance, order independence, refusals), load plans end to end through
real files, and key matching.

Oracles: the set of boxes every rank holds (from paddle's chunking rule written by hand, see
helpers.ref_box) and numpy slices of the global arrays, compared bit for bit.
"""
import math
import tempfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.io import reads
from paddle_dcp.core import keys, load_plan, nested, save_plan
from paddle_dcp.parallel import wire
from paddle_dcp.io import local
from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import FormatError, IntegrityError, MismatchError, PlanError
from paddle_dcp.core.metadata import ALIGNMENT
from paddle_dcp.core.metadata_parse import parse_metadata

from ..helpers import (
    coords,
    count_copies,
    fast,
    load_rank,
    meshes,
    placements_for,
    random_array,
    rank_states,
    ref_box,
    same_bits,
    save_checkpoint,
    shapes,
)

DTYPES = ["float32", "int64", "bool", "float16", "uint8"]
ITEMSIZE = {"float32": 4, "int64": 8, "bool": 1, "float16": 2, "uint8": 1, "float64": 8}


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


# ------------------------------------------------------------------ strategies
@st.composite
def layouts(draw, max_world=8, max_tensors=3, max_side=7):
    n = draw(st.integers(1, max_tensors))
    names = [f"t{i}" for i in range(n)]
    shape = {k: draw(shapes(max_ndim=3, max_side=max_side)) for k in names}
    dtypes = {k: draw(st.sampled_from(DTYPES)) for k in names}
    mesh = draw(meshes(max_world))
    placements = {k: draw(placements_for(len(mesh), len(shape[k]))) for k in names}
    return shape, dtypes, mesh, placements


def arrays_for(shape, dtypes, seed):
    rng = np.random.default_rng(seed)
    return {k: random_array(rng, dtypes[k], s) for k, s in shape.items()}


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


# ------------------------------------------------------------------ save then load, through files
def load_everything(path, shape, dtypes, mesh, placements, arrays, block_bytes, **plan_kw):
    max_read = max(plan_kw.get("max_read_bytes", 64 << 20), 2 * block_bytes + 64)
    for coord in coords(mesh):
        targets = [
            load_plan.TargetPiece(f"model.{k}", dtypes[k], shape[k], ref_box(shape[k], mesh, placements[k], coord))
            for k in shape
        ]
        out, ops = load_rank(path, 0, targets, **plan_kw)
        part, _ = load_rank(path, 0, targets, restrict=True, **plan_kw)
        for t, got, got_part in zip(targets, out, part):
            want = arrays[t.key.split(".")[1]][t.box.slices()]
            assert same_bits(got, want), (t, got, want)
            assert same_bits(got_part, want), ("restricted metadata", t, got_part, want)
        for t, n in zip(targets, count_copies(ops, targets)):
            assert (n == 1).all(), f"{t.key}: elements copied {np.unique(n)} times"
        for op in ops:
            assert 0 < op.nbytes <= max_read
            for seg in op.segments:
                assert (seg.start - seg.piece.byte_offset) % block_bytes == 0  # whole blocks


@fast(150)
@given(
    layouts(),
    st.data(),
    st.sampled_from([64, 128, 4096]),
    st.sampled_from([1, 300, 64 << 20]),
    st.sampled_from([0, 64, 1 << 16]),
    st.sampled_from([0, 1 << 20]),
    st.integers(0, 2**32 - 1),
)
def test_any_saved_layout_loads_into_any_target_layout_bit_for_bit(
    layout, data, block_bytes, max_read_bytes, coalesce_gap, direct_min_bytes, seed
):
    shape, dtypes, save_mesh, save_pl = layout
    load_mesh = data.draw(meshes(8), label="load mesh")
    load_pl = {k: data.draw(placements_for(len(load_mesh), len(s)), label=f"load {k}") for k, s in shape.items()}
    arrays = arrays_for(shape, dtypes, seed)
    values = {"step": 7, "lr": [0.5, float("nan")]}
    with tempfile.TemporaryDirectory() as d:
        saved = save_checkpoint(d, arrays, dtypes, save_mesh, save_pl, block_bytes, values)
        meta = local.read_metadata(d, 0)
        assert meta.world_size == math.prod(save_mesh)
        assert meta.values()["step"] == 7 and math.isnan(meta.values()["lr.1"])
        assert sorted(meta.tensors) == sorted(f"model.{k}" for k in shape)
        assert len(saved.plan.file_bytes) == len(meta.files)
        load_everything(d, shape, dtypes, load_mesh, load_pl, arrays, block_bytes,
                        max_read_bytes=max_read_bytes, coalesce_gap=coalesce_gap,
                        direct_min_bytes=direct_min_bytes)  # fmt: skip



def every_block(meta, keys):
    """(file, start, stop) of every checksum block of every piece of ``keys``, from the
    metadata's columns alone."""
    out = []
    for key in keys:
        e = meta.tensors[key]
        size = ITEMSIZE[e.dtype]
        for i in range(e.pieces.count):
            n = int(np.prod(e.pieces.shapes[i])) * size
            at, f = int(e.pieces.byte_offsets[i]), int(e.pieces.files[i])
            out += [(f, at + b, at + min(n, b + meta.block_bytes)) for b in range(0, max(n, 1), meta.block_bytes)]
    return out


@fast(120)
@given(layouts(), st.sampled_from([64, 128, 4096]), st.integers(1, 6), st.sampled_from([1, 300, 1 << 20]),
       st.data(), st.integers(0, 2**32 - 1))  # fmt: skip
def test_shared_checks_deal_every_block_to_exactly_one_rank_in_balanced_shares(
    layout, block_bytes, count, max_read_bytes, data, seed
):
    shape, dtypes, mesh, pl = layout
    arrays = arrays_for(shape, dtypes, seed)
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(d, arrays, dtypes, mesh, pl, block_bytes)
        meta = local.read_metadata(d, 0, lazy=True)
        keys = data.draw(st.lists(st.sampled_from(sorted(meta.tensors)), min_size=1, unique=True), label="keys")
        want = every_block(meta, keys)
        dealt, per_rank = [], []
        files = local.FileSet(d, meta)
        try:
            for index in range(count):
                ops = load_plan.plan_shared_checks(meta, keys, index, count, max_read_bytes)
                assert [(op.file, op.start) for op in ops] == sorted((op.file, op.start) for op in ops)
                mine = 0
                for op in ops:
                    assert op.nbytes <= max(max_read_bytes, block_bytes)
                    for seg in op.segments:
                        assert not seg.copies and op.start <= seg.start <= seg.stop <= op.stop
                        piece = seg.piece
                        assert (seg.start - piece.byte_offset) % block_bytes == 0
                        end = piece.byte_offset + piece.nbytes
                        assert seg.stop == end or (seg.stop - piece.byte_offset) % block_bytes == 0
                        for b in range(seg.start, max(seg.stop, seg.start + 1), block_bytes):
                            dealt.append((op.file, b, min(b + block_bytes, end)))
                            mine += min(b + block_bytes, end) - b
                    reads.execute_op(op, files, [], reads.Staging(), check_only=True)  # the real checks pass
                per_rank.append(mine)
        finally:
            files.close()
        assert sorted(dealt) == sorted(want)  # every block once, no other bytes
        total = sum(b - a for _, a, b in want)
        assert max(per_rank) <= total / count + block_bytes


def test_shared_checks_find_a_flipped_byte_in_exactly_one_share(tmp_path):
    arrays = arrays_for({"w": (64, 16), "b": (40,)}, {"w": "float32", "b": "int64"}, 5)
    save_checkpoint(str(tmp_path), arrays, {"w": "float32", "b": "int64"}, (2,), {"w": (0,), "b": (None,)}, 256)
    name = str(tmp_path / "1_0.distcp")
    raw = bytearray(open(name, "rb").read())
    raw[700] ^= 0x10
    open(name, "wb").write(bytes(raw))
    meta = local.read_metadata(str(tmp_path), 0, lazy=True)
    failed = []
    for index in range(3):
        files = local.FileSet(str(tmp_path), meta)
        try:
            for op in load_plan.plan_shared_checks(meta, ["model.w", "model.b"], index, 3):
                reads.execute_op(op, files, [], reads.Staging(), check_only=True)
        except IntegrityError as exc:
            assert "1_0.distcp" in str(exc) and "checksum" in str(exc)
            failed.append(index)
        finally:
            files.close()
    assert len(failed) == 1


@pytest.mark.parametrize("max_read_bytes", [1, 64 << 20])
def test_every_dtype_and_scalars_round_trip_with_many_checksum_blocks(tmp_path, max_read_bytes):
    rng = np.random.default_rng(1)
    names = ["float32", "int64", "bool", "float16", "uint8", "bfloat16", "complex64", "float64", "int8"]
    shape = {f"{n}_m": (13, 6) for n in names}
    shape.update({f"{n}_s": () for n in names})
    dtypes = {k: k.rsplit("_", 1)[0] for k in shape}
    arrays = {k: random_array(rng, dtypes[k], s) for k, s in shape.items()}
    save_pl = {k: ((0, 1) if s else (None, None)) for k, s in shape.items()}  # Shard(0), Shard(1)
    save_checkpoint(str(tmp_path), arrays, dtypes, (3, 2), save_pl, block_bytes=64)
    load_pl = {k: ((1, None, 0) if s else (None,) * 3) for k, s in shape.items()}
    load_everything(str(tmp_path), shape, dtypes, (2, 2, 2), load_pl, arrays, 64, max_read_bytes=max_read_bytes)
    # NaN payloads included: random bits of float16 / float32 hold many NaNs
    assert np.isnan(arrays["float16_m"]).any()


def test_zero_size_tensors_round_trip(tmp_path):
    shape = {"e": (0, 4), "f": (3, 0), "w": (5,)}
    dtypes = {"e": "float32", "f": "int64", "w": "uint8"}
    arrays = arrays_for(shape, dtypes, 2)
    pl = {"e": (0,), "f": (1,), "w": (0,)}
    save_checkpoint(str(tmp_path), arrays, dtypes, (2,), pl)
    meta = local.read_metadata(str(tmp_path), 0)
    assert meta.tensors["model.e"].pieces.count == 0 and meta.tensors["model.e"].shape == (0, 4)
    load_everything(str(tmp_path), shape, dtypes, (3,), {"e": (1,), "f": (None,), "w": (0,)}, arrays, 64)


def test_plan_reads_refuses_a_target_of_another_shape_or_dtype(tmp_path):
    arrays = {"w": np.zeros((4, 4), np.float32)}
    save_checkpoint(str(tmp_path), arrays, {"w": "float32"}, (1,), {"w": (None,)})
    meta = local.read_metadata(str(tmp_path), 0)
    with pytest.raises(MismatchError) as info:
        load_plan.plan_reads(meta, [load_plan.TargetPiece("model.w", "float32", (4, 5), Box.whole((4, 5)))])
    assert all(w in str(info.value) for w in ["model.w", "(4, 4)", "(4, 5)"])
    with pytest.raises(MismatchError) as info:
        load_plan.plan_reads(meta, [load_plan.TargetPiece("model.w", "float16", (4, 4), Box.whole((4, 4)))])
    assert all(w in str(info.value) for w in ["model.w", "float32", "float16"])



def test_plan_reads_names_each_target_by_its_slot(tmp_path):
    shape = {"w": (6, 4), "s": ()}
    dtypes = {"w": "float32", "s": "int64"}
    arrays = arrays_for(shape, dtypes, 3)
    save_checkpoint(str(tmp_path), arrays, dtypes, (2,), {"w": (0,), "s": (None,)})
    meta = local.read_metadata(str(tmp_path), 0)
    targets = [
        load_plan.TargetPiece("model.w", "float32", (6, 4), Box((0, 1), (6, 2))),  # both saved pieces
        load_plan.TargetPiece("model.s", "int64", (), Box((), ())),
    ]
    plain = load_plan.plan_reads(meta, targets)
    slotted = load_plan.plan_reads(meta, targets, slots=[7, 3])
    assert sorted(c.target for op in plain for seg in op.segments for c in seg.copies) == [0, 0, 1]
    named = [c.target for op in slotted for seg in op.segments for c in seg.copies]
    assert named == [{0: 7, 1: 3}[c.target] for op in plain for seg in op.segments for c in seg.copies]

    def segment_regions(seg):
        return seg.start, seg.stop, [(c.region_in_saved, c.region_in_target) for c in seg.copies]

    def without_targets(ops):
        return [(op.file, op.start, op.stop, [segment_regions(seg) for seg in op.segments]) for op in ops]

    assert without_targets(plain) == without_targets(slotted)
    with pytest.raises(ValueError, match="1 slots for 2 targets"):
        load_plan.plan_reads(meta, targets, slots=[0])

# ------------------------------------------------------------------ keys
@pytest.mark.parametrize(
    "a, b",
    [
        ("opt.master_weights.linear_0.w_0", "opt.linear_0.w_0_fp32_master_0"),
        ("optimizer.master_weights.embedding_0.w_0", "optimizer.embedding_0.w_0_fp32_master_0"),
    ],
)
def test_mw_compatible_name_maps_both_ways(a, b):
    assert keys.mw_compatible_name(a) == b
    assert keys.mw_compatible_name(b) == a


@pytest.mark.parametrize("key", ["model.linear_0.w_0", "opt.linear_0.w_0_moment1_0", "step"])
def test_mw_compatible_name_of_other_keys_is_none(key):
    assert keys.mw_compatible_name(key) is None


def test_match_keys_reports_missing_and_unexpected():
    m = keys.match_keys(["a", "b", "c"], ["b", "c", "d", "e"])
    assert m.source == {"b": "b", "c": "c"}
    assert m.missing == ("a",)
    assert m.unexpected == ("d", "e")


def test_match_keys_loads_master_weights_saved_under_the_other_spelling():
    wanted = ["opt.master_weights.linear_0.w_0", "opt.linear_1.w_0_fp32_master_0", "model.w"]
    available = ["opt.linear_0.w_0_fp32_master_0", "opt.master_weights.linear_1.w_0", "model.w"]
    m = keys.match_keys(wanted, available)
    assert m.source == {
        "opt.master_weights.linear_0.w_0": "opt.linear_0.w_0_fp32_master_0",
        "opt.linear_1.w_0_fp32_master_0": "opt.master_weights.linear_1.w_0",
        "model.w": "model.w",
    }
    assert m.missing == () and m.unexpected == ()
    off = keys.match_keys(wanted, available, mw_name_compatibility=False)
    assert off.source == {"model.w": "model.w"}
    assert off.missing == tuple(wanted[:2])
    assert off.unexpected == tuple(available[:2])


def test_match_keys_prefers_the_exact_key():
    m = keys.match_keys(["opt.master_weights.w"], ["opt.master_weights.w", "opt.w_fp32_master_0"])
    assert m.source == {"opt.master_weights.w": "opt.master_weights.w"}
    assert m.unexpected == ("opt.w_fp32_master_0",)


def test_layout_offsets_align_every_piece():
    starts, total = save_plan.layout_offsets([1, 64, 65, 0, 3])
    assert starts.tolist() == [0, 64, 128, 256, 256] and total == 259
    starts, total = save_plan.layout_offsets([])
    assert len(starts) == 0 and total == 0



def _lazy_meta_with_boxes(boxes, shape=(8, 4)):
    """Metadata whose pieces are the given (offsets, shape) boxes, parsed lazily (tiling not
    checked at parse), as a load parses it."""
    doc = {
        "format": "paddle_dcp", "format_version": 1, "unique_id": 0, "world_size": 1,
        "checksum": {"algorithm": "xxh3_64", "block_bytes": 1 << 20},
        "files": [{"name": "0_0.distcp", "bytes": 1 << 20}],
        "structure": {"d": [["w", {"t": 0}]]},
        "tensors": {"w": {
            "dtype": "float32", "shape": list(shape), "count": len(boxes),
            "offsets": [x for o, _ in boxes for x in o], "shapes": [x for _, s in boxes for x in s],
            "file": [0] * len(boxes), "byte_offset": [4096 * i for i in range(len(boxes))],
            "checksums": ["0" * 16] * len(boxes),
        }},
    }  # fmt: skip
    import json

    return parse_metadata(json.dumps(doc), lazy=True)


def test_lazy_metadata_with_overlapping_pieces_is_refused_where_a_target_uses_them():
    # rows 0-4 and rows 3-7 overlap on rows 3-4; total volume equals the tensor's
    meta = _lazy_meta_with_boxes([((0, 0), (5, 4)), ((3, 0), (5, 4))])
    with pytest.raises(PlanError, match="overlap"):
        load_plan.plan_reads(meta, [load_plan.TargetPiece("w", "float32", (8, 4), Box((0, 0), (8, 4)))])
    # an eager parse refuses the file outright
    with pytest.raises(FormatError):
        parse_metadata(_lazy_meta_with_boxes([((0, 0), (5, 4)), ((3, 0), (5, 4))]).to_json())


def test_lazy_metadata_with_a_gap_is_refused_where_a_target_needs_it():
    meta = _lazy_meta_with_boxes([((0, 0), (3, 4)), ((4, 0), (4, 4))])  # row 3 missing
    with pytest.raises(PlanError, match="cover"):
        load_plan.plan_reads(meta, [load_plan.TargetPiece("w", "float32", (8, 4), Box((2, 0), (4, 4)))])
    # a target that avoids the gap loads
    ops = load_plan.plan_reads(meta, [load_plan.TargetPiece("w", "float32", (8, 4), Box((4, 0), (4, 4)))])
    assert sum(c.region_in_target.volume for op in ops for s in op.segments for c in s.copies) == 16


def test_a_scalar_loads_from_its_one_piece_and_is_refused_without_one():
    target = load_plan.TargetPiece("w", "float32", (), Box((), ()))
    one = load_plan.plan_reads(_lazy_meta_with_boxes([((), ())], shape=()), [target])
    assert [(op.start, op.stop, op.direct) for op in one] == [(0, 4, True)]
    with pytest.raises(PlanError, match="w: the checkpoint's pieces cover 0 of the 1 elements"):
        load_plan.plan_reads(_lazy_meta_with_boxes([], shape=()), [target])
    with pytest.raises(FormatError, match="2 pieces"):  # two pieces of a scalar: refused when parsed
        load_plan.plan_reads(_lazy_meta_with_boxes([((), ())] * 2, shape=()), [target])


@pytest.mark.parametrize("count", [3, 16, 17, 40])  # plain Python up to 16 pieces, numpy above
def test_overlapping_pieces_and_overlap_checks_agree_with_brute_force(count):
    rng = np.random.default_rng(count)
    shape = (2 * count, 6)
    boxes = [((2 * i, 0), (2, 6)) for i in range(count)]
    meta = _lazy_meta_with_boxes(boxes, shape)
    entry = meta.tensors["w"]
    for _ in range(50):
        lo = [int(rng.integers(0, s)) for s in shape]
        box = Box(tuple(lo), tuple(int(rng.integers(1, s - a + 1)) for a, s in zip(lo, shape)))
        want = [i for i, (o, s) in enumerate(boxes) if Box(o, s).intersect(box) is not None]
        assert load_plan.overlapping_pieces(entry, box).tolist() == want
    # the last piece moved one row up overlaps its neighbour: refused wherever a target meets both
    moved = boxes[:-1] + [((2 * count - 3, 0), (2, 6))]
    meta = _lazy_meta_with_boxes(moved, shape)
    whole = load_plan.TargetPiece("w", "float32", shape, Box((0, 0), shape))
    with pytest.raises(PlanError, match="overlap"):
        load_plan.plan_reads(meta, [whole])
    top = load_plan.TargetPiece("w", "float32", shape, Box((0, 0), (2 * count - 4, 6)))
    assert load_plan.plan_reads(meta, [top])  # a target away from the overlap plans


# ------------------------------------------------------------------ reconcile
def _sk(sd):
    return nested.flatten(sd, lambda v: isinstance(v, np.ndarray)).skeleton


def test_reconcile_restores_plain_subtrees_whole_and_names_what_is_missing():
    t = np.zeros(1)
    saved = _sk({"w": t, "sched": {"milestones": [3, 1, 4, 1.5]}, "opt": [t, 5], "only_saved": 1})
    target = {"w": t, "sched": {"milestones": []}, "opt": [t, 0, 7], "extra": [1], "x": t}
    r = keys.reconcile(["w", "opt.0", "x"], _sk(target), ["w", "opt.0"], saved)
    assert dict(r.plain) == {("sched",): saved["d"][1][1], ("opt", 1): {"v": 5}}
    assert sorted(r.missing) == ["extra.0", "opt.2", "x"]
    assert r.unexpected == ("only_saved",)
    assert r.match.source == {"w": "w", "opt.0": "opt.0"}


def test_reconcile_leaves_a_target_subtree_holding_tensors_to_the_tensors():
    saved = _sk({"m": {}})
    r = keys.reconcile(["m.w"], _sk({"m": {"w": np.zeros(1)}}), [], saved)
    assert r.plain == () and r.missing == ("m.w",)


def test_reconcile_refuses_a_tensor_against_a_plain_value_either_way():
    with pytest.raises(MismatchError, match="step: the checkpoint holds a plain value here"):
        keys.reconcile(["step"], _sk({"step": np.zeros(1)}), [], _sk({"step": 3}))
    with pytest.raises(MismatchError, match="step: the checkpoint holds a tensor here"):
        keys.reconcile([], _sk({"step": 3}), ["step"], _sk({"step": np.zeros(1)}))


def test_missing_message_names_twenty_keys_and_counts_all():
    text = keys.missing_message([f"k{i}" for i in range(23)], "checkpoint 4 in /ck")
    assert text.startswith("23 key(s) of the state_dict are not in checkpoint 4 in /ck: k0, ")
    assert "k19 and 3 more" in text and "k20" not in text and "strict=False" in text
