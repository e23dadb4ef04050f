"""Byte ranges between two ranks (parallel/transfer.py), over threads with a point to point that
blocks until taken (tests/unit/parallel/fakes.py): messages arrive whole and in order, filled
ahead or not; a sender that fails sends FAILED for the rest and the receiver stays in step; a
message of another size is the sender's fault, dropped, and the pair still ends."""
from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from paddle_dcp.errors import CollectiveError, StorageError
from paddle_dcp.parallel import transfer, wire

from .fakes import ThreadWorld

SIZES = [0, 1, 7, 4096, 3, 100_000]


def payload(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def test_pair_order_is_the_same_global_order_from_both_sides():
    for me, peer in itertools.permutations(range(5), 2):
        assert transfer.directions(me, peer) == transfer.directions(peer, me)
        assert transfer.directions(me, peer)[0] == (min(me, peer), max(me, peer))
    assert transfer.pair_order(2, [4, 0, 3, 0, 1]) == [0, 1, 3, 4]
    assert transfer.pair_order(3, [4, 0, 2]) == [0, 2, 4]


@pytest.mark.parametrize("ahead", [False, True])
def test_every_message_arrives_whole_and_in_order_into_the_receivers_buffers(ahead):
    bufs = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
    filled = []

    def fill(i):  # two buffers in turn, as a reading sender uses them
        if len(bufs[i % 2]) < SIZES[i]:
            bufs[i % 2] = np.empty(SIZES[i], np.uint8)
        out = bufs[i % 2][: SIZES[i]]
        out[...] = payload(i, SIZES[i])
        filled.append((i, threading.current_thread().name))
        return out

    def rank(comm):
        if comm.rank == 0:
            return transfer.send(comm, 1, len(SIZES), fill, ahead=ahead)
        inbox = transfer.Receiver(comm, 0)
        got = [np.full(n, 0xAB, np.uint8) for n in SIZES]
        return [inbox.into(g, f"message {i}") for i, g in enumerate(got)], got, inbox

    world = ThreadWorld(2)
    results = world.run(rank)
    assert results[0] is None
    oks, got, inbox = results[1]
    assert oks == [True] * len(SIZES) and not inbox.failed and inbox.error is None
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g, payload(i, SIZES[i]))
    assert [i for i, _ in filled] == list(range(len(SIZES)))
    threads = {name for _, name in filled}
    assert all(n.startswith("paddle_dcp-fill") for n in threads) if ahead else not any(n.startswith("paddle_dcp-fill") for n in threads)
    # each message: a 16-byte header, then its bytes (none for an empty one)
    assert [n for _, _, n in world.sent] == [x for n in SIZES for x in ([16, n] if n else [16])]


@pytest.mark.parametrize("ahead", [False, True])
def test_a_failed_fill_sends_failed_for_it_and_every_later_message_and_is_returned(ahead):
    calls = []

    def fill(i):
        calls.append(i)
        if i == 2:
            raise StorageError("f is cut short")
        return payload(i, SIZES[i])

    def rank(comm):
        if comm.rank == 0:
            return transfer.send(comm, 1, len(SIZES), fill, ahead=ahead)
        inbox = transfer.Receiver(comm, 0)
        got = [np.full(n, 0xAB, np.uint8) for n in SIZES]
        return [inbox.into(g, f"message {i}") for i, g in enumerate(got)], got, inbox.failed

    world = ThreadWorld(2)
    results = world.run(rank)
    assert isinstance(results[0], StorageError) and "cut short" in str(results[0])
    assert calls == [0, 1, 2]  # nothing is read after the failure
    oks, got, failed = results[1]
    assert oks == [True, True, False, False, False, False] and failed
    np.testing.assert_array_equal(got[1], payload(1, 1))
    assert all((g == 0xAB).all() for g in got[2:])  # nothing of a FAILED message is written
    assert sum(n for _, _, n in world.sent) == 16 * len(SIZES) + 0 + 1  # no bytes after the failure


def test_a_message_of_another_size_is_dropped_as_the_senders_error_and_the_pair_stays_in_step():
    def rank(comm):
        if comm.rank == 0:
            wire.send_message(comm, 1, np.arange(10, dtype=np.uint8))
            wire.send_message(comm, 1, np.arange(3, dtype=np.uint8))
            return None
        inbox = transfer.Receiver(comm, 0)
        first, second = np.zeros(12, np.uint8), np.zeros(3, np.uint8)
        return inbox.into(first, "bytes [0, 12) of f"), inbox.into(second, "bytes [12, 15) of f"), first, second, inbox

    ok1, ok2, first, second, inbox = ThreadWorld(2).run(rank)[1]
    assert (ok1, ok2) == (False, True) and not first.any()
    np.testing.assert_array_equal(second, np.arange(3))
    assert isinstance(inbox.error, CollectiveError) and list(inbox.error.failures) == [0]
    assert "sent 10 bytes where 12 were expected (bytes [0, 12) of f)" in str(inbox.error)


def test_skip_takes_a_message_or_a_failed_status():
    def rank(comm):
        if comm.rank == 0:
            wire.send_message(comm, 1, np.arange(5, dtype=np.uint8))
            wire.send_failed(comm, 1)
            return None
        inbox = transfer.Receiver(comm, 0)
        inbox.skip()
        skipped_bytes = inbox.failed
        inbox.skip()
        return skipped_bytes, inbox.failed

    assert ThreadWorld(2).run(rank)[1] == (False, True)


def test_a_receiver_sees_its_buffer_filled_in_place_through_a_memoryview_of_another_dtype():
    """A load receives straight into the target's memory: a float32 array's bytes."""
    values = np.linspace(-1, 1, 6, dtype=np.float32)

    def rank(comm):
        if comm.rank == 0:
            return transfer.send(comm, 1, 1, lambda i: values.view(np.uint8))
        target = np.zeros(6, np.float32)
        assert transfer.Receiver(comm, 0).into(memoryview(target), "target")
        return target

    np.testing.assert_array_equal(ThreadWorld(2).run(rank)[1], values)
