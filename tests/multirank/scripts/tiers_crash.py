"""A rank killed while a CheckpointManager saves a step to its node-local tier, on two "nodes"
(two launches with --nnodes 2, each in its own working directory: the relative ``local`` is a
directory of that node alone), and the job restarted (issue 29, point 4).

Usage (run by launcher.run_two_nodes): tiers_crash.py GLOBAL PHASE POINT [async]
  crash: steps 1 and 2 saved, then step 3, during which the victim, the last rank, dies
        (os._exit) at POINT; it writes ``killed`` beside GLOBAL first and prints
        ``VICTIM rank=r point=P``. Every other rank's save of step 3 must raise, not wait:
        it prints ``SURVIVOR rank=r raised=True error=...`` and ends (with ``async``, the
        saves are asynchronous and the error comes from wait()). Every rank ends with
        exit code 0 (the victim too), so that paddle's launcher, which stops the whole job
        at once when a rank exits non-zero, leaves the survivors to end by themselves: a
        survivor that waited forever would make the launch time out.
  resume: a new job over the same directories: restore() must give the newest step that was
        complete before the kill (RESTORE line, as scripts/tiers.py prints it), bit-exact;
        then the job goes on: every step after it up to 4 saved (step 3 again, unless it was
        the one restored), step 3 and step 4 restored and checked.
  restore (POINT is a step): restore(step=POINT) must give it from the local tier, bit-exact.

The manager: the local tier every step (the newest 2 kept, one copy of each rank's data on
the other node), the global tier every 3 steps, synchronous saves unless ``async``; the
copies and the metadata of an async save follow in the background. replicate.CHUNK is 32
bytes, so a copy of a data file (a few hundred bytes) takes several messages.

Kill points (the victim is the last rank, N - 1), while step 3 is saved:
  save_before     as its data file of step 3 is to be written (LocalSaveRank.write)
  save_writing    after the first piece of that file is written, under its temporary name
  copy_receiving  after the third chunk of the first copy it receives is written
  copy_sending    as it reads the fourth chunk of its own file to send (three were sent)
  retention       step 3 published on every node, then retention of step 1: just after it
                  removed 1.metadata on its node, before any data file of step 1 goes; the
                  survivors do their removal once the victim is dead
  publish_stopped  every copy committed, then just after it wrote 3.metadata on its node;
                  the survivors end (``STOPPED rank=r``) once the victim is dead, before
                  they write theirs: step 3's metadata is on the victim's node alone
  retention_stopped  as retention, but the survivors end (``STOPPED rank=r``) once the
                  victim is dead, before their own removal, as paddle's launcher stops every
                  rank once one failed: 1.metadata stays on their node alone
"""
import json
import os
import sys
import time

import paddle.distributed as dist

import common as c
import paddle_dcp
from paddle_dcp.io import datafile
from paddle_dcp.io import local
from paddle_dcp.parallel import replicate, ranks

dist.init_parallel_env()
R = c.rank()
N = dist.get_world_size()
GLOBAL, PHASE, POINT = sys.argv[1], sys.argv[2], sys.argv[3]
ASYNC = sys.argv[4:] == ["async"]
KILLED = os.path.join(os.path.dirname(GLOBAL), "killed")
VICTIM = N - 1
LOCAL = os.path.abspath("local")
replicate.CHUNK = 32  # every rank alike: both ends of a copy count its chunks

LEAVES = c.tier_leaves(N)
RESTORED = {"save_before": 2, "save_writing": 2, "copy_receiving": 2, "copy_sending": 2, "retention": 3,
            "retention_stopped": 3, "publish_stopped": 3}


def manager() -> paddle_dcp.CheckpointManager:
    return paddle_dcp.CheckpointManager(
        GLOBAL, save_interval_steps=3, local_directory="local", local_max_to_keep=2, replicas=1,
        async_save=ASYNC,
    )


def state(step: int) -> dict:
    return c.build(LEAVES, step, {"step": step})


def in_local(path: str) -> bool:
    return os.path.dirname(os.path.abspath(path)) == LOCAL


def die() -> None:
    with open(KILLED, "w") as f:
        f.write(str(R))
    print(f"VICTIM rank={R} point={POINT}", flush=True)
    sys.stderr.flush()
    os._exit(0)


def stop() -> None:
    """A survivor ends once the victim is dead, as paddle's launcher would stop it."""
    deadline = time.monotonic() + 60
    while not os.path.exists(KILLED) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"STOPPED rank={R}", flush=True)
    os._exit(0)


