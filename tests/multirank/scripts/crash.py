"""Crashes during a save or a load (issue 6, points 2 and 5), run by tests/multirank/test_reliability.py.

Usage:
  crash.py DIR save SCENARIO        3 ranks started by launcher.spawn (no paddle launcher)
  crash.py DIR load PHASE           2 ranks started by launcher.spawn, node-local directories
  crash.py DIR check SCENARIO...    one process, no launcher: what a crash left behind
  crash.py DIR recover SCENARIO...  3 ranks under paddle.distributed.launch: the next save

``save``: every rank saves checkpoint 0 (variant 0) and, for the ``*_same`` scenarios, a first
checkpoint 1 (variant 2); then one rank, the victim, blocks in the middle of saving checkpoint 1
(variant 1) and announces it in DIR/victim.{rank} (its pid); the test kills it with SIGKILL.
  writer_new / writer_same            rank 1, after the first piece of its data file
  coordinator_new / coordinator_same  rank 0, after every data file and the metadata's
                                      temporary file were written, before the rename (the commit)
  writer_frozen                       as writer_new; the test stops it (SIGSTOP) instead
The other ranks must raise CollectiveError (gloo reports the dead peer) instead of waiting;
they print ``SURVIVOR rank=r step=S seconds=T`` and exit 0.

``load``: rank r works in DIR/node{r} (its own disk): the checkpoint saved there holds the
metadata and 0_0.distcp on node 0 and 1_0.distcp on node 1, and a load into replicated tensors
needs bytes only the other rank can read. Rank 1, the server, blocks while serving rank 0
  verify    in the checksums of the blocks rank 0 will read (before any target changes)
  exchange  in sending the bytes (rank 0 already copied its local bytes)
and is killed; rank 0 must raise. ``SURVIVOR rank=0 ... unchanged=True|False`` tells whether
its state dict is as it was.
"""
import json
import os
import sys
import time

ROOT, MODE = sys.argv[1], sys.argv[2]
ARGS = sys.argv[3:]
os.makedirs(ROOT, exist_ok=True)

import common as c  # noqa: E402
import paddle_dcp  # noqa: E402
from paddle_dcp.parallel import exchange
from paddle_dcp.io import datafile  # noqa: E402
from paddle_dcp.io import local, storage  # noqa: E402

SAVE_RANKS = 3


def leaves(mesh, spec):
    # 6 rows: 2 per rank of 3, so every rank writes a data file with a piece of each tensor
    return [
        c.Leaf(("m", "w"), (6, 5), "float32", mesh, spec, index=0),
        c.Leaf(("m", "b"), (6, 4), "int64", mesh, spec, index=1),
        c.Leaf(("m", "h"), (6, 3), "bfloat16", mesh, spec, index=2),
    ]


def variant_values(v):
    return {"step": 100 + v, "name": f"variant {v}"}


def announce(reason: str) -> None:
    """Tell the test where this rank blocks, and wait to be killed."""
    r = c.rank()
    tmp = os.path.join(ROOT, f".victim.{r}")
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "rank": r, "reason": reason}, f)
    os.replace(tmp, os.path.join(ROOT, f"victim.{r}"))
    print(f"VICTIM rank={r} pid={os.getpid()} blocked {reason}", flush=True)
    time.sleep(600)
    print(f"VICTIM rank={r} was not killed", flush=True)
    os._exit(5)


def survive(fn, step_hint: str, snapshot_of=None) -> None:
    """Run ``fn``, which must raise CollectiveError on this surviving rank; report and exit."""
    r = c.rank()
    before = c.snapshot(snapshot_of) if snapshot_of is not None else None
    start = time.monotonic()
    try:
        fn()
    except paddle_dcp.CollectiveError as exc:
        seconds = time.monotonic() - start
        unchanged = ""
        if snapshot_of is not None:
            try:
                c.assert_unchanged(snapshot_of, before)
                unchanged = " unchanged=True"
            except AssertionError as diff:
                unchanged = f" unchanged=False ({str(diff)[:200]})"
        print(f"rank {r}: {exc}", flush=True)
        print(f"SURVIVOR rank={r} step={exc.step} seconds={seconds:.1f}{unchanged}", flush=True)
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001 - any other outcome fails the test
        print(f"WRONG rank={r}: {type(exc).__name__}: {exc}", flush=True)
        os._exit(3)
    print(f"WRONG rank={r}: {step_hint} finished although a rank was killed", flush=True)
    os._exit(4)


