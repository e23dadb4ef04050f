"""paddle_dcp.parallel.device on the fake GPU (tests/fakegpu.py), one path at a time, each against
numpy: host views only of host memory, pinned memory only in CUDAPinnedPlace, the caller's
tensors filled in place, the staging arena reused, the pinned area bounded."""
import numpy as np
import paddle
import pytest

import fakegpu
from fakegpu import ACCOUNT
from paddle_dcp.parallel import device


def gpu_tensor(array, dtype=None):
    t = paddle.to_tensor(array)
    t = t.astype(dtype) if dtype else t
    assert t.place.is_gpu_place()
    return t


def host_tensor(array):
    t = paddle.to_tensor(array, place=paddle.CPUPlace())
    assert t.place.is_cpu_place()
    return t


def test_a_device_tensor_is_never_viewed_in_place():
    with pytest.raises(RuntimeError, match="device address"):
        device._view(gpu_tensor(np.arange(4.0)), "float64")


def test_an_empty_tensor_views_as_an_empty_array():
    view = device._view(paddle.empty([0, 3], dtype="float32", device=paddle.CPUPlace()), "float32")
    assert view.shape == (0, 3) and view.dtype == np.float32


def test_a_non_contiguous_host_tensor_is_refused_as_a_view_and_copied_for_writing():
    t = fakegpu.mark(host_tensor(np.arange(12, dtype=np.float32).reshape(3, 4)).T, "cpu", count=False)
    assert not t.is_contiguous() and t.place.is_cpu_place()
    with pytest.raises(ValueError, match="not contiguous"):
        device._view(t, "float32")
    np.testing.assert_array_equal(device.host_bytes(t).array, np.arange(12, dtype=np.float32).reshape(3, 4).T)


def test_host_bytes_of_a_device_tensor_is_one_pinned_copy_that_outlives_its_holder():
    expected = np.arange(24, dtype=np.float32).reshape(4, 6)
    ACCOUNT.reset()
    array = device.host_bytes(gpu_tensor(expected)).array  # the HostBytes itself is dropped at once
    assert ACCOUNT.copied["d2h"] == expected.nbytes and ACCOUNT.current["pinned"] == expected.nbytes
    paddle.zeros([1 << 16])  # memory freed by now would be reused
    np.testing.assert_array_equal(array, expected)
    del array
    assert ACCOUNT.current["pinned"] == 0
    staged = device.host_bytes(np.arange(3))
    assert device.host_bytes(staged) is staged  # staged bytes are written as they are


def test_staged_copies_of_every_kind_hold_the_values_at_the_call():
    values = np.arange(6, dtype=np.int64)
    for source in (values.copy(), host_tensor(values), gpu_tensor(values)):
        copy = device.staged_copy(source)
        if isinstance(source, np.ndarray):
            source[...] = 0
        else:
            source.copy_(paddle.zeros([6], dtype="int64"), True)
        held = copy if isinstance(copy, np.ndarray) else copy.numpy()
        np.testing.assert_array_equal(held, values)
    assert device.staged_copy(gpu_tensor(values)).place.is_cuda_pinned_place()


def test_the_staging_arena_reuses_its_pinned_buffers_and_copies_fresh_when_busy():
    arena = device.StagingArena()
    tensors = [gpu_tensor(np.full((3, 4), 1.5, np.float32)), host_tensor(np.arange(5.0))]
    np.testing.assert_array_equal(arena.stage(tensors)[0].numpy(), np.full((3, 4), 1.5, np.float32))  # unreserved
    arena.done()
    arena.release()
    arena.reserve(tensors)
    assert arena.fits(tensors)
    ACCOUNT.reset()
    staged = arena.stage(tensors)
    assert ACCOUNT.allocations["pinned"] == 0, "the reserved pinned buffer was not reused"
    assert not arena.fits(tensors)  # busy until done()
    arena.reserve(tensors)  # a no-op while busy
    fresh = arena.stage(tensors)  # busy: fresh copies, the staged bytes untouched
    assert ACCOUNT.allocations["pinned"] == 1
    np.testing.assert_array_equal(staged[0].numpy(), np.full((3, 4), 1.5, np.float32))
    np.testing.assert_array_equal(staged[1].array, np.arange(5.0))
    np.testing.assert_array_equal(fresh[1].numpy(), np.arange(5.0))
    arena.done()
    bigger = [host_tensor(np.arange(100.0))]
    np.testing.assert_array_equal(arena.stage(bigger)[0].array, np.arange(100.0))  # the buffer grows
    arena.done()
    arena.release()
    assert len(arena.buf) == 0 and arena.pinned == {}


