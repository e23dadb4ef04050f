"""The coordinator's side of the node-local tier's check of one step: what each node's ranks
found, and what each rank is told in return (:meth:`paddle_dcp.tiers.LocalTier._check` gathers
the findings; every rank receives only its own answer, a few runs of ranks and the names its
node must not read, however many ranks the job has).

The check runs in passes. The survey: each rank says whether its node holds an intact metadata
file, which writers' files the step has (``need``), which originals its node holds at their
size (``good``), what it must keep away from (``bad``), and, on a node's first rank, which
writers' originals the node's record places there (``recorded``). Then passes of hashing: the
originals and the copies of writers no original is left of (``absent``), then, only for
originals found damaged, their copies; each pass says which writers' files a rank found intact
and which names it found damaged. Pure: sets of ints and names in, dicts out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Survey:
    """One rank's survey of the step on its node.

    Attributes:
        meta: its node holds the step's metadata, intact.
        need: the writers of the step's data files (by the metadata; empty without it).
        good: the writers whose original its node holds at its size.
        bad: names its node must not read (a damaged metadata's step).
        digest: the metadata's fingerprint (0 without it).
        recorded: the writers whose originals its node's record places there (None: no record
            of this metadata, or not the node's first rank).
    """

    meta: bool
    need: frozenset = frozenset()
    good: frozenset = frozenset()
    bad: tuple[str, ...] = ()
    digest: int = 0
    recorded: frozenset | None = None


@dataclass
class TierCheck:
    """What the coordinator knows of the check so far (one per check, on the coordinator).

    Attributes:
        nodes: the ranks of each node.
        need / absent / lost: the step's writers; those no node holds the original of; those
            no pass has yet found an intact file of.
        bad: per node, the names its ranks must not read.
    """

    nodes: Sequence[Sequence[int]]
    need: set = field(default_factory=set)
    absent: set = field(default_factory=set)
    lost: set = field(default_factory=set)
    bad: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bad = [set() for _ in self.nodes]
        self._node_of = {r: i for i, node in enumerate(self.nodes) for r in node}

    def survey(self, ranks: Sequence[int], found: Sequence[Survey]) -> tuple[dict, list[dict]]:
        """The answer common to every rank and each node's, from every rank's survey (in
        ``ranks`` order). Common: ``known`` (some node holds the metadata), and with it its
        ``digest``, the ``absent`` writers, the ``holder`` (the first rank whose node has a
        record of the step, or None) and ``gone`` (the writers no record places on a node of
        this job). Per node: ``bad``."""
        self._take_bad(ranks, (s.bad for s in found))
        known = next((s for s in found if s.meta), None)
        per_node = [{"bad": sorted(b)} for b in self.bad]
        if known is None:
            return {"known": False}, per_node
        self.need = set(known.need)
        self.absent = self.need - set().union(*(s.good for s in found))
        self.lost = set(self.need)
        holder = next((r for r, s in zip(ranks, found) if s.recorded is not None), None)
        present = set().union(*(s.recorded for s in found if s.recorded is not None))
        gone = self.need - present if holder is not None else set()
        return {"known": True, "digest": known.digest, "absent": self.absent, "holder": holder, "gone": gone}, per_node

    def checked(self, ranks: Sequence[int], good: Sequence[frozenset], bad: Sequence[Sequence[str]],
                originals: bool) -> tuple[dict, list[dict]]:
        """The answer after a pass of hashing (every rank's intact writers and damaged names):
        common, ``next``: the writers whose copies the next pass checks (their originals
        failed), or None when the check is done, then with ``lost``: the writers without an
        intact file on any node; per node, the names it must not read found in this pass."""
        before = [set(b) for b in self.bad]
        self._take_bad(ranks, bad)
        self.lost -= set().union(*good)
        failed = self.lost - self.absent
        common: dict = {"next": failed if originals and failed else None}
        if common["next"] is None:
            common["lost"] = self.lost
        return common, [{"bad": sorted(now - was)} for now, was in zip(self.bad, before)]

    def _take_bad(self, ranks: Sequence[int], bad: Iterable[Sequence[str]]) -> None:
        for r, names in zip(ranks, bad):
            self.bad[self._node_of[r]].update(names)
