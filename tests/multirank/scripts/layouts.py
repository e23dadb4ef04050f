"""One tiny PaddleFormers Llama and its AdamW on six layouts: ``paddle_dcp.get_state_dict``
gives the same keys on every one, and a checkpoint saved on any loads strictly on any other.

argv: ROOT PHASE LAYOUT [LAYOUT ...]

- ``save``: for each layout named (one after the other, in one job), every tensor of
  ``get_state_dict(model, opt)`` is set to the oracle's value of its key (this rank's slice of
  a numpy array, from the tensor's placements), saved under ``ROOT/<layout>``, and the flat
  keys written to ``ROOT/<layout>.keys.json``.
- ``load``: one case per pair (layout named, layout saved under ROOT): a fresh model and
  optimizer on the first has the keys the second saved, loads its checkpoint strictly, and
  every tensor equals the oracle, bit for bit.

Layouts (ranks): ``one`` (1; no mesh, paddle's own AdamW), ``tp2`` (2; paddle's own
``dist.shard_layer``, every Linear's weight split by columns, its rotary buffers made
persistable by paddle), ``dp2tp2`` (4; a [dp, mp] mesh, weights replicated over dp and split by
columns over mp, optimizer states sharded over dp: ShardingStage1), ``stage1``, ``stage2``,
``stage3`` (2; replicated model, ``dist.shard_optimizer`` with ShardingStage1/2/3; stage 3 shards
the parameters too). No patch: paddle's functions are paddle's.
"""
import json
import os
import sys
import zlib

import numpy as np

try:  # pyarrow (for `datasets`) may need a newer numpy than the one installed; unused here
    import pyarrow  # noqa: F401
except ImportError:
    sys.modules["datasets"] = None

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402

import common as c  # noqa: E402
import paddle_dcp  # noqa: E402

ROOT = c.init()
PHASE, NAMES = sys.argv[2], sys.argv[3:]
R = c.rank()
RANKS = {"one": 1, "tp2": 2, "dp2tp2": 4, "stage1": 2, "stage2": 2, "stage3": 2}


def tiny_model(tied: bool = False):
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, fuse_rms_norm=False, dtype="float32",
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def columns(mesh, placements):
    def shard_fn(name, layer, process_mesh):
        if isinstance(layer, paddle.nn.Linear):
            layer.weight = dist.shard_tensor(layer.weight, mesh, placements)

    return shard_fn


def build(layout: str, tied: bool = False):
    """The model and its optimizer on ``layout``."""
    model = tiny_model(tied)
    stage = None
    if layout == "tp2":
        mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
        model = dist.shard_layer(model, mesh, columns(mesh, [dist.Shard(1)]))
    elif layout == "dp2tp2":
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        model = dist.shard_layer(model, mesh, columns(mesh, [dist.Replicate(), dist.Shard(1)]))
        stage = dist.ShardingStage1("dp", mesh)
    elif layout.startswith("stage"):
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        model = dist.shard_layer(model, mesh)
        stage = getattr(dist, f"ShardingStage{layout[-1]}")("dp", mesh)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    if layout != "one":
        opt = dist.shard_optimizer(opt, stage)
    return model, opt


def tensors(state: dict) -> dict:
    """Flat key -> tensor of a get_state_dict result."""
    return {f"{part}.{k}": v for part in ("model", "optim") for k, v in state.get(part, {}).items()
            if isinstance(v, paddle.Tensor)}


def oracle(key: str, shape) -> np.ndarray:
    """The whole value of ``key``: positions, offset by a number of the key's own."""
    return c.global_array(shape, "float32", variant=zlib.crc32(key.encode()) % 997)


def my_slice(t) -> tuple:
    """The slice of the whole tensor this rank holds, from ``t``'s mesh and placements."""
    if not t.is_dist():
        return tuple(slice(0, n) for n in t.shape)
    mesh = t.process_mesh
    ids = np.asarray(mesh.process_ids).reshape(mesh.shape)
    coord = tuple(int(x) for x in np.argwhere(ids == R)[0])
    spec = []
    for p in t.placements[: len(mesh.shape)]:
        assert not p.is_partial(), f"a Partial placement in {t.placements}"
        spec.append(("S", p.get_dim()) if p.is_shard() else "R")
    return c.local_slices(list(t.shape), mesh.shape, coord, tuple(spec))


