"""safetensors=True on 2 ranks: Hugging Face directories (an index and 2 shards; a single
model.safetensors) written here by the ``safetensors`` package, loaded into Shard(0), Shard(1)
and Replicate; each rank's reads stay inside the bytes of its own slices; paddle's built-in
load of the same directory gives the same values; a save with safetensors=True writes files the
package opens, and loads back into other layouts.

Usage (under paddle.distributed.launch): safetensors_load.py DIR [case ...]
"""
import json
import os
import shutil

import numpy as np
import paddle
import paddle.distributed as dist
from safetensors.numpy import load_file, save_file

import common as c
import paddle_dcp
from paddle_dcp.io import reads

ROOT = c.init()
R = c.rank()
MESH = c.Mesh([0, 1])
TENSORS = {  # key -> (global shape, dtype); every one shards on both dims over 2 ranks
    "embed.weight": ((8, 6), "float32"),
    "layers.0.w": ((6, 10), "int64"),
    "layers.0.b": ((4, 2), "float64"),
}
LAYOUTS = {"s0": (("S", 0),), "s1": (("S", 1),), "r": ("R",)}


def oracle(key):
    shape, dtype = TENSORS[key]
    return c.global_array(shape, dtype, variant=list(TENSORS).index(key))


def make_directories():
    """On rank 0: DIR/sharded (index + 2 shards) and DIR/single (model.safetensors)."""
    if R == 0:
        arrays = {k: oracle(k) for k in TENSORS}
        sharded = os.path.join(ROOT, "sharded")
        os.makedirs(sharded, exist_ok=True)
        shards = {"model-00001-of-00002.safetensors": ["embed.weight"], "model-00002-of-00002.safetensors": ["layers.0.w", "layers.0.b"]}
        for name, keys in shards.items():
            save_file({k: arrays[k] for k in keys}, os.path.join(sharded, name))
        weight_map = {k: name for name, keys in shards.items() for k in keys}
        with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(a.nbytes for a in arrays.values())}, "weight_map": weight_map}, f)
        single = os.path.join(ROOT, "single")
        os.makedirs(single, exist_ok=True)
        save_file(arrays, os.path.join(single, "model.safetensors"))
    dist.barrier()


def target(spec):
    return {"embed": {"weight": c.make(oracle("embed.weight"), "float32", MESH, spec, fill=0)},
            "layers": {"0": {k: c.make(oracle(f"layers.0.{k}"), TENSORS[f"layers.0.{k}"][1], MESH, spec, fill=0) for k in ("w", "b")}}}


def check(sd, spec, what):
    for key in TENSORS:
        node = sd
        for part in key.split("."):
            node = node[part]
        c.check_tensor(node, oracle(key), TENSORS[key][1], MESH, spec, R, f"{what}: {key}")


def allowed_spans(directory):
    """file name -> [begin, end) byte spans this rank may read: from the first to the last byte
    of its slice of every tensor (the header's offsets, read here from the specification)."""
    spans = {}
    for name in os.listdir(directory):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            spans.setdefault(name, []).append((key, 8 + n + info["data_offsets"][0]))
    return spans


def load_case(directory, layout):
    spec = LAYOUTS[layout]
    path = os.path.join(ROOT, directory)
    read = []  # (file, start, stop) of every byte range a read op of this rank copies from
    real = reads.execute_op

    def counting(op, meta, *args, **kwargs):
        read.extend((meta.files[op.file].name, seg.start, seg.stop) for seg in op.segments)
        return real(op, meta, *args, **kwargs)

    reads.execute_op = counting
    try:
        sd = target(spec)
        paddle_dcp.load_state_dict(sd, path, safetensors=True)
    finally:
        reads.execute_op = real
    check(sd, spec, f"{directory} into {layout}")
    # every read lies between the first and last byte of this rank's slice of one tensor
    bounds = []
    for name, keys in allowed_spans(path).items():
        for key, base in keys:
            shape, dtype = TENSORS[key]
            flat = np.arange(int(np.prod(shape))).reshape(shape)[c.local_slices(shape, MESH.shape, MESH.coord(R), spec)]
            isz = np.dtype(dtype).itemsize
            bounds.append((name, base + int(flat.min()) * isz, base + (int(flat.max()) + 1) * isz, flat.size * isz))
    for name, start, stop in read:
        assert any(n == name and lo <= start and stop <= hi for n, lo, hi, _ in bounds), (name, start, stop, bounds)
    assert read, "nothing was read"
    if layout != "s1":  # contiguous slices: exactly their bytes, nothing more
        assert sum(b - a for _, a, b in read) == sum(size for *_, size in bounds), (read, bounds)


