"""Compressed checkpoints end to end: tensors saved quantized (``compress``) in one layout and
loaded into others, against a reference quantizer written here from the format's definition
(docs/format.md: blocks of 256 elements of a piece in C order, each its float32 minimum and
step, codes round((x - min) / step)), not the library's codec; the load compared bit for bit.

Layouts: Shard on either axis, uneven pieces, 1-, 2- and 3-D meshes, a rank count change
between save and load, any box of a tensor read alone, block boundaries inside pieces; float32,
bfloat16 and float16 sources. And what a load reads (only the blocks of its box), plain saves
byte-identical with and without an unused policy, and damaged or hostile checkpoints refused.
"""
from __future__ import annotations

import json
import math
import os

import metadoc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import paddle_dcp
from paddle_dcp.core import load_plan
from paddle_dcp.core.boxes import Box
from paddle_dcp.core.metadata import with_digest
from paddle_dcp.errors import ArgumentError, DcpError, FormatError, IntegrityError, UnsupportedError
from paddle_dcp.io import local
from paddle_dcp.io import storage as dcp_storage

from unit.helpers import (
    BLOCK,
    BLOCK_BYTES,
    STORAGE,
    coords,
    dequantized,
    expected_tensor,
    fast,
    load_rank,
    ref_box,
    save_checkpoint,
    saved_boxes,
)

