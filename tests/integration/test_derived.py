"""Master weights derived on load, end to end: a float32 master weight saved with
``compress={MASTER_WEIGHTS: "derived"}`` is not stored, and a load into any layout and rank
count fills it with its bfloat16 parameter's values cast up. The oracle is numpy's: a bfloat16
pattern is the high half of a float32 (docs/format.md), so the master weight a load gives is
``param_bits << 16``, bit for bit. Layouts: the parameter and its master weight held in
different layouts, loaded into a third (Shard on either axis, uneven pieces, 1- and 2-D
meshes, a rank count change), by a rank that gets its part of the metadata from another; a
quantized parameter; paddle's optimizer keys through the public API and the manager; the
save's refusals; paddle's contract for missing keys kept."""
from __future__ import annotations

import os

import metadoc
import numpy as np
import pytest

import paddle_dcp
from paddle_dcp.core import load_plan
from paddle_dcp.errors import MismatchError
from paddle_dcp.io import local
from paddle_dcp.io import storage as dcp_storage

from unit.helpers import coords, expected_tensor, load_rank, ref_box, save_checkpoint, saved_boxes, to_float32

MASTER = {paddle_dcp.MASTER_WEIGHTS: "derived"}


def bf16_values(shape, seed: int) -> np.ndarray:
    """bfloat16 patterns of normal values of scales 1e-3 .. 1e2."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 2, size=(shape[0],) + (1,) * (len(shape) - 1))
    return ((rng.standard_normal(shape) * scale).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


# shape, the save's mesh, the parameter's and the master weight's placements on it, the load's
# mesh and placements
LAYOUTS = {
    "param_rows_master_columns_2_into_columns_3": ((37, 300), (2,), (0,), (1,), (3,), (1,)),
    "param_replicated_master_rows_3_into_mesh_2x2": ((33, 70), (3,), (None,), (0,), (2, 2), (1, 0)),
    "flat_3_into_1_rank": ((1000,), (3,), (0,), (0,), (1,), (None,)),
    "mesh_2x2_into_rows_2": ((6, 10, 45), (2, 2), (0, 2), (1, None), (2,), (0,)),
}


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request, tmp_path):
    shape, mesh, p_pl, m_pl, load_mesh, load_pl = LAYOUTS[request.param]
    param = bf16_values(shape, seed=len(request.param))
    master = np.random.default_rng(1).standard_normal(shape).astype(np.float32)  # not what a load gives
    saved = save_checkpoint(str(tmp_path), {"p": param, "p.w_0": master}, {"p": "bfloat16", "p.w_0": "float32"}, mesh,
                            {"p": p_pl, "p.w_0": m_pl}, compress=MASTER)  # fmt: skip
    return str(tmp_path), param, saved, load_mesh, load_pl


@pytest.mark.parametrize("restrict", [False, True])
def test_a_derived_master_weight_loads_into_any_layout_as_its_parameter_cast(layout, restrict):
    path, param, saved, load_mesh, load_pl = layout
    meta = dcp_storage.read_metadata(local.LocalStorage(path), 0)
    entry = meta.tensors["model.p.w_0"]
    assert (entry.encoding, entry.source, entry.pieces.count, meta.format_version) == ("derived", "model.p", 0, 2)
    # the data files hold the parameter's pieces alone (each at a multiple of 64 bytes)
    assert sum(f.nbytes for f in meta.files) < param.size * 2 + 64 * meta.tensors["model.p"].pieces.count
    want = to_float32(param, "bfloat16")
    for c in coords(load_mesh):
        box = ref_box(param.shape, load_mesh, load_pl, c)
        if not box.volume:
            continue
        targets = [load_plan.TargetPiece("model.p.w_0", "float32", param.shape, box),
                   load_plan.TargetPiece("model.p", "bfloat16", param.shape, box)]  # fmt: skip
        (got, got_param), ops = load_rank(path, 0, targets, restrict=restrict)
        assert got.tobytes() == want[box.slices()].tobytes(), (c, box)
        assert got_param.tobytes() == param[box.slices()].tobytes()
        assert not any(op.direct and op.segments[0].copies[0].target == 0 for op in ops)  # cast, never direct


def test_only_the_master_weight_is_loaded_when_the_state_dict_lacks_the_parameter(layout):
    path, param, _, _, _ = layout
    box = ref_box(param.shape, (1,), (None,) * 1, (0,))
    (got,), ops = load_rank(path, 0, [load_plan.TargetPiece("model.p.w_0", "float32", param.shape, box)])
    assert got.tobytes() == to_float32(param, "bfloat16").tobytes()
    assert {seg.piece.key for op in ops for seg in op.segments} == {"model.p"}


def test_a_quantized_parameter_gives_its_master_weight_its_dequantized_values(tmp_path):
    shape, mesh, pl = (37, 300), (2,), (1,)
    param = bf16_values(shape, seed=5)
    save_checkpoint(str(tmp_path), {"p": param, "p.w_0": np.zeros(shape, np.float32)}, {"p": "bfloat16", "p.w_0": "float32"},
                    mesh, {"p": pl, "p.w_0": (0,)}, compress={r"\.p$": "int8", **MASTER})  # fmt: skip
    want = to_float32(expected_tensor(param, "bfloat16", "int8", saved_boxes(shape, mesh, pl)), "bfloat16")
    box = ref_box(shape, (3,), (0,), (1,))
    (got,), _ = load_rank(str(tmp_path), 0, [load_plan.TargetPiece("model.p.w_0", "float32", shape, box)])
    assert got.tobytes() == want[box.slices()].tobytes()


def test_a_master_weight_without_its_parameter_in_the_save_is_refused_naming_both(tmp_path):
    with pytest.raises(MismatchError, match=r"model\.p\.w_0.*keyed as its stem.*leave model\.p\.w_0 out of compress"):
        save_checkpoint(str(tmp_path), {"p.w_0": np.zeros((4, 4), np.float32)}, {"p.w_0": "float32"}, (1,),
                        {"p.w_0": (None,)}, compress=MASTER)  # fmt: skip
    with pytest.raises(MismatchError, match=r"model\.p\.w_0: .*\(float32, shape \(4, 4\)\).*model\.p \(by its key\), which is float32"):
        save_checkpoint(str(tmp_path), {"p": np.zeros((4, 4), np.float32), "p.w_0": np.zeros((4, 4), np.float32)},
                        {"p": "float32", "p.w_0": "float32"}, (1,), {"p": (None,), "p.w_0": (None,)}, compress=MASTER)  # fmt: skip


# ------------------------------------------------------------------ paddle tensors, the public API
paddle = pytest.importorskip("paddle")


def paddle_state(rng, names: bool = True) -> dict:
    """Parameters (bfloat16) and paddle AdamW(multi_precision=True)'s state_dict() as paddle
    keys it: moments by the accumulator's name, master weights by the parameter's name."""
    params = {"fc.weight": ("linear_0.w_0", (300, 7)), "fc.bias": ("linear_0.b_0", (7,))}
    model, opt = {}, {"master_weights": {}}
    for key, (name, shape) in params.items():
        master = rng.standard_normal(shape).astype(np.float32)
        p = paddle.to_tensor(master).astype("bfloat16")
        if names:
            p.name = name
        model[key] = p
        opt["master_weights"][name] = paddle.to_tensor(master)
        opt[f"{name}_moment1_0"] = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32) * 1e-3)
    return {"model": model, "opt": opt}


def zeros(state):
    if isinstance(state, dict):
        return {k: zeros(v) for k, v in state.items()}
    return paddle.zeros(state.shape, state.dtype)


def test_paddle_optimizer_master_weights_are_left_out_and_load_as_their_parameters(tmp_path):
    state = paddle_state(np.random.default_rng(0))
    policy = {**paddle_dcp.ADAMW_MOMENTS_INT4, **paddle_dcp.MASTER_WEIGHTS_DERIVED}
    paddle_dcp.save_state_dict(state, str(tmp_path / "d"), compress=policy)
    paddle_dcp.save_state_dict(state, str(tmp_path / "q"), compress=paddle_dcp.ADAMW_MOMENTS_INT4)
    meta = paddle_dcp.read_metadata(str(tmp_path / "d"))
    assert {k: (e.encoding, e.source) for k, e in meta.tensors.items() if e.derived} == {
        "opt.master_weights.linear_0.w_0": ("derived", "model.fc.weight"),
        "opt.master_weights.linear_0.b_0": ("derived", "model.fc.bias"),
    }
    size = lambda d: sum(os.path.getsize(tmp_path / d / n) for n in os.listdir(tmp_path / d) if n.endswith(".distcp"))  # noqa: E731
    assert size("q") - size("d") >= (300 * 7 + 7) * 4 - 2 * 64  # the master weights' bytes, not written
    got = zeros(state)
    paddle_dcp.load_state_dict(got, str(tmp_path / "d"))
    for key, name in (("fc.weight", "linear_0.w_0"), ("fc.bias", "linear_0.b_0")):
        param = state["model"][key].astype("float32").numpy()
        assert got["opt"]["master_weights"][name].numpy().tobytes() == param.tobytes(), key
        assert got["model"][key].numpy().tobytes() == state["model"][key].numpy().tobytes()


def test_master_weights_saved_apart_from_their_parameters_are_refused_and_nothing_is_committed(tmp_path):
    """PaddleFormers' flex checkpoint saves ``master_weights/`` in a call of its own."""
    state = paddle_state(np.random.default_rng(1))
    with pytest.raises(MismatchError, match=r"opt\.master_weights\.linear_0\.(w|b)_0.*named 'linear_0\.(w|b)_0'") as info:
        paddle_dcp.save_state_dict({"opt": state["opt"]}, str(tmp_path), compress=paddle_dcp.MASTER_WEIGHTS_DERIVED)
    assert "save the parameter in the same call" in str(info.value)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".metadata")]


