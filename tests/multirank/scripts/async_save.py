"""async_save=True on 2 ranks: the call returns once the pieces are staged; values saved load
back exactly although the tensors change right after; a failure of the background writer
surfaces on every rank; the next save waits for a pending one.

argv: WORKDIR [case ...]
"""
import os
import sys

import paddle
import paddle.distributed as dist

import common as c
import paddle_dcp
from paddle_dcp import CollectiveError
from paddle_dcp.io import datafile

root = c.init()
R = c.rank()
MESH = c.Mesh([0, 1])
LEAVES = [
    c.Leaf(("model", "w"), (64, 33), "float32", MESH, (("S", 0),), index=0),
    c.Leaf(("model", "b"), (16, 8), "bfloat16", MESH, (("S", 1),), index=1),
    c.Leaf(("opt", "m"), (40,), "int64", MESH, ("R",), index=2),
]


def state(variant):
    return c.build(LEAVES, variant, values={"step": variant})


def changed_after_return():
    p = os.path.join(root, "changed")
    sd = state(0)
    handle = paddle_dcp.save_state_dict(sd, p, async_save=True)
    assert isinstance(handle, paddle_dcp.AsyncSave)
    # the training loop goes on: every tensor overwritten, a value changed, a collective run
    for leaf in LEAVES:
        t = c.get(sd, leaf.path)
        (t._local_value() if t.is_dist() else t).fill_(3)
    sd["step"] = 99
    x = paddle.to_tensor([1.0])
    dist.all_reduce(x)
    assert handle.wait(timeout=120) == 0 and handle.done()
    target = c.build(LEAVES, 0, values={"step": -1}, target=True)
    paddle_dcp.load_state_dict(target, p)
    c.check_state(target, LEAVES, 0, R)
    assert target["step"] == 0, target["step"]


def writer_fails_in_background():
    p = os.path.join(root, "fails")
    original = datafile.DataFileWriter.write

    def broken(self, data, *args, **kwargs):
        if R == 1:
            raise OSError(28, "No space left on device (injected)")
        return original(self, data, *args, **kwargs)

    datafile.DataFileWriter.write = broken
    try:
        handle = paddle_dcp.save_state_dict(state(1), p, async_save=True)
        try:
            handle.wait(timeout=120)
        except CollectiveError as exc:
            assert sorted(exc.failures) == [1], exc.failures
            assert "No space left on device" in exc.failures[1], exc.failures
        else:
            raise AssertionError("the background failure did not surface")
    finally:
        datafile.DataFileWriter.write = original
    dist.barrier()
    assert not [n for n in os.listdir(p) if n.endswith(".metadata")], os.listdir(p)
    # nothing pending is left: a new save goes through
    paddle_dcp.save_state_dict(state(2), p)
    target = c.build(LEAVES, 2, values={"step": -1}, target=True)
    paddle_dcp.load_state_dict(target, p)
    c.check_state(target, LEAVES, 2, R)


def next_save_waits():
    p = os.path.join(root, "queue")
    first = paddle_dcp.save_state_dict(state(3), p, async_save=True)
    paddle_dcp.save_state_dict(state(4), p)  # waits for the first, then saves id 1
    assert first.done()
    second = paddle_dcp.save_state_dict(state(5), p, async_save=True)
    paddle_dcp.wait_async_save(timeout=120)
    assert second.done()
    for uid, variant in ((0, 3), (1, 4), (2, 5)):
        target = c.build(LEAVES, variant, values={"step": -1}, target=True)
        paddle_dcp.load_state_dict(target, p, unique_id=uid)
        c.check_state(target, LEAVES, variant, R)
        assert target["step"] == variant


def load_while_saving():
    """A load that moves pieces between the two ranks (node-local directories: each rank sees
    only its own files) runs while an async save still writes: the background save has a
    process group of its own, so neither's messages reach the other."""
    home = os.getcwd()
    os.makedirs(os.path.join(root, f"local{R}"), exist_ok=True)
    os.chdir(os.path.join(root, f"local{R}"))
    saved = c.mixed_layout(MESH, (("S", 0),))
    target_layout = c.mixed_layout(MESH, (("S", 1),))
    original = datafile.DataFileWriter.write

    def slow(self, data, *args, **kwargs):
        import time

        time.sleep(0.05)
        return original(self, data, *args, **kwargs)

    try:
        paddle_dcp.save_state_dict(c.build(saved, 0, {"step": 11}), "ck")
        datafile.DataFileWriter.write = slow
        handle = paddle_dcp.save_state_dict(state(6), "bg", async_save=True)
        for _ in range(3):
            target = c.build(target_layout, 0, {"step": 0}, target=True)
            paddle_dcp.load_state_dict(target, "ck")
            c.check_state(target, target_layout, 0, R)
            assert target["step"] == 11, target["step"]
        assert handle.wait(timeout=120) == 0
    finally:
        datafile.DataFileWriter.write = original
        os.chdir(home)
    assert sorted(os.listdir(os.path.join(root, f"local{R}", "bg"))) == sorted(
        [f"{R}_0.distcp"] + (["0.0.claim", "0.metadata"] if R == 0 else [])), os.listdir(os.path.join(root, f"local{R}", "bg"))


c.run_cases(
    {"changed_after_return": changed_after_return, "writer_fails_in_background": writer_fails_in_background,
     "next_save_waits": next_save_waits, "load_while_saving": load_while_saving},
    sys.argv[2:],
)