# ------------------------------------------------------------------------------ save
def save_scenario(scenario: str) -> None:
    c.init([None, ROOT])
    r = c.rank()
    mesh = c.Mesh(list(range(SAVE_RANKS)))
    saved = leaves(mesh, (("S", 0),))
    path = os.path.join(ROOT, "ck")
    paddle_dcp.save_state_dict(c.build(saved, 0, variant_values(0)), path)
    if scenario.endswith("_same"):
        paddle_dcp.save_state_dict(c.build(saved, 2, variant_values(2)), path, unique_id=1)
    c.dist.barrier()
    if scenario.startswith("writer") and r == 1:
        real_write = datafile.DataFileWriter.write
        calls = [0]

        def write_then_block(self, data, *args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:  # the first piece is in the temporary file (written by a thread)
                deadline = time.monotonic() + 10
                while os.path.getsize(self.stream.tmp) == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                announce(f"writing {os.path.basename(self.stream.tmp)} after its first piece")
            return real_write(self, data, *args, **kwargs)

        datafile.DataFileWriter.write = write_then_block
        datafile.DataFileWriter.SMALL_PIECE = 0  # each piece written as it comes, not batched until the close
    if scenario.startswith("coordinator") and r == 0:
        real_replace = os.replace

        def block_before_commit(src, dst, *args, **kwargs):
            if str(dst).endswith(".metadata"):
                announce(f"before renaming {os.path.basename(str(src))} to {os.path.basename(str(dst))}")
            return real_replace(src, dst, *args, **kwargs)

        os.replace = block_before_commit
    step = "write" if scenario.startswith("writer") else "commit"
    survive(lambda: paddle_dcp.save_state_dict(c.build(saved, 1, variant_values(1)), path, unique_id=1), step)


# ------------------------------------------------------------------------------ load
def load_phase(phase: str) -> None:
    c.init([None, ROOT])
    r = c.rank()
    node = os.path.join(ROOT, f"node{r}")
    os.makedirs(node, exist_ok=True)
    os.chdir(node)
    mesh = c.Mesh([0, 1])
    saved = leaves(mesh, (("S", 0),))
    paddle_dcp.save_state_dict(c.build(saved, 0, variant_values(0)), "ck")
    c.dist.barrier()
    assert sorted(os.listdir("ck")) == (["0.0.claim", "0.metadata", "0_0.distcp"] if r == 0 else ["1_0.distcp"]), os.listdir("ck")
    if r == 1:
        if phase == "verify":
            real = local.RangeReader.read_into

            def read_then_block(self, name, *args, **kwargs):
                announce(f"reading {name} to hash the blocks rank 0 asked for")
                return real(self, name, *args, **kwargs)

            local.RangeReader.read_into = read_then_block
        else:
            real_serve = exchange._serve

            def serve_then_block(comm, client, *args, **kwargs):
                announce(f"serving bytes to rank {client}")
                return real_serve(comm, client, *args, **kwargs)

            exchange._serve = serve_then_block
    targets = leaves(mesh, ("R",))
    sd = c.build(targets, 0, {"step": 0, "name": ""}, target=True)
    survive(lambda: paddle_dcp.load_state_dict(sd, "ck"), phase, snapshot_of=sd)


# ------------------------------------------------------------------------------ after the crash
def plain():
    return leaves(None, None)


def check(scenarios) -> None:
    """One process (a world of one) looks at what each crash left."""
    cases = {}
    for scenario in scenarios:
        cases[scenario] = lambda s=scenario: check_one(s)
    c.run_cases(cases, list(scenarios))


def check_one(scenario: str) -> None:
    path = os.path.join(ROOT, scenario, "ck")
    names = sorted(os.listdir(path))
    print(f"{scenario}: {names}", flush=True)
    tmp = [n for n in names if storage.TMP_MARK in n]
    same = scenario.endswith("_same")
    if scenario.startswith("writer"):
        # rank 1's data file of the crashed save is still temporary, with its first piece
        gen = ".1" if same else ""
        victim = [n for n in tmp if n.startswith(f"1_1{gen}.distcp.tmp.")]
        assert len(victim) == 1 and os.path.getsize(os.path.join(path, victim[0])) > 0, names
        assert f"1_1{gen}.distcp" not in names, names
    else:
        # every data file of the crashed save renamed, its metadata still temporary
        gen = ".1" if same else ""
        assert all(f"{r}_1{gen}.distcp" in names for r in range(SAVE_RANKS)), names
        assert [n for n in tmp if n.startswith("1.metadata.tmp.")], names
    listing = storage.list_checkpoints(local.LocalStorage(path))
    expected_latest = 1 if same else 0
    assert listing.latest == expected_latest, (listing.complete, names)
    # the previous checkpoint loads exactly; the crashed one is never chosen
    variant = 2 if same else 0
    sd = c.build(plain(), 0, {"step": 0, "name": ""}, target=True)
    paddle_dcp.load_state_dict(sd, path)
    c.check_state(sd, plain(), variant, 0)
    assert sd["step"] == 100 + variant and sd["name"] == f"variant {variant}", sd
    sd0 = c.build(plain(), 0, {"step": 0, "name": ""}, target=True)
    paddle_dcp.load_state_dict(sd0, path, unique_id=0)
    c.check_state(sd0, plain(), 0, 0)
    if not same:
        sd1 = c.build(plain(), 0, {"step": 0, "name": ""}, target=True)
        before = c.snapshot(sd1)
        try:
            paddle_dcp.load_state_dict(sd1, path, unique_id=1)
        except paddle_dcp.StorageError as exc:
            assert "not complete" in str(exc) and "1.metadata" in str(exc), exc
        else:
            raise AssertionError("the crashed checkpoint 1 loaded")
        c.assert_unchanged(sd1, before)
    # read_metadata (no process group) picks the same checkpoint
    assert paddle_dcp.read_metadata(path).unique_id == expected_latest


def recover(scenarios) -> None:
    """Under the launcher, 3 ranks: the next save of the crashed id (durable) completes in the
    next generation, removes every older generation of that id with its claim, leaves the
    crash's temporary files (``clean`` removes them), and loads exactly."""
    c.init([None, ROOT])
    cases = {s: (lambda s=s: recover_one(s)) for s in scenarios}
    c.run_cases(cases, list(scenarios))


def recover_one(scenario: str) -> None:
    r = c.rank()
    path = os.path.join(ROOT, scenario, "ck")
    mesh = c.Mesh(list(range(SAVE_RANKS)))
    saved = leaves(mesh, (("S", 0),))
    events = []
    real_replace, real_fsync = os.replace, os.fsync

    def rec_replace(src, dst, *args, **kwargs):
        out = real_replace(src, dst, *args, **kwargs)
        events.append(("rename", os.path.basename(str(dst)), time.monotonic_ns()))
        return out

    def rec_fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), time.monotonic_ns()))
        return real_fsync(fd)

    os.replace, os.fsync = rec_replace, rec_fsync
    try:
        paddle_dcp.save_state_dict(c.build(saved, 3, variant_values(3)), path, unique_id=1, durable=True)
    finally:
        os.replace, os.fsync = real_replace, real_fsync
    everyone = []
    c.dist.all_gather_object(everyone, events)
    c.dist.barrier()
    # the metadata is renamed after every rank's data file, each fsynced before its rename,
    # and the directory after it
    renames = [(q, name, t) for q, ev in enumerate(everyone) for kind, name, t in ev if kind == "rename"]
    meta = [t for q, name, t in renames if name == "1.metadata"]
    data = [t for q, name, t in renames if name.endswith(".distcp")]
    assert len(meta) == 1 and len(data) == SAVE_RANKS, renames
    assert max(data) < meta[0], renames
    for q, ev in enumerate(everyone):
        fsynced = [name for kind, name, _ in ev if kind == "fsync"]
        mine = [name for kind, name, _ in ev if kind == "rename"]
        for name in mine:
            assert any(f.startswith(name + ".tmp.") for f in fsynced), (q, name, fsynced)
            assert "ck" in fsynced, (q, fsynced)  # the directory
    names = sorted(os.listdir(path))
    gen = 2 if scenario.endswith("_same") else 1
    want = ["0.0.claim", "0.metadata"] + [f"{q}_0.distcp" for q in range(SAVE_RANKS)] + ["1.metadata", f"1.{gen}.claim"]
    want += [f"{q}_1.{gen}.distcp" for q in range(SAVE_RANKS)]
    # the crash's temporary files stay: a save never removes one (it could be another save's)
    crashed = ".1" if gen == 2 else ""
    left = [n for n in names if storage.TMP_MARK in n]
    assert left and all(n.startswith((f"1_1{crashed}.distcp.tmp.", "1.metadata.tmp.")) for n in left), left
    assert names == sorted(want + left), (names, sorted(want + left))
    for uid, variant in ((None, 3), (1, 3), (0, 0)):
        sd = c.build(saved, 0, {"step": 0, "name": ""}, target=True)
        paddle_dcp.load_state_dict(sd, path, unique_id=uid)
        c.check_state(sd, saved, variant, r)
        assert sd["step"] == 100 + variant and sd["name"] == f"variant {variant}", sd


if MODE == "save":
    save_scenario(ARGS[0])
elif MODE == "load":
    load_phase(ARGS[0])
elif MODE == "check":
    check(ARGS)
elif MODE == "recover":
    recover(ARGS)
else:
    raise SystemExit(f"unknown mode {MODE}")