def test_a_load_keeps_the_contract_for_keys_the_checkpoint_lacks(tmp_path, caplog):
    state = paddle_state(np.random.default_rng(2))
    paddle_dcp.save_state_dict(state, str(tmp_path), compress=paddle_dcp.MASTER_WEIGHTS_DERIVED)
    got = zeros(state)
    got["opt"]["master_weights"]["linear_9.w_0"] = paddle.full([3], 5.0)  # a parameter the checkpoint never had
    with pytest.raises(MismatchError, match=r"opt\.master_weights\.linear_9\.w_0"):
        paddle_dcp.load_state_dict(got, str(tmp_path))
    assert not got["opt"]["master_weights"]["linear_0.w_0"].numpy().any()  # refused before any tensor changed
    paddle_dcp.load_state_dict(got, str(tmp_path), strict=False)
    assert "linear_9.w_0" in caplog.text and (got["opt"]["master_weights"]["linear_9.w_0"].numpy() == 5.0).all()
    want = state["model"]["fc.weight"].astype("float32").numpy()
    assert got["opt"]["master_weights"]["linear_0.w_0"].numpy().tobytes() == want.tobytes()


def test_the_manager_saves_master_weights_derived_and_restores_them(tmp_path):
    state = paddle_state(np.random.default_rng(3))
    with paddle_dcp.CheckpointManager(str(tmp_path), compress=paddle_dcp.MASTER_WEIGHTS_DERIVED) as manager:
        manager.save(4, state)
        manager.wait()
        got = zeros(state)
        assert manager.restore(got) == 4
    doc = metadoc.read((tmp_path / "4.metadata").read_bytes())
    assert doc["tensors"]["opt.master_weights.linear_0.b_0"]["source"] == "model.fc.bias"
    want = state["model"]["fc.bias"].astype("float32").numpy()
    assert got["opt"]["master_weights"]["linear_0.b_0"].numpy().tobytes() == want.tobytes()