def test_a_failing_stage_leaves_the_arena_free():
    arena = device.StagingArena()

    class Broken:
        shape, dtype = [2], paddle.float32

        def __getattr__(self, name):
            raise RuntimeError("broken tensor")

    with pytest.raises(RuntimeError):
        arena.stage([Broken()])
    assert not arena.busy


def test_a_device_target_is_filled_in_place_through_a_bounded_pinned_area():
    expected = np.arange(40 * 6, dtype=np.float32).reshape(40, 6)
    target = gpu_tensor(np.zeros((40, 6), np.float32))
    buffer = device.TargetBuffer(target)
    assert not buffer.in_place
    buffer.array[...] = expected
    ACCOUNT.reset()
    with device.PinnedStage(nbytes=100) as stage:  # 4 rows of 24 bytes a run
        buffer.finish(stage)
        assert ACCOUNT.peak["pinned"] <= 100 and ACCOUNT.allocations["pinned"] == 1
    assert ACCOUNT.peak["gpu"] == 0, "a device copy of the tensor was made"
    assert target.place.is_gpu_place()
    np.testing.assert_array_equal(target.numpy(), expected)


def test_offload_fills_in_place_with_no_pinned_memory():
    target = gpu_tensor(np.zeros((3, 2), np.float32), "bfloat16")
    buffer = device.TargetBuffer(target, offload=True)
    buffer.fill(2.5)
    ACCOUNT.reset()
    with device.PinnedStage() as stage:
        buffer.finish(stage)
    assert ACCOUNT.allocations["pinned"] == 0
    np.testing.assert_array_equal(target.astype("float32").numpy(), np.full((3, 2), 2.5, np.float32))


def test_a_scalar_and_an_empty_device_target():
    scalar = gpu_tensor(np.float64(0.0))
    buffer = device.TargetBuffer(scalar)
    buffer.array[...] = 7.25
    buffer.finish(device.PinnedStage(nbytes=8))
    assert scalar.item() == 7.25
    empty = gpu_tensor(np.zeros((0, 3), np.float32))
    device.TargetBuffer(empty).finish(device.PinnedStage())  # nothing to copy, nothing made
    assert list(empty.shape) == [0, 3]


def test_a_host_target_is_its_own_buffer(monkeypatch):
    target = host_tensor(np.zeros((2, 3), np.int32))
    buffer = device.TargetBuffer(target)
    assert buffer.in_place
    buffer.array[...] = np.arange(6, dtype=np.int32).reshape(2, 3)
    buffer.finish(device.PinnedStage())
    np.testing.assert_array_equal(target.numpy(), np.arange(6, dtype=np.int32).reshape(2, 3))
    monkeypatch.setattr(device, "host_only_build", lambda: True)  # the CPU wheel: no place asked
    assert device.is_host(gpu_tensor(np.zeros(1)))


def test_a_non_contiguous_host_target_is_copied_back_whole():
    base = host_tensor(np.zeros((3, 4), np.float32))
    target = fakegpu.mark(base.T, "cpu", count=False)
    buffer = device.TargetBuffer(target)
    assert not buffer.in_place
    buffer.array[...] = np.arange(12, dtype=np.float32).reshape(4, 3)
    buffer.finish()
    np.testing.assert_array_equal(target.numpy(), np.arange(12, dtype=np.float32).reshape(4, 3))


def test_an_unknown_build_asks_every_tensor(monkeypatch):
    device.host_only_build.cache_clear()

    def broken():
        raise RuntimeError("no such query")

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", broken)
    try:
        assert device.host_only_build() is False
        assert not device.is_host(gpu_tensor(np.zeros(2)))
        assert device.is_host(host_tensor(np.zeros(2)))
    finally:
        monkeypatch.undo()
        device.host_only_build.cache_clear()
    assert device.host_only_build() is False and fakegpu.installed()
