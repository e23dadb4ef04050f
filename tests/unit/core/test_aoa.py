"""aoa.py: slice maps (written here by hand, as paddle's engine would give them) turned into
reads, staging and numpy postprocess; dtypes.cast against rounding oracles. No paddle."""
import numpy as np
import pytest

from paddle_dcp.io import reads
from paddle_dcp.core import aoa, load_plan
from paddle_dcp.io import local
from paddle_dcp.core.boxes import Box
from paddle_dcp.core.dtypes import cast
from paddle_dcp.errors import MismatchError, UnsupportedError
from paddle_dcp.io import storage as dcp_storage

from ..helpers import save_checkpoint

ROWS, COLS = 12, 4
QKV = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) * 0.5 + 1
W = np.arange(24, dtype=np.float32).reshape(4, 6) - 7


@pytest.fixture()
def saved(tmp_path):
    # qkv saved as rows 0:6 (rank 0) and 6:12 (rank 1); blocks of 64 bytes = 4 rows
    return save_checkpoint(
        str(tmp_path), {"qkv": QKV, "w": W}, {"qkv": "float32", "w": "float32"}, [2], {"qkv": [0], "w": [None]}
    )


def whole(shape):
    return Box.whole(shape)


def run(saved, targets):
    """Plan and read like parallel.loadwork.plan_load: buffers first, staging after; returns the buffers,
    the read plan and the ops."""
    meta = dcp_storage.read_metadata(local.LocalStorage(saved.path), saved.unique_id)
    read_plan = aoa.plan(meta, targets, first_slot=len(targets))
    ops = load_plan.plan_reads(meta, read_plan.pieces, slots=read_plan.slots, direct_min_bytes=1 << 40)
    buffers = [np.full(t.box.shape, -1, dtype=np.float32 if t.dtype == "float32" else np.uint16) for t, _ in targets]
    arrays = buffers + aoa.staging_arrays(read_plan.staged)
    files = local.FileSet(saved.path, meta.files)
    try:
        reads.execute_reads(ops, meta, files, arrays)
    finally:
        files.close()
    aoa.apply(read_plan.staged, arrays)
    return buffers, read_plan, ops


def target(slot, key, shape, box=None, dtype="float32"):
    return aoa.LocalTarget(slot, key, dtype, tuple(shape), box or whole(shape))


def test_rename_reads_straight_into_the_buffer(saved):
    t = target(0, "renamed", W.shape)
    buffers, rp, _ = run(saved, [(t, [aoa.SliceMap("renamed", whole(W.shape), "model.w", whole(W.shape))])])
    assert rp.staged == [] and rp.slots == [0]
    np.testing.assert_array_equal(buffers[0], W)


def test_split_of_a_fused_tensor_reads_only_its_rows(saved):
    # qkv -> q, k, v (axis 0): k is rows 4:8, across both saved pieces; whole target, no step:
    # straight into k's buffer
    t = target(0, "k", (4, COLS))
    maps = [aoa.SliceMap("k", whole((4, COLS)), "model.qkv", Box((4, 0), (4, COLS)))]
    buffers, rp, ops = run(saved, [(t, maps)])
    assert rp.staged == []
    np.testing.assert_array_equal(buffers[0], QKV[4:8])
    # only the checksum blocks (64 bytes = 4 rows) holding rows 4:8: the second block of
    # piece 0 (rows 4, 5 of its 0:6), the first of piece 1 (rows 6:10 of its 6:12)
    assert read_ranges(saved, ops) == {(0, 64, 96), (6, 0, 64)}


def read_ranges(saved, ops):
    """(first row of the saved piece, start, stop in the piece) of every read segment."""
    meta = dcp_storage.read_metadata(local.LocalStorage(saved.path), saved.unique_id)
    entry = meta.tensors["model.qkv"]
    where = {(f, b): o[0] for o, f, b in zip(entry.pieces.offsets.tolist(), entry.pieces.files.tolist(),
                                             entry.pieces.byte_offsets.tolist())}
    return {(where[seg.piece.file, seg.piece.byte_offset], seg.start - seg.piece.byte_offset,
             seg.stop - seg.piece.byte_offset) for op in ops for seg in op.segments}