def local_of(t) -> np.ndarray:
    return np.array((t._local_value() if t.is_dist() else t).numpy(), copy=True)


def set_oracle(key: str, t) -> None:
    want = oracle(key, list(t.shape))[my_slice(t)].astype(local_of(t).dtype)
    (t._local_value() if t.is_dist() else t).set_value(want)
    c.assert_same(local_of(t), want, f"{key} as set")  # the oracle is really in the live tensor


def check_oracle(key: str, t, source: str) -> None:
    want = oracle(key, list(t.shape))[my_slice(t)]
    c.assert_same(local_of(t), want.astype(local_of(t).dtype), f"{key} loaded from {source}")


def save(layout: str) -> None:
    model, opt = build(layout)
    state = paddle_dcp.get_state_dict(model, opt)
    flat = tensors(state)
    buffers = [k for k in flat if "inv_freq" in k]
    assert not buffers, f"{layout}: buffers declared non-persistable in the state: {buffers}"
    for key, t in flat.items():
        set_oracle(key, t)
    paddle_dcp.save_state_dict(state, os.path.join(ROOT, layout))
    if R == 0:
        with open(os.path.join(ROOT, f"{layout}.keys.json"), "w") as f:
            json.dump(sorted(flat), f)
    sharded = [k for k, t in flat.items() if local_of(t).shape != tuple(t.shape)]
    assert (layout == "one") == (not sharded), f"{layout}: split tensors {sharded[:5]}"


def stage3_tied_weights_refused() -> None:
    """paddle's ShardingStage3 splits a tied embedding once per use: its local piece is a quarter
    of the rows while its placements say half. The save refuses it on every rank, naming the
    key and both shapes, and writes nothing."""
    model, opt = build("stage3", tied=True)
    target = os.path.join(ROOT, "stage3_tied")
    try:
        paddle_dcp.save_state_dict(paddle_dcp.get_state_dict(model, opt), target)
        raise AssertionError("a tied embedding under stage 3 was saved")
    except paddle_dcp.CollectiveError as exc:
        message = str(exc)
    assert "embed_tokens.weight" in message and "(32, 64)" in message and "(64, 64)" in message, message
    assert not os.path.exists(target) or not [n for n in os.listdir(target) if n.endswith(".metadata")]


def saved_layouts() -> list:
    return sorted(n for n in RANKS if os.path.isfile(os.path.join(ROOT, f"{n}.keys.json")))


def load(layout: str, source: str) -> None:
    """A fresh model and optimizer on ``layout``: the same keys as ``source`` saved, and its
    checkpoint loaded strictly, every tensor (and the live ones behind them) as the oracle."""
    model, opt = build(layout)
    state = paddle_dcp.get_state_dict(model, opt)
    with open(os.path.join(ROOT, f"{source}.keys.json")) as f:
        keys = json.load(f)
    assert sorted(tensors(state)) == keys, (layout, source, sorted(set(tensors(state)) ^ set(keys)))
    paddle_dcp.load_state_dict(state, os.path.join(ROOT, source))  # strict: paddle_dcp's default
    for key, t in tensors(state).items():
        check_oracle(key, t, source)
    live = tensors(paddle_dcp.get_state_dict(model, opt))  # filled in place: the live tensors
    for key, t in live.items():
        check_oracle(key, t, f"{source} (live)")


for name in NAMES:
    assert RANKS[name] == dist.get_world_size(), (name, dist.get_world_size())
if PHASE == "save":
    CASES = {f"save_{name}": (lambda n=name: save(n)) for name in NAMES}
else:  # one case per (target, source) pair
    assert saved_layouts() == sorted(RANKS), f"saved: {saved_layouts()}"
    CASES = {f"load_{name}_from_{source}": (lambda n=name, s=source: load(n, s))
             for name in NAMES for source in saved_layouts()}
if PHASE == "save" and "stage3" in NAMES:
    CASES["stage3_tied_weights_refused"] = stage3_tied_weights_refused
c.run_cases(CASES, [])
