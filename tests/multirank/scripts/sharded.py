"""ShardedWeight state dicts (flattened or not) mixed with dist tensors, plain tensors and numpy
arrays: saved in one layout, loaded into another, on 2 ranks; and save_replicas.

The oracle: numpy global arrays (common.global_array); each rank's piece is computed here from
the layout (rows / columns cut with common.chunk, flat ranges cut at fixed element counts), never
by paddle_dcp. Values are compared bit for bit.

Usage (under paddle.distributed.launch, 2 ranks): sharded.py DIR [case ...]
"""
import os

import numpy as np
import paddle
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

import paddle_dcp
from paddle_dcp.parallel import loadwork

import common as c
import metadoc

ROOT = c.init()
R = c.rank()
MESH = c.Mesh([0, 1])
SHAPES = {"w": (6, 5), "e": (3, 4, 5), "b": (7,)}
DTYPES = {"w": "float32", "e": "int64", "b": "float32"}
ABSENT = object()


def glob(name, variant):
    return c.global_array(SHAPES[name], DTYPES[name], variant + 2 * list(SHAPES).index(name))


def tp_box(shape, dim, r):
    lo, hi = c.chunk(shape[dim], 2, r)
    return tuple(lo if d == dim else 0 for d in range(len(shape))), tuple(
        hi - lo if d == dim else n for d, n in enumerate(shape)
    )


# A layout maps every key to how each rank holds it:
#   ("tp", dim)       ShardedWeight of rank r's chunk along dim (tensor parallel)
#   ("owner", r)      ShardedWeight of the whole tensor on rank r only (sharding stage 1)
#   ("whole",)        ShardedWeight of the whole tensor on every rank (replicated)
#   ("flat", cuts)    flattened ShardedWeight of the whole box: rank r holds [cuts[r], cuts[r+1])
#   ("dist", spec)    dist tensor on MESH; ("plain",) paddle tensor; ("numpy",) numpy array
def expected(how, name, variant):
    """What rank R must hold (numpy), ABSENT when its state dict lacks the key."""
    gl = glob(name, variant)
    kind = how[0]
    if kind == "tp":
        off, shape = tp_box(gl.shape, how[1], R)
        return gl[tuple(slice(o, o + n) for o, n in zip(off, shape))]
    if kind == "owner":
        return gl if how[1] == R else ABSENT
    if kind == "flat":
        return gl.reshape(-1)[how[1][R] : how[1][R + 1]]
    if kind == "dist":
        return c.expected_local(gl, DTYPES[name], MESH, how[1], R)
    return gl


def make(how, name, variant, target):
    want = expected(how, name, variant)
    if want is ABSENT:
        return ABSENT
    data = np.full_like(want, c.sentinel(DTYPES[name])) if target else want.copy()
    kind = how[0]
    shape = SHAPES[name]
    if kind == "numpy":
        return data
    if kind == "dist":
        return c.make(glob(name, variant), DTYPES[name], MESH, how[1], fill=c.sentinel(DTYPES[name]) if target else None)
    if kind == "plain":
        return paddle.to_tensor(data)
    if kind == "tp":
        off, local_shape = tp_box(shape, how[1], R)
        return ShardedWeight(name, paddle.to_tensor(data), local_shape, shape, off)
    if kind == "flat":
        rng = slice(how[1][R], how[1][R + 1])
        return ShardedWeight(name, paddle.to_tensor(data), shape, shape, (0,) * len(shape), True, rng)
    return ShardedWeight(name, paddle.to_tensor(data), shape, shape, (0,) * len(shape))  # owner, whole


def build(layout, variant, target=False, value=0):
    sd = {}
    for name, how in layout.items():
        v = make(how, name, variant, target)
        if v is not ABSENT:
            sd[f"model.{name}"] = v
    sd["step"] = value
    return sd


def local_of(v):
    if isinstance(v, ShardedWeight):
        return v.local_tensor.numpy()
    return c.held(v)


def check(sd, layout, variant, what):
    for name, how in layout.items():
        want = expected(how, name, variant)
        key = f"model.{name}"
        if want is ABSENT:
            assert key not in sd, f"{what}: {key} appeared"
            continue
        c.assert_same(local_of(sd[key]), np.asarray(want), f"{what}: {key} ({how[0]})")


