"""Which rank reads for another the data files that rank cannot read itself (node-local disks,
a node's damaged or missing files): the coordinator alone holds every rank's list of the files
it sees (gathered once, :func:`paddle_dcp.parallel.protocol.load`); each rank that needs a file
it cannot see asks it for the file (:func:`asking`), and each rank receives only its own answer
(:func:`assign`): the server of each file it asked for, and the ranks it serves.

A file is named by (generation, writer) as its data name says; the lists and the questions
hold writers as runs of ranks, so a node's files stay a few bytes whatever the job's size.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..core.naming import parse_data_name
from . import wire


def file_key(name: str) -> tuple[int, int] | None:
    """(generation, writer) of a data file's ``name``; None when it is not a data file's."""
    parsed = parse_data_name(name)
    return None if parsed is None else (parsed[2], parsed[0])


def asking(names: Iterable[str], near: Iterable[int]) -> bytes:
    """A rank's question to the coordinator: the data files ``names`` it cannot read, and the
    ranks it prefers to take them from (``near``)."""
    by_gen: dict[int, list[int]] = {}
    for key in filter(None, map(file_key, names)):
        by_gen.setdefault(key[0], []).append(key[1])
    return wire.encode_json({"f": {str(g): wire.rle(w) for g, w in sorted(by_gen.items())}, "near": wire.rle(near)})


@dataclass(frozen=True)
class Answer:
    """What the coordinator tells one rank.

    Attributes:
        servers: (generation, writer) -> the rank that reads that file for this one, for
            every file it asked for that some other rank can read.
        clients: the ranks this one reads files for.
    """

    servers: dict = field(default_factory=dict)
    clients: tuple[int, ...] = ()


def assign(ranks: Sequence[int], lists: Sequence[dict] | None, asks: Sequence[bytes]) -> list[bytes]:
    """Each rank's answer (in ``ranks`` order) to its question ``asks[i]``, from every rank's
    list of the files it sees (``lists[i]``: generation -> runs of writers; None when every
    rank sees the same files: then no rank can read one another cannot). A file's server is
    one of the other ranks that list it, one of the asker's ``near`` ranks when some are, the
    same for every file those ranks hold alike, spread by the asker's rank."""
    questions = [wire.decode_json(b) for b in asks]
    wanted: dict[int, set[int]] = {}
    for q in questions:
        for g, runs in q["f"].items():
            wanted.setdefault(int(g), set()).update(wire.from_runs(runs))
    holders = _holders(ranks, lists or [], {g: sorted(w) for g, w in wanted.items()})
    served: list[dict] = [{} for _ in ranks]
    clients: list[list[int]] = [[] for _ in ranks]
    index = {r: i for i, r in enumerate(ranks)}
    for i, (client, q) in enumerate(zip(ranks, questions)):
        near = wire.from_runs(q["near"])
        for g, runs in q["f"].items():
            for w in wire.from_runs(runs):
                able = [r for r in holders.get((int(g), w), ()) if r != client]
                if not able:
                    continue
                able = [r for r in able if r in near] or able
                server = able[client % len(able)]
                served[i].setdefault((server, int(g)), []).append(w)
                if not clients[index[server]] or clients[index[server]][-1] != client:
                    clients[index[server]].append(client)
    return [
        wire.encode_json({"from": [[s, g, wire.rle(ws)] for (s, g), ws in sorted(mine.items())],
                          "clients": wire.rle(mine_clients)})
        for mine, mine_clients in zip(served, clients)
    ]


def _holders(ranks: Sequence[int], lists: Sequence[dict], wanted: dict[int, list[int]]) -> dict:
    """(generation, writer) -> the ranks whose list holds that file, in rank order, for the
    files ``wanted`` (generation -> sorted writers)."""
    out: dict[tuple[int, int], list[int]] = {}
    for r, files in zip(ranks, lists):
        for g, runs in files.items():
            writers = wanted.get(int(g))
            if not writers:
                continue
            for first, last in runs:
                for w in writers[bisect.bisect_left(writers, int(first)):bisect.bisect_right(writers, int(last))]:
                    out.setdefault((int(g), w), []).append(r)
    return out


def answered(blob: bytes) -> Answer:
    """The :class:`Answer` of :func:`assign`'s part for this rank."""
    doc = wire.decode_json(blob, "the coordinator's answer of servers")
    mine = {(int(g), w): int(s) for s, g, runs in doc["from"] for w in wire.from_runs(runs)}
    return Answer(mine, tuple(sorted(wire.from_runs(doc["clients"]))))
