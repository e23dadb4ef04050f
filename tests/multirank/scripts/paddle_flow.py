"""A user's script written for paddle.distributed alone (it never imports paddle_dcp), run by the
tests as ``paddle-dcp run paddle_flow.py ROOTS PHASE`` (patch_paddle applied from outside), on
several rank counts, as Paddle's own semi-auto save/load tests exercise paddle's functions.

- ``save``: dist tensors over a 1-D mesh of every rank (Shard(0) rows, Replicate, a plain
  tensor, a value of a uneven split) saved with ``dist.save_state_dict``.
- ``load``: for each of the ROOTS (joined by ``os.pathsep``: the checkpoints of several rank
  counts, loaded in one launch), a fresh state dict in another layout (Shard(1) columns over every rank; plain
  tensors in one process) filled with ``dist.load_state_dict``, every value against numpy; then
  a target with a key the checkpoint lacks: paddle's contract, no error, that tensor unchanged,
  the others loaded (the patch's default; ``paddle-dcp run --strict`` would raise); the
  metadata's ``flat_mapping`` (read with ``paddle.load``) gives each flat key's nested path.
- ``dynamic_static`` (one process): paddle's dynamic <-> static (``DistModel``) mutual load.
"""
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import common as c

ROOTS, PHASE = sys.argv[1].split(os.pathsep), sys.argv[2]
ROOT = ROOTS[0]
LAUNCHED = "PADDLE_TRAINER_ID" in os.environ
if LAUNCHED:
    dist.init_parallel_env()
R = dist.get_rank() if LAUNCHED else 0
N = dist.get_world_size() if LAUNCHED else 1
MESH = c.Mesh(list(range(N))) if LAUNCHED else None
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
    # deeper nesting: flattened to "opt.state.m" (paddle's flat_mapping gives the path back)
    out.append(c.Leaf(("opt", "state", "m"), (5,), "float32", MESH, None if MESH is None else ("R",), index=len(out)))
    return out


def save():
    dist.save_state_dict(c.build(leaves("rows"), 0), os.path.join(ROOT, "flow"))


def load():
    for root in ROOTS:
        load_one(os.path.join(root, "flow"))


def load_one(ck: str):
    lv = leaves("columns")
    sd = c.build(lv, 0, target=True)
    dist.load_state_dict(sd, ck)  # paddle's name: routed to paddle_dcp from outside this script
    c.check_state(sd, lv, 0, R)
    meta = paddle.load(os.path.join(ck, "0.metadata"))  # paddle's call: paddle_dcp's JSON read for it
    assert meta.flat_mapping == {".".join(leaf.path): leaf.path for leaf in lv}, meta.flat_mapping
    assert sorted(meta.state_dict_metadata) == sorted(meta.flat_mapping)
    sd = c.build(lv, 0, target=True)
    sd["model"]["learning_rate_0"] = paddle.full([1], 0.5)  # not in the checkpoint
    dist.load_state_dict(sd, ck)
    assert sd["model"]["learning_rate_0"].numpy().tolist() == [0.5]
    c.check_state(sd, lv, 0, R)


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(8, 6)
        self.out = paddle.nn.Linear(6, 4)

    def forward(self, x):
        return self.out(self.fc(x))


class Ones(paddle.io.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.ones([8], "float32"), np.ones([4], "float32")


def dynamic_static():
    """Paddle's dynamic <-> static mutual load, in one process (the CPU build's static engine
    needs a GPU for a group of two): a checkpoint of the dynamic model loads into the state
    dict of a DistModel (``dist.to_static``), which also holds ``learning_rate_0``, a key the
    checkpoint lacks: paddle's contract, a warning naming it, the value unchanged. Then the
    DistModel's state dict, saved, loads back into a dynamic model."""
    import logging

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("paddle_dcp").addHandler(handler)
    mesh = dist.ProcessMesh([0], dim_names=["x"])

    def model(seed):
        paddle.seed(seed)
        net = Net()
        net.fc.weight = dist.shard_tensor(net.fc.weight, mesh, [dist.Shard(1)])
        return net

    source = model(1)
    want = {k: v.numpy().copy() for k, v in source.state_dict().items()}
    dist.save_state_dict(source.state_dict(), os.path.join(ROOT, "dynamic"))
    loader = dist.shard_dataloader(paddle.io.DataLoader(Ones(), batch_size=2), [mesh])
    net = model(2)
    dm = dist.to_static(net, loader, paddle.nn.MSELoss(), paddle.optimizer.SGD(0.25, parameters=net.parameters()))
    dm.train()
    sd = dm.state_dict()
    assert sorted(sd) == sorted([*want, "learning_rate_0"]), sorted(sd)
    assert not all(np.array_equal(sd[k].numpy(), want[k]) for k in want)  # another model's values until loaded
    dist.load_state_dict(sd, os.path.join(ROOT, "dynamic"))
    dm.set_state_dict(sd)
    got = dm.state_dict()
    for key in want:
        c.assert_same(got[key].numpy(), want[key], f"{key} (dynamic -> static)")
    assert np.asarray(got["learning_rate_0"].numpy()).reshape(-1).tolist() == [0.25]  # unchanged
    assert [w for w in warnings if "learning_rate_0" in w], warnings
    dist.save_state_dict(dm.state_dict(), os.path.join(ROOT, "static"))
    back = model(3)
    sd = back.state_dict()
    dist.load_state_dict(sd, os.path.join(ROOT, "static"))
    for key in want:
        c.assert_same(back.state_dict()[key].numpy(), want[key], f"{key} (static -> dynamic)")


CASES = {"save": save, "load": load, "dynamic_static": dynamic_static}
if LAUNCHED:
    c.run_cases({PHASE: CASES[PHASE]}, [PHASE])
else:
    CASES[PHASE]()
    print(f"PASS {PHASE} rank=0", flush=True)
