"""The meshes of a state dict's dist tensors (parallel/placements.meshes_of), in one process: a mesh of
one rank, as a one-process job has."""
import numpy as np
import paddle
import paddle.distributed as dist

from paddle_dcp.core.job_layout import Mesh
from paddle_dcp.parallel.placements import meshes_of


def test_each_mesh_once_in_the_order_of_its_first_key_and_none_for_plain_tensors():
    flat = dist.ProcessMesh([0], dim_names=["x"])
    square = dist.ProcessMesh([[0]], dim_names=["dp", "mp"])
    sd = {
        "b": {"w": dist.shard_tensor(paddle.ones([4, 2]), square, [dist.Shard(0), dist.Replicate()])},
        "a": dist.shard_tensor(paddle.ones([3]), flat, [dist.Replicate()]),
        "c": [dist.shard_tensor(paddle.zeros([2]), flat, [dist.Shard(0)]), paddle.ones([2]), np.ones(3)],
        "step": 4,
    }
    assert meshes_of(sd) == (Mesh((1,), (0,), ("x",)), Mesh((1, 1), (0,), ("dp", "mp")))
    assert meshes_of({"w": paddle.ones([2]), "n": np.zeros(2), "step": 1}) == ()


def test_a_state_dict_that_cannot_be_taken_apart_has_no_meshes():
    assert meshes_of({1: paddle.ones([2])}) is None  # a non-str key: the save itself says why
