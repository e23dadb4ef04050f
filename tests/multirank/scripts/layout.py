"""Cross-check of the shard rule: paddle's local values, the oracle's slice and
paddle_dcp.parallel.placements.describe's box agree for many (shape, mesh, placements).

Usage (under paddle.distributed.launch): layout.py DIR {2|4|coshard} [case ...]

The global tensor is an arange, so the values paddle holds locally identify where its piece
sits in the global tensor: comparing them with ``global[oracle slice]`` checks paddle's rule
against ours, and comparing the box describe computes with both checks paddle_dcp's.
"""
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import common as c
from paddle_dcp.parallel.placements import describe

c.init()
SCENARIO = sys.argv[2]
R = c.rank()
NRANKS = dist.get_world_size()


def cases_2():
    m = c.Mesh([0, 1])
    swapped = c.Mesh([1, 0])
    out = []
    for n in range(1, 10):
        out.append(((n, 3), m, (("S", 0),)))
        out.append(((3, n), m, (("S", 1),)))
        out.append(((n,), swapped, (("S", 0),)))
    for d in range(3):
        out.append(((2, 3, 5), m, (("S", d),)))
        out.append(((5, 1, 7), swapped, (("S", d),)))
    out += [((7, 5), m, ("R",)), ((), m, ("R",)), ((4,), m, ("R",))]
    return out


def cases_4():
    meshes_2d = [c.Mesh([[0, 1], [2, 3]]), c.Mesh([[0, 2], [1, 3]]), c.Mesh([[3, 2], [1, 0]])]
    specs_2d = [("R", "R"), ("R", ("S", 0)), ("R", ("S", 1)), (("S", 0), "R"), (("S", 1), "R"),
                (("S", 0), ("S", 1)), (("S", 1), ("S", 0))]
    out = []
    for mesh in meshes_2d:
        for spec in specs_2d:
            for shape in [(1, 1), (2, 3), (3, 5), (7, 2), (5, 7)]:
                out.append((shape, mesh, spec))
        out.append(((2, 3, 5), mesh, (("S", 2), ("S", 0))))
        out.append(((3, 5, 4), mesh, (("S", 1), ("S", 2))))
    for mesh in [c.Mesh([0, 1, 2, 3]), c.Mesh([2, 0, 3, 1])]:
        for n in range(1, 14):
            for shape, spec in [((n, 2), (("S", 0),)), ((2, n), (("S", 1),))]:
                if c.paddle_accepts(shape, mesh.shape, spec):
                    out.append((shape, mesh, spec))
        out.append(((5, 3), mesh, ("R",)))
    for ids in ([0, 1], [1, 3], [2]):  # sub-meshes: the other ranks hold nothing
        out.append(((5, 3), c.Mesh(ids), (("S", 0),)))
        out.append(((5, 3), c.Mesh(ids), ("R",)))
    return out


def cases_coshard():
    out = []
    s0, s1 = ("S", 0), ("S", 1)
    for mesh in [c.Mesh([[0, 1], [2, 3]]), c.Mesh([[3, 1], [2, 0]])]:
        for n in range(1, 12):
            out.append(((n, 2), mesh, (s0, s0)))
            out.append(((2, n), mesh, (s1, s1)))
            out.append(((n, 3), mesh, (("S", 0, 1), ("S", 0, 0))))
    return out


def check_paddle(shape, mesh, spec):
    """Paddle's local value is the oracle's slice of the global arange."""
    gl = c.global_array(shape, "float32")
    t = dist.shard_tensor(paddle.to_tensor(gl), mesh.paddle, c.placements(spec))
    c.check_tensor(t, gl, "float32", mesh, spec, R, f"paddle {shape} {mesh.ids.tolist()} {spec}")
    return gl, t


def check_describe(shape, mesh, spec):
    """describe's box is the oracle's slice, paddle's local shape, and holds paddle's values."""
    gl, t = check_paddle(shape, mesh, spec)
    what = f"describe {shape} {mesh.ids.tolist()} {spec}"
    held = describe("k", t, R)
    assert held.piece.key == "k" and held.piece.dtype == "float32", what
    assert tuple(held.piece.global_shape) == tuple(shape), (what, held.piece.global_shape)
    coord = mesh.coord(R)
    if coord is None:
        assert held.piece.box is None and held.local is None, (what, held.piece.box)
        return
    sl = c.local_slices(shape, mesh.shape, coord, spec)
    want_shape = tuple(s.stop - s.start for s in sl)
    if not t._is_initialized():  # paddle's empty shard: describe says "holds nothing"
        assert int(np.prod(want_shape)) == 0, (what, want_shape)
        assert held.piece.box is None, (what, held.piece.box)
        return
    box = held.piece.box
    assert box.offsets == tuple(s.start for s in sl) and box.shape == want_shape, (what, box, sl)
    local = t._local_value().numpy()
    assert box.shape == local.shape, (what, box.shape, local.shape)
    c.assert_same(local, gl[box.slices()], what)
    if local.size:  # the first value is the flat position of the box's first element
        assert int(local.reshape(-1)[0]) == int(np.ravel_multi_index(box.offsets, shape)), what
    assert held.mesh_coord == coord, (what, held.mesh_coord, coord)


def run(cases, check):
    def go():
        for case in cases:
            check(*case)
        print(f"rank {R}: {len(cases)} layouts checked", flush=True)
    return go


if SCENARIO == "2":
    CASES = {"paddle_matches_oracle": run(cases_2(), check_paddle),
             "describe_matches_paddle": run(cases_2(), check_describe)}
elif SCENARIO == "4":
    CASES = {"paddle_matches_oracle": run(cases_4(), check_paddle),
             "describe_matches_paddle": run(cases_4(), check_describe),
             "paddle_matches_oracle_coshard": run(cases_coshard(), check_paddle)}
else:
    CASES = {"describe_matches_paddle_coshard": run(cases_coshard(), check_describe)}

c.run_cases(CASES, sys.argv[3:])