def test_tensor_parallel_slice_of_a_split_target(saved):
    # the rank holds columns 2:4 of v (rows 8:12 of qkv): staged (a sub-box of the source
    # lands in the whole buffer, but the buffer is one column half: the region is exact)
    t = target(0, "v", (4, COLS), Box((0, 2), (4, 2)))
    maps = [aoa.SliceMap("v", Box((0, 2), (4, 2)), "model.qkv", Box((8, 2), (4, 2)))]
    buffers, rp, ops = run(saved, [(t, maps)])
    np.testing.assert_array_equal(buffers[0], QKV[8:12, 2:4])
    # rows 8:12 are rows 2:6 of piece 1: its two blocks, nothing of piece 0
    assert read_ranges(saved, ops) == {(6, 0, 96)}


def test_transpose_is_staged_and_permuted(saved):
    t = target(0, "wt", (6, 4))
    maps = [aoa.SliceMap("wt", whole((6, 4)), "model.w", whole((4, 6)), (aoa.Step(perm=(1, 0)),))]
    buffers, rp, _ = run(saved, [(t, maps)])
    assert len(rp.staged) == 1 and rp.slots == [1]
    np.testing.assert_array_equal(buffers[0], W.T)


def test_transposed_shard_of_a_transposed_target(saved):
    # the rank holds rows 2:5 of w^T (6, 4): columns 2:5 of w, permuted
    t = target(0, "wt", (6, 4), Box((2, 0), (3, 4)))
    maps = [aoa.SliceMap("wt", Box((2, 0), (3, 4)), "model.w", Box((0, 2), (4, 3)), (aoa.Step(perm=(1, 0)),))]
    buffers, _, _ = run(saved, [(t, maps)])
    np.testing.assert_array_equal(buffers[0], W.T[2:5])


def test_merge_into_a_fused_target(saved):
    # w (4, 6) and qkv rows 0:4 (4, 4) -> fused (4, 10) along axis 1; the rank holds cols 3:8
    t = target(0, "fused", (4, 10), Box((0, 3), (4, 5)))
    maps = [
        aoa.SliceMap("fused", Box((0, 3), (4, 3)), "model.w", Box((0, 3), (4, 3))),
        aoa.SliceMap("fused", Box((0, 6), (4, 2)), "model.qkv", Box((0, 0), (4, 2))),
    ]
    buffers, rp, _ = run(saved, [(t, maps)])
    assert len(rp.staged) == 2
    np.testing.assert_array_equal(buffers[0], np.concatenate([W, QKV[:4]], axis=1)[:, 3:8])


def test_cast_to_bfloat16(saved):
    t = target(0, "wb", W.shape, dtype="bfloat16")
    maps = [aoa.SliceMap("wb", whole(W.shape), "model.w", whole(W.shape), (aoa.Step(dtype="bfloat16"),))]
    buffers, _, _ = run(saved, [(t, maps)])
    np.testing.assert_array_equal(buffers[0], (W.view(np.uint32) >> 16).astype(np.uint16))  # exact in bf16


def test_permute_then_cast_of_several_targets(saved):
    ts = [target(0, "a", (6, 4), dtype="bfloat16"), target(1, "b", W.shape)]
    steps = (aoa.Step(perm=(1, 0)), aoa.Step(dtype="bfloat16"))
    buffers, rp, _ = run(saved, [
        (ts[0], [aoa.SliceMap("a", whole((6, 4)), "model.w", whole((4, 6)), steps)]),
        (ts[1], [aoa.SliceMap("b", whole(W.shape), "model.w", whole(W.shape))]),
    ])
    assert [s.slot for s in rp.staged] == [2] and rp.slots == [2, 1]
    np.testing.assert_array_equal(buffers[0], (W.T.copy().view(np.uint32) >> 16).astype(np.uint16))
    np.testing.assert_array_equal(buffers[1], W)


def test_no_maps_leaves_the_target(saved):
    buffers, rp, ops = run(saved, [(target(0, "x", (2,)), [])])
    assert ops == [] and (buffers[0] == -1).all()


@pytest.mark.parametrize(
    "maps, words",
    [
        ([aoa.SliceMap("k", whole((4, 4)), "model.nope", whole((4, 4)))], "lacks"),
        ([aoa.SliceMap("k", Box((0, 0), (2, 4)), "model.qkv", Box((0, 0), (2, 4)))], "fills 8 of the 16"),
        ([aoa.SliceMap("k", whole((4, 4)), "model.qkv", Box((10, 0), (4, 4)))], "whose shape is (12, 4)"),
        ([aoa.SliceMap("k", whole((4, 4)), "model.qkv", Box((0, 0), (4, 4)), (aoa.Step(dtype="float16"),))], "dtype float16"),
        ([aoa.SliceMap("k", whole((4, 4)), "model.qkv", Box((0, 0), (8, 2)))], "fills box"),
    ],
)
def test_maps_that_do_not_fit_raise(saved, maps, words):
    meta = dcp_storage.read_metadata(local.LocalStorage(saved.path), saved.unique_id)
    with pytest.raises(MismatchError, match="k: .*" + words.replace("(", r"\(").replace(")", r"\)")):
        aoa.plan(meta, [(target(0, "k", (4, 4)), maps)], first_slot=1)


