"""A user's script written for paddle.distributed alone (it never imports paddle_dcp), run by the
tests as ``paddle-dcp run paddle_flow.py ROOT PHASE`` (patch_paddle applied from outside), on
several rank counts, as Paddle's own semi-auto save/load tests exercise paddle's functions.

- ``save``: dist tensors over a 1-D mesh of every rank (Shard(0) rows, Replicate, a plain
  tensor, a value of a uneven split) saved with ``dist.save_state_dict``.
- ``load``: a fresh state dict in another layout (Shard(1) columns over every rank; plain
  tensors in one process) filled with ``dist.load_state_dict``, every value against numpy; then
  a target with a key the checkpoint lacks: paddle's contract, no error, that tensor unchanged,
  the others loaded (the patch's default; ``paddle-dcp run --strict`` would raise).
"""
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import common as c

ROOT, PHASE = sys.argv[1], sys.argv[2]
LAUNCHED = "PADDLE_TRAINER_ID" in os.environ
if LAUNCHED:
    dist.init_parallel_env()
R = dist.get_rank() if LAUNCHED else 0
N = dist.get_world_size() if LAUNCHED else 1
MESH = c.Mesh(list(range(N))) if LAUNCHED else None
CK = os.path.join(ROOT, "flow")
SHAPES = {"w": ((8, 6), "float32"), "b": ((6,), "float32"), "uneven": ((7, 6), "int64"), "emb": ((6, 4), "bfloat16")}


def leaves(layout: str):
    out = []
    for i, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        if MESH is None:
            spec = None
        elif layout == "rows":
            spec = ("R",) if name == "b" else (("S", 0),)
        else:
            spec = (("S", len(shape) - 1),)
        if spec is not None and not c.paddle_accepts(shape, MESH.shape, spec):  # too few columns for N
            spec = ("R",)
        out.append(c.Leaf(("model", name), shape, dtype, MESH, spec, index=i))
    return out


def save():
    dist.save_state_dict(c.build(leaves("rows"), 0), CK)


def load():
    lv = leaves("columns")
    sd = c.build(lv, 0, target=True)
    dist.load_state_dict(sd, CK)  # paddle's name: routed to paddle_dcp from outside this script
    c.check_state(sd, lv, 0, R)
    sd = c.build(lv, 0, target=True)
    sd["model"]["learning_rate_0"] = paddle.full([1], 0.5)  # not in the checkpoint
    dist.load_state_dict(sd, CK)
    assert sd["model"]["learning_rate_0"].numpy().tolist() == [0.5]
    c.check_state(sd, lv, 0, R)


CASES = {"save": save, "load": load}
if LAUNCHED:
    c.run_cases({PHASE: CASES[PHASE]}, [PHASE])
else:
    CASES[PHASE]()
    print(f"PASS {PHASE} rank=0", flush=True)
