"""Node-local disks: every group of ranks ("node") sees its own directory under one relative
path, so a rank may lack the metadata file (it asks a rank that has it) or data files (a rank
that can read them sends the bytes). Values must still equal the numpy oracle's.

Usage (under paddle.distributed.launch): nodelocal.py DIR RANKS_PER_NODE [case ...]
Rank r works in DIR/node{r // RANKS_PER_NODE} and saves to / loads from the relative path "ck".
"""
import logging
import os
import sys

import paddle_dcp

import common as c

ROOT = c.init()
PER_NODE = int(sys.argv[2])
R = c.rank()
N = c.dist.get_world_size()
NODE = R // PER_NODE
os.makedirs(os.path.join(ROOT, f"node{NODE}"), exist_ok=True)
os.chdir(os.path.join(ROOT, f"node{NODE}"))

if N == 4:
    SAVED = c.mixed_layout(c.Mesh([[0, 1], [2, 3]]), (("S", 0), ("S", 1)))
    TARGETS = {
        "same_layout": SAVED,
        "into_1d_s1": c.mixed_layout(c.Mesh([0, 1, 2, 3]), (("S", 1),)),
        "into_reversed_2d": c.mixed_layout(c.Mesh([[3, 2], [1, 0]]), (("S", 1), ("S", 0))),
        "into_replicate": c.mixed_layout(c.Mesh([0, 1, 2, 3]), ("R",)),
        "into_plain": c.mixed_layout(),
    }
else:
    SAVED = c.mixed_layout(c.Mesh([0, 1]), (("S", 0),))
    TARGETS = {
        "same_layout": SAVED,
        "into_s1": c.mixed_layout(c.Mesh([0, 1]), (("S", 1),)),
        "into_swapped_s0": c.mixed_layout(c.Mesh([1, 0]), (("S", 0),)),
        "into_plain": c.mixed_layout(),
    }


