"""paddle_dcp.parallel.placements: what a rank holds of a state-dict tensor (key, dtype, global
shape, box) from a numpy array, a plain paddle tensor, a ShardedWeight (flattened or not), and
paddle's placements read as plain ints (their objects or, for co-sharded ones, their repr).
Oracles: boxes written out by hand, and C-order positions from numpy."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import PlanError, UnsupportedError
from paddle_dcp.parallel import placements
from paddle_dcp.parallel.placements import _coord



@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_mesh_coordinate_of_a_process_is_its_c_order_position(mesh_shape, data):
    index = data.draw(st.integers(0, math.prod(mesh_shape) - 1))
    grid = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)  # the ids of a mesh, in order
    assert grid[_coord(index, mesh_shape)] == index


class Placement:
    """A placement object as paddle's are asked: is_shard, is_partial, and their getters."""

    def __init__(self, kind: str, dim: int = 0, order: int = 0, split: int = 1, reduce: str = "kRedSum"):
        self.kind, self.dim, self.order, self.split, self.reduce = kind, dim, order, split, reduce

    def is_shard(self):
        return self.kind == "shard"

    def is_partial(self):
        return self.kind == "partial"

    def get_dim(self):
        return self.dim

    def get_co_shard_order(self):
        return self.order

    def get_split_factor(self):
        return self.split

    def reduce_type(self):
        return f"ReduceType.{self.reduce}"


class Bare:
    """A co-sharded placement as paddle returns it: a bare object known by its repr alone."""

    def __init__(self, text: str, kind: str = "shard"):
        self.text, self.kind = text, kind

    def __repr__(self):
        return self.text

    def is_shard(self):
        return self.kind == "shard"

    def is_partial(self):
        return self.kind == "partial"


def test_placements_become_the_mesh_dims_of_each_tensor_dim_in_co_shard_order():
    pl = [Placement("shard", 1), Placement("replicate"), Bare("Shard(dim=1, shard_order=0)"),
          Placement("partial", reduce="kRedMax"), Placement("shard", -3, order=0)]  # fmt: skip
    pl[0].order = 1  # mesh dim 0 shards dim 1 after mesh dim 2
    dims, partial = placements._mesh_dims_of_tensor_dims("w", pl, 3)
    assert dims == [[4], [2, 0], []] and partial == [(3, "max")]


@pytest.mark.parametrize("placement, words", [
    (Placement("shard", 2), "on a tensor of rank 2"),
    (Placement("shard", -3), "on a tensor of rank 2"),
    (Placement("shard", 0, split=2), "split_factor=2"),
    (Bare("Shard(0)"), "cannot read the placement"),
])  # fmt: skip
def test_a_placement_that_cannot_be_expressed_is_a_plan_error_naming_the_key(placement, words):
    with pytest.raises(PlanError, match=f"^w: .*{words}"):
        placements._mesh_dims_of_tensor_dims("w", [placement], 2)


@pytest.mark.parametrize("placement, kind", [
    (Placement("partial", reduce="kRedSum"), "sum"), (Placement("partial", reduce="kRedAvg"), "avg"),
    (Bare("Partial(reduce_type=MAX)", "partial"), "max"),
])  # fmt: skip
def test_the_reduce_type_of_a_partial_placement(placement, kind):
    assert placements.reduce_type("w", placement) == kind


def test_a_numpy_array_is_held_whole():
    held = placements.describe("w", np.zeros((3, 4), np.float16), rank=5)
    assert (held.piece.key, held.piece.dtype, held.piece.global_shape, held.piece.box) == ("w", "float16", (3, 4), Box.whole((3, 4)))
    assert held.pieces() == [(held.piece, None)] and placements.is_tensor(held.local)


def test_a_plain_paddle_tensor_is_held_whole():
    paddle = pytest.importorskip("paddle")
    held = placements.describe("w", paddle.zeros([2, 5], dtype="bfloat16"), rank=0)
    assert (held.piece.dtype, held.piece.box, held.mesh_coord) == ("bfloat16", Box.whole((2, 5)), None)
    assert not placements.is_tensor(3.0) and not placements.is_tensor([1.0])


def sharded_weight(local_shape, offset, flat=None, global_shape=(4, 6)):
    pytest.importorskip("paddle")
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    count = math.prod(local_shape) if flat is None else flat[1] - flat[0]
    local = paddle.arange(count, dtype="float32")
    if flat is None:
        local = local.reshape(list(local_shape))
    rng = None if flat is None else slice(*flat)
    return ShardedWeight("w", local, tuple(local_shape), tuple(global_shape), tuple(offset), flat is not None, rng)


def test_a_sharded_weight_holds_its_stated_box():
    sw = sharded_weight((2, 6), (2, 0))
    held = placements.describe("w", sw, rank=0)
    assert placements.is_sharded_weight(sw) and placements.is_tensor(sw)
    assert (held.piece.global_shape, held.piece.box, held.parts) == ((4, 6), Box((2, 0), (2, 6)), None)
    assert held.local is sw.local_tensor


def test_a_flattened_sharded_weight_holds_the_boxes_of_its_range_in_order():
    sw = sharded_weight((2, 6), (2, 0), flat=(4, 9))  # elements 4..8 of rows 2-3: (2, 4:6) then (3, 0:3)
    with pytest.raises(UnsupportedError, match="flattened ShardedWeight"):
        placements.describe("w", sw, rank=0)
    held = placements.describe("w", sw, rank=0, flat_ok=True)
    assert held.parts == ((Box((2, 4), (1, 2)), 0), (Box((3, 0), (1, 3)), 2))
    assert [(p.box, at) for p, at in held.pieces()] == [(Box((2, 4), (1, 2)), 0), (Box((3, 0), (1, 3)), 2)]


@pytest.mark.parametrize("local_shape, offset, words", [
    ((2, 6), (3, 0), "not inside its global shape"),
    ((2, 6), (-1, 0), "not inside its global shape"),
])  # fmt: skip
def test_a_sharded_weight_outside_its_tensor_is_a_plan_error(local_shape, offset, words):
    with pytest.raises(PlanError, match=words):
        placements.describe("w", sharded_weight(local_shape, offset), rank=0)


def test_off_the_first_coordinate_of_a_partial_dim_a_sum_holds_zero_and_a_product_one():
    piece = placements.LocalPiece("w", "float32", (2,), Box.whole((2,)))

    def fill(partial, coord):
        return placements.partial_fill(placements.HeldTensor(piece, None, partial, coord))

    assert fill((), None) is None
    assert fill(((1, "sum"),), (0, 1)) == 0
    assert fill(((1, "prod"),), (0, 1)) == 1
    assert fill(((1, "max"),), (0, 1)) is None  # the value itself, on every rank
    assert fill(((1, "sum"),), (1, 0)) is None  # the first coordinate of its partial dim


def test_numpy_state_dicts_have_no_buffers():
    assert placements.buffer_like({"w": np.zeros(2)}, ["w"]) == [] and placements.buffer_like({}, []) == []
