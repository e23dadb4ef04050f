"""paddle_dcp.parallel.p2p: byte streams between two ranks over TCP on 127.0.0.1, ranks as threads
of this process, the job's store as a dict."""
import threading

import numpy as np
import pytest

from paddle_dcp.parallel.p2p import Transport
from paddle_dcp.errors import CollectiveError


class DictStore:
    """The job's key-value store: ``get`` waits for the key, as paddle's TCPStore does."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout=10), key
            return self.values[key]


def run_ranks(fns):
    """Run fns[rank]() on threads; return their results, re-raising the first error."""
    results, errors = {}, {}

    def run(rank):
        try:
            results[rank] = fns[rank]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise next(iter(errors.values()))
    return results


@pytest.fixture
def world(monkeypatch):
    monkeypatch.setenv("PADDLE_DCP_GROUP_TIMEOUT", "5")
    store = DictStore()
    ends = [Transport(r, store) for r in range(3)]
    yield ends
    for end in ends:
        end.close()


def test_messages_both_ways_between_every_pair_and_none_left_open(world):
    payload = {(a, b): np.arange(1000 * (a + 1) + b, dtype=np.int64).view(np.uint8) for a in range(3) for b in range(3)}

    def rank(me):
        def run():
            got = {}
            for peer in sorted({0, 1, 2} - {me}):  # one global order of pairs: lower rank first
                first, second = (me, peer) if me < peer else (peer, me)
                for src, dst in ((first, second), (second, first)):
                    if src == me:
                        world[me].send(dst, "control", payload[(me, dst)])
                    else:
                        out = np.empty(payload[(src, me)].nbytes, np.uint8)
                        world[me].recv_into(src, "control", out)
                        got[src] = out
            world[me].end_step("control")
            return got

        return run

    results = run_ranks([rank(0), rank(1), rank(2)])
    for me, got in results.items():
        for src, out in got.items():
            assert out.tobytes() == payload[(src, me)].tobytes()
    assert all(end.open_connections() == 0 for end in world)


def test_a_length_other_than_expected_is_a_collective_error_naming_the_peer(world):
    def sender():
        world[0].send(1, "control", np.zeros(10, np.uint8))

    def receiver():
        with pytest.raises(CollectiveError, match="sent 10 bytes where 12 were expected") as info:
            world[1].recv_into(0, "control", np.empty(12, np.uint8))
        assert set(info.value.failures) == {0}

    run_ranks([sender, receiver])


def test_channels_are_separate_streams(world):
    """The caller's thread and a writer thread talk to the same peer at once, each on its own
    channel: neither takes the other's bytes."""
    msgs = {ch: np.full(4096, i + 1, np.uint8) for i, ch in enumerate(["control", "background"])}

    def send_both():
        run_ranks([lambda: world[0].send(1, "background", msgs["background"]),
                   lambda: world[0].send(1, "control", msgs["control"])])

    def recv_both():
        outs = {ch: np.empty(4096, np.uint8) for ch in msgs}
        run_ranks([lambda: world[1].recv_into(0, "control", outs["control"]),
                   lambda: world[1].recv_into(0, "background", outs["background"])])
        return outs

    outs = run_ranks([send_both, recv_both])[1]
    for ch in msgs:
        assert (outs[ch] == msgs[ch]).all(), ch


def test_a_peer_that_goes_away_fails_the_receiver_at_once(world):
    def leaver():
        world[0].send(1, "control", np.zeros(4, np.uint8))
        world[0].close()

    def receiver():
        first = np.empty(4, np.uint8)
        world[1].recv_into(0, "control", first)
        with pytest.raises(CollectiveError, match="closed the connection"):
            world[1].recv_into(0, "control", np.empty(4, np.uint8))

    run_ranks([leaver, receiver])


def test_a_peer_that_never_connects_times_out(world, monkeypatch):
    monkeypatch.setenv("PADDLE_DCP_GROUP_TIMEOUT", "1")
    with pytest.raises(CollectiveError, match="did not connect within 1 s"):
        world[2].recv_into(1, "control", np.empty(4, np.uint8))


class NoGetStore(DictStore):
    """A store whose lookups fail the test: addresses must come from Transport.learn."""

    def get(self, key):
        raise AssertionError(f"asked the store for {key}")


def test_a_group_that_learned_its_addresses_connects_without_the_store(monkeypatch):
    """The all-gathered addresses are used: paddle's store takes ~90 ms a lookup."""
    monkeypatch.setenv("PADDLE_DCP_GROUP_TIMEOUT", "5")
    ends = [Transport(r, NoGetStore()) for r in range(2)]
    try:
        group = ("control", (0, 1))
        assert not any(end.knows(group) for end in ends)
        addresses = [end.address() for end in ends]
        for end in ends:
            end.learn(group, (0, 1), addresses)
        assert all(end.knows(group) for end in ends) and not ends[0].knows(("background", (0, 1)))
        data = np.arange(4096, dtype=np.uint8)
        out = np.empty_like(data)
        run_ranks([lambda: ends[0].send(1, "control", data), lambda: ends[1].recv_into(0, "control", out)])
        assert out.tobytes() == data.tobytes()
    finally:
        for end in ends:
            end.close()


def test_a_stray_connection_that_says_nothing_sensible_is_dropped_and_the_ranks_still_pair(world):
    """A port scan or a stray client connects to a rank's listener before its peer does, with
    bytes that are no hello (not ASCII, or closed early): dropped, and the real peer's bytes
    arrive."""
    import socket
    import struct

    host, port = world[1].address().rsplit(":", 1)
    for junk in (struct.pack("<q16s", 0, b"\xff\xfe garbage"), b"\x01\x02"):
        stray = socket.create_connection((host, int(port)))
        stray.sendall(junk)
        stray.close()
    msg = np.arange(1000, dtype=np.uint8)
    out = np.empty(1000, np.uint8)
    run_ranks([lambda: world[0].send(1, "control", msg), lambda: world[1].recv_into(0, "control", out)])
    assert (out == msg).all()