def save():
    paddle_dcp.save_state_dict(c.build(SAVED, 0, {"step": 11, "milestones": [3, 1, 4, 1.5]}), "ck")
    c.dist.barrier()
    mine = sorted(os.listdir("ck"))
    node_ranks = [r for r in range(N) if r // PER_NODE == NODE]
    want = [f"{r}_0.distcp" for r in node_ranks] + (["0.0.claim", "0.metadata"] if NODE == 0 else [])
    assert mine == sorted(want), (mine, want)


def load(leaves):
    sd = c.build(leaves, 0, {"step": 0, "milestones": []}, target=True)
    paddle_dcp.load_state_dict(sd, "ck")
    c.check_state(sd, leaves, 0, R)
    assert sd["step"] == 11 and sd["milestones"] == [3, 1, 4, 1.5], (sd["step"], sd["milestones"])


def file_missing_everywhere():
    """A data file no rank can read: every rank raises (the ranks that need it name it), and
    the state dict is left exactly as it was."""
    victim = f"{N - 1}_0.distcp"
    c.dist.barrier()
    if R == N - 1:
        os.rename(os.path.join("ck", victim), os.path.join("..", "hidden"))
    c.dist.barrier()
    try:
        sd = c.build(TARGETS["into_plain"], 0, {"step": 0}, target=True)
        before = c.snapshot(sd)
        try:
            paddle_dcp.load_state_dict(sd, "ck")
        except paddle_dcp.CollectiveError as exc:
            assert exc.failures, exc
            assert all(victim in m for m in exc.failures.values()), exc.failures
            print(f"rank {R}: got the expected CollectiveError: {exc}", flush=True)
        else:
            raise AssertionError("loading without a data file did not raise")
        c.assert_unchanged(sd, before)  # found before any byte moved: nothing was loaded
    finally:
        c.dist.barrier()
        if R == N - 1:
            os.rename(os.path.join("..", "hidden"), os.path.join("ck", victim))
        c.dist.barrier()


MISSING_WARNING_BUG = "warned as missing from the checkpoint, though it holds them"


def warnings_name_only_missing_keys():
    """Tensors on a sub-mesh of the coordinator's node, plus keys the checkpoint lacks (a
    tensor, a value): every rank warns about the lacking keys, and no rank names a key the
    checkpoint holds as missing, not even a rank without the metadata file that holds no
    piece of that tensor (it asks its helper only for the boxes it holds)."""
    sub = c.Mesh(list(range(PER_NODE)))  # the ranks of node 0, which has the metadata
    leaves = c.mixed_layout(sub, ("R",))
    extra = c.Leaf(("extra",), (3, 2), "float32", sub, ("R",), index=20)
    sd = c.build(leaves + [extra], 0, {"step": 0, "extra_value": 5}, target=True)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    try:  # strict: every rank raises, whether or not it can read the metadata file
        paddle_dcp.load_state_dict(sd, "ck")
        raise AssertionError("a strict load of keys the checkpoint lacks returned")
    except paddle_dcp.MismatchError as exc:
        assert "extra" in str(exc) and "extra_value" in str(exc), str(exc)
    handler = Keep(logging.WARNING)
    logging.getLogger("paddle_dcp").addHandler(handler)
    try:
        paddle_dcp.load_state_dict(sd, "ck", strict=False)
    finally:
        logging.getLogger("paddle_dcp").removeHandler(handler)
    c.check_state(sd, leaves, 0, R)
    assert sd["step"] == 11 and sd["extra_value"] == 5, (sd["step"], sd["extra_value"])
    print(f"rank {R}: warnings {records}", flush=True)
    for key in ("extra", "extra_value"):
        assert any(repr(key) in m for m in records), (key, records)
    spurious = [leaf.key for leaf in leaves if any(repr(leaf.key) in m for m in records)]
    assert not spurious, f"rank {R}: {spurious} {MISSING_WARNING_BUG}: {records}"


def servers_with(**kwargs):
    """The ranks this rank receives bytes from in a load into plain tensors (every rank needs
    every piece, half of them from the other node's files)."""
    leaves = TARGETS["into_plain"]
    seen = []
    plan_class = paddle_dcp.parallel.loadwork.LoadPlan
    original = plan_class.served

    def served(self, answer):
        plan = original(self, answer)
        seen.append(sorted(plan.remote))
        return plan

    plan_class.served = served
    try:
        sd = c.build(leaves, 0, {"step": 0, "milestones": []}, target=True)
        paddle_dcp.load_state_dict(sd, "ck", **kwargs)
    finally:
        plan_class.served = original
    c.check_state(sd, leaves, 0, R)
    return seen[0] if seen else []  # no rank needed another's bytes: no servers named


def worker_groups_choose_the_sender():
    """A rank that must receive bytes takes them from a rank of its worker groups when one can
    read the file: with the group [1, 2], rank 1 receives from 2 and rank 2 from 1 (without
    it, from 3 and 0); every comm_method paddle names loads the same, any other is refused."""
    group = c.dist.new_group([1, 2])
    default = {0: [2], 1: [3], 2: [0], 3: [1]}
    grouped = {0: [2], 1: [2], 2: [1], 3: [1]}
    assert servers_with() == default[R], (R, servers_with())
    got = servers_with(worker_groups=[None, group], comm_method="send_recv")
    assert got == grouped[R], (R, got)
    for method in ("broadcast", "multi_group_broadcast", "grouped_send_recv", "parallel_broadcast"):
        assert servers_with(comm_method=method) == default[R]
    try:
        paddle_dcp.load_state_dict({}, "ck", comm_method="scatter")
        raise AssertionError("an unknown comm_method was accepted")
    except ValueError as exc:
        assert "send_recv" in str(exc) and "'scatter'" in str(exc), str(exc)


def aoa_refused():
    """aoa_config needs the whole metadata on every rank (paddle's engine reads every
    checkpoint key and shard): with a rank that lacks the file, every rank refuses clearly
    and nothing is loaded."""
    sd = c.build(TARGETS["into_plain"], 0, {"step": 0}, target=True)
    before = c.snapshot(sd)
    try:
        paddle_dcp.load_state_dict(sd, "ck", aoa_config={"aoa_statements": []})
    except paddle_dcp.UnsupportedError as exc:
        assert "needs every rank to read the metadata" in str(exc), exc
    else:
        raise AssertionError("aoa_config on node-local disks did not raise")
    c.assert_unchanged(sd, before)


CASES = {"save": save}
CASES.update({name: (lambda leaves=leaves: load(leaves)) for name, leaves in TARGETS.items()})
CASES["file_missing_everywhere"] = file_missing_everywhere
CASES["load_after_restoring_the_file"] = lambda: load(TARGETS["into_plain"])
if N == 4:
    CASES["worker_groups_choose_the_sender"] = worker_groups_choose_the_sender
if "warnings_name_only_missing_keys" in sys.argv[3:]:  # a known bug: run only when asked
    CASES["warnings_name_only_missing_keys"] = warnings_name_only_missing_keys
if "aoa_refused" in sys.argv[3:]:
    CASES["aoa_refused"] = aoa_refused

c.run_cases(CASES, sys.argv[3:])