def builtin_case():
    """paddle.distributed.load_state_dict(..., safetensors=True) fills Shard(0) targets from an
    index and 2 shards as ours do (its reader knows no I64: float tensors only; it writes an
    auto-generated metadata file into the directory, so it gets a directory of its own)."""
    paddle.Tensor.cuda = lambda self, *a, **k: self  # its broadcasts stage through the GPU (see scripts/bench/io_worker.py)
    keys = ["embed.weight", "layers.0.b"]
    theirs_dir, ours_dir = os.path.join(ROOT, "floats_paddle"), os.path.join(ROOT, "floats")
    if R == 0:
        os.makedirs(ours_dir)
        weight_map = {}
        for i, key in enumerate(keys):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({key: oracle(key)}, os.path.join(ours_dir, name))
            weight_map[key] = name
        with open(os.path.join(ours_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        shutil.copytree(ours_dir, theirs_dir)
    dist.barrier()
    theirs = {k: c.make(oracle(k), TENSORS[k][1], MESH, LAYOUTS["s0"], fill=0) for k in keys}
    dist.load_state_dict(theirs, theirs_dir, safetensors=True)
    ours = {k: c.make(oracle(k), TENSORS[k][1], MESH, LAYOUTS["s0"], fill=0) for k in keys}
    paddle_dcp.load_state_dict(ours, ours_dir, safetensors=True)
    for k in keys:
        c.assert_same(c.held(ours[k]), c.held(theirs[k]), f"{k}: ours vs paddle's")
        c.check_tensor(ours[k], oracle(k), TENSORS[k][1], MESH, LAYOUTS["s0"], R, k)


def save_case():
    path = os.path.join(ROOT, "saved")
    sd = {"embed": {"weight": c.make(oracle("embed.weight"), "float32", MESH, LAYOUTS["s0"])},
          "layers": {"0": {k: c.make(oracle(f"layers.0.{k}"), TENSORS[f"layers.0.{k}"][1], MESH, LAYOUTS["s0"]) for k in ("w", "b")}},
          "step": 9}
    paddle_dcp.save_state_dict(sd, path, safetensors=True)
    assert sorted(os.listdir(path)) == ["0.0.claim", "0.metadata", "0_0.safetensors", "1_0.safetensors"], os.listdir(path)
    mine = load_file(os.path.join(path, f"{R}_0.safetensors"))  # the package opens the rank's file
    for key in TENSORS:
        shape, dtype = TENSORS[key]
        sl = c.local_slices(shape, MESH.shape, MESH.coord(R), LAYOUTS["s0"])
        name = f"{key}[{','.join(f'{s.start}:{s.stop}' for s in sl)}]"
        c.assert_same(mine[name], oracle(key)[sl], f"{R}_0.safetensors: {name}")


def reload_case(layout):
    spec = LAYOUTS[layout]
    sd = dict(target(spec), step=0)
    paddle_dcp.load_state_dict(sd, os.path.join(ROOT, "saved"))
    check(sd, spec, f"saved into {layout}")
    assert sd["step"] == 9


CASES = {"make": make_directories}
for d in ("sharded", "single"):
    for lay in LAYOUTS:
        CASES[f"{d}_into_{lay}"] = (lambda d=d, lay=lay: load_case(d, lay))
CASES["builtin_sharded"] = builtin_case
CASES["save"] = save_case
for lay in LAYOUTS:
    CASES[f"saved_into_{lay}"] = (lambda lay=lay: reload_case(lay))

c.run_cases(CASES)
