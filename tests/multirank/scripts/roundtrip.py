"""Save a state dict and load it back into the same layout, comparing with the numpy oracle.

Usage (under paddle.distributed.launch): roundtrip.py DIR {1d|2d} [case ...]
  1d: 2 ranks, a 1-D mesh; every dtype, uneven shards, nested values, checkpoint ids.
  2d: 4 ranks, a [2, 2] mesh, 1-D meshes of 4 ranks and sub-meshes of 2.
  coshard: 4 ranks, a [2, 2] mesh whose two dims shard the same tensor dim.
"""
import math
import os
import sys

import numpy as np

import common as c
import paddle_dcp

ROOT = c.init()
SCENARIO = sys.argv[2]
R = c.rank()

DTYPES = ["float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
          "float16", "bfloat16", "complex64"]


def leaves_1d():
    mesh = c.Mesh([0, 1])
    layouts = {
        "s0": ((7, 5), (("S", 0),)),          # 4 + 3 rows
        "s1": ((7, 5), (("S", 1),)),          # 3 + 2 columns
        "r": ((7, 5), ("R",)),
        "s0_vec": ((3,), (("S", 0),)),        # 2 + 1
        "s0_one_row": ((1, 6), (("S", 0),)),  # rank 1 holds an empty shard
        "s2_3d": ((4, 3, 3), (("S", 2),)),
        "s1_3d": ((2, 5, 3), (("S", 1),)),
        "plain": ((2, 3), None),
    }
    out = []
    for dtype in DTYPES:
        for name, (shape, spec) in layouts.items():
            out.append(c.Leaf(("model", dtype, name), shape, dtype, mesh if spec else None, spec))
    for dtype in ["float32", "bfloat16", "int64"]:
        out.append(c.Leaf(("opt", "m", dtype), (6, 4), dtype, mesh, (("S", 0),)))
        out.append(c.Leaf(("opt", "v", dtype), (6, 4), dtype, mesh, (("S", 1),)))
    out += [
        c.Leaf(("scalar",), (), "float32"),                          # plain 0-d
        c.Leaf(("scalar_i",), (), "int64"),
        c.Leaf(("scalar_dist",), (), "float32", mesh, ("R",)),       # dist 0-d
        c.Leaf(("bufs", 0), (3, 2), "float32"),                      # tensors inside a list
        c.Leaf(("bufs", 1), (5, 2), "int32", mesh, (("S", 0),)),
        c.Leaf(("np", "arr"), (4, 3), "float64", kind="numpy"),      # numpy leaves
        c.Leaf(("np", "flags"), (5,), "bool", kind="numpy"),
    ]
    for i, leaf in enumerate(out):
        leaf.index = i
    return out


def leaves_2d(coshard: bool):
    """coshard: only the layouts where two mesh dims shard one tensor dim (paddle reports
    their placements as bare ``Placement`` objects); else every other layout."""
    m22 = c.Mesh([[0, 1], [2, 3]], ["a", "b"])
    m4 = c.Mesh([0, 1, 2, 3])
    low, high = c.Mesh([0, 1]), c.Mesh([2, 3])
    s0, s1 = ("S", 0), ("S", 1)
    cases = [
        ("s0_s1", (9, 7), m22, (s0, s1)),
        ("r_s1", (6, 5), m22, ("R", s1)),
        ("s1_r", (6, 5), m22, (s1, "R")),
        ("s1_s0", (5, 7), m22, (s1, s0)),
        ("r_r", (3, 4), m22, ("R", "R")),
        ("m4_s0_7", (7, 3), m4, (s0,)),                 # 2 2 2 1
        ("m4_s0_6", (6, 3), m4, (s0,)),                 # 2 2 2 0
        ("m4_s0_3", (3, 3), m4, (s0,)),                 # 1 1 1 0 (2 rows over 4 crash paddle)
        ("m4_s1_10", (3, 10), m4, (s1,)),
        ("m4_r", (4, 4), m4, ("R",)),
        ("low_s0", (5, 3), low, (s0,)),                 # ranks 2 and 3 hold nothing
        ("high_s1", (4, 5), high, (s1,)),               # ranks 0 (coordinator) and 1 nothing
        ("plain", (3, 3), None, None),
    ]
    co = [
        ("s0_s0", (9, 3), m22, (s0, s0)),              # 5 | 4 rows, then 3 + 2 | 2 + 2
        ("s0_s0_b_first", (9, 3), m22, (("S", 0, 1), ("S", 0, 0))),
        ("s1_s1", (2, 5), m22, (s1, s1)),
        ("s0_s0_3rows", (3, 4), m22, (s0, s0)),         # rank 3 holds an empty shard
        ("s1_s1_9cols", (4, 9), m22, (s1, s1)),
    ]
    out = []
    for dtype in ["float32", "bfloat16", "int64", "bool"]:
        for name, shape, mesh, spec in (co if coshard else cases):
            out.append(c.Leaf(("model", dtype, name), shape, dtype, mesh, spec))
    for i, leaf in enumerate(out):
        leaf.index = i
    return out


