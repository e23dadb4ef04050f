"""Load plans: every saved layout loads into every target layout through real files, bit for
bit; the blocks a verify deals out to its ranks; refusals of targets and of lazily parsed
pieces that overlap or leave gaps.

Oracles: numpy slices of the global arrays, compared bit for bit, and boxes and checksum
blocks computed by hand from the metadata's columns.
"""
import math
import tempfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.io import reads
from paddle_dcp.core import load_plan
from paddle_dcp.io import local
from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import FormatError, IntegrityError, MismatchError, PlanError
from paddle_dcp.core.metadata_parse import parse_metadata
from paddle_dcp.io import storage as dcp_storage

from ..helpers import (
    ITEMSIZE,
    arrays_for,
    coords,
    count_copies,
    fast,
    layouts,
    load_rank,
    meshes,
    placements_for,
    random_array,
    ref_box,
    same_bits,
    save_checkpoint,
)
from .replicas import SHAPE, meta_of, plan_of, replicated


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
        meta = dcp_storage.read_metadata(local.LocalStorage(d), 0)
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
        meta = dcp_storage.read_metadata(local.LocalStorage(d), 0, lazy=True)
        keys = data.draw(st.lists(st.sampled_from(sorted(meta.tensors)), min_size=1, unique=True), label="keys")
        want = every_block(meta, keys)
        dealt, per_rank = [], []
        files = local.FileSet(d, meta.files)
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
                    reads.execute_op(op, meta, files, [], reads.Staging(), check_only=True)  # the real checks pass
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
    meta = dcp_storage.read_metadata(local.LocalStorage(str(tmp_path)), 0, lazy=True)
    failed = []
    for index in range(3):
        files = local.FileSet(str(tmp_path), meta.files)
        try:
            for op in load_plan.plan_shared_checks(meta, ["model.w", "model.b"], index, 3):
                reads.execute_op(op, meta, files, [], reads.Staging(), check_only=True)
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
    meta = dcp_storage.read_metadata(local.LocalStorage(str(tmp_path)), 0)
    assert meta.tensors["model.e"].pieces.count == 0 and meta.tensors["model.e"].shape == (0, 4)
    load_everything(str(tmp_path), shape, dtypes, (3,), {"e": (1,), "f": (None,), "w": (0,)}, arrays, 64)


def test_plan_reads_refuses_a_target_of_another_shape_or_dtype(tmp_path):
    arrays = {"w": np.zeros((4, 4), np.float32)}
    save_checkpoint(str(tmp_path), arrays, {"w": "float32"}, (1,), {"w": (None,)})
    meta = dcp_storage.read_metadata(local.LocalStorage(str(tmp_path)), 0)
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
    meta = dcp_storage.read_metadata(local.LocalStorage(str(tmp_path)), 0)
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


def test_a_target_equal_to_a_quantized_piece_reads_its_stored_bytes_and_is_never_direct(tmp_path):
    values = np.random.default_rng(2).standard_normal((40, 100)).astype(np.float32)
    save_checkpoint(str(tmp_path), {"q": values, "p": values}, {"q": "float32", "p": "float32"}, (2,),
                    {"q": (0,), "p": (0,)}, block_bytes=64, compress={r"\.q$": "int4"})  # fmt: skip
    meta = dcp_storage.read_metadata(local.LocalStorage(str(tmp_path)), 0)
    box = Box((20, 0), (20, 100))  # rank 1's piece: 2000 elements, 8 blocks of 136 bytes
    targets = [load_plan.TargetPiece(f"model.{k}", "float32", (40, 100), box) for k in ("q", "p")]
    ops = load_plan.plan_reads(meta, targets, direct_min_bytes=1)
    by_key = {op.segments[0].piece.key: op for op in ops}
    q, p = by_key["model.q"], by_key["model.p"]
    assert not q.direct and q.nbytes == 8 * 136 and len(q.segments) == 1
    assert q.segments[0].start == q.segments[0].piece.byte_offset
    assert p.direct and p.nbytes == 2000 * 4  # the same box of a plain tensor lands in place


def test_a_derived_tensor_reads_its_source_s_pieces_and_casts_every_copy():
    from .hand_metadata import derived_meta

    meta = parse_metadata(derived_meta().to_json(), lazy=True)
    box = Box((5, 8), (10, 20))  # rows 5..15: half in each of m.p's two pieces (rows 0..10, 10..20)
    target = load_plan.TargetPiece("o.p.w_0", "float32", (20, 40), box)
    ops = load_plan.plan_reads(meta, [target], direct_min_bytes=1)
    segs = [seg for op in ops for seg in op.segments]
    assert {seg.piece.key for seg in segs} == {"m.p"} and not any(op.direct for op in ops)
    assert sorted(seg.piece.box.offsets for seg in segs) == [(0, 0), (10, 0)]
    copies = [c for seg in segs for c in seg.copies]
    assert {c.dtype for c in copies} == {"float32"} and sum(c.region_in_target.volume for c in copies) == box.volume
    plain = load_plan.plan_reads(meta, [load_plan.TargetPiece("m.p", "bfloat16", (20, 40), box)], direct_min_bytes=1)
    assert {c.dtype for op in plain for seg in op.segments for c in seg.copies} == {None}
    with pytest.raises(MismatchError, match=r"o\.p\.w_0: checkpoint has dtype float32, state_dict has bfloat16"):
        load_plan.plan_reads(meta, [load_plan.TargetPiece("o.p.w_0", "bfloat16", (20, 40), box)])


