"""load_state_dict(aoa_config=...) on 2 ranks: a checkpoint saved sharded, loaded into a
differently named, transposed, fused, cast and tensor-parallel state dict; every rank's
values are compared with a numpy oracle built here, and bit for bit with paddle's built-in
``paddle.distributed.load_state_dict(..., aoa_config=...)`` of a checkpoint paddle's built-in
saved from the same values (on a CPU build with its GPU staging patched out, as
scripts/bench/io_worker.py does).

Usage (under paddle.distributed.launch, 2 ranks): aoa.py DIR [case ...]
"""
import os

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

import paddle_dcp

import common as c

ROOT = c.init()
R = c.rank()
MESH = dist.ProcessMesh([0, 1], dim_names=["tp"])
D, HEADS, KV, HD, FFN = 4, 4, 2, 2, 6


def values(shape, seed):
    """Exact in float16 / bfloat16 except for the 1/3 added to some (rounding matters)."""
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + seed * 13) % 200 / 8 - 11).astype(np.float32).reshape(shape)


SAVED = {
    "layers.0.w": values((D, 8), 1), "layers.1.w": values((D, 8), 2),
    "attn.q": values((D, HEADS * HD), 3), "attn.k": values((D, KV * HD), 4), "attn.v": values((D, KV * HD), 5),
    "mlp.gate": values((D, FFN), 6), "mlp.up": values((D, FFN), 7),
    "emb": values((6, 3), 8) + np.float32(1 / 3),
}
STATEMENTS = [
    "layers.$LAYER_ID.w^T -> blocks.$LAYER_ID.w",
    f"attn.q, attn.k, attn.v -> qkv, fused_qkv, num_heads={HEADS}, num_key_value_groups={KV}",
    "mlp.gate, mlp.up -> up_gate, fused_ffn",
    "emb^T -> emb_t",
    "emb_t -> emb_b, dtype='bfloat16'",
]


def oracle():
    """The loaded tensors from the statements' meaning: transposed layers; per key/value
    group its query heads, key head and value head; per tensor-parallel rank its half of gate
    then its half of up (fused_ffn keeps each rank's gate and up together); emb^T in bfloat16."""
    out = {f"blocks.{i}.w": SAVED[f"layers.{i}.w"].T for i in (0, 1)}
    qs, ks, vs = (np.split(SAVED[k], n, axis=1) for k, n in (("attn.q", HEADS), ("attn.k", KV), ("attn.v", KV)))
    per = HEADS // KV
    out["qkv"] = np.concatenate([a for g in range(KV) for a in qs[g * per:(g + 1) * per] + [ks[g], vs[g]]], axis=1)
    gates, ups = np.split(SAVED["mlp.gate"], 2, axis=1), np.split(SAVED["mlp.up"], 2, axis=1)
    out["up_gate"] = np.concatenate([gates[0], ups[0], gates[1], ups[1]], axis=1)
    out["emb_b"] = SAVED["emb"].T
    return out


# target key -> (global shape, dtype, tensor dim split over the 2 ranks or None)
TARGETS = {
    "blocks.0.w": ((8, D), "float32", 0), "blocks.1.w": ((8, D), "float32", 1),
    "qkv": ((D, (HEADS + 2 * KV) * HD), "float32", 1),
    "up_gate": ((D, 2 * FFN), "float32", 1),
    "emb_b": ((3, 6), "bfloat16", None),
}


def local_box(shape, dim):
    offsets, sizes = [0] * len(shape), list(shape)
    if dim is not None:
        sizes[dim] = shape[dim] // 2
        offsets[dim] = R * sizes[dim]
    return tuple(offsets), tuple(sizes)


def source_state():
    return {k: dist.shard_tensor(paddle.to_tensor(v), MESH, [dist.Shard(0)]) for k, v in SAVED.items()}


def ours_targets():
    sd = {}
    for key, (shape, dtype, dim) in TARGETS.items():
        t = paddle.full(shape, -99, dtype=dtype)
        sd[key] = dist.shard_tensor(t, MESH, [dist.Shard(dim)] if dim is not None else [dist.Replicate()])
    return sd


def local_of(t):
    t = t._local_value() if t.is_dist() else t
    return t.view(paddle.uint16).numpy() if t.dtype == paddle.bfloat16 else t.numpy()


def expected(key):
    shape, dtype, dim = TARGETS[key]
    offsets, sizes = local_box(shape, dim)
    part = oracle()[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    if dtype == "bfloat16":
        return paddle.cast(paddle.to_tensor(np.ascontiguousarray(part)), "bfloat16").view(paddle.uint16).numpy()
    return part


def save_ours():
    paddle_dcp.save_state_dict(source_state(), os.path.join(ROOT, "ours"))


def save_paddle():
    dist.save_state_dict(source_state(), os.path.join(ROOT, "paddle"))


def load_ours():
    sd = ours_targets()
    paddle_dcp.load_state_dict(sd, os.path.join(ROOT, "ours"), aoa_config={"aoa_statements": STATEMENTS})
    for key in TARGETS:
        c.assert_same(local_of(sd[key]), expected(key), f"{key} on rank {R}")
    return sd


def stage_on_host():
    if not paddle.is_compiled_with_cuda():
        paddle.Tensor.cuda = lambda self, *a, **k: self


def load_paddle():
    """paddle's built-in: aoa_config applies to a state dict of ShardedWeight only."""
    stage_on_host()
    sd = {}
    for key, (shape, dtype, dim) in TARGETS.items():
        offsets, sizes = local_box(shape, dim)
        sd[key] = ShardedWeight(key, paddle.full(sizes, -99, dtype=dtype), sizes, shape, offsets)
    dist.load_state_dict(sd, os.path.join(ROOT, "paddle"), aoa_config={"aoa_statements": STATEMENTS})
    return {k: local_of(w.local_tensor) for k, w in sd.items()}


def ours_equal_paddles():
    ours = load_ours()
    theirs = load_paddle()
    for key in TARGETS:
        c.assert_same(local_of(ours[key]), theirs[key], f"{key} (ours vs paddle's built-in) on rank {R}")


def rename_sharded():
    """A rename into another layout (columns split where rows were saved split)."""
    sd = {"blocks.0.w": dist.shard_tensor(paddle.zeros([D, 8]), MESH, [dist.Shard(1)])}
    paddle_dcp.load_state_dict(sd, os.path.join(ROOT, "ours"), aoa_config={"aoa_statements": ["layers.0.w -> blocks.0.w"]})
    c.assert_same(local_of(sd["blocks.0.w"]), SAVED["layers.0.w"][:, R * 4:(R + 1) * 4], "renamed")


c.run_cases({
    "save_ours": save_ours,
    "save_paddle": save_paddle,
    "load_ours": load_ours,
    "ours_equal_paddles": ours_equal_paddles,
    "rename_sharded": rename_sharded,
})
