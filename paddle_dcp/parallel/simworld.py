"""Every rank of a job in one process: the second driver of the save and load protocols, for
measuring them at scale (:mod:`paddle_dcp.tools.simulate`, ``python scripts/bench scale``). Each
rank's traffic is counted with the cost functions a real comm counts with
(:mod:`paddle_dcp.parallel.comm`)."""
from __future__ import annotations

import gc
import os
import sys
import time
from typing import Sequence

from .requests import Agree, AllGather, AllMax, Broadcast, Gather, Pairwise, ReduceAmong, Scatter, combine
from .comm import Traffic, cost_all_gather, cost_all_max, cost_gather, cost_scatter


class SimWorld:
    """Every rank of a job in one process, for measuring the protocols at scale.

    :meth:`run` advances all ranks' protocol generators in lockstep; each collective receives
    all ranks' requests at once, hands every rank the result the real collective would, and
    counts every rank's traffic with the same cost functions as a real comm. Agreements see no
    failure. A Pairwise (node-local) step runs each rank's function with no comm (None), then
    its agreement: a simulated rank's pairwise work moves no bytes between ranks (it may count
    the bytes a real one would send point to point).
    """

    def __init__(self, ranks: Sequence[int], coordinator: int):
        self.ranks = tuple(ranks)
        self.coordinator = coordinator
        self.traffic = {r: Traffic() for r in self.ranks}
        self.seconds: dict[int, float] = {r: 0.0 for r in self.ranks}
        # of ``seconds``, the time Python's cyclic collector ran: at thousands of simulated
        # ranks the process holds millions of objects, and a full collection (seconds) lands
        # in whichever step happens to allocate when it is due
        self.gc_seconds: dict[int, float] = {r: 0.0 for r in self.ranks}
        # of ``seconds``, the time the kernel worked for the process (page faults, mostly: on a
        # virtual machine whose host backs guest memory lazily, memory touched for the first
        # time costs seconds per GiB, a cost of the machine rather than of the steps)
        self.kernel_seconds: dict[int, float] = {r: 0.0 for r in self.ranks}
        # Python and C function calls made in each timed rank's steps (run(count_calls=True))
        self.calls: dict[int, int] = {r: 0 for r in self.ranks}
        self._timed: tuple[int, ...] = ()  # the ranks run() times
        # every collective run, in order: (its index, kind and step; the most bytes any rank but
        # the coordinator received in it; the coordinator's)
        self.log: list[tuple[str, int, int]] = []

    def run(self, protocols: dict[int, "object"], timed: Sequence[int] = (), count_calls: bool = False):
        """Drive ``protocols`` (rank -> generator) to the end; returns rank -> value. Ranks in
        ``timed`` have the time spent in their own steps added up in ``seconds``, the part of
        it the garbage collector took in ``gc_seconds`` and, with ``count_calls``, the
        function calls made in ``calls`` (a measure of work that does not depend on the
        machine; profiling slows the steps, so their seconds mean little then)."""
        results = {r: None for r in self.ranks}
        done: dict[int, object] = {}
        self._timed = tuple(timed)
        timing: list = [None, 0.0]  # the timed rank whose step runs, when the collector started

        def collector(phase: str, info: dict) -> None:
            if timing[0] is None:
                return
            if phase == "start":
                timing[1] = time.perf_counter()
            else:
                self.gc_seconds[timing[0]] += time.perf_counter() - timing[1]

        def profile(frame, event: str, arg) -> None:
            if timing[0] is not None and event in ("call", "c_call"):
                self.calls[timing[0]] += 1

        gc.callbacks.append(collector)
        if count_calls:
            sys.setprofile(profile)
        try:
            while len(done) < len(self.ranks):
                requests = self._step(protocols, results, done, timed, timing)
                if not requests:
                    break
                if done:
                    raise RuntimeError(f"ranks finished at different steps: {sorted(done)} done, {sorted(requests)} not")
                kinds = {type(q) for q in requests.values()}
                if len(kinds) != 1:
                    raise RuntimeError(f"ranks disagree on the next collective: {sorted(k.__name__ for k in kinds)}")
                results = self._logged(requests, kinds.pop())
        finally:
            if count_calls:
                sys.setprofile(None)
            gc.callbacks.remove(collector)
        return done

    def _logged(self, requests: dict, kind) -> dict:
        """Execute one collective and log it (``log``)."""
        before = {r: self.traffic[r].received for r in requests}
        results = self._execute(requests, kind)
        got = {r: self.traffic[r].received - before[r] for r in requests}
        first = next(iter(requests.values()))
        name = f"{len(self.log)} {kind.__name__}" + (f" {first.step}" if hasattr(first, "step") else "")
        self.log.append((name, max((n for r, n in got.items() if r != self.coordinator), default=0), got.get(self.coordinator, 0)))
        return results

    def _step(self, protocols, results, done, timed, timing) -> dict:
        """Advance every unfinished rank to its next collective; returns rank -> request."""
        requests = {}
        for r in self.ranks:
            if r in done:
                continue
            t0 = time.perf_counter() if r in timed else 0.0
            k0 = os.times().system if r in timed else 0.0
            timing[0] = r if r in timed else None
            try:
                requests[r] = protocols[r].send(results[r])
            except StopIteration as stop:
                done[r] = stop.value
            finally:
                timing[0] = None
            if r in timed:
                self.seconds[r] += time.perf_counter() - t0
                self.kernel_seconds[r] += os.times().system - k0
        return requests

    def _add(self, rank: int, cost: tuple[int, int]) -> None:
        self.traffic[rank].add(*cost)

    def _width(self, lengths: dict[int, int]) -> int:
        for r in lengths:
            self._add(r, cost_all_max(1, len(self.ranks)))
        return max(lengths.values())

    def _reduce(self, reductions: dict) -> None:
        """Every rank's reductions (rank -> its list): the k-th reduction among a set of members
        on each of them is one collective, its result written into each member's array. The
        bytes of these collectives are not counted (the planning traffic is)."""
        groups: dict = {}
        for r, mine in reductions.items():
            seen: dict = {}
            for red in mine:
                members = tuple(sorted(set(red.members)))
                k = seen[members] = seen.get(members, -1) + 1
                groups.setdefault((members, k), []).append((r, red))
        for (members, k), taking in groups.items():
            if sorted(r for r, _ in taking) != list(members):
                raise RuntimeError(f"reduction {k} among ranks {list(members)}: only {sorted(r for r, _ in taking)} took part")
            total = combine([red.array for _, red in taking], taking[0][1].collective_op)
            for _, red in taking:
                red.array[...] = total
                red.finish()

    def _execute(self, requests: dict, kind) -> dict:
        for r in requests:
            self.traffic[r].collectives += 1
        size = len(self.ranks)
        first = next(iter(requests.values()))
        if kind is Agree:
            for r, q in requests.items():
                if q.error is not None:
                    raise q.error
                self._add(r, cost_all_max(1 + len(q.values), size))
            out = [max(v) for v in zip(*(q.values for q in requests.values()))]
            return {r: list(out) for r in requests}
        if kind is Pairwise:  # each rank's function in turn, timed as its steps are; then its agreement
            out = {}
            for r, q in requests.items():
                t0 = time.perf_counter()
                out[r] = q.fn(None)
                if r in self._timed:
                    self.seconds[r] += time.perf_counter() - t0
                self._add(r, cost_all_max(1, size))
            return out
        if kind is ReduceAmong:  # the reductions of each group of members, then an agreement
            self._reduce({r: q.reductions for r, q in requests.items()})
            for r in requests:
                self._add(r, cost_all_max(1, size))
            return {r: None for r in requests}
        if kind is AllMax:
            out = [max(v) for v in zip(*(q.values for q in requests.values()))]
            for r, q in requests.items():
                self._add(r, cost_all_max(len(q.values), size))
            return {r: list(out) for r in requests}
        if kind is Gather:
            width = self._width({r: len(q.data) for r, q in requests.items()})
            for r in requests:
                self._add(r, cost_gather(width, size, r == first.root))
            gathered = [requests[r].data for r in self.ranks]
            return {r: (gathered if r == first.root else None) for r in requests}
        if kind is Scatter:
            parts = requests[first.root].parts
            width = self._width({r: (max(map(len, parts), default=0) if r == first.root else 0) for r in requests})
            for r in requests:
                self._add(r, cost_scatter(width, size, r == first.root))
            return {r: parts[i] for i, r in enumerate(self.ranks)}
        if kind is Broadcast:
            data = requests[first.root].data
            width = self._width({r: (len(data) if r == first.root else 0) for r in requests})
            for r in requests:
                self._add(r, cost_scatter(width, size, r == first.root))
            return {r: data for r in requests}
        if kind is AllGather:
            width = self._width({r: len(q.data) for r, q in requests.items()})
            for r in requests:
                self._add(r, cost_all_gather(width, size))
            everything = [requests[r].data for r in self.ranks]
            return {r: everything for r in requests}
        raise RuntimeError(f"{kind.__name__} is not simulated")
