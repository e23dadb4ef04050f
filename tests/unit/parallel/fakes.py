"""Fakes for the dist tests: a world of ranks as threads of one process, each with a real
:class:`~paddle_dcp.parallel.comm.Comm` whose primitives meet at a barrier, and point to point that
blocks until the message is taken (as gloo's does), so an order of pairs that could deadlock
fails with a timeout instead of passing."""
from __future__ import annotations

import queue
import threading

import numpy as np

from paddle_dcp.parallel.comm import Comm, Traffic
from paddle_dcp.parallel.requests import combine

TIMEOUT = 10.0


class ThreadWorld:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT)
        self.slots: list = [None] * size
        self.mail = {(a, b, lane): queue.Queue() for a in range(size) for b in range(size) if a != b for lane in range(2)}
        self.sent: list[tuple[int, int, int]] = []  # (sender, receiver, bytes), in order of sending
        self.lanes_used: set[int] = set()  # which of a pair's connections carried messages
        self.lock = threading.Lock()
        self.rounds: dict = {}  # (members, rank) -> reductions among members that rank began
        self.reductions: dict = {}  # (members, round) -> (barrier, rank -> its array)

    def everyone(self, rank: int, value):
        """Every rank posts ``value``; each gets all ranks' values, in rank order."""
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def run(self, fn) -> dict[int, object]:
        """``fn(comm)`` on every rank, each in its own thread; rank -> its value or exception."""
        results: dict[int, object] = {}

        def main(rank: int) -> None:
            try:
                results[rank] = fn(ThreadComm(self, rank))
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                results[rank] = exc

        threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * TIMEOUT)
            assert not t.is_alive(), "a rank is still waiting: deadlock"
        return results


class ThreadComm(Comm):
    lanes = 2

    def __init__(self, world: ThreadWorld, rank: int, coordinator: int = 0, lane: int = 0):
        self.world, self.rank = world, rank
        self.ranks = tuple(range(world.size))
        self.coordinator = coordinator
        self.traffic = Traffic()
        self.index = lane  # which of a pair's connections its messages travel on

    def lane(self, index):
        return ThreadComm(self.world, self.rank, self.coordinator, index)

    def _all_max(self, values):
        return [max(v) for v in zip(*self.world.everyone(self.rank, list(values)))]

    def _gather(self, buf, root):
        out = self.world.everyone(self.rank, np.array(buf, copy=True))
        return out if self.rank == root else None

    def _scatter(self, bufs, width, root):
        return np.array(self.world.everyone(self.rank, bufs)[root][self.rank], copy=True)

    def _broadcast(self, buf, root):
        return np.array(self.world.everyone(self.rank, np.array(buf, copy=True))[root], copy=True)

    def _all_gather(self, buf):
        return self.world.everyone(self.rank, np.array(buf, copy=True))

    def reduce_among(self, members, array, op):
        """As gloo's all-reduce among ``members``: each member's k-th reduction among the same
        members meets the others' k-th; all wait until every member came."""
        members = tuple(sorted(set(members)))
        if len(members) == 1:
            return
        world = self.world
        with world.lock:
            k = world.rounds[(members, self.rank)] = world.rounds.get((members, self.rank), -1) + 1
            barrier, parts = world.reductions.setdefault((members, k), (threading.Barrier(len(members), timeout=TIMEOUT), {}))
            parts[self.rank] = np.array(array, copy=True)
        barrier.wait()
        array[...] = combine([parts[m] for m in members], op)

    def send(self, peer, data):
        taken = threading.Event()
        with self.world.lock:
            self.world.sent.append((self.rank, peer, len(data)))
            self.world.lanes_used.add(self.index)
        self.world.mail[(self.rank, peer, self.index)].put((np.array(data, dtype=np.uint8, copy=True), taken))
        if not taken.wait(TIMEOUT):
            raise TimeoutError(f"rank {self.rank}: rank {peer} never took the message")

    def recv_into(self, peer, out):
        data, taken = self.world.mail[(peer, self.rank, self.index)].get(timeout=TIMEOUT)
        taken.set()
        assert len(data) == len(out), f"rank {self.rank} expected {len(out)} bytes from {peer}, got {len(data)}"
        out[...] = data
