"""CheckpointManager on 2 ranks (issue 18): retention, restore, crashes, node-local disks.

Usage:
  manager.py DIR cases [case ...]      under paddle.distributed.launch
  manager.py DIR crash SCENARIO        under launcher.spawn: a rank dies (os._exit) mid-way
  manager.py DIR resume SCENARIO       under paddle.distributed.launch: after the crash
  manager.py DIR exit                  under paddle.distributed.launch: exit with a save in flight
  manager.py URL s3                    under paddle.distributed.launch: on object storage

The state saved at step s is the oracle's variant s (values from positions), with the plain
value "step": s; a restore is compared with the variant of the step it says it loaded.

Crash scenarios (every step saved, async_save=True): ``async_keep1`` / ``async_keep2``
(max_to_keep 1 / 2): rank 1 dies while writing step 3's data file (steps 0-2 committed);
``retention``: max_to_keep=1, synchronous saves; the coordinator dies while deleting step 1
after step 2 committed, its metadata removed but no data file yet. The victim writes
DIR/killed just before os._exit(17); the other rank then exits (os._exit(0)) at once.
"""
import json
import os
import sys
import time

import common as c

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/
from s3server import Requests  # noqa: E402
import paddle_dcp
from paddle_dcp.io import datafile
from paddle_dcp.io import cleanup
from paddle_dcp import CheckpointManager

ROOT, MODE = sys.argv[1], sys.argv[2]
ARGS = sys.argv[3:]
c.init()
R = c.rank()
MESH = c.Mesh([0, 1])
LEAVES = [
    c.Leaf(("model", "w"), (8, 6), "float32", MESH, (("S", 0),), index=0),
    c.Leaf(("opt", "m"), (5,), "int64", MESH, ("R",), index=1),
]


def state(step: int) -> dict:
    return c.build(LEAVES, step, values={"step": step})


def check_restore(m: CheckpointManager, expected: int) -> None:
    target = c.build(LEAVES, 0, values={"step": -1}, target=True)
    assert m.restore(target) == expected
    c.check_state(target, LEAVES, expected, R)
    assert target["step"] == expected, target["step"]


def files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("paddle_dcp_manager"))


def expect_files(path: str, steps, ranks=(0, 1), metadata: bool = True) -> None:
    want = [f"{r}_{s}.distcp" for s in steps for r in ranks]
    want += [f"{s}.metadata" for s in steps] + [f"{s}.0.claim" for s in steps] if metadata else []
    assert files(path) == sorted(want), (files(path), sorted(want))


# ------------------------------------------------------------------------------ cases
def interval_and_max_to_keep():
    p = os.path.join(ROOT, "interval")
    with CheckpointManager(p, max_to_keep=2, save_interval_steps=5, async_save=True) as m:
        saved = [step for step in range(0, 23) if m.save(step, state(step))]
        assert saved == [0, 5, 10, 15, 20], saved
        assert m.save(21, state(21), force=True)
        m.wait()
        assert m.all_steps() == [20, 21] and m.latest_step() == 21, m.all_steps()
        c.dist.barrier()
        expect_files(p, [20, 21])
        check_restore(m, 21)
    # a directory's other checkpoints (a copy, another job's ids) are never touched
    paddle_dcp.save_state_dict(state(3), p, unique_id=3)
    with CheckpointManager(p, max_to_keep=1) as m:
        assert m.all_steps() == [20, 21]
        m.save(30, state(30), metrics={"loss": 0.5})
        assert m.all_steps() == [30] and m.metrics(30) == {"loss": 0.5}
        c.dist.barrier()
        expect_files(p, [3, 30])
        check_restore(m, 30)


def keep_every_n_steps():
    p = os.path.join(ROOT, "every")
    with CheckpointManager(p, max_to_keep=1, keep_every_n_steps=4) as m:
        for step in range(1, 10):
            m.save(step, state(step))
        assert m.all_steps() == [4, 8, 9], m.all_steps()
    c.dist.barrier()
    expect_files(p, [4, 8, 9])


def best_fn_max_and_min():
    losses = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.1, 5: 0.7, 6: 0.8}
    for mode, kept in (("min", [2, 4, 6]), ("max", [1, 6])):  # the 2 best, and the newest (6) always
        p = os.path.join(ROOT, f"best_{mode}")
        with CheckpointManager(p, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode=mode, async_save=True) as m:
            for step, loss in losses.items():
                m.save(step, state(step), metrics={"loss": loss})
            m.wait()
            assert m.all_steps() == kept, (mode, m.all_steps())
            assert m.metrics(kept[0]) == {"loss": losses[kept[0]]}
        c.dist.barrier()
        expect_files(p, kept)


def two_managers():
    p = os.path.join(ROOT, "two")
    with CheckpointManager(p, max_to_keep=1) as m:
        m.save(1, state(1))
        try:
            CheckpointManager(p, max_to_keep=1)
        except paddle_dcp.DcpError as exc:  # refused on every rank (the coordinator holds the lock)
            assert "in use by another CheckpointManager" in str(exc), exc
        else:
            raise AssertionError("a second manager on the same directory was not refused")
        m.save(2, state(2))
    with CheckpointManager(p, max_to_keep=1) as m:  # closed: the directory is free again
        check_restore(m, 2)


