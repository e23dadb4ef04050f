"""Two "nodes" on one machine: two launches of this script (``--nnodes 2``), each in its own
working directory, each saving to and loading from its own relative directory ``ckpt``. The
metadata exists only on the coordinator's node and each node holds only its own ranks' data
files, so every load below needs bytes that only the other node can read.

Usage (run by launcher.run_two_nodes, 2 nodes x 2 ranks): twonode.py [case ...]
"""
import os
import sys

import paddle.distributed as dist

import common as c
import paddle_dcp

dist.init_parallel_env()
R = c.rank()
N = dist.get_world_size()
assert N == 4, N
CK = "ckpt"  # relative: resolved in this node's own working directory

# the ranks that share this rank's working directory: its node
_cwds = []
dist.all_gather_object(_cwds, os.getcwd())
NODE_RANKS = sorted(r for r in range(N) if _cwds[r] == os.getcwd())
OTHER_RANKS = sorted(set(range(N)) - set(NODE_RANKS))
assert len(NODE_RANKS) == 2 and len(set(_cwds)) == 2, _cwds

M4 = c.Mesh([0, 1, 2, 3])
M22 = c.Mesh([[2, 3], [0, 1]])  # ranks 0, 1 at row 1 of the mesh: they get rows 4..7
S0, S1 = ("S", 0), ("S", 1)
# 8 rows: 2 per rank, so every rank writes a data file of its own; columns that paddle can
# split over 4 ranks (6: 2 2 2 0, 7: 2 2 2 1, 3: 1 1 1 0, 10: 3 3 3 1)
SHAPES = [("f32", (8, 6), "float32"), ("bf16", (8, 7), "bfloat16"), ("i64", (8, 3), "int64"),
          ("bool", (8, 4), "bool"), ("f16", (8, 10), "float16")]


def leaves(mesh, spec):
    return [c.Leaf(("t", name), shape, dtype, mesh, spec, index=i) for i, (name, shape, dtype) in enumerate(SHAPES)]


SAVED = leaves(M4, (S0,))
TARGETS = {
    "into_s1": leaves(M4, (S1,)),            # every rank: columns of all 8 rows, half from the other node
    "into_replicate": leaves(M4, ("R",)),    # every rank: everything
    "into_2d": leaves(M22, (S0, S1)),        # each rank: rows written on the other node
    "into_plain": leaves(None, None),
}


def files_needed(leaves_) -> set:
    """Data files holding rows this rank's targets need (rows 2q, 2q+1 were saved by rank q)."""
    need = set()
    for leaf in leaves_:
        coord = leaf.mesh.coord(R) if leaf.mesh is not None else ()
        if coord is None:
            continue
        sl = c.local_slices(leaf.shape, leaf.mesh.shape if leaf.mesh else (), coord, leaf.spec)
        if sl[1].stop > sl[1].start:
            need |= {f"{q}_0.distcp" for q in range(N) if sl[0].start < 2 * q + 2 and 2 * q < sl[0].stop}
    return need


def save():
    paddle_dcp.save_state_dict(c.build(SAVED, 0, {"step": 11, "name": "two nodes"}), CK)
    dist.barrier()
    mine = sorted(os.listdir(CK))
    want = [f"{r}_0.distcp" for r in NODE_RANKS] + (["0.0.claim", "0.metadata"] if 0 in NODE_RANKS else [])
    assert mine == sorted(want), (mine, want)
    print(f"rank {R}: node ranks {NODE_RANKS}, files here {mine}", flush=True)


def load(leaves_):
    need = files_needed(leaves_)
    missing_here = need - set(os.listdir(CK))
    # the premise: this rank needs bytes that only the other node has
    assert missing_here and missing_here <= {f"{q}_0.distcp" for q in OTHER_RANKS}, (need, missing_here)
    sd = c.build(leaves_, 0, {"step": 0, "name": ""}, target=True)
    paddle_dcp.load_state_dict(sd, CK)
    c.check_state(sd, leaves_, 0, R)
    assert sd["step"] == 11 and sd["name"] == "two nodes", (sd["step"], sd["name"])


def file_on_no_node():
    """Rank 3 moves its data file out of its node's checkpoint: no node has it. Every rank
    needs it (Replicate), so every rank raises StorageError naming it, no rank hangs, and the
    state dict is left as it was."""
    victim = "3_0.distcp"
    hidden = os.path.join("..", f"hidden_{os.path.basename(os.getcwd())}")
    dist.barrier()
    if R == 3:
        os.rename(os.path.join(CK, victim), hidden)
    dist.barrier()
    try:
        sd = c.build(TARGETS["into_replicate"], 0, {"step": 0, "name": ""}, target=True)
        before = c.snapshot(sd)
        try:
            paddle_dcp.load_state_dict(sd, CK)
        except paddle_dcp.CollectiveError as exc:
            assert sorted(exc.failures) == list(range(N)), exc.failures
            for r, msg in exc.failures.items():
                assert msg.startswith("StorageError") and victim in msg, (r, msg)
            assert isinstance(exc.__cause__, paddle_dcp.StorageError), repr(exc.__cause__)
            assert victim in str(exc.__cause__), str(exc.__cause__)
            print(f"rank {R}: got the expected CollectiveError: {exc}", flush=True)
        else:
            raise AssertionError("loading without a data file on any node did not raise")
        c.assert_unchanged(sd, before)
    finally:
        dist.barrier()
        if R == 3:
            os.rename(hidden, os.path.join(CK, victim))
        dist.barrier()


CASES = {"save": save}
CASES.update({name: (lambda leaves_=leaves_: load(leaves_)) for name, leaves_ in TARGETS.items()})
CASES["file_on_no_node"] = file_on_no_node
CASES["load_after_restoring_the_file"] = lambda: load(TARGETS["into_s1"])

c.run_cases(CASES, sys.argv[1:])
