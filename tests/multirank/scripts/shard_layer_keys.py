"""A tiny PaddleFormers Llama saved on one layout (every rank holds the whole model) and loaded
into the same model made tensor-parallel with ``dist.shard_layer`` (2 ranks, CPU).

argv: ROOT [case ...]

- ``paddles_shard_layer``: paddle's own shard_layer re-registers the model's non-persistable
  rotary buffers as persistable, so the sharded model's state dict has keys the checkpoint
  lacks: a strict load raises, names them, says they look like buffers and prints the
  ``allow_missing`` that allows them; with it, every parameter is loaded (numpy oracle) and
  strictness holds for the rest.
- ``patched_shard_layer``: under ``paddle_dcp.patch_paddle()`` shard_layer keeps them
  non-persistable: the same keys on both layouts, and a strict load fills every parameter.
"""
import ast
import os
import sys


try:  # pyarrow (for `datasets`) may need a newer numpy than the one installed; unused here
    import pyarrow  # noqa: F401
except ImportError:
    sys.modules["datasets"] = None

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402

import common as c  # noqa: E402
import paddle_dcp  # noqa: E402

ROOT = c.init()
R = c.rank()
MESH = c.Mesh([0, 1])
PADDLES_SHARD_LAYER = dist.shard_layer  # kept before any patch


def tiny_model(seed: int):
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, fuse_rms_norm=False, dtype="float32",
    )
    return LlamaForCausalLM(config)


def columns(name, layer, mesh):
    """Tensor parallel as a user writes it: every Linear's weight split by columns."""
    if isinstance(layer, paddle.nn.Linear):
        layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Shard(1)])


SAVED = tiny_model(11)
EXPECTED = {k: v.numpy().copy() for k, v in SAVED.state_dict().items()}
CK = os.path.join(ROOT, "one_layout")
paddle_dcp.save_state_dict(SAVED.state_dict(), CK)


def check_parameters(model) -> None:
    checked = 0
    for key, value in model.state_dict().items():
        if key not in EXPECTED:
            continue
        spec = tuple(("S", 1) if p.is_shard() else "R" for p in value.placements) if value.is_dist() else None
        local = value._local_value().numpy() if value.is_dist() else value.numpy()
        want = EXPECTED[key] if spec is None else EXPECTED[key][c.local_slices(EXPECTED[key].shape, MESH.shape, MESH.coord(R), spec)]
        c.assert_same(local, want, key)
        checked += 1
    assert checked == len(EXPECTED), (checked, len(EXPECTED))


def paddles_shard_layer():
    model = PADDLES_SHARD_LAYER(tiny_model(12), MESH.paddle, columns)
    extra = sorted(set(model.state_dict()) - set(EXPECTED))
    assert extra and all("inv_freq" in k for k in extra), extra  # what the user meets
    try:
        paddle_dcp.load_state_dict(model.state_dict(), CK)
        raise AssertionError("a strict load into the sharded model's extra buffers returned")
    except paddle_dcp.MismatchError as exc:
        message = str(exc)
    assert all(k in message for k in extra) and "look like buffers" in message, message
    allow = ast.literal_eval(message.rsplit("allow_missing=", 1)[1])  # the error's own suggestion
    paddle_dcp.load_state_dict(model.state_dict(), CK, allow_missing=allow)
    check_parameters(model)
    try:  # strict for every other key
        paddle_dcp.load_state_dict(dict(model.state_dict(), lm_extra=paddle.zeros([2])), CK, allow_missing=allow)
        raise AssertionError("allow_missing let a key it does not match be missing")
    except paddle_dcp.MismatchError as exc:
        assert "lm_extra" in str(exc), str(exc)


def patched_shard_layer():
    with paddle_dcp.patch_paddle():
        model = dist.shard_layer(tiny_model(13), MESH.paddle, columns)
    assert sorted(model.state_dict()) == sorted(EXPECTED), sorted(set(model.state_dict()) ^ set(EXPECTED))
    paddle_dcp.load_state_dict(model.state_dict(), CK)  # strict
    check_parameters(model)


c.run_cases({"paddles_shard_layer": paddles_shard_layer, "patched_shard_layer": patched_shard_layer})
