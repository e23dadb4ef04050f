"""paddle_dcp on a (fake) GPU job: paddle's GPU rules hold on every path, values against numpy.

Runs on 2 ranks with PADDLE_DCP_FAKE_GPU=1 (tests/fakegpu.py makes every tensor report a GPU
place, refuses pinning into a CPU place and host views of device memory, makes the job's
group an NCCL group that takes device tensors from the main thread only, and counts device and
pinned bytes). PADDLE_DCP_PINNED_STAGING_MB is set small by the test, so a load must stage
through its bounded pinned area in several runs.

Usage (under paddle.distributed.launch): gpu_rules.py DIR [case ...]
"""
import os
import threading


import common as c
import fakegpu
import paddle
import paddle.distributed as dist
import paddle_dcp
from fakegpu import ACCOUNT, NcclGuard

ROOT = c.init()
R = c.rank()
MESH = c.Mesh(list(range(dist.get_world_size())))
STAGE_BYTES = int(float(os.environ["PADDLE_DCP_PINNED_STAGING_MB"]) * (1 << 20))


def leaves(spec_w, spec_b):
    return [
        c.Leaf(("w",), (40, 24), "float32", MESH, spec_w),   # 3840 bytes: several runs of the pinned area
        c.Leaf(("b",), (6, 10), "bfloat16", MESH, spec_b),
        c.Leaf(("v",), (9,), "int64", MESH, (("S", 0),)),
        c.Leaf(("plain",), (3, 5), "float16", None, None),
    ]


def nccl_calls() -> int:
    return sum(NcclGuard.CALLS.values())


def fake_is_on():
    t = paddle.to_tensor([1.0, 2.0])
    assert fakegpu.installed() and t.place.is_gpu_place() and paddle.is_compiled_with_cuda()
    for call in (lambda: t.data_ptr(), lambda: paddle.empty([2], device=paddle.CPUPlace(), pin_memory=True)):
        try:
            call()
        except RuntimeError:
            continue
        raise AssertionError("the fake GPU does not enforce paddle's rules")


def load_device_targets():
    """Save Shard(0) / Replicate, load into Shard(1) / Shard(0): every target is a device tensor
    filled in place, through a pinned area no larger than its bound, with no device copy of a
    whole tensor, and no collective of ours on the job's NCCL group."""
    src, dst = leaves((("S", 0),), ("R",)), leaves((("S", 1),), (("S", 0),))
    sd = c.build(src, 0)
    before = nccl_calls()
    paddle_dcp.save_state_dict(sd, os.path.join(ROOT, "ck"))
    target = c.build(dst, 0, target=True)
    held = {key: id(value._local_value() if value.is_dist() else value) for key, value in target.items()}
    ACCOUNT.reset_peak()
    base_gpu, base_pinned = ACCOUNT.current["gpu"], ACCOUNT.current["pinned"]
    paddle_dcp.load_state_dict(target, os.path.join(ROOT, "ck"))
    c.check_state(target, dst, 0, R)
    assert nccl_calls() == before, f"paddle_dcp ran {nccl_calls() - before} collectives on the job's NCCL group"
    assert 0 < ACCOUNT.peak["pinned"] - base_pinned <= 8 * STAGE_BYTES, ACCOUNT.peak  # one area per dtype
    assert ACCOUNT.peak["gpu"] == base_gpu, f"a load made {ACCOUNT.peak['gpu'] - base_gpu} bytes of device copies"
    for key, value in target.items():
        local = value._local_value() if value.is_dist() else value
        assert local.place.is_gpu_place(), f"{key} left the device: {local.place}"
    assert set(held) == set(target)


def async_in_a_row():
    """Four async saves in a row of changing values: each stages into pinned memory (paddle's
    only pinned place), runs its collectives over gloo on the writer thread, and loads back."""
    lv = leaves((("S", 0),), ("R",))
    handles, pinned = [], []
    for step in range(4):
        sd = c.build(lv, step)
        handles.append(paddle_dcp.save_state_dict(sd, os.path.join(ROOT, "async"), async_save=True))
        handles[-1].wait()
        pinned.append(ACCOUNT.allocations["pinned"])
    ids = [h.wait() for h in handles]
    assert ids == sorted(set(ids)), ids
    assert pinned[1] > 0, f"no async save staged into pinned memory: {pinned}"
    assert pinned[3] == pinned[2], f"async saves of the same tensors allocate pinned memory again: {pinned}"
    for step, uid in enumerate(ids):
        target = c.build(lv, step, target=True)
        paddle_dcp.load_state_dict(target, os.path.join(ROOT, "async"), unique_id=uid)
        c.check_state(target, lv, step, R)
    assert "paddle_dcp-async-save" in {t.name for t in threading.enumerate()}


