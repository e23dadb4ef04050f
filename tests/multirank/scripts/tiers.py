"""A CheckpointManager with a node-local tier on two "nodes" (two launches, each in its own
working directory: the relative ``local`` is a directory of that node alone) and a global tier
in a directory both see.

Usage (run by launcher.run_two_nodes, or by launcher.run_launch for one node): tiers.py GLOBAL PHASE REPLICAS [STEP TIER]
  save: steps 1..4, the local tier every step (the newest 2 kept), the global every 3 steps;
        each step's values are the oracle's variant ``step``.
  restore: the manager's restore; it must give STEP from TIER, every tensor bit-exact against
        the numpy oracle of that step; each rank prints its last_restore as one JSON line.
  train: a training script, the same on any number of nodes: restore the newest step if there
        is one (bit-exact against the oracle, on whatever layout this job has), save the next 4
        steps, then restore into a new state dict (the last step saved, bit-exact); each rank
        prints one "TRAIN {json}" line. The library's log records go to the rank's log, each
        line "LOG rank=R LEVEL logger: message".
"""
import json
import logging
import sys

import paddle.distributed as dist

import common as c
import paddle_dcp

dist.init_parallel_env()
R = c.rank()
N = dist.get_world_size()
GLOBAL, PHASE, REPLICAS = sys.argv[1], sys.argv[2], int(sys.argv[3])

LEAVES = c.tier_leaves(N)
logging.basicConfig(level=logging.WARNING, format=f"LOG rank={R} %(levelname)s %(name)s: %(message)s", force=True)


def manager() -> paddle_dcp.CheckpointManager:
    return paddle_dcp.CheckpointManager(
        GLOBAL, save_interval_steps=3, local_directory="local", local_max_to_keep=2, replicas=REPLICAS,
    )


def save() -> None:
    with manager() as m:
        for step in range(1, 5):
            assert m.save(step, c.build(LEAVES, step, {"step": step}))
        assert m.all_steps() == [3], m.all_steps()
        assert m.latest_step() == 4


def restore(step: int, tier: str) -> None:
    with manager() as m:
        got, report, sd = c.restore_reported(m, LEAVES, R)
        assert (got, report.tier) == (step, tier), (got, report)
        c.check_state(sd, LEAVES, step, R)
        assert sd["step"] == step, sd["step"]


def train() -> None:
    """Resume from the newest step there is (none: start at step 0), save 4 more, and load
    the last one back into a new state dict."""
    with manager() as m:
        start, restored = m.latest_step(), None
        if start is not None:
            got, report, sd = c.restore_reported(m, LEAVES, R)
            assert got == start, (got, start)
            c.check_state(sd, LEAVES, start, R)
            assert sd["step"] == start, sd["step"]
            restored = {"step": got, "tier": report.tier, "bytes": report.bytes, "refused": [list(x) for x in report.refused]}
        first = (start or 0) + 1
        for step in range(first, first + 4):
            assert m.save(step, c.build(LEAVES, step, {"step": step}))
        got, report, sd = c.restore_reported(m, LEAVES, R)
        c.check_state(sd, LEAVES, first + 3, R)
        assert sd["step"] == first + 3, sd["step"]
        print("TRAIN " + json.dumps({"rank": R, "world": N, "restored": restored, "saved": list(range(first, first + 4)),
                                     "reloaded": [got, report.tier], "global": m.all_steps()}), flush=True)


if PHASE == "save":
    CASES = {f"save_{REPLICAS}": save}
elif PHASE == "train":
    CASES = {f"train_{REPLICAS}": train}
else:
    want_step, want_tier = int(sys.argv[4]), sys.argv[5]
    CASES = {f"restore_{want_step}_{want_tier}": lambda: restore(want_step, want_tier)}
c.run_cases(CASES, [])
