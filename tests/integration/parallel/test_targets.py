"""Where a load puts what it reads (paddle_dcp/parallel/targets.py): a numpy array is filled in
place, a paddle tensor through its host buffer, a flattened ShardedWeight box by box in its flat
local tensor; and the batches of host buffers a single-file load is cut into. Oracles: numpy
slices of arrays built here."""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from paddle_dcp.core.boxes import Box
from paddle_dcp.core.save_plan import LocalPiece
from paddle_dcp.errors import MismatchError
from paddle_dcp.parallel.placements import HeldTensor, describe
from paddle_dcp.parallel.targets import NumpyTarget, host_batches, key_targets, target_buffer


def test_a_numpy_array_is_its_own_target_filled_in_place():
    array = np.zeros((2, 3), np.float32)
    held = describe("a", array, 0, flat_ok=True)
    target = target_buffer(held, offload=False)
    assert isinstance(target, NumpyTarget) and target.array is array
    ((box, view),) = key_targets(held, target)
    assert box == Box((0, 0), (2, 3))
    view[...] = np.arange(6, dtype=np.float32).reshape(2, 3)
    target.fill(7.0)  # a constant instead (a Partial tensor's other ranks)
    target.finish()
    np.testing.assert_array_equal(array, np.full((2, 3), 7.0, np.float32))


@pytest.mark.parametrize("array", [np.zeros((3, 4), np.float32)[:, :2], np.zeros(4, np.int64)])
def test_a_numpy_array_that_cannot_be_filled_in_place_is_refused_by_key(array):
    if array.flags.c_contiguous:
        array.flags.writeable = False
    with pytest.raises(MismatchError, match="^w: numpy arrays loaded in place must be C-contiguous and writable"):
        target_buffer(describe("w", array, 0, flat_ok=True), offload=False)


def test_a_paddle_tensor_is_filled_through_its_host_buffer():
    tensor = paddle.zeros([2, 2], dtype="float32")
    held = describe("t", tensor, 0, flat_ok=True)
    target = target_buffer(held, offload=False)
    ((_, view),) = key_targets(held, target)
    view[...] = [[1, 2], [3, 4]]
    target.finish()
    np.testing.assert_array_equal(tensor.numpy(), [[1, 2], [3, 4]])


def test_a_flattened_sharded_weight_fills_each_box_its_range_covers_in_its_flat_tensor():
    """Elements 2..9 of a (3, 4) tensor, held flat: row 0's last two, all of row 1, row 2's
    first two, each box a segment of the flat local array."""
    flat = np.zeros(8, np.float32)
    parts = ((Box((0, 2), (1, 2)), 0), (Box((1, 0), (1, 4)), 2), (Box((2, 0), (1, 2)), 6))
    held = HeldTensor(LocalPiece("s", "float32", (3, 4), Box((0, 0), (3, 4))), flat, parts=parts)
    global_ = np.arange(12, dtype=np.float32).reshape(3, 4)
    targets = key_targets(held, NumpyTarget(flat, "s"))
    assert [box for box, _ in targets] == [box for box, _ in parts]
    for box, view in targets:
        view[...] = global_[box.slices()]
    np.testing.assert_array_equal(flat, np.arange(2, 10, dtype=np.float32))


def test_tensors_in_host_memory_need_no_host_buffer_and_go_in_one_batch():
    held = [describe(k, np.zeros(1 << 10, np.float32), 0, flat_ok=True) for k in "abc"]
    held.append(describe("t", paddle.zeros([256], dtype="float32"), 0, flat_ok=True))  # on the CPU: viewed in place
    assert host_batches(held, 1) == [held]
    assert host_batches([], 1) == [[]]
