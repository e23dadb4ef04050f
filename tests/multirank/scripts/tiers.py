"""A CheckpointManager with a node-local tier on two "nodes" (two launches, each in its own
working directory: the relative ``local`` is a directory of that node alone) and a global tier
in a directory both see.

Usage (run by launcher.run_two_nodes; one_node by launcher.run_launch): tiers.py GLOBAL PHASE REPLICAS [STEP TIER]
  save: steps 1..4, the local tier every step (the newest 2 kept), the global every 3 steps;
        each step's values are the oracle's variant ``step``.
  one_node: one launch, every rank seeing the same local directory: replicas must be refused.
  restore: the manager's restore; it must give STEP from TIER, every tensor bit-exact against
        the numpy oracle of that step; each rank prints its last_restore as one JSON line.
"""
import sys

import paddle.distributed as dist

import common as c
import paddle_dcp

dist.init_parallel_env()
R = c.rank()
N = dist.get_world_size()
GLOBAL, PHASE, REPLICAS = sys.argv[1], sys.argv[2], int(sys.argv[3])

LEAVES = c.tier_leaves(N)


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


def refused_on_one_node() -> None:
    """Every rank sees the same local directory: one node, so copies have nowhere to go; every
    rank raises the same error, and none waits for another."""
    try:
        manager()
    except paddle_dcp.ArgumentError as exc:
        assert "every rank sees the same local directory" in str(exc), str(exc)
    else:
        raise AssertionError(f"replicas={REPLICAS} on one node was accepted")


if PHASE == "save":
    CASES = {f"save_{REPLICAS}": save}
elif PHASE == "one_node":
    CASES = {"refused_on_one_node": refused_on_one_node}
else:
    want_step, want_tier = int(sys.argv[4]), sys.argv[5]
    CASES = {f"restore_{want_step}_{want_tier}": lambda: restore(want_step, want_tier)}
c.run_cases(CASES, [])