def test_read_state_dict_metadata_lays_a_derived_tensor_out_as_its_source(tmp_path):
    state = paddle_state(np.random.default_rng(4))
    paddle_dcp.save_state_dict(state, str(tmp_path), compress=paddle_dcp.MASTER_WEIGHTS_DERIVED)
    sdm = paddle_dcp.read_state_dict_metadata(str(tmp_path)).state_dict_metadata
    (piece,) = sdm["opt.master_weights.linear_0.w_0"]
    assert (piece.dtype, piece.global_shape, piece.local_shape, piece.global_offset) == ("float32", (300, 7), (300, 7), (0, 0))


def test_a_load_whose_checkpoint_lacks_the_parameter_fails_naming_both_before_any_tensor_changes(tmp_path):
    from paddle_dcp.errors import FormatError

    state = paddle_state(np.random.default_rng(5))
    paddle_dcp.save_state_dict(state, str(tmp_path), compress=paddle_dcp.MASTER_WEIGHTS_DERIVED)
    doc = metadoc.read((tmp_path / "0.metadata").read_bytes())
    doc["tensors"]["opt.master_weights.linear_0.w_0"]["source"] = "model.fc.gone"  # a hand-edited file
    (tmp_path / "0.metadata").write_bytes(metadoc.write(doc))
    got = zeros(state)
    with pytest.raises(FormatError, match=r"opt\.master_weights\.linear_0\.w_0.*'model\.fc\.gone'.*not a tensor"):
        paddle_dcp.load_state_dict(got, str(tmp_path))
    assert not any(t.numpy().any() for t in (got["model"]["fc.weight"], got["opt"]["master_weights"]["linear_0.b_0"]))