def test_steps_of_paddles_postprocess_list():
    assert aoa.steps_of(None) == ()
    assert aoa.steps_of(["[1, 0]", "bfloat16", "[2,0,1]"]) == (
        aoa.Step(perm=(1, 0)), aoa.Step(dtype="bfloat16"), aoa.Step(perm=(2, 0, 1)))
    for bad in (["[0, 0]"], ["[a]"]):
        with pytest.raises(UnsupportedError):
            aoa.steps_of(bad)
    assert aoa.after_steps((2, 3, 4), "float32", aoa.steps_of(["[2, 0, 1]", "float16"])) == ((4, 2, 3), "float16")


def test_shard_descriptions_merge_every_ranks_boxes(saved):
    meta = dcp_storage.read_metadata(local.LocalStorage(saved.path), saved.unique_id)
    src = aoa.source_shards(meta)
    assert src["model.qkv"] == ("float32", (12, 4), [Box((0, 0), (6, 4)), Box((6, 0), (6, 4))])
    ranks = [aoa.encode_targets([("t", "float32", (4, 4), Box((0, r), (4, 2)))]) for r in (0, 2, 0)]
    assert aoa.merge_targets(ranks) == {"t": ("float32", (4, 4), [Box((0, 0), (4, 2)), Box((0, 2), (4, 2))])}


def test_check_config():
    for bad in (["a -> b"], {"aoa_statements": "a -> b"}, {"aoa_statements": [1]}):
        with pytest.raises(UnsupportedError):
            aoa.check_config(bad)
    aoa.check_config({"aoa_statements": ["a -> b"]})


# ------------------------------------------------------------------ casts
def bf16_oracle(x: np.ndarray) -> np.ndarray:
    """Nearest bfloat16 by exact arithmetic in float64 (ties to the even pattern), NaN 0x7fff."""
    out = np.empty(x.shape, np.uint16)
    for i, v in enumerate(x.tolist()):
        if v != v:
            out[i] = 0x7FFF
            continue
        lo = int(np.float32(v).view(np.uint32)) >> 16
        cands = [lo, lo + 1]
        vals = [float(np.uint32(c << 16).view(np.float32)) if (c << 16) < 2**32 else float("nan") for c in cands]
        d = [abs(val - v) if val == val and abs(val) != float("inf") else (0 if val == v else float("inf")) for val in vals]
        if abs(v) == float("inf"):
            out[i] = lo
        elif d[0] < d[1] or (d[0] == d[1] and lo % 2 == 0):
            out[i] = lo
        else:
            out[i] = lo + 1
    return out


def test_float32_to_bfloat16_rounds_to_nearest_even():
    rng = np.random.default_rng(1)
    bits = np.concatenate([
        rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32),
        np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x80018000,
                  0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0, 0x80000000], np.uint32),
    ])
    x = bits.view(np.float32)
    got = cast(x, "float32", "bfloat16")
    want = bf16_oracle(x)
    # the largest finite floats round past bfloat16's largest: to inf, as in IEEE
    big = np.abs(x) > float(np.uint32(0x7F7F0000).view(np.float32)) + 2.0 ** 103
    want[big & ~np.isnan(x) & np.isfinite(x)] = np.where(x[big & ~np.isnan(x) & np.isfinite(x)] > 0, 0x7F80, 0xFF80)
    np.testing.assert_array_equal(got, want)


def test_casts_between_half_types_go_through_float32():
    bf = np.array([0x3F80, 0x4049, 0xC2F7, 0x7F80, 0x0001, 0x7FFF], np.uint16)
    as32 = (bf.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(cast(bf, "bfloat16", "float32"), as32)
    np.testing.assert_array_equal(cast(bf, "bfloat16", "float16"), as32.astype(np.float16))
    h = np.array([1.0, -2.5, 65504, 6e-8, np.inf], np.float16)
    np.testing.assert_array_equal(cast(h, "float16", "bfloat16"), bf16_oracle(h.astype(np.float32)))
    assert cast(h, "float16", "float16") is h