# rows of w are 5 long, e's (4, 5) blocks 20: cuts mid-row, and e's mid-row in 3-D
TP = {"w": ("tp", 1), "e": ("tp", 0), "b": ("tp", 0)}
STAGE1 = {"w": ("owner", 0), "e": ("owner", 1), "b": ("owner", 0)}
STAGE2 = {"w": ("flat", (0, 13, 30)), "e": ("flat", (0, 27, 60)), "b": ("flat", (0, 7, 7))}
DIST = {"w": ("dist", (("S", 0),)), "e": ("dist", (("S", 2),)), "b": ("dist", ("R",))}
MIXED = {"w": ("flat", (0, 8, 30)), "e": ("dist", (("S", 1),)), "b": ("plain",)}
MIXED2 = {"w": ("tp", 0), "e": ("flat", (0, 33, 60)), "b": ("numpy",)}
ONE = {"w": ("owner", 0), "e": ("owner", 0), "b": ("owner", 0)}
WHOLE = {"w": ("whole",), "e": ("whole",), "b": ("whole",)}
REPLICATED = {"w": ("whole",), "e": ("dist", ("R",)), "b": ("plain",)}


def path(name):
    return os.path.join(ROOT, name)


def save(layout, name, variant=0, **kw):
    sd = build(layout, variant, value=f"{name}-{variant}")
    check(sd, layout, variant, f"fixture {name}")  # the fixture holds what the oracle says
    paddle_dcp.save_state_dict(sd, path(name), **kw)


def load(layout, name, variant=0, **kw):
    sd = build(layout, variant, target=True)
    paddle_dcp.load_state_dict(sd, path(name), **kw)
    check(sd, layout, variant, f"{name} -> {sorted(set(h[0] for h in layout.values()))}")
    assert sd["step"] == f"{name}-{variant}", sd["step"]
    return sd


def pieces_of(name):
    meta = paddle_dcp.read_metadata(path(name))
    return {k: [(tuple(o), tuple(s), meta.files[f].name) for o, s, f in
                zip(t.pieces.offsets.tolist(), t.pieces.shapes.tolist(), t.pieces.files.tolist())]
            for k, t in meta.tensors.items()}, meta


def saved_as_boxes():
    """A flattened range is saved as the boxes it covers (elements 13..30 of w = rest of row
    2, rows 3-5): the checkpoint lists boxes, never flat ranges."""
    save(STAGE2, "stage2")
    boxes, _ = pieces_of("stage2")
    assert sorted((o, s) for o, s, _ in boxes["model.w"]) == [
        ((0, 0), (2, 5)), ((2, 0), (1, 3)), ((2, 3), (1, 2)), ((3, 0), (3, 5))], boxes["model.w"]
    assert sorted((o, s) for o, s, _ in boxes["model.b"]) == [((0,), (7,))], boxes["model.b"]


def node_local_replicas():
    """Each rank in its own directory ("node"; the metadata only on rank 0's): with
    save_replicas, every rank's file holds a copy of every replicated piece and a load into the
    replicated layout receives no byte from another rank; without it, some pieces live only in
    the other node's file and are received (which shows the check can fail)."""
    node = os.path.join(ROOT, f"node{R}")
    os.makedirs(node, exist_ok=True)
    here = os.getcwd()
    remote = []
    original = loadwork.LoadPlan.served

    def served(self, answer):  # the servers named for the files this rank cannot read
        plan = original(self, answer)
        remote[-1] = {server: len(ops) for server, ops in plan.remote.items()}
        return plan

    def load_state_dict(sd, name):
        remote.append({})  # no file it cannot read: no servers
        paddle_dcp.load_state_dict(sd, name)

    loadwork.LoadPlan.served = served
    os.chdir(node)
    try:
        for replicas in (True, False):
            name = f"ck_{replicas}"
            paddle_dcp.save_state_dict(build(REPLICATED, 1, value=name), name, save_replicas=replicas)
            c.dist.barrier()
            mine = sorted(os.listdir(name))
            assert mine == sorted([f"{R}_0.distcp"] + (["0.0.claim", "0.metadata"] if R == 0 else [])), mine
            sd = build(REPLICATED, 1, target=True)
            load_state_dict(sd, name)
            check(sd, REPLICATED, 1, f"node-local {name}")
            assert sd["step"] == name, sd["step"]
            if replicas:
                assert remote[-1] == {}, f"rank {R} received pieces from {remote[-1]} despite save_replicas"
            else:
                assert remote[-1], f"rank {R} read everything locally without replicas: the check proves nothing"
    finally:
        os.chdir(here)
        loadwork.LoadPlan.served = original