def offload_into_model():
    """load_state_dict(model.state_dict(), path, offload=...) fills the model's own parameters,
    which stay the same tensors on the device (paddle's contract for offload)."""
    paddle.seed(1)
    saved = paddle.nn.Linear(8, 6)
    expected = {k: v.numpy().copy() for k, v in saved.state_dict().items()}
    paddle_dcp.save_state_dict(saved.state_dict(), os.path.join(ROOT, "model"))
    for offload in (True, False):
        paddle.seed(2)
        model = paddle.nn.Linear(8, 6)
        params = {k: id(v) for k, v in model.state_dict().items()}
        paddle_dcp.load_state_dict(model.state_dict(), os.path.join(ROOT, "model"), offload=offload)
        for key, value in model.state_dict().items():
            assert id(value) == params[key]
            assert value.place.is_gpu_place(), f"offload={offload}: {key} moved to {value.place}"
            c.assert_same(value.numpy(), expected[key], f"offload={offload}: {key}")


def partial_target():
    """A Partial(sum) target off coordinate 0 is filled with zeros in host memory, then copied."""
    lv = [c.Leaf(("p",), (6, 4), "float32", MESH, (("P", "sum"),)), c.Leaf(("q",), (5,), "bfloat16", MESH, (("P", "sum"),))]
    paddle_dcp.save_state_dict(c.build(lv, 0), os.path.join(ROOT, "partial"))
    target = c.build(lv, 1, target=True)
    paddle_dcp.load_state_dict(target, os.path.join(ROOT, "partial"))
    c.check_state(target, lv, 0, R)


def groups_of_an_nccl_job():
    """Every group paddle_dcp makes in an NCCL job is a gloo group of its own (no NCCL
    communicator, no import of paddle internals that moved): one control group, one background
    group, one per Partial line, whatever the number of pairs that exchanged bytes (they talk
    over connections closed after each step). Released by close, made again when needed."""
    lv = leaves((("S", 0),), (("S", 1),))
    sd = c.build(lv, 0)
    ACCOUNT.reset_peak()
    base = ACCOUNT.current["gpu"]
    paddle_dcp.save_gathered(sd, os.path.join(ROOT, "gathered.safetensors"))  # rank 0 <- every rank
    assert ACCOUNT.peak["gpu"] == base, f"bytes between ranks took {ACCOUNT.peak['gpu'] - base} bytes of device memory"
    GROUPS = paddle_dcp.process_state().groups

    everyone = "-".join(str(r) for r in range(dist.get_world_size()))
    assert set(GROUPS.names()) <= {f"{everyone}/{p}" for p in ("control", "background", "reduce")}, GROUPS.names()
    assert f"{everyone}/control" in GROUPS.names()
    assert GROUPS.transport(R).open_connections() == 0
    paddle_dcp.close()
    assert len(GROUPS) == 0 and GROUPS.transport(R).open_connections() == 0
    paddle_dcp.save_state_dict(c.build(lv, 1), os.path.join(ROOT, "after_close"))  # made again, new store keys
    target = c.build(lv, 1, target=True)
    paddle_dcp.load_state_dict(target, os.path.join(ROOT, "after_close"))
    c.check_state(target, lv, 1, R)
    assert GROUPS.names() == [f"{everyone}/control"], GROUPS.names()


def save_holds_one_host_copy():
    """A synchronous save copies device tensors to host memory one at a time."""
    lv = [c.Leaf((f"t{i}",), (64, 64), "float32", MESH, ("R",)) for i in range(4)]
    sd = c.build(lv, 0)
    ACCOUNT.reset_peak()
    base = ACCOUNT.current["pinned"]
    paddle_dcp.save_state_dict(sd, os.path.join(ROOT, "one_copy"))
    one = 64 * 64 * 4
    assert ACCOUNT.peak["pinned"] - base <= one, f"a save held {ACCOUNT.peak['pinned'] - base} pinned bytes (one copy: {one})"


c.run_cases({  # all cases by default; the test runs groups_of_an_nccl_job on 4 ranks too
    "fake_is_on": fake_is_on,
    "load_device_targets": load_device_targets,
    "async_in_a_row": async_in_a_row,
    "offload_into_model": offload_into_model,
    "partial_target": partial_target,
    "groups_of_an_nccl_job": groups_of_an_nccl_job,
    "save_holds_one_host_copy": save_holds_one_host_copy,
})
