"""The simulated job (parallel/simworld.py): every rank's generator advanced in lockstep, each
collective given the result real ranks would get (checked against ranks that are threads with
real comms, tests/unit/parallel/fakes.py), the same bytes counted, and a disagreement between
ranks refused rather than simulated."""
from __future__ import annotations

import pytest

from paddle_dcp.parallel import protocol
from paddle_dcp.parallel.requests import AllGather, AllMax, Broadcast, Gather, Scatter
from paddle_dcp.parallel.simworld import SimWorld

from .fakes import ThreadWorld

SIZE = 3


def exchanges(rank: int, size: int) -> protocol.Protocol:
    """One rank's run through every kind of collective; returns what it received."""
    got = []
    got.append((yield AllMax((rank, -rank))))
    got.append((yield Gather(b"x" * (rank + 1), 1)))
    got.append((yield Scatter([bytes([r]) * 4 for r in range(size)] if rank == 0 else None, 0)))
    got.append((yield Broadcast(b"hello" if rank == 2 else b"", 2)))
    got.append((yield AllGather(str(rank).encode())))
    value = yield from protocol.local("step", lambda: rank * 10)
    got.append(value)
    return got


def test_every_collective_gives_what_real_ranks_get_and_counts_the_same_bytes():
    world = SimWorld(tuple(range(SIZE)), 0)
    simulated = world.run({r: exchanges(r, SIZE) for r in range(SIZE)})
    comms = {}

    def real(comm):
        comms[comm.rank] = comm
        return protocol.run(comm, exchanges(comm.rank, SIZE))

    assert simulated == ThreadWorld(SIZE).run(real)
    assert simulated[0][0] == [SIZE - 1, 0] and simulated[1][1] == [b"x", b"xx", b"xxx"] and simulated[0][1] is None
    for r in range(SIZE):
        assert (world.traffic[r].sent, world.traffic[r].received) == (comms[r].traffic.sent, comms[r].traffic.received)
        assert world.traffic[r].collectives == 6  # five collectives and the step's agreement


def test_ranks_that_ask_for_different_collectives_are_refused():
    def rank(r):
        yield (AllMax((1,)) if r == 0 else AllGather(b""))

    with pytest.raises(RuntimeError, match="disagree on the next collective"):
        SimWorld((0, 1), 0).run({r: rank(r) for r in (0, 1)})


def test_a_failed_step_is_raised_not_agreed_on():
    def rank(r):
        yield from protocol.local("write", lambda: 1 / (r - 1))

    with pytest.raises(ZeroDivisionError):
        SimWorld((0, 1), 0).run({r: rank(r) for r in (0, 1)})


def test_timed_ranks_count_their_own_calls():
    def rank(r):
        yield from protocol.local("work", lambda: sorted(range(1000), key=lambda x: -x))

    world = SimWorld((0, 1), 0)
    world.run({r: rank(r) for r in (0, 1)}, timed=(0,), count_calls=True)
    assert world.calls[0] > 1000 and world.calls[1] == 0 and world.seconds[1] == 0.0


def test_timed_ranks_count_the_kernels_time_in_their_own_steps():
    import os

    def rank(r):  # reading random bytes is kernel work (getrandom)
        yield from protocol.local("work", lambda: os.urandom(64 << 20))

    world = SimWorld((0, 1), 0)
    before = os.times().system
    world.run({r: rank(r) for r in (0, 1)}, timed=(0,))
    spent = os.times().system - before
    assert 0.0 < world.kernel_seconds[0] <= spent  # its own step's share of the process's
    assert world.kernel_seconds[1] == 0.0 and world.kernel_seconds[0] <= world.seconds[0] + 0.02


def test_a_pairwise_step_runs_each_ranks_function_without_a_comm_then_its_agreement_and_is_logged():
    seen = []

    def pairwise(rank: int) -> protocol.Protocol:
        got = yield protocol.Pairwise("exchange", lambda comm: seen.append((rank, comm)) or rank * 2)
        yield AllGather(b"ab")
        return got

    world = SimWorld(tuple(range(SIZE)), 0)
    assert world.run({r: pairwise(r) for r in range(SIZE)}) == {r: 2 * r for r in range(SIZE)}
    assert seen == [(r, None) for r in range(SIZE)]
    assert [name for name, _, _ in world.log] == ["0 Pairwise exchange", "1 AllGather"]
    # the agreement: one integer each way; the all-gather: the width agreed (one integer), then
    # (SIZE - 1) messages of 2 bytes and their lengths
    assert [(other, coord) for _, other, coord in world.log] == [(8, 8), (8 + (SIZE - 1) * 10, 8 + (SIZE - 1) * 10)]
