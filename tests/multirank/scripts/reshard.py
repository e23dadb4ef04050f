"""Save in one layout, load into others (and on another number of ranks), comparing with the
numpy oracle.

Usage (under paddle.distributed.launch): reshard.py DIR SCENARIO [case ...]
  2               2 ranks: Shard(0) / Replicate / Partial / plain saves loaded into every 1-D
                  layout (Partial included).
  4               4 ranks: a [2, 2] mesh save loaded into 1-D, 2-D, sub-mesh, Partial and plain
                  layouts.
  partial_half    4 ranks: float16 / bfloat16 Partial tensors sharded unevenly on another
                  mesh dim (a known bug).
  ws_save2        2 ranks save DIR/ws2 (the three ws_* scenarios run in turn on one DIR).
  ws_load2_save4  4 ranks load DIR/ws2, then save DIR/ws4.
  ws_load4        2 ranks load DIR/ws4.
"""
import os
import sys

import paddle_dcp

import common as c

ROOT = c.init()
SCENARIO = sys.argv[2]
R = c.rank()

layout = c.mixed_layout


def save(leaves, name):
    path = os.path.join(ROOT, name)
    c.check_state(c.build(leaves, 0), leaves, 0, R, source=True)  # the fixture holds what the oracle says
    paddle_dcp.save_state_dict(c.build(leaves, 0, {"tag": name}), path)
    return path


def load(leaves, name, **kwargs):
    sd = c.build(leaves, 0, {"tag": ""}, target=True)
    paddle_dcp.load_state_dict(sd, os.path.join(ROOT, name), **kwargs)
    c.check_state(sd, leaves, 0, R)
    assert sd["tag"] == name, sd["tag"]


def without(leaves, *keys):
    return [leaf for leaf in leaves if leaf.key not in keys]


def case(fn, *args, **kwargs):
    return lambda: fn(*args, **kwargs)


if SCENARIO == "2":
    m, swapped, only1 = c.Mesh([0, 1]), c.Mesh([1, 0]), c.Mesh([1])
    S0, S1, S2 = (("S", 0),), (("S", 1),), (("S", 2),)
    CASES = {
        "save_s0": case(save, layout(m, S0), "s0"),
        "s0_into_s1": case(load, layout(m, S1), "s0"),
        "s0_into_replicate": case(load, layout(m, ("R",)), "s0"),
        "s0_into_s0": case(load, layout(m, S0), "s0"),
        "s0_into_s2": case(load, layout(m, S2), "s0"),
        "s0_into_swapped_mesh_s0": case(load, layout(swapped, S0), "s0"),
        "s0_into_submesh": case(load, layout(only1, S0), "s0"),
        "s0_into_plain": case(load, layout(), "s0"),
        "s0_into_numpy": case(load, layout(kind="numpy"), "s0"),
        "s0_into_s1_offload": case(load, layout(m, S1), "s0", offload=True),
        "save_replicate": case(save, layout(m, ("R",)), "r"),
        "replicate_into_s0": case(load, layout(m, S0), "r"),
        "replicate_into_s1": case(load, layout(swapped, S1), "r"),
        "save_plain": case(save, layout(), "plain"),
        "plain_into_s1": case(load, layout(m, S1), "plain"),
        "save_s1_swapped": case(save, layout(swapped, S1), "s1"),
        "s1_into_s0": case(load, layout(m, S0), "s1"),
        "s1_into_plain": case(load, layout(), "s1"),
        "save_partial_sum": case(save, layout(m, (("P", "sum"),)), "psum"),
        "partial_sum_into_s1": case(load, layout(m, S1), "psum"),
        "save_partial_max": case(save, layout(swapped, (("P", "max"),)), "pmax"),
        "partial_max_into_s0": case(load, layout(m, S0), "pmax"),
        "s0_into_partial_sum": case(load, layout(swapped, (("P", "sum"),)), "s0"),
        "s0_into_partial_max": case(load, layout(m, (("P", "max"),)), "s0"),
    }
