"""Elastic restores of the node-local tier (issue 39, point 2): a CheckpointManager whose state
lives on a 2-D mesh of the job's ranks, saved on one layout (nodes x ranks, mesh shape) and
restored on another. Run by launcher.run_two_nodes or launcher.run_launch; each node has its
own working directory, so the relative ``local`` is a directory of that node alone.

Usage: elastic.py GLOBAL PHASE MESH [STEP TIER]
  MESH: "AxB", the mesh of this job's ranks (A * B of them, in C order).
  save: steps 1..4 (the local tier every step, the newest 2 kept; the global every 2 steps),
        each step's values the oracle's variant ``step``, replicas=1.
  restore: the manager's restore into a state dict laid out on MESH; it must give STEP from
        TIER, every tensor bit-exact against the numpy oracle (the rank's slice computed
        from the global arrays and MESH's placements by common.py, never by the library);
        each rank prints its last_restore as one "REPORT {json}" line.
"""
import dataclasses
import json
import sys

import paddle.distributed as dist

import common as c
import paddle_dcp

dist.init_parallel_env()
R = c.rank()
N = dist.get_world_size()
GLOBAL, PHASE, MESH = sys.argv[1], sys.argv[2], tuple(int(x) for x in sys.argv[3].split("x"))
assert MESH[0] * MESH[1] == N, (MESH, N)


def leaves() -> list:
    """Rows over one mesh dim and columns over the other, a bfloat16 tensor split one way and
    replicated the other, a replicated one."""
    mesh = c.Mesh([[a * MESH[1] + b for b in range(MESH[1])] for a in range(MESH[0])])
    return [
        c.Leaf(("model", "w"), (8, 6), "float32", mesh, (("S", 0), ("S", 1)), index=0),
        c.Leaf(("model", "b"), (6, 4), "bfloat16", mesh, ("R", ("S", 1)), index=1),
        c.Leaf(("model", "r"), (5,), "int64", mesh, ("R", "R"), index=2),
        c.Leaf(("opt", "m"), (8, 6), "float32", mesh, (("S", 1), ("S", 0)), index=3),
    ]


LEAVES = leaves()


def manager() -> paddle_dcp.CheckpointManager:
    return paddle_dcp.CheckpointManager(GLOBAL, save_interval_steps=2, local_directory="local", local_max_to_keep=2,
                                        replicas=1)


def save() -> None:
    with manager() as m:
        for step in range(1, 5):
            assert m.save(step, c.build(LEAVES, step, {"step": step}))
        assert m.all_steps() == [2, 4], m.all_steps()


def restore(step: int, tier: str) -> None:
    with manager() as m:
        sd = c.build(LEAVES, 0, {"step": -1}, target=True)
        got = m.restore(sd)
        report = m.last_restore
        print("REPORT " + json.dumps({"rank": R, **dataclasses.asdict(report)}), flush=True)
        assert (got, report.tier) == (step, tier), (got, report)
        c.check_state(sd, LEAVES, step, R)
        assert sd["step"] == step, sd["step"]


if PHASE == "save":
    CASES = {"save": save}
else:
    want_step, want_tier = int(sys.argv[4]), sys.argv[5]
    CASES = {f"restore_{want_step}_{want_tier}": lambda: restore(want_step, want_tier)}
c.run_cases(CASES, [])