def node_local():
    """Each rank has its own disk (DIR/node{r}): the coordinator's holds the manifest and the
    metadata; retention removes every rank's own data files on its own disk."""
    home = os.getcwd()
    os.makedirs(os.path.join(ROOT, f"node{R}"), exist_ok=True)
    os.chdir(os.path.join(ROOT, f"node{R}"))
    try:
        with CheckpointManager("ck", max_to_keep=2, async_save=True) as m:
            for step in range(4):
                m.save(step, state(step))
            m.wait()
            assert m.all_steps() == [2, 3], m.all_steps()
            c.dist.barrier()
            expect_files("ck", [2, 3], ranks=[R], metadata=R == 0)
            check_restore(m, 3)
    finally:
        os.chdir(home)


# ------------------------------------------------------------------------------ crashes
def die() -> None:
    with open(os.path.join(ROOT, "killed"), "w") as f:
        f.write(str(R))
    os._exit(17)


def survive() -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(ROOT, "killed")):
        if time.monotonic() > deadline:
            print("the victim did not die", flush=True)
            os._exit(3)
        time.sleep(0.05)
    print(f"SURVIVOR rank={R}", flush=True)
    os._exit(0)


def crash(scenario: str) -> None:
    p = os.path.join(ROOT, "ck")
    if scenario in ("async_keep1", "async_keep2"):
        original = datafile.DataFileWriter.write

        def write(self, data, *args, **kwargs):
            out = original(self, data, *args, **kwargs)
            if R == 1 and os.path.basename(self.stream.final) == "1_3.distcp":
                die()  # part of step 3's data file written, under its temporary name
            return out

        datafile.DataFileWriter.write = write
        m = CheckpointManager(p, max_to_keep=1 if scenario == "async_keep1" else 2, async_save=True)
        try:
            for step in range(4):
                m.save(step, state(step))
        finally:
            survive()
    elif scenario == "retention":
        original = cleanup.remove_temporary

        def remove_temporary(store, unique_id=None, rank=None):
            out = original(store, unique_id, rank)
            if R == 0 and rank == -1 and unique_id == 1 and "2.metadata" in os.listdir(p):
                die()  # step 1's metadata is gone, its data files are not
            return out

        cleanup.remove_temporary = remove_temporary
        m = CheckpointManager(p, max_to_keep=1)
        try:
            for step in range(3):
                m.save(step, state(step))
        finally:
            survive()  # rank 1: its save of step 2 raised (the coordinator is gone)
    raise ValueError(scenario)


def resume(scenario: str) -> None:
    p = os.path.join(ROOT, "ck")
    keep = 2 if scenario == "async_keep2" else 1
    latest = 2
    with CheckpointManager(p, max_to_keep=keep, async_save=True) as m:
        kept = [1, 2] if keep == 2 else [2]
        assert m.all_steps() == kept, m.all_steps()
        expect_files(p, kept)  # leftovers of the crash (step 3's files, step 1's) are gone
        check_restore(m, latest)
        m.save(3, state(3))
        m.save(4, state(4))
        m.wait()
        assert m.all_steps() == [3, 4][-keep:], m.all_steps()
        check_restore(m, 4)
    with open(os.path.join(p, "paddle_dcp_manager.json")) as f:
        assert [e["state"] for e in json.load(f)["steps"]] == ["complete"] * keep
    print(f"PASS resume_{scenario} rank={R}", flush=True)


def exit_in_flight() -> None:
    """The script ends while step 5 is still being written (slowly): the interpreter's exit
    waits for it, and for its retention, instead of losing it (the test reads what is left)."""
    original = datafile.DataFileWriter.write

    def slow(self, data, *args, **kwargs):
        time.sleep(0.2)
        return original(self, data, *args, **kwargs)

    m = CheckpointManager(os.path.join(ROOT, "ck"), max_to_keep=1, async_save=True)
    m.save(4, state(4))
    datafile.DataFileWriter.write = slow
    m.save(5, state(5))
    print(f"PASS returned rank={R}", flush=True)


def object_storage() -> None:
    """Retention on an s3:// URL: async saves, max_to_keep 2; the coordinator alone lists and
    deletes (one listing, batched deletes, for both ranks), the other rank only writes."""
    from paddle_dcp.io import open_storage

    with Requests(open_storage(ROOT).fs) as wire:
        with CheckpointManager(ROOT, max_to_keep=2, async_save=True) as m:
            for step in range(5):
                assert m.save(step, state(step))
            m.wait()
            assert m.all_steps() == [3, 4], m.all_steps()
            c.dist.barrier()
            lists = wire.count("ListObjectsV2") + wire.count("ListMultipartUploads")
            deletes = wire.count("DeleteObjects") + wire.count("DeleteObject")
            if R == 0:
                assert lists > 0 and deletes > 0, wire.seen
            else:
                assert lists == 0 and deletes == 0, wire.seen
            names = sorted(n for n in open_storage(ROOT).sizes() if not n.startswith("paddle_dcp_manager"))
            assert names == sorted([f"{r}_{s}.distcp" for s in (3, 4) for r in (0, 1)]
                                   + ["3.0.claim", "3.metadata", "4.0.claim", "4.metadata"]), names
            check_restore(m, 4)
    with CheckpointManager(ROOT, max_to_keep=2) as m:  # reopened: the record is read back
        assert m.all_steps() == [3, 4] and m.latest_step() == 4
        check_restore(m, 4)
    print(f"PASS object_storage rank={R}", flush=True)


if MODE == "cases":
    c.run_cases(
        {"interval_and_max_to_keep": interval_and_max_to_keep, "keep_every_n_steps": keep_every_n_steps,
         "best_fn_max_and_min": best_fn_max_and_min, "two_managers": two_managers, "node_local": node_local},
        ARGS,
    )
elif MODE == "crash":
    crash(ARGS[0])
elif MODE == "resume":
    resume(ARGS[0])
elif MODE == "exit":
    exit_in_flight()
elif MODE == "s3":
    object_storage()
