"""Node-local disks: every group of ranks ("node") sees its own directory under one relative
path, so a rank may lack the metadata file (it asks a rank that has it) or data files (a rank
that can read them sends the bytes). Values must still equal the numpy oracle's.

Usage (under paddle.distributed.launch): nodelocal.py DIR RANKS_PER_NODE [case ...]
Rank r works in DIR/node{r // RANKS_PER_NODE} and saves to / loads from the relative path "ck".
"""
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
    paddle_dcp.save_state_dict(c.build(SAVED, 0, {"step": 11}), "ck")
    c.dist.barrier()
    mine = sorted(os.listdir("ck"))
    node_ranks = [r for r in range(N) if r // PER_NODE == NODE]
    want = [f"{r}_0.distcp" for r in node_ranks] + (["0.metadata"] if NODE == 0 else [])
    assert mine == sorted(want), (mine, want)


def load(leaves):
    sd = c.build(leaves, 0, {"step": 0}, target=True)
    paddle_dcp.load_state_dict(sd, "ck")
    c.check_state(sd, leaves, 0, R)
    assert sd["step"] == 11, sd["step"]


def file_missing_everywhere():
    """A data file no rank can read: every rank raises (the ranks that need it name it)."""
    victim = f"{N - 1}_0.distcp"
    c.dist.barrier()
    if R == N - 1:
        os.rename(os.path.join("ck", victim), os.path.join("..", "hidden"))
    c.dist.barrier()
    try:
        sd = c.build(TARGETS["into_plain"], 0, {"step": 0}, target=True)
        paddle_dcp.load_state_dict(sd, "ck")
    except paddle_dcp.CollectiveError as exc:
        assert exc.failures, exc
        assert all(victim in m for m in exc.failures.values()), exc.failures
        print(f"rank {R}: got the expected CollectiveError: {exc}", flush=True)
    else:
        raise AssertionError("loading without a data file did not raise")
    finally:
        c.dist.barrier()
        if R == N - 1:
            os.rename(os.path.join("..", "hidden"), os.path.join("ck", victim))
        c.dist.barrier()


CASES = {"save": save}
CASES.update({name: (lambda leaves=leaves: load(leaves)) for name, leaves in TARGETS.items()})
CASES["file_missing_everywhere"] = file_missing_everywhere
CASES["load_after_restoring_the_file"] = lambda: load(TARGETS["into_plain"])

c.run_cases(CASES, sys.argv[3:])
