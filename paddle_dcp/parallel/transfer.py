"""Byte ranges moved from one rank to another: the one way checkpoint bytes cross between ranks
(a load's exchange, the local tier's copies of data files, a gathered save).

Both ends of a transfer know the messages it carries, in order, and the size of each (from a
plan both hold, or from a request the receiver sent first). A message travels point to point
as a header (status, length: :mod:`paddle_dcp.parallel.wire`) and then its bytes. A sender
that cannot produce a message sends the FAILED status in its place, and in the place of every
later one, without their bytes: the pair stays in step, and the sender's error reaches every
rank at the step's agreement (:mod:`paddle_dcp.parallel.agree`), not as a hang. The receiver
takes each message straight into the buffer it names (the bytes' final place where it can) and
learns only that its sender failed.

Ranks that move bytes both ways visit their partners in one global order of pairs (by lower
rank, then higher rank; :func:`pair_order`), and within a pair handle the two directions in one
order (:func:`directions`): the smallest pair still pending always has both its ranks waiting
for each other, so it completes, and so on; no order of pairs can deadlock.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import numpy as np

from . import wire
from .comm import Comm
from ..errors import CollectiveError


def pair_order(me: int, peers: Iterable[int]) -> list[int]:
    """``peers`` in the global order of pairs (min, max) as seen from rank ``me``."""
    return sorted(set(peers), key=lambda p: (min(me, p), max(me, p)))


def directions(me: int, peer: int) -> list[tuple[int, int]]:
    """The two directions of a pair, (lower rank, higher rank) then (higher, lower): the order
    both ranks handle them in (the caller names the ends: client and server, or sender and
    receiver)."""
    lo, hi = min(me, peer), max(me, peer)
    return [(lo, hi), (hi, lo)]


def send(comm: Comm, peer: int, count: int, fill: Callable[[int], np.ndarray], ahead: bool = False) -> Exception | None:
    """Send ``count`` messages to ``peer``, message ``i`` being the bytes (a uint8 array) that
    ``fill(i)`` returns. With ``ahead``, each next message is filled on a thread of its own
    while the one before is sent, so ``fill`` must return buffers that stay valid across one
    more call (two in turn). When ``fill`` fails, that message and every later one go as
    FAILED; returns that error (the caller raises it once its peers are in step)."""
    if not ahead or count < 2:
        return _send_each(comm, peer, count, fill)
    error: Exception | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="paddle_dcp-fill") as pool:
        pending = pool.submit(fill, 0)
        for i in range(count):
            data = None
            if error is None:
                try:
                    data = pending.result()
                except Exception as exc:  # noqa: BLE001 - the peer learns FAILED; agreed on later
                    error = exc
            pending = pool.submit(fill, i + 1) if error is None and i + 1 < count else None
            _send_one(comm, peer, data)
    return error


def _send_each(comm: Comm, peer: int, count: int, fill: Callable[[int], np.ndarray]) -> Exception | None:
    error: Exception | None = None
    for i in range(count):
        data = None
        if error is None:
            try:
                data = fill(i)
            except Exception as exc:  # noqa: BLE001 - the peer learns FAILED; agreed on later
                error = exc
        _send_one(comm, peer, data)
    return error


def _send_one(comm: Comm, peer: int, data: np.ndarray | None) -> None:
    if data is None:
        wire.send_failed(comm, peer)
    else:
        wire.send_message(comm, peer, data)


class Receiver:
    """The messages of one sender, taken in the order it sends them (see :func:`send`)."""

    def __init__(self, comm: Comm, peer: int):
        self.comm, self.peer = comm, peer
        self.failed = False  # the sender sent FAILED: every later message is FAILED too
        self.error: CollectiveError | None = None  # the first message of a size not agreed

    def into(self, out: np.ndarray | memoryview, what: str) -> bool:
        """Receive the next message into ``out`` (contiguous, exactly the message's length;
        ``what``: its bytes, for messages). False when the sender failed, or when it sent
        another length (taken and dropped, the pair in step; :attr:`error` says so): ``out``
        then holds nothing of it. A failed connection raises."""
        status, length = wire.recv_header(self.comm, self.peer)
        if status == wire.FAILED:
            self.failed = True
            return False
        arr = np.frombuffer(out, dtype=np.uint8)  # the caller's bytes themselves
        if length != arr.nbytes:
            self._drop(length)
            self.error = self.error or CollectiveError(
                "transfer", {self.peer: f"sent {length} bytes where {arr.nbytes} were expected ({what})"}
            )
            return False
        if length:
            self.comm.recv_into(self.peer, arr)
        return True

    def skip(self) -> None:
        """Take the next message and drop its bytes."""
        status, length = wire.recv_header(self.comm, self.peer)
        self.failed = self.failed or status == wire.FAILED
        self._drop(length)

    def _drop(self, length: int) -> None:
        if length:
            self.comm.recv_into(self.peer, np.empty(length, np.uint8))
