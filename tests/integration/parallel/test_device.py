"""paddle_dcp.parallel.device on a CPU-only paddle: tensors viewed in place (no copy), a
non-contiguous tensor copied once, staged copies that outlive the tensor's changes, and a load's
target buffer that is the tensor's own memory (tests/fakegpu_unit/test_device.py runs the GPU
branches on the fake GPU). Oracle: the numpy arrays the tensors were made from."""
import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from paddle_dcp.parallel import device  # noqa: E402



def test_a_cpu_build_places_every_tensor_in_host_memory_without_asking_each():
    import paddle

    from paddle_dcp.parallel import device

    assert device.host_only_build() == (not paddle.is_compiled_with_cuda())
    t = paddle.ones([3, 2])
    assert device.is_host(t)
    # a build with a device asks the tensor: a CPU tensor is still in host memory
    device.host_only_build.cache_clear()
    real = paddle.is_compiled_with_cuda
    paddle.is_compiled_with_cuda = lambda: True
    try:
        assert not device.host_only_build()
        assert device.is_host(t)
    finally:
        paddle.is_compiled_with_cuda = real
        device.host_only_build.cache_clear()
    assert device.host_only_build() == (not paddle.is_compiled_with_cuda())


@pytest.mark.parametrize("dtype, name", [("float32", "float32"), ("int64", "int64"), ("bfloat16", "bfloat16"), ("bool", "bool")])
def test_the_dtype_name_of_a_tensor_is_the_formats(dtype, name):
    assert device.dtype_name(paddle.zeros([2], dtype=dtype)) == name


def test_a_cpu_tensor_is_viewed_in_place_without_a_copy():
    t = paddle.to_tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    held = device.host_bytes(t)
    assert held.array.dtype == np.dtype("<f4") and held.array.shape == (3, 4)
    assert np.array_equal(held.array, np.arange(12, dtype=np.float32).reshape(3, 4))
    t.fill_(5.0)  # the view is the tensor's memory: its change shows
    assert (held.array == 5).all()
    assert not device.needs_host_copy(t) and device.host_bytes(held) is held


def test_a_bfloat16_tensor_is_viewed_as_its_bit_patterns():
    t = paddle.to_tensor(np.array([1.0, -2.0], np.float32)).astype("bfloat16")
    assert device.host_bytes(t).array.tolist() == [0x3F80, 0xC000]


def test_a_non_contiguous_tensor_is_copied_once_in_c_order():
    base = paddle.to_tensor(np.arange(12, dtype=np.int64).reshape(3, 4))
    t = base.transpose([1, 0])
    if t.is_contiguous():  # this paddle made a copy: nothing left to test here
        pytest.skip("paddle's transpose made a contiguous tensor")
    held = device.host_bytes(t)
    assert np.array_equal(held.array, np.arange(12).reshape(3, 4).T)
    base.fill_(0)
    assert held.array.any()  # a copy, not a view of the tensor


def test_a_numpy_leaf_is_held_in_its_storage_dtype():
    a = np.arange(4, dtype=">i4")  # big-endian: the format is little-endian
    held = device.host_bytes(a)
    assert held.array.dtype == np.dtype("<i4") and held.array.tolist() == [0, 1, 2, 3]
    assert not device.needs_host_copy(a)


def test_a_staged_copy_outlives_changes_to_the_tensor():
    t = paddle.to_tensor(np.arange(6, dtype=np.float32))
    a = np.arange(3, dtype=np.int64)
    copies = device.staged_copy(t), device.staged_copy(a)
    t.fill_(0.0)
    a[:] = 9
    assert copies[0].numpy().tolist() == [0, 1, 2, 3, 4, 5] and copies[1].tolist() == [0, 1, 2]


def test_a_cpu_target_buffer_is_the_tensors_own_memory():
    t = paddle.zeros([2, 3], dtype="float32")
    buf = device.TargetBuffer(t)
    assert buf.in_place and buf.array.shape == (2, 3)
    buf.array[...] = np.arange(6, dtype=np.float32).reshape(2, 3)
    buf.finish()
    assert t.numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    buf.fill(7)
    assert (t.numpy() == 7).all()


def test_a_target_buffer_of_a_non_contiguous_tensor_is_copied_into_it_in_place():
    base = paddle.zeros([4, 3], dtype="float32")
    t = base.transpose([1, 0])
    if t.is_contiguous():
        pytest.skip("paddle's transpose made a contiguous tensor")
    buf = device.TargetBuffer(t)
    assert not buf.in_place
    buf.array[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
    buf.finish()
    assert t.numpy().tolist() == np.arange(12).reshape(3, 4).tolist()


def test_a_cpu_build_has_no_pinned_memory_and_its_stage_copies_rows_in_runs():
    if paddle.is_compiled_with_cuda():
        pytest.skip("a CUDA build")
    assert not device._has_pinned()
    t = paddle.zeros([5, 2], dtype="int64")
    device._copy_rows(t, paddle.to_tensor(np.array([[1, 2], [3, 4]], np.int64)), start=2)
    assert t.numpy().tolist() == [[0, 0], [0, 0], [1, 2], [3, 4], [0, 0]]
    with device.PinnedStage(nbytes=16) as stage:
        assert stage.nbytes == 16
    assert stage.areas == {}


# ---------------------------------------------------------------------- the async save's staging arena
# copies that outlive the tensors' changes, in memory kept and reused from one save to the next
# (numpy leaves)
def leaves(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((33, 7)).astype(np.float32), np.arange(5, dtype=np.int64),
            rng.integers(0, 255, 1000).astype(np.uint8), np.zeros((0, 3), np.float64)]


def test_copies_hold_the_values_at_the_call_and_the_memory_is_reused():
    arena, first = device.StagingArena(), leaves(0)
    assert not arena.fits(first)
    staged = arena.stage(first)
    expected = [a.copy() for a in first]
    for a in first:
        a[...] = 7  # training goes on
    for s, e in zip(staged, expected):
        assert isinstance(s, device.HostBytes) and np.array_equal(device.host_bytes(s).array, e)
    buf = arena.buf
    arena.done()
    second = leaves(1)
    assert arena.fits(second)
    again = arena.stage(second)
    assert arena.buf is buf  # no new memory
    for s, e in zip(again, second):
        assert np.array_equal(s.array, e)
    # pieces never overlap in the arena
    spans = sorted((s.array.__array_interface__["data"][0], s.array.nbytes) for s in again if s.array.nbytes)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))


def test_a_busy_arena_is_never_overwritten():
    arena = device.StagingArena()
    held = arena.stage(leaves(0))
    snapshot = [s.array.copy() for s in held]
    assert not arena.fits(leaves(1))
    other = arena.stage(leaves(1))  # another save while the first still writes: fresh copies
    assert all(not isinstance(o, device.HostBytes) for o in other)
    for s, e in zip(held, snapshot):
        assert np.array_equal(s.array, e)


def test_reserve_makes_the_memory_ahead_and_release_frees_it():
    arena = device.StagingArena()
    arena.reserve(leaves(0))
    assert arena.fits(leaves(1)) and len(arena.buf) >= sum(a.nbytes for a in leaves(0))
    bigger = leaves(0) + [np.ones(4096, np.float64)]
    assert not arena.fits(bigger)
    arena.release()
    assert len(arena.buf) == 0