elif SCENARIO == "4":
    m22, m22r = c.Mesh([[0, 1], [2, 3]]), c.Mesh([[3, 2], [1, 0]])
    m4, low, odd = c.Mesh([0, 1, 2, 3]), c.Mesh([0, 1]), c.Mesh([1, 3])
    s0, s1 = ("S", 0), ("S", 1)
    CASES = {
        "save_2d": case(save, layout(m22, (s0, s1)), "2d"),
        "2d_into_2d_transposed": case(load, layout(m22, (s1, s0)), "2d"),
        "2d_into_2d_reversed_ranks": case(load, layout(m22r, (s0, s1)), "2d"),
        "2d_into_r_s0": case(load, layout(m22, ("R", s0)), "2d"),
        "2d_into_replicate": case(load, layout(m22, ("R", "R")), "2d"),
        "2d_into_1d_s0": case(load, layout(m4, (s0,)), "2d"),
        "2d_into_1d_s1": case(load, layout(m4, (s1,)), "2d"),
        "2d_into_submesh_s1": case(load, layout(odd, (s1,)), "2d"),
        "2d_into_plain": case(load, layout(), "2d"),
        "2d_into_numpy": case(load, layout(kind="numpy"), "2d"),
        "save_submesh": case(save, layout(low, (s0,)), "low"),   # ranks 2, 3 hold nothing
        "submesh_into_2d": case(load, layout(m22, (s1, s0)), "low"),
        "save_1d_s1": case(save, layout(m4, (s1,)), "1d"),
        "1d_into_2d": case(load, layout(m22, (s0, s1)), "1d"),
        # without t.f: a float16 Partial tensor sharded unevenly is a known bug (partial_half)
        "save_partial_2d": case(save, without(layout(m22, (("P", "sum"), s0)), "t.f"), "p2d"),
        "partial_2d_into_1d_s1": case(load, without(layout(m4, (s1,)), "t.f"), "p2d"),
        "2d_into_partial_2d": case(load, layout(m22r, (s1, ("P", "sum"))), "2d"),
    }
elif SCENARIO == "partial_half":
    m22 = c.Mesh([[0, 1], [2, 3]])
    P, s0 = ("P", "sum"), ("S", 0)
    uneven = [c.Leaf(("t", "bf16_7_rows"), (7, 3), "bfloat16", m22, (P, s0)),              # 4 | 3 rows
              c.Leaf(("t", "f16_1_row"), (1, 6), "float16", m22, (P, s0), index=1)]       # 1 | 0 rows
    CASES = {"save_half_partial_uneven": case(save, uneven, "half"),
             "load_half_partial_uneven": case(load, [c.Leaf(l.path, l.shape, l.dtype, index=l.index)
                                                     for l in uneven], "half")}
elif SCENARIO == "ws_save2":
    CASES = {"save_on_2": case(save, layout(c.Mesh([0, 1]), (("S", 0),)), "ws2")}
elif SCENARIO == "ws_load2_save4":
    m22, m4 = c.Mesh([[0, 1], [2, 3]]), c.Mesh([0, 1, 2, 3])
    CASES = {
        "load_2_into_2d": case(load, layout(m22, (("S", 0), ("S", 1))), "ws2"),
        "load_2_into_1d_s1": case(load, layout(m4, (("S", 1),)), "ws2"),
        "load_2_into_replicate": case(load, layout(m4, ("R",)), "ws2"),
        "save_on_4": case(save, layout(m22, (("S", 1), ("S", 0))), "ws4"),
    }
elif SCENARIO == "ws_load4":
    m = c.Mesh([0, 1])
    CASES = {
        "load_4_into_s0": case(load, layout(m, (("S", 0),)), "ws4"),
        "load_4_into_s1": case(load, layout(m, (("S", 1),)), "ws4"),
        "load_4_into_plain": case(load, layout(), "ws4"),
    }
else:
    raise SystemExit(f"unknown scenario {SCENARIO}")

c.run_cases(CASES, sys.argv[3:])