def replicas_written():
    """save_replicas: both ranks write every piece of a tensor they both hold (two copies per
    box in the metadata, in different files, files of equal size); without it each box once."""
    save(WHOLE, "whole_rep", save_replicas=True)
    save(WHOLE, "whole_once")
    rep, meta_rep = pieces_of("whole_rep")
    once, meta_once = pieces_of("whole_once")
    for key in rep:
        assert len(rep[key]) == 2 and len({f for _, _, f in rep[key]}) == 2, rep[key]
        assert len({(o, s) for o, s, _ in rep[key]}) == 1, rep[key]
        assert len(once[key]) == 1, once[key]
    sizes = [f.nbytes for f in meta_rep.files]
    assert len(sizes) == 2 and sizes[0] == sizes[1], sizes
    logical = sum(t.nbytes for t in meta_rep.tensors.values())
    assert sizes[0] >= logical and sum(f.nbytes for f in meta_once.files) < 2 * logical, (sizes, logical)
    doc = metadoc.read(open(os.path.join(path("whole_rep"), "0.metadata"), "rb").read())
    assert doc["replicas"] is True
    assert "replicas" not in metadoc.read(open(os.path.join(path("whole_once"), "0.metadata"), "rb").read())
    for layout in (WHOLE, TP, STAGE2, DIST):  # any copy loads into any layout
        load(layout, "whole_rep")


def paddle_builtin_agrees():
    """paddle.distributed's own save / load of the same ShardedWeight state dicts (on CPU, its
    GPU staging patched out as scripts/bench/io_worker.py does) gives the same values as ours."""
    import paddle.distributed as pdist

    original = paddle.Tensor.cuda
    paddle.Tensor.cuda = lambda self, *a, **k: self
    try:
        # no empty flattened range here: paddle's own load leaves a tensor saved with one as
        # zeros (STAGE2's model.b; ours loads it, see stage2_into_stage1)
        stage2 = dict(STAGE2, b=("flat", (0, 4, 7)))
        for i, (src, dst) in enumerate(((TP, ONE), (STAGE1, stage2), (stage2, STAGE1), (stage2, TP))):
            directory = path(f"paddle_builtin_{i}")
            sd = build(src, 0)
            del sd["step"]  # paddle's built-in takes tensors and ShardedWeights only
            pdist.save_state_dict(sd, directory)
            c.dist.barrier()
            theirs = build(dst, 0, target=True)
            del theirs["step"]
            pdist.load_state_dict(theirs, directory)
            paddle_dcp.save_state_dict(build(src, 0), directory + "_ours")
            ours = build(dst, 0, target=True)
            paddle_dcp.load_state_dict(ours, directory + "_ours")
            for key in theirs:
                c.assert_same(local_of(ours[key]), local_of(theirs[key]), f"case {i}, {key}: ours vs paddle's")
            check(theirs, dst, 0, f"paddle's own load, case {i}")
    finally:
        paddle.Tensor.cuda = original


def case(fn, *args, **kwargs):
    return lambda: fn(*args, **kwargs)


CASES = {
    "save_mixed": case(save, MIXED, "mixed"),
    "mixed_round_trip": case(load, MIXED, "mixed"),
    "mixed_into_mixed2": case(load, MIXED2, "mixed"),
    "save_tp": case(save, TP, "tp"),
    "tp2_into_one_rank": case(load, ONE, "tp"),
    "tp2_into_replicated": case(load, REPLICATED, "tp"),
    "tp_into_dist": case(load, DIST, "tp"),
    "save_stage1": case(save, STAGE1, "stage1"),
    "stage1_into_stage2": case(load, STAGE2, "stage1"),
    "saved_as_boxes": saved_as_boxes,
    "stage2_into_stage1": case(load, STAGE1, "stage2"),
    "stage2_into_other_cuts": case(load, {"w": ("flat", (0, 2, 30)), "e": ("flat", (0, 59, 60)),
                                          "b": ("flat", (0, 0, 7))}, "stage2"),
    "stage2_into_dist": case(load, DIST, "stage2"),
    "save_dist": case(save, DIST, "dist"),
    "dist_into_tp": case(load, TP, "dist"),
    "dist_into_stage2": case(load, STAGE2, "dist"),
    "replicas_written": replicas_written,
    "node_local_replicas": node_local_replicas,
    "paddle_builtin_agrees": paddle_builtin_agrees,
}

c.run_cases(CASES, __import__("sys").argv[2:])
