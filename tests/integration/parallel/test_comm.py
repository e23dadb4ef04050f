"""SoloComm: the world of one that runs without paddle.distributed."""
import pytest

from paddle_dcp.parallel import protocol
from paddle_dcp.parallel.comm import SoloComm
from paddle_dcp.errors import FormatError


def test_solo_collectives_return_their_own_input():
    c = SoloComm(rank=5)
    assert (c.size, c.rank, c.ranks, c.coordinator, c.is_coordinator) == (1, 5, (5,), 5, True)
    assert c.all_max([3, 1]) == [3, 1]
    assert c.gather(b"ab", 5) == [b"ab"]
    assert c.scatter([b"x"], 5) == b"x"
    assert c.broadcast(b"y", 5) == b"y"
    assert c.all_gather(b"z") == [b"z"]


def test_solo_step_re_raises_the_original_error():
    c = SoloComm()

    def broken():
        raise FormatError("broken")

    with pytest.raises(FormatError, match="broken"):
        protocol.run(c, protocol.local("read", broken))
    assert protocol.run(c, protocol.local("fine", lambda: 7)) == 7
    c.agree("fine", None)


def test_a_read_only_message_can_be_sent():
    """Messages made from bytes are read-only arrays, which numpy < 2 cannot export through
    DLPack: the wire tensor must still carry their bytes (node-local loads hung without it)."""
    import numpy as np

    from paddle_dcp.parallel.comm import host_tensor

    message = np.frombuffer(b"paddle_dcp", dtype=np.uint8)
    assert not message.flags.writeable
    assert host_tensor(message).numpy().tobytes() == b"paddle_dcp"


def test_a_group_pairs_up_after_one_all_gather_of_addresses(monkeypatch):
    """PaddleComm.begin_pairwise: the first pairwise step of a comm all-gathers where its
    ranks listen; its later ones do not gather again. Another comm over the same ranks (an
    async save's, pairing up on its own thread, in its own order on each rank) gathers for
    itself: had it reused the first comm's addresses on one rank and not on another, the other
    would wait in an all-gather nobody joins."""
    from paddle_dcp.parallel import comm as comm_mod

    learned, gathers = {}, []

    class FakeTransport:
        def knows(self, key):
            return key in learned

        def address(self):
            return "127.0.0.1:4000"

        def learn(self, key, ranks, addresses):
            learned[key] = (tuple(ranks), addresses)

    monkeypatch.setattr(comm_mod.STATE.groups, "transport", lambda rank: FakeTransport())

    def comm(purpose):
        c = comm_mod.PaddleComm.__new__(comm_mod.PaddleComm)
        c.rank, c.ranks, c.purpose = 1, (0, 1, 2), purpose
        monkeypatch.setattr(c, "all_gather", lambda data: gathers.append((purpose, data)) or [b"h0:1", data, b"h2:3"], raising=False)
        return c

    control, background = comm("control"), comm("background")
    control.begin_pairwise()
    control.begin_pairwise()
    assert gathers == [("control", b"127.0.0.1:4000")]
    background.begin_pairwise()
    background.begin_pairwise()
    assert gathers == [("control", b"127.0.0.1:4000"), ("background", b"127.0.0.1:4000")]
    want = ((0, 1, 2), ["h0:1", "127.0.0.1:4000", "h2:3"])
    assert learned == {("control", (0, 1, 2)): want, ("background", (0, 1, 2)): want}
