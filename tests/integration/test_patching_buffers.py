"""Buffers a layer declared non-persistable stay out of get_state_dict after paddle's own
dist.shard_layer made them persistable (one process, a mesh of one; paddle imported)."""
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp import patching

paddle = pytest.importorskip("paddle")
import paddle.distributed as dist  # noqa: E402

MESH = dist.ProcessMesh([0], dim_names=["x"])


class Rotary(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(4, 3)
        self.register_buffer("inv_freq", paddle.arange(4, dtype="float32"), persistable=False)
        self.register_buffer("steps", paddle.ones([2]))
        self.cached = paddle.zeros([3])  # a tensor attribute: paddle makes it a non-persistable buffer


class Model(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.rotary = Rotary()
        self.head = paddle.nn.Linear(3, 2)


ONE_PROCESS = ["head.bias", "head.weight", "rotary.fc.bias", "rotary.fc.weight", "rotary.steps"]


def test_paddles_shard_layer_adds_keys_and_get_state_dict_leaves_them_out():
    assert sorted(Model().state_dict()) == ONE_PROCESS
    model = dist.shard_layer(Model(), MESH)  # paddle's own, no patch
    assert {"rotary.inv_freq", "rotary.cached"} <= set(model.state_dict())  # paddle's keys grew
    assert model.rotary.inv_freq.is_dist()
    state = paddle_dcp.get_state_dict(model)["model"]
    assert sorted(state) == ONE_PROCESS
    for key in ONE_PROCESS:  # the live tensors, not copies
        assert state[key] is model.state_dict()[key]
    assert patching.forgotten(model.rotary) == {"inv_freq", "cached"}
    assert patching.forgotten(model) == frozenset()
    assert patching.forgotten_keys(model) == {"rotary.inv_freq", "rotary.cached"}


def test_an_explicit_persistable_is_the_callers_choice():
    model = dist.shard_layer(Model(), MESH)
    model.rotary.register_buffer("inv_freq", model.rotary.inv_freq, persistable=True)
    assert "rotary.inv_freq" in paddle_dcp.get_state_dict(model)["model"]
    model.rotary.register_buffer("inv_freq", model.rotary.inv_freq, persistable=False)
    assert "rotary.inv_freq" not in paddle_dcp.get_state_dict(model)["model"]


def test_a_plain_tensor_registered_with_paddles_default_becomes_persistable_as_paddle_says():
    model = Model()
    model.rotary.register_buffer("inv_freq", paddle.ones([4]))  # not shard_layer's call
    assert "rotary.inv_freq" in paddle_dcp.get_state_dict(model)["model"]
    assert "rotary.inv_freq" in model.state_dict()


def test_set_state_dict_takes_the_same_keys(caplog):
    paddle.seed(5)
    saved = Model()
    want = {k: v.numpy().copy() for k, v in saved.state_dict().items()}
    paddle.seed(6)
    model = dist.shard_layer(Model(), MESH)
    with caplog.at_level(logging.WARNING, logger="paddle_dcp"):
        paddle_dcp.set_state_dict(model, None, {"model": saved.state_dict()})
    assert not [r for r in caplog.records if "inv_freq" in r.getMessage() or "cached" in r.getMessage()]
    for key, value in model.state_dict().items():
        if key in want:
            np.testing.assert_array_equal(value._local_value().numpy(), want[key], err_msg=key)


def test_patched_shard_layer_marks_them_non_persistable_again():
    """Under patch_paddle, model.state_dict() itself has the same keys on every layout (paddle's
    own save and load see them too); the buffers still move to the mesh."""
    paddles = dist.shard_layer
    with paddle_dcp.patch_paddle():
        assert dist.shard_layer is not paddles
        model = dist.shard_layer(Model(), MESH)
    assert dist.shard_layer is paddles
    assert sorted(model.state_dict()) == ONE_PROCESS
    assert model.rotary.inv_freq.is_dist() and model.rotary.steps.is_dist()
    assert patching.forgotten_keys(model) == frozenset()


@pytest.mark.parametrize("first", ["paddle_dcp", "paddle"])
def test_either_import_order(first):
    """With paddle_dcp imported before paddle, the note is put in place when paddle's layers
    module loads (and the import hook leaves sys.meta_path)."""
    second = "paddle" if first == "paddle_dcp" else "paddle_dcp"
    code = textwrap.dedent(f"""
        import sys
        import {first}
        import {second}
        import paddle.distributed as dist
        from paddle_dcp import patching
        assert not any(isinstance(f, patching._WhenLoaded) for f in sys.meta_path)
        layer = paddle.nn.Layer()
        layer.register_buffer("freq", paddle.ones([2]), persistable=False)
        layer = dist.shard_layer(layer, dist.ProcessMesh([0], dim_names=["x"]))
        assert "freq" in layer.state_dict()
        assert "freq" not in paddle_dcp.get_state_dict(layer)["model"]
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