def values_of(shape, dtype: str, seed: int) -> np.ndarray:
    """Normal values whose scale changes along the first axis (blocks of different steps), in
    the storage dtype of ``dtype``."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 2, size=(shape[0],) + (1,) * (len(shape) - 1)) if shape else 1.0
    values = (rng.standard_normal(shape) * scale).astype(np.float32)
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(STORAGE[dtype])


# ------------------------------------------------------------------ layouts
# (shape, dtype, encoding, save mesh, save placements, load mesh, load placements)
LAYOUTS = {
    "rows_2_into_columns_3": ((37, 300), "float32", "int8", (2,), (0,), (3,), (1,)),
    "columns_4_into_whole": ((37, 300), "bfloat16", "int4", (4,), (1,), (1,), (None,)),
    "columns_2_into_rows_2_block_edge_inside": ((7, 100), "float16", "int8", (2,), (1,), (2,), (0,)),
    "mesh_2x2_into_3_on_axis_1": ((6, 10, 45), "float32", "int4", (2, 2), (0, 2), (3,), (1,)),
    "flat_3_into_2": ((1000,), "bfloat16", "int8", (3,), (0,), (2,), (0,)),
    "replicated_into_2d": ((33, 70), "float32", "int8", (2,), (None,), (2, 2), (1, 0)),
}


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request, tmp_path):
    shape, dtype, encoding, mesh, placements, load_mesh, load_placements = LAYOUTS[request.param]
    array = values_of(shape, dtype, seed=len(request.param))
    plain = values_of((5, 9), "float32", seed=1)
    save_checkpoint(
        str(tmp_path), {"m": array, "p": plain}, {"m": dtype, "p": "float32"}, mesh,
        {"m": placements, "p": (None,) * len(mesh)}, compress={r"\.m$": encoding},
    )  # fmt: skip
    want = expected_tensor(array, dtype, encoding, saved_boxes(shape, mesh, placements))
    return str(tmp_path), dtype, encoding, want, plain, load_mesh, load_placements


@pytest.mark.parametrize("restrict", [False, True])
def test_every_rank_of_another_layout_loads_the_reference_values(layout, restrict):
    path, dtype, encoding, want, plain, load_mesh, load_placements = layout
    meta = dcp_storage.read_metadata(local.LocalStorage(path), 0)
    assert meta.tensors["model.m"].encoding == encoding and meta.tensors["model.p"].encoding is None
    assert meta.format_version == 2
    for c in coords(load_mesh):
        box = ref_box(want.shape, load_mesh, load_placements, c)
        if not box.volume:
            continue
        targets = [load_plan.TargetPiece("model.m", dtype, want.shape, box),
                   load_plan.TargetPiece("model.p", "float32", plain.shape, Box.whole(plain.shape))]  # fmt: skip
        (got, got_plain), ops = load_rank(path, 0, targets, restrict=restrict)
        assert got.tobytes() == want[box.slices()].tobytes(), (c, box)
        assert got_plain.tobytes() == plain.tobytes()
        assert not any(op.direct for op in ops if op.segments[0].piece.key == "model.m")


@fast(40)
@given(st.data())
def test_any_box_read_alone_is_the_reference_and_reads_only_its_blocks(tmp_path_factory, data):
    shape, dtype, encoding, mesh, placements = data.draw(st.sampled_from([
        ((37, 300), "float32", "int8", (2,), (0,)),
        ((37, 300), "bfloat16", "int4", (3,), (1,)),
        ((9, 8, 40), "float16", "int8", (2, 2), (2, 0)),
    ]))  # fmt: skip
    path = str(tmp_path_factory.mktemp("box"))
    array = values_of(shape, dtype, seed=3)
    save_checkpoint(path, {"m": array}, {"m": dtype}, mesh, {"m": placements}, compress={"m": encoding})
    want = expected_tensor(array, dtype, encoding, saved_boxes(shape, mesh, placements))
    lo = [data.draw(st.integers(0, n - 1)) for n in shape]
    box = Box(tuple(lo), tuple(data.draw(st.integers(1, n - a)) for a, n in zip(lo, shape)))
    max_read = data.draw(st.sampled_from([1 << 20, 4096]))  # small reads: the region is cut in parts
    (got,), ops = load_rank(path, 0, [load_plan.TargetPiece("model.m", dtype, shape, box)], max_read_bytes=max_read)
    assert got.tobytes() == want[box.slices()].tobytes()
    for op in ops:
        for seg in op.segments:
            piece = seg.piece
            for c in seg.copies:  # the blocks a copy's elements lie in, from their C-order indices
                grid = np.indices(c.region_in_saved.shape).reshape(len(shape), -1).T + c.region_in_saved.offsets
                flat = np.ravel_multi_index(grid.T, piece.box.shape)
                first, last = int(flat.min()) // BLOCK, int(flat.max()) // BLOCK
                start = piece.byte_offset + first * BLOCK_BYTES[encoding] // 64 * 64  # 64-byte checksum blocks
                stop = piece.byte_offset + min(-(-(last + 1) * BLOCK_BYTES[encoding] // 64) * 64, piece.nbytes)
                assert start <= seg.start and seg.stop <= stop, (seg, start, stop)


# ------------------------------------------------------------------ through the public API
def adamw_state(rng, moments=None):
    w = rng.standard_normal((37, 300)).astype(np.float32)
    m1 = rng.standard_normal((37, 300)).astype(np.float32) * 1e-3
    m2 = rng.random((37, 300)).astype(np.float32) * 1e-6
    return {
        "model": {"w": w},
        "opt": {"w_moment1_0": m1, "w_moment2_0": m2, "w_beta1_pow_acc_0": np.array([0.9], np.float32),
                "step": np.array([7], np.int64)},
    } if moments is None else moments  # fmt: skip


def zeros_like(state):
    return {k: zeros_like(v) if isinstance(v, dict) else np.zeros_like(v) for k, v in state.items()}


@pytest.mark.parametrize("policy, encoding", [(paddle_dcp.ADAMW_MOMENTS_INT8, "int8"), (paddle_dcp.ADAMW_MOMENTS_INT4, "int4")])
def test_adamw_moments_saved_quantized_load_as_the_reference_and_the_rest_exactly(tmp_path, policy, encoding):
    state = adamw_state(np.random.default_rng(0))
    paddle_dcp.save_state_dict(state, str(tmp_path / "q"), compress=policy)
    paddle_dcp.save_state_dict(state, str(tmp_path / "plain"))
    got = zeros_like(state)
    paddle_dcp.load_state_dict(got, str(tmp_path / "q"))
    for key in ("w_moment1_0", "w_moment2_0"):
        assert got["opt"][key].tobytes() == dequantized(state["opt"][key], encoding).tobytes(), key
    for a, b in ((got["model"]["w"], state["model"]["w"]), (got["opt"]["w_beta1_pow_acc_0"], state["opt"]["w_beta1_pow_acc_0"]),
                 (got["opt"]["step"], state["opt"]["step"])):  # fmt: skip
        assert a.tobytes() == b.tobytes()
    meta = paddle_dcp.read_metadata(str(tmp_path / "q"))
    assert {k: e.encoding for k, e in meta.tensors.items()} == {
        "model.w": None, "opt.w_moment1_0": encoding, "opt.w_moment2_0": encoding,
        "opt.w_beta1_pow_acc_0": None, "opt.step": None,
    }  # fmt: skip
    # the moments' stored bytes: whole blocks of the encoding, from the definition
    moments = 2 * math.ceil(37 * 300 / BLOCK) * BLOCK_BYTES[encoding]
    size = os.path.getsize(tmp_path / "q" / "0_0.distcp")
    plain = os.path.getsize(tmp_path / "plain" / "0_0.distcp")
    assert abs((plain - size) - (2 * 37 * 300 * 4 - moments)) < 5 * 64  # pieces start at multiples of 64


def test_a_plain_save_is_byte_identical_with_a_policy_that_matches_nothing(tmp_path):
    state = adamw_state(np.random.default_rng(1))
    state["opt"] = {"step": state["opt"]["step"], "w_beta1_pow_acc_0": state["opt"]["w_beta1_pow_acc_0"]}
    paddle_dcp.save_state_dict(state, str(tmp_path / "a"))
    paddle_dcp.save_state_dict(state, str(tmp_path / "b"), compress=paddle_dcp.ADAMW_MOMENTS_INT4)
    paddle_dcp.save_state_dict(state, str(tmp_path / "c"), compress={"step": "int8"})  # matches an int64 only
    files = sorted(os.listdir(tmp_path / "a"))
    for other in ("b", "c"):
        assert sorted(os.listdir(tmp_path / other)) == files
        for name in files:
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / other / name).read_bytes(), (other, name)
    doc = metadoc.read((tmp_path / "a" / "0.metadata").read_bytes())
    assert doc["format_version"] == 3 and not any("encoding" in t for t in doc["tensors"].values())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_in_a_tensor_to_compress_is_refused_naming_the_key_and_nothing_is_committed(tmp_path, bad):
    state = adamw_state(np.random.default_rng(2))
    state["opt"]["w_moment2_0"][3, 5] = bad
    with pytest.raises(UnsupportedError, match=r"opt\.w_moment2_0.*not finite.*without compress"):
        paddle_dcp.save_state_dict(state, str(tmp_path), compress=paddle_dcp.ADAMW_MOMENTS_INT8)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".metadata")]
    # left plain, the same state saves and loads exactly, the non-finite value included
    paddle_dcp.save_state_dict(state, str(tmp_path), compress={"moment1": "int8"})
    got = zeros_like(state)
    paddle_dcp.load_state_dict(got, str(tmp_path))
    assert got["opt"]["w_moment2_0"].tobytes() == state["opt"]["w_moment2_0"].tobytes()


def test_compress_with_safetensors_rank_files_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match="safetensors"):
        paddle_dcp.save_state_dict(adamw_state(np.random.default_rng(0)), str(tmp_path), safetensors=True,
                                   compress=paddle_dcp.ADAMW_MOMENTS_INT8)  # fmt: skip
    assert os.listdir(tmp_path) == []


def test_a_scalar_and_a_tensor_smaller_than_a_block_round_trip(tmp_path):
    state = {"s": np.array(2.5, np.float32), "v": np.array([1.0, -3.0, 0.25], np.float32)}
    paddle_dcp.save_state_dict(state, str(tmp_path), compress={".": "int4"})
    got = {"s": np.array(0.0, np.float32), "v": np.zeros(3, np.float32)}
    paddle_dcp.load_state_dict(got, str(tmp_path))
    assert got["s"].tobytes() == state["s"].tobytes()  # a block of equal values reads back exactly
    assert got["v"].tobytes() == dequantized(state["v"], "int4").tobytes()


def test_the_manager_saves_with_its_policy(tmp_path):
    state = adamw_state(np.random.default_rng(3))
    with paddle_dcp.CheckpointManager(str(tmp_path), compress=paddle_dcp.ADAMW_MOMENTS_INT4) as manager:
        manager.save(5, state)
        got = zeros_like(state)
        assert manager.restore(got) == 5
    meta = paddle_dcp.read_metadata(str(tmp_path), 5)
    assert meta.tensors["opt.w_moment1_0"].encoding == "int4" and meta.tensors["model.w"].encoding is None
    assert got["opt"]["w_moment1_0"].tobytes() == dequantized(state["opt"]["w_moment1_0"], "int4").tobytes()
    with pytest.raises(ArgumentError, match="int2"):
        paddle_dcp.CheckpointManager(str(tmp_path / "x"), compress={"m": "int2"})


# ------------------------------------------------------------------ damage and hostile metadata
@pytest.fixture
def ck(tmp_path):
    """A compressed checkpoint of one tensor in three row pieces (two data files), 64-byte
    checksum blocks; its reference values."""
    array = values_of((12, 100), "float32", seed=5)
    save_checkpoint(str(tmp_path), {"m": array, "n": np.arange(6, dtype=np.int64)}, {"m": "float32", "n": "int64"},
                    (2,), {"m": (0,), "n": (None,)}, compress={"m": "int8"})  # fmt: skip
    return str(tmp_path), expected_tensor(array, "float32", "int8", saved_boxes((12, 100), (2,), (0,)))


SENTINEL = -7.0


def target():
    return {"model": {"m": np.full((12, 100), SENTINEL, np.float32), "n": np.zeros(6, np.int64)}}


def test_the_fixture_loads(ck):
    path, want = ck
    sd = target()
    paddle_dcp.load_state_dict(sd, path)
    assert sd["model"]["m"].tobytes() == want.tobytes()


def _flip(path: str, at: int) -> None:
    name = os.path.join(path, "0_0.distcp")
    data = bytearray(open(name, "rb").read())
    data[at] ^= 0x10
    open(name, "wb").write(bytes(data))


@pytest.mark.parametrize("at", [0, 3, 4, 7, 8, 200, 263, 264])  # minimum, step, codes, the next block
def test_checksums_cover_the_stored_bytes_scales_included(ck, at):
    path, _ = ck
    _flip(path, at)
    sd = target()
    with pytest.raises(IntegrityError, match=r"0_0\.distcp.*'model\.m'"):
        paddle_dcp.load_state_dict(sd, path)
    assert (sd["model"]["m"] == SENTINEL).all()


def _set_scale(path: str, block: int, low: float, step: float) -> None:
    name = os.path.join(path, "0_0.distcp")
    data = bytearray(open(name, "rb").read())
    at = block * BLOCK_BYTES["int8"]
    data[at : at + 8] = np.array([low, step], "<f4").tobytes()
    open(name, "wb").write(bytes(data))


@pytest.mark.parametrize("low, step", [(np.nan, 0.1), (0.0, np.inf), (0.0, -1.0), (3e38, 3e37), (0.0, np.nan)])
def test_a_damaged_scale_read_without_checksums_is_a_format_error_not_a_wrong_value(ck, low, step):
    path, _ = ck
    _set_scale(path, 1, low, step)
    sd = target()
    with pytest.raises(FormatError, match=r"model\.m.*int8 block"):
        paddle_dcp.load_state_dict(sd, path, verify=False)


@pytest.mark.parametrize("dtype, low", [("float16", 1e6), ("bfloat16", 3.4e38)])
def test_blocks_that_decode_past_the_tensors_dtype_are_a_format_error_not_infinities(tmp_path, dtype, low):
    """A block whose float32 decode is finite but past what the tensor's dtype holds (float16
    above 65504; bfloat16 rounding to inf near float32's maximum), read without checksums: a
    FormatError naming the key, never a tensor of infinities."""
    array = values_of((4, 300), dtype, seed=3)
    save_checkpoint(str(tmp_path), {"m": array}, {"m": dtype}, (1,), {"m": (None,)}, compress={"m": "int8"})
    _set_scale(str(tmp_path), 1, low, 0.0)
    if dtype == "bfloat16":  # numpy has no bfloat16: a paddle tensor holds it
        import paddle

        sd = {"model": {"m": paddle.zeros([4, 300], dtype="bfloat16")}}
    else:
        sd = {"model": {"m": np.zeros((4, 300), np.float16)}}
    with pytest.raises(FormatError, match=rf"model\.m.*past {dtype}'s range"):
        paddle_dcp.load_state_dict(sd, str(tmp_path), verify=False)
    _set_scale(str(tmp_path), 1, 60000.0, 0.0)  # inside float16's range, and bfloat16's: loads
    paddle_dcp.load_state_dict(sd, str(tmp_path), verify=False)


def _doc(path):
    """The checkpoint's metadata as a version 2 JSON document (the layout a save wrote before
    version 3, which a load still reads): the cases below edit it."""
    with open(os.path.join(path, "0.metadata"), "rb") as f:
        return dict(metadoc.read(f.read()), format_version=2)


def _write(path, doc):
    body = json.dumps({k: v for k, v in doc.items() if k != "digest"}, separators=(",", ":")).encode()
    with open(os.path.join(path, "0.metadata"), "wb") as f:
        f.write(with_digest(body))


def _tensor(doc, key="model.m"):
    return doc["tensors"][key]


def _checksums_plus_one(doc):
    sums = _tensor(doc)["checksums"]
    _tensor(doc)["checksums"] = sums + sums[:1] if isinstance(sums, list) else sums[:-4]


HOSTILE = {
    "unknown_encoding": (lambda d: _tensor(d).update(encoding="int3"), ["model.m", "'int3'", "int4, int8"]),
    "encoding_not_a_string": (lambda d: _tensor(d).update(encoding=8), ["model.m", "encoding"]),
    "encoding_null": (lambda d: _tensor(d).update(encoding=None), ["model.m", "encoding"]),
    "encoding_on_integers": (lambda d: _tensor(d, "model.n").update(encoding="int8"), ["model.n", "int64"]),
    "encoding_in_version_1": (lambda d: d.update(format_version=1), ["model.m", "format_version 1"]),
    "future_version": (lambda d: d.update(format_version=3), ["format_version", "3"]),
    # rank 1's file holds the second piece of model.m alone: its stored size, one byte short
    "file_one_byte_short": (lambda d: d["files"][1].update(bytes=d["files"][1]["bytes"] - 1), ["model.m", "past the end"]),
    # room for 700 bytes, where the piece's int8 blocks take 792 (6 rows of 100: 3 blocks)
    "room_for_less_than_its_blocks": (
        lambda d: _tensor(d)["byte_offset"].__setitem__(0, d["files"][0]["bytes"] - 700), ["model.m", "past the end"]
    ),
    "negative_offset": (lambda d: _tensor(d)["byte_offset"].__setitem__(0, -264), ["model.m"]),
    "huge_offset": (lambda d: _tensor(d)["byte_offset"].__setitem__(0, 2**62), ["model.m"]),
    "block_count_off_by_one": (_checksums_plus_one, ["model.m", "checksums"]),
    "shape_larger_than_its_blocks": (lambda d: _tensor(d)["shapes"].__setitem__(0, 7), ["model.m"]),
    "negative_shape": (lambda d: _tensor(d)["shapes"].__setitem__(1, -100), ["model.m"]),
    "huge_count": (lambda d: _tensor(d).update(count=2**40), ["model.m"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_metadata_of_a_quantized_tensor_is_a_format_error_and_nothing_changes(ck, case):
    path, _ = ck
    doc = _doc(path)
    edit, needles = HOSTILE[case]
    edit(doc)
    _write(path, doc)
    sd = target()
    with pytest.raises(DcpError) as info:
        paddle_dcp.load_state_dict(sd, path)
    assert isinstance(info.value, FormatError), repr(info.value)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert (sd["model"]["m"] == SENTINEL).all() and (sd["model"]["n"] == 0).all()
    with pytest.raises(FormatError):
        dcp_storage.read_metadata(local.LocalStorage(path), 0).validate()


def test_an_async_save_encodes_what_it_staged_not_what_the_tensors_hold_later(tmp_path):
    state = adamw_state(np.random.default_rng(4))
    saved = state["opt"]["w_moment1_0"].copy()
    # the first async save of a process writes before it returns (and makes staging memory)
    paddle_dcp.save_state_dict(state, str(tmp_path), async_save=True, compress=paddle_dcp.ADAMW_MOMENTS_INT8).wait()
    handle = paddle_dcp.save_state_dict(state, str(tmp_path), async_save=True, compress=paddle_dcp.ADAMW_MOMENTS_INT8)
    state["opt"]["w_moment1_0"][...] = 0  # the training goes on while the save writes
    handle.wait()
    got = zeros_like(state)
    paddle_dcp.load_state_dict(got, str(tmp_path))
    assert got["opt"]["w_moment1_0"].tobytes() == dequantized(saved, "int8").tobytes()
    assert paddle_dcp.read_metadata(str(tmp_path)).tensors["opt.w_moment1_0"].encoding == "int8"


def test_the_manager_s_node_local_tier_saves_with_its_policy_and_its_check_takes_the_stored_sizes(tmp_path):
    state = adamw_state(np.random.default_rng(5))
    local_dir = str(tmp_path / "local")
    with paddle_dcp.CheckpointManager(str(tmp_path / "global"), local_directory=local_dir, replicas=0,
                                      save_interval_steps=10, compress=paddle_dcp.ADAMW_MOMENTS_INT4) as manager:  # fmt: skip
        manager.save(1, state)  # the local tier alone
        got = zeros_like(state)
        assert manager.restore(got) == 1
        assert manager.last_restore.tier == "local"
    assert paddle_dcp.read_metadata(local_dir, 1).tensors["opt.w_moment2_0"].encoding == "int4"
    assert got["opt"]["w_moment2_0"].tobytes() == dequantized(state["opt"]["w_moment2_0"], "int4").tobytes()
    assert got["model"]["w"].tobytes() == state["model"]["w"].tobytes()