def arm() -> None:
    """Install the kill at POINT (the victim) and what the survivors do differently (only the
    wait of the retention case: they remove their metadata once the victim is dead)."""
    if POINT == "save_before":
        original = ranks.LocalSaveRank.write

        def write(self, described, uid, generation, leaves):
            if R == VICTIM and uid == 3:
                die()
            return original(self, described, uid, generation, leaves)

        ranks.LocalSaveRank.write = write
    elif POINT in ("save_writing", "copy_receiving"):
        original = datafile.DataFileWriter.write
        own = f"{VICTIM}_3.distcp"
        seen = {"copy": None, "chunks": 0}

        def write(self, data, *args, **kwargs):
            out = original(self, data, *args, **kwargs)
            name = os.path.basename(self.stream.final)
            if R != VICTIM or not in_local(self.stream.final) or not name.endswith("_3.distcp"):
                return out
            if POINT == "save_writing" and name == own:
                for pending in list(self.stream._pending):  # the piece is on disk, under the temporary name
                    pending.result()
                die()
            if POINT == "copy_receiving" and name != own:
                seen["copy"] = seen["copy"] or name
                if name == seen["copy"]:
                    seen["chunks"] += 1
                    if seen["chunks"] == 3:
                        for pending in list(self.stream._pending):
                            pending.result()
                        die()
            return out

        datafile.DataFileWriter.write = write
    elif POINT == "copy_sending":
        original = local.RangeReader.read_into
        own = f"{VICTIM}_3.distcp"
        chunks = [0]

        def read_into(self, name, start, out):
            if R == VICTIM and name == own and os.path.abspath(self.path) == LOCAL:
                chunks[0] += 1
                if chunks[0] == 4:
                    die()
            return original(self, name, start, out)

        local.RangeReader.read_into = read_into
    elif POINT == "publish_stopped":
        original = local.LocalStorage.write_atomic

        def write_atomic(self, name, data, durable=False):
            if os.path.abspath(self.path) != LOCAL:
                return original(self, name, data, durable)
            if R == VICTIM and name == "3.metadata":
                original(self, name, data, durable)
                die()
            # the survivor stops at its first write once every copy is in place (the victim's
            # copy here): the step's metadata, or anything written with it
            copied = os.path.exists(os.path.join(LOCAL, f"{VICTIM}_3.distcp"))
            if R != VICTIM and copied and name in ("3.metadata", "paddle_dcp_tier.json"):
                stop()
            return original(self, name, data, durable)

        local.LocalStorage.write_atomic = write_atomic
    elif POINT in ("retention", "retention_stopped"):
        original = local.LocalStorage.remove

        def remove(self, names):
            names = list(names)
            if "1.metadata" not in names or os.path.abspath(self.path) != LOCAL:
                return original(self, names)
            if R == VICTIM:
                original(self, names)
                die()
            if POINT == "retention_stopped":
                stop()
            deadline = time.monotonic() + 60
            while not os.path.exists(KILLED) and time.monotonic() < deadline:
                time.sleep(0.05)
            return original(self, names)

        local.LocalStorage.remove = remove
    else:
        raise ValueError(f"unknown kill point {POINT!r}")


def crash() -> None:
    m = manager()
    for step in (1, 2):
        assert m.save(step, state(step))
    m.wait()
    assert m.latest_step() == 2
    dist.barrier()
    arm()
    started = time.monotonic()
    try:
        m.save(3, state(3))
        m.wait()
    except BaseException as exc:  # noqa: BLE001 - the survivor's report: how its save ended
        error = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:400]
        print(f"SURVIVOR rank={R} raised=True seconds={time.monotonic() - started:.1f} error={error}", flush=True)
    else:
        print(f"SURVIVOR rank={R} raised=False seconds={time.monotonic() - started:.1f}", flush=True)
    sys.stderr.flush()
    os._exit(0)  # no teardown, no close(): the job is going down


def resume() -> None:
    want = RESTORED[POINT]
    with manager() as m:
        got, report, sd = c.restore_reported(m, LEAVES, R)
        assert (got, report.tier) == (want, "local"), (got, report)
        c.check_state(sd, LEAVES, want, R)
        assert sd["step"] == want, sd["step"]
        for step in range(want + 1, 5):
            assert m.save(step, state(step))
        for step in (3, 4):
            sd = c.build(LEAVES, 0, {"step": -1}, target=True)
            assert m.restore(sd, step) == step and m.last_restore.tier == "local", m.last_restore
            c.check_state(sd, LEAVES, step, R)
            assert sd["step"] == step, sd["step"]
        assert m.latest_step() == 4
        assert m.all_steps() == ([3] if want < 3 else []), m.all_steps()


def restore(step: int) -> None:
    with manager() as m:
        sd = c.build(LEAVES, 0, {"step": -1}, target=True)
        assert m.restore(sd, step) == step and m.last_restore.tier == "local", m.last_restore
        c.check_state(sd, LEAVES, step, R)
        assert sd["step"] == step, sd["step"]
        report = m.last_restore
        nodes = None if report.saved_on.nodes is None else [list(n) for n in report.saved_on.nodes]
        print(f"LOST rank={R} {json.dumps(list(report.from_lost_nodes), separators=(',', ':'))} "
              f"{json.dumps(nodes, separators=(',', ':'))}", flush=True)


if PHASE == "crash":
    crash()
elif PHASE == "resume":
    c.run_cases({f"resume_{POINT}": resume}, [])
else:
    c.run_cases({f"restore_{POINT}": lambda: restore(int(POINT))}, [])