def test_the_part_of_the_metadata_for_a_derived_target_lists_it_and_its_source_s_pieces():
    from .hand_metadata import derived_meta

    meta = parse_metadata(derived_meta().to_json())
    part = load_plan.restrict(meta, [load_plan.TargetPiece("o.p.w_0", "float32", (20, 40), Box((12, 0), (3, 40)))])
    again = parse_metadata(part.to_json(), allow_subset=True)  # what the receiving rank parses
    assert sorted(again.tensors) == ["m.p", "o.p.w_0"]
    assert again.tensors["o.p.w_0"].source == "m.p" and again.tensors["m.p"].pieces.offsets.tolist() == [[10, 0]]
    nothing = load_plan.restrict(meta, [], tensor_keys=["o.p.w_0"])  # holds none of it: still listed, with its source
    assert sorted(parse_metadata(nothing.to_json(), allow_subset=True).tensors) == ["m.p", "o.p.w_0"]


# ------------------------------------------------------------------ work per segment (issue 36)
class _CountedFound(tuple):
    """A found segment (load_plan._Found) that counts every read of its fields."""

    reads = 0

    def __getitem__(self, i):
        _CountedFound.reads += 1
        return tuple.__getitem__(self, i)


def _coalesced(n: int, size: int = 2048):
    """``n`` segments of ``size`` bytes back to back in one file (shuffled), merged into reads
    larger than all of them: (the reads, field reads per segment)."""
    order = np.random.default_rng(n).permutation(n).tolist()
    found = [_CountedFound((0, i * size, (i + 1) * size, ("seg", i), True, False)) for i in order]
    _CountedFound.reads = 0
    ops = load_plan._coalesce(found, coalesce_gap=0, max_read_bytes=1 << 40)
    return ops, _CountedFound.reads / n


def test_coalescing_reads_each_segment_a_constant_number_of_times_however_long_the_read():
    small_ops, small = _coalesced(1_000)
    large_ops, large = _coalesced(10_000)
    # by hand: one read of the whole run, its segments in file order, not direct (several)
    for ops, n in ((small_ops, 1_000), (large_ops, 10_000)):
        assert [(op.file, op.start, op.stop, op.direct) for op in ops] == [(0, 0, n * 2048, False)]
        assert list(ops[0].segments) == [("seg", i) for i in range(n)]
    # a read's end is kept as its segments join, not found again from all of them for each one
    assert large <= small + 0.01, (small, large)


def test_a_target_over_many_saved_pieces_checks_them_as_a_grid_not_pair_by_pair(monkeypatch):
    """One target over 10,000 saved pieces (a checkpoint of many ranks loaded onto one): they
    are checked to be disjoint as a grid, in O(p log p), never pair by pair (O(p**2)); pieces
    that do overlap are still named."""
    from paddle_dcp.core.metadata import FileEntry, Metadata, PieceTable, TensorEntry

    def meta_of(offsets):
        n = len(offsets)
        table = PieceTable(np.array(offsets, np.int64).reshape(n, 1), np.full((n, 1), 4, np.int64), np.zeros(n, np.int64),
                           np.arange(n, dtype=np.int64) * 64, np.zeros(n, np.uint64))
        entry = TensorEntry("w", "float32", (4 * n,), table, 1 << 20)
        return Metadata(0, 1, (FileEntry("0_0.distcp", 64 * n),), {"w": entry}, {"d": [["w", {"t": 0}]]}, block_bytes=1 << 20)

    def pairwise(lo, hi):
        raise AssertionError("checked pair by pair")

    n = 10_000
    target = load_plan.TargetPiece("w", "float32", (4 * n,), Box((0,), (4 * n,)))
    monkeypatch.setattr(load_plan, "_overlapping_pair", pairwise)
    assert len(load_plan.plan_reads(meta_of([4 * i for i in range(n)]), [target])) > 0
    monkeypatch.undo()
    with pytest.raises(PlanError, match=r"w: saved pieces at offsets \(20,\) and \(22,\) overlap"):
        load_plan.plan_reads(meta_of([4 * i for i in range(n - 1)] + [22]), [target])
