"""paddle_dcp.parallel.requests, as a comm carries them out: every request a protocol can
yield (``Request``) has its answer from ``protocol.run`` on a one-rank comm, a failure comes
back into the protocol as the agreed error, and a request no comm knows is refused by name."""
import typing

import numpy as np
import pytest

from paddle_dcp.errors import StorageError
from paddle_dcp.parallel import protocol, requests
from paddle_dcp.parallel.comm import SoloComm


def answers():
    """Yields one request of every kind and collects what the comm answered."""
    got = {}
    got["AllMax"] = yield requests.AllMax((3, 1))
    got["Gather"] = yield requests.Gather(b"g", 0)
    got["Scatter"] = yield requests.Scatter([b"s"], 0)
    got["Broadcast"] = yield requests.Broadcast(b"b", 0)
    got["AllGather"] = yield requests.AllGather(b"a")
    got["Agree"] = yield requests.Agree("step", None, (7,))
    got["Pairwise"] = yield requests.Pairwise("pairs", lambda comm: ("asked", comm.rank))
    array = np.array([4.0, 6.0])
    got["ReduceAmong"] = yield requests.ReduceAmong("reduce", (requests.Reduction((0,), array, "avg"),))
    got["reduced"] = array.tolist()
    got["Detach"] = yield requests.Detach()
    return got


def test_every_request_has_its_answer_from_a_comm():
    got = protocol.run(SoloComm(), answers())
    assert got == {
        "AllMax": [3, 1], "Gather": [b"g"], "Scatter": b"s", "Broadcast": b"b", "AllGather": [b"a"], "Agree": [7],
        "Pairwise": ("asked", 0), "ReduceAmong": None, "reduced": [4.0, 6.0], "Detach": None,
    }
    # every kind the union names was asked for above
    assert {c.__name__ for c in typing.get_args(requests.Request)} == set(got) - {"reduced"}


def test_a_failed_pairwise_step_comes_back_into_the_protocol_after_its_agreement():
    def failing():
        try:
            yield requests.Pairwise("pairs", lambda comm: (_ for _ in ()).throw(StorageError("disk gone")))
        except StorageError as exc:  # on the rank that failed: its own error
            after = yield requests.AllMax((5,))  # the protocol goes on (e.g. releases what it holds)
            return str(exc), after

    assert protocol.run(SoloComm(), failing()) == ("disk gone", [5])


def test_a_request_no_comm_knows_is_refused_naming_it():
    def unknown():
        yield ("not", "a request")

    with pytest.raises(TypeError, match="unknown protocol request"):
        protocol.run(SoloComm(), unknown())


def test_a_detach_stops_the_driver_that_asked_to_stop_there_and_the_rest_runs_later():
    def detached():
        first = yield requests.AllMax((1,))
        yield requests.Detach()
        second = yield requests.AllMax((2,))
        return first + second

    gen = detached()
    assert isinstance(protocol.run(SoloComm(), gen, until_detach=True), requests.Detach)
    assert protocol.run(SoloComm(), gen) == [1, 2]
