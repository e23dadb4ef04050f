"""The one agreement on failures (parallel/agree.py), by both routes, on ranks that are
threads with real comms (tests/unit/parallel/fakes.py): the same maxima, or the same
CollectiveError built from the failing ranks' class and message, on every rank."""
from __future__ import annotations

import json

import pytest

from paddle_dcp.errors import CollectiveError, CollectiveMismatchError, Failure, IntegrityError, MismatchError
from paddle_dcp.parallel import agree, wire
from paddle_dcp.parallel.comm import SoloComm

from .fakes import ThreadWorld

SIZE = 4


def run(fn) -> dict:
    return ThreadWorld(SIZE).run(fn)


@pytest.mark.parametrize("star", [False, True])
def test_no_failure_gives_every_rank_the_maxima(star):
    results = run(lambda comm: agree.agree(comm, "step", None, (comm.rank, 10 - comm.rank), star))
    assert results == {r: [SIZE - 1, 10] for r in range(SIZE)}


@pytest.mark.parametrize("star", [False, True])
def test_failures_become_the_same_error_on_every_rank_with_their_class_as_data(star):
    def rank(comm):
        error = {1: IntegrityError("1_0.distcp: bytes [0, 8) fail their checksum"), 3: OSError("disk full")}.get(comm.rank)
        return agree.agree(comm, "write", error, (comm.rank,), star)

    results = run(rank)
    for r in range(SIZE):
        e = results[r]
        assert type(e) is CollectiveError and e.step == "write", e
        assert e.errors == {1: Failure.of(IntegrityError("1_0.distcp: bytes [0, 8) fail their checksum")),
                            3: Failure("OSError", "disk full")}
    assert isinstance(results[1].__cause__, IntegrityError) and results[0].__cause__ is None  # the failing rank chains its own


@pytest.mark.parametrize("star", [False, True])
def test_mismatches_on_every_failing_rank_are_a_collective_mismatch_error(star):
    results = run(lambda comm: agree.agree(comm, "plan", MismatchError("w: shape (2,) here, (3,) saved") if comm.rank else None, (), star))
    assert all(type(e) is CollectiveMismatchError and sorted(e.errors) == [1, 2, 3] for e in results.values())


def test_a_world_of_one_raises_its_own_error():
    with pytest.raises(OSError, match="disk full"):
        agree.agree(SoloComm(), "write", OSError("disk full"), (), star=True)
    assert agree.agree(SoloComm(), "write", None, (3, 4)) == [3, 4]


def test_the_star_route_sends_only_point_to_point_messages():
    """No collective: ranks that reach the agreement far apart wait on a connection, not on
    a gloo collective that gives up after 30 s."""
    world, comms = ThreadWorld(SIZE), {}

    def rank(comm):
        comms[comm.rank] = comm
        return agree.agree(comm, "gather", None, (1,), star=True)

    assert world.run(rank) == {r: [1] for r in range(SIZE)}
    assert all((c.traffic.sent, c.traffic.received) == (0, 0) for c in comms.values())  # counts collectives only
    peers = {(src, dst) for src, dst, _ in world.sent}
    assert peers == {(r, 0) for r in range(1, SIZE)} | {(0, r) for r in range(1, SIZE)}


def test_a_malformed_report_is_the_sender_s_failure():
    def rank(comm):
        if comm.rank == 2:  # a peer of another version: not a report
            wire.send_message(comm, 0, json.dumps({"values": [1]}).encode())
            return wire.decode_json(wire.recv_message(comm, 0))
        return agree.agree(comm, "commit", None, (), star=True)

    results = run(rank)
    assert sorted(results[2]["f"]) == ["2"]  # the verdict it received names it
    for r in (0, 1, 3):
        assert type(results[r]) is CollectiveError and list(results[r].errors) == [2]
        assert "malformed agreement report" in results[r].errors[2].message
