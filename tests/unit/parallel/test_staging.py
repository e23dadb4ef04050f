"""The async save's staging arena: copies that outlive the tensors' changes, in memory kept and
reused from one save to the next (numpy leaves: no paddle needed)."""
import numpy as np

from paddle_dcp.parallel.device import HostBytes, StagingArena, host_bytes


def leaves(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((33, 7)).astype(np.float32), np.arange(5, dtype=np.int64),
            rng.integers(0, 255, 1000).astype(np.uint8), np.zeros((0, 3), np.float64)]


def test_copies_hold_the_values_at_the_call_and_the_memory_is_reused():
    arena, first = StagingArena(), leaves(0)
    assert not arena.fits(first)
    staged = arena.stage(first)
    expected = [a.copy() for a in first]
    for a in first:
        a[...] = 7  # training goes on
    for s, e in zip(staged, expected):
        assert isinstance(s, HostBytes) and np.array_equal(host_bytes(s).array, e)
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
    arena = StagingArena()
    held = arena.stage(leaves(0))
    snapshot = [s.array.copy() for s in held]
    assert not arena.fits(leaves(1))
    other = arena.stage(leaves(1))  # another save while the first still writes: fresh copies
    assert all(not isinstance(o, HostBytes) for o in other)
    for s, e in zip(held, snapshot):
        assert np.array_equal(s.array, e)


def test_reserve_makes_the_memory_ahead_and_release_frees_it():
    arena = StagingArena()
    arena.reserve(leaves(0))
    assert arena.fits(leaves(1)) and len(arena.buf) >= sum(a.nbytes for a in leaves(0))
    bigger = leaves(0) + [np.ones(4096, np.float64)]
    assert not arena.fits(bigger)
    arena.release()
    assert len(arena.buf) == 0