VALUES = [
    {"step": 7, "name": "x", "lrs": [0.1, 0.2], "none": None, "flag": True, "big": 2**40,
     "inf": math.inf, "nan": math.nan, "tup": (1, "a"), "npint": np.int64(5),
     "sched": {"last_lr": 0.01, "milestones": [3, 6]}},
    {"step": 8, "name": "y", "lrs": [0.3, 0.4], "none": None, "flag": False, "big": -(2**40),
     "inf": -math.inf, "nan": math.nan, "tup": (2, "b"), "npint": np.int64(6),
     "sched": {"last_lr": 0.02, "milestones": [4]}},
]
BLANK = {"step": 0, "name": "", "lrs": [0.0, 0.0], "none": 123, "flag": None, "big": 0,
         "inf": 0.0, "nan": 0.0, "tup": (0, ""), "npint": 0,
         "sched": {"last_lr": 0.0, "milestones": [0, 0]}}


def check_values(sd, v: int) -> None:
    exp = VALUES[v]
    for k in ("step", "name", "none", "flag", "big", "inf"):
        assert sd[k] == exp[k] and type(sd[k]) is type(exp[k]), (k, sd[k], exp[k])
    assert sd["lrs"] == exp["lrs"] and all(type(x) is float for x in sd["lrs"]), sd["lrs"]
    assert isinstance(sd["nan"], float) and math.isnan(sd["nan"]), sd["nan"]
    assert sd["tup"] == exp["tup"] and isinstance(sd["tup"], tuple), sd["tup"]
    assert sd["npint"] == int(exp["npint"]) and type(sd["npint"]) is int, sd["npint"]
    assert sd["sched"]["last_lr"] == exp["sched"]["last_lr"], sd["sched"]
    # a list of values is restored element by element: the target's list had two slots
    ms = exp["sched"]["milestones"]
    assert sd["sched"]["milestones"][: len(ms)] == ms, sd["sched"]


LEAVES = leaves_1d() if SCENARIO == "1d" else leaves_2d(SCENARIO == "coshard")
NRANKS = 2 if SCENARIO == "1d" else 4
CK = os.path.join(ROOT, "ck")


def source(v):
    return c.build(LEAVES, v, dict(VALUES[v]))


def target():
    return c.build(LEAVES, 0, dict(BLANK), target=True)


def fixture_layout():
    """The tensors the tests save hold what the oracle says (paddle's layout = ours)."""
    for v in (0, 1):
        c.check_state(source(v), LEAVES, v, R, source=True)


def save_first():
    paddle_dcp.save_state_dict(source(0), CK)
    files = sorted(os.listdir(CK))
    assert files == sorted(["0.0.claim", "0.metadata"] + [f"{r}_0.distcp" for r in range(NRANKS)]), files


def load_same_layout():
    sd = target()
    paddle_dcp.load_state_dict(sd, CK)
    c.check_state(sd, LEAVES, 0, R)
    check_values(sd, 0)


def pieces():
    meta = paddle_dcp.read_metadata(CK)
    assert meta.unique_id == 0 and meta.world_size == NRANKS, (meta.unique_id, meta.world_size)
    c.check_pieces(meta, LEAVES, NRANKS)


def save_second_gets_id_1():
    paddle_dcp.save_state_dict(source(1), CK)
    files = sorted(os.listdir(CK))
    want = sorted(["0.0.claim", "0.metadata", "1.0.claim", "1.metadata"] + [f"{r}_{i}.distcp" for r in range(NRANKS) for i in (0, 1)])
    assert files == want, files


def load_latest_is_id_1():
    sd = target()
    paddle_dcp.load_state_dict(sd, CK)
    c.check_state(sd, LEAVES, 1, R)
    check_values(sd, 1)


def load_unique_id_0():
    sd = target()
    paddle_dcp.load_state_dict(sd, CK, unique_id=0)
    c.check_state(sd, LEAVES, 0, R)
    check_values(sd, 0)


def explicit_id_and_coordinator_1():
    path = os.path.join(ROOT, "coord1")
    paddle_dcp.save_state_dict(source(1), path, coordinator_rank=1, unique_id=5)
    files = sorted(os.listdir(path))
    assert files == sorted(["5.0.claim", "5.metadata"] + [f"{r}_5.distcp" for r in range(NRANKS)]), files
    sd = target()
    paddle_dcp.load_state_dict(sd, path, coordinator_rank=1)
    c.check_state(sd, LEAVES, 1, R)
    check_values(sd, 1)


CASES = {
    "fixture_layout": fixture_layout,
    "save_first": save_first,
    "load_same_layout": load_same_layout,
    "pieces": pieces,
    "save_second_gets_id_1": save_second_gets_id_1,
    "load_latest_is_id_1": load_latest_is_id_1,
    "load_unique_id_0": load_unique_id_0,
    "explicit_id_and_coordinator_1": explicit_id_and_coordinator_1,
}

c.run_cases(CASES, sys.argv[3:])
