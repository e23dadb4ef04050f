"""Every rank of a job in one process: the node-local tier's restore, run on layouts alone.

The restore of :meth:`paddle_dcp.tiers.LocalTier.restore` after a save of a job on some nodes,
into a job on other nodes (fewer, a new one, another mesh): the tier's open (the real
discovery of the nodes from each rank's marker, the steps on the nodes), its survey and checks
(``LocalTier._check``, the real generator on a real :class:`~paddle_dcp.tiers.LocalTier` per
rank), then its load (:func:`paddle_dcp.parallel.protocol.load` with each node's listing less
the files the check left out, every rank planning its reads and choosing its servers with the
real code). The collectives are :class:`~paddle_dcp.parallel.simworld.SimWorld`'s.

What is simulated: each node's directory is a listing (:class:`NodeFiles`: names and sizes;
the metadata's and the record's bytes are real); the check of the data files' bytes (hashing)
finds every file intact, so the lost node's files are the only ones missing; no data byte
moves (a rank's pairwise exchange is a no-op, its metadata from a helper is the real part the
helper would send, whose bytes are counted). Ranks that are not timed share the parsed metadata
of their node (each real rank parses its own).
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

from ..core import metafile
from ..core.job_layout import JobLayout
from ..core.metadata import Metadata
from ..core.metadata_parse import parse_metadata
from ..core.naming import metadata_name, parse_data_name
from ..core.replica_plan import copy_holders
from ..core.save_plan import SaveSummary
from ..io import file_check, storage
from ..parallel import loadwork, protocol, wire
from ..parallel.comm import Traffic
from ..parallel.ranks import helper_answer
from ..parallel.simworld import SimWorld
from ..tiers import RECORD, RECORD_FORMAT, RECORD_VERSION, LocalTier, _digest
from .simulate import RankLayout, NoWork, SimLoadRank, targets_of, wanted_of


class NodeFiles:
    """One node's local directory as the tier's restore lists and reads it: file names and
    sizes; the bytes of the small files (metadata, record) only. Nothing is written."""

    seen_by_all = False

    def __init__(self, node: int, sizes: Mapping[str, int], small: Mapping[str, bytes]):
        self.node, self.sizes, self.small = node, dict(sizes), dict(small)
        self.path = f"<node {node}>"

    def list_names(self, temporary: bool = True) -> list[str]:
        return sorted(self.sizes)

    def size(self, name: str) -> int | None:
        return self.sizes.get(name)

    def read_file(self, name: str, limit: int | None = None) -> bytes | None:
        return self.small.get(name)

    def resolve(self, name: str) -> str:
        return f"{self.path}/{name}"

    def create(self) -> None:
        pass

    def write_atomic(self, name: str, data: bytes, durable: bool = False) -> None:
        """A small file written (the tier's node markers): listed and read back."""
        self.sizes[name], self.small[name] = len(data), bytes(data)


def saved_nodes(metadata_json: bytes, nodes: Sequence[Sequence[int]], replicas: int,
                records: Sequence[JobLayout | None] | None = None) -> list[NodeFiles]:
    """Each node's local directory after a save of the tier: the metadata, every original of
    the node's ranks, the copies :func:`~paddle_dcp.core.replica_plan.copy_holders` places
    there, and the node's record of the step (``records[i]``: the layout node i records; None:
    no record)."""
    meta = parse_metadata(metadata_json, lazy=True)
    step = meta.unique_id
    size = {parse_data_name(f.name)[0]: (f.name, f.nbytes) for f in meta.files if parse_data_name(f.name)}
    holders = copy_holders(nodes, replicas, {w: n for w, (_, n) in size.items()})
    node_of = {r: i for i, n in enumerate(nodes) for r in n}
    held: list[dict[str, int]] = [{} for _ in nodes]
    for writer, (name, nbytes) in size.items():
        held[node_of[writer]][name] = nbytes
        for h in holders.get(writer, ()):
            held[node_of[h]][name] = nbytes
    digest = _digest(metadata_json)
    out = []
    for i, node in enumerate(nodes):
        small = {metadata_name(step): metadata_json}
        layout = records[i] if records is not None else None
        if layout is not None:
            entry = {"layout": layout.to_json(), "node": list(node), "digest": digest}
            small[RECORD] = json.dumps({"format": RECORD_FORMAT, "version": RECORD_VERSION, "steps": {str(step): entry}}).encode()
        files = dict(held[i], **{n: len(b) for n, b in small.items()})
        out.append(NodeFiles(i, files, small))
    return out


@dataclass(frozen=True)
class _SimComm:
    """What a LocalTier asks of its comm outside the collectives."""

    rank: int
    ranks: tuple[int, ...]
    coordinator: int

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator


class _SimTier(LocalTier):
    """A real LocalTier on a node's listing; a rank that is not timed takes its node's view
    of the step's files (the metadata parsed) from the first rank of the node that read it."""

    def __init__(self, comm: _SimComm, nodes, store: NodeFiles, replicas: int, timed: bool, memo: dict):
        super().__init__("<simulated node-local directory>", comm, replicas, max_to_keep=2)  # type: ignore[arg-type]
        self.store, self.nodes, self.timed, self.memo = store, nodes, timed, memo  # type: ignore[assignment]

    def _step_files(self, step: int):
        if self.timed:
            return super()._step_files(step)
        key = (self.store.node, step)
        if key not in self.memo:
            self.memo[key] = super()._step_files(step)
        return self.memo[key]


def _open_and_list(tier: LocalTier) -> protocol.Protocol:
    """What a restarted job's tier does before its restore checks a step: learn the nodes
    (each rank's marker, written into its node's listing), the steps complete on some node
    (:meth:`LocalTier.open`), then the steps a restore chooses from (:meth:`LocalTier.steps`).
    Returns (the nodes found, the newest step)."""
    nodes, _ = yield from tier._discover()
    yield from tier._complete_everywhere()
    steps = yield from tier._all_steps()
    return nodes, max(steps, default=-1)


@contextlib.contextmanager
def _every_file_intact() -> Iterator[None]:
    """The file checks' hashing skipped: every file a rank checks is intact."""
    real = file_check.check_files
    file_check.check_files = lambda store, meta, names=None, progress=None, **kw: {n: None for n in (names or ())}
    try:
        yield
    finally:
        file_check.check_files = real


class _NodeLoadRank(SimLoadRank):
    """A rank of the tier's load (node-local listings): every rank plans its reads for real,
    and the coordinator names their servers; only the coordinator reads its metadata (the
    others share the parsed file); a rank whose node has no metadata gets the part it needs
    from a helper."""

    def __init__(self, rank, ranks, coordinator, listing, metadata_json, shared, layout, wanted, read_bytes, starts,
                 p2p: dict, answers: dict, layouts: Mapping[int, RankLayout], parsed: dict):
        super().__init__(rank, ranks, coordinator, listing, metadata_json, shared, layout, parsed, False, wanted,
                         read_bytes, starts)
        self.p2p, self.answers, self.layouts = p2p, answers, layouts

    def read_metadata(self, view, uid: int) -> Metadata:
        return super().read_metadata(view, uid) if self.rank == self.coordinator else self.shared

    def plan(self, view, meta, uid, listing, every_target):
        """As :func:`paddle_dcp.parallel.loadwork.plan_work` plans: the reads, on the files
        this rank sees first, then split between this rank and the ranks that will serve it."""
        targets = targets_of(self.layout)
        meta.prefetch(t.key for t in targets)
        sources = loadwork.Sources(uid, frozenset(loadwork.visible_files(listing, uid)))
        ops = loadwork._plan_ops(meta, targets, list(range(len(targets))), self.path, sources)
        _, elsewhere = loadwork.split_ops(ops, meta, sources)
        return NoWork(ops, elsewhere, meta)

    def metadata_from_helpers(self, view, readers, meta):
        """The helpers as :func:`paddle_dcp.parallel.ranks.metadata_from_helpers` picks them;
        a helper's answer is the client's part of the file, read and encoded for real."""
        others = [r for r in self.ranks if r not in readers]
        helper_of = {r: readers[i % len(readers)] for i, r in enumerate(others)}

        def answer(client: int) -> bytes:  # the helper's real work: its part of the file read, or restricted
            if client not in self.answers:
                lay = self.layouts[client]
                summary = SaveSummary.from_pieces(client, lay.skeleton, lay.pieces)
                # every helper read what the coordinator did: its part of a large file, or all
                helper = self.parsed[self.coordinator] if self.in_parts(b"M" + self.metadata_json) is not None else self.shared
                view_ = memoryview(self.metadata_json)
                self.answers[client] = helper_answer(
                    helper, summary, False,
                    lambda uid, wanted: metafile.read_part(lambda rs: [view_[a:b] for a, b in rs], len(view_), wanted))
            return self.answers[client]

        def exchange(comm) -> Metadata:
            for client in (c for c, h in helper_of.items() if h == self.rank):
                answer(client)
            if self.rank not in helper_of:
                return meta
            reply = answer(self.rank)
            lay = self.layouts[self.rank]
            question = wire.encode_summary(SaveSummary.from_pieces(self.rank, lay.skeleton, lay.pieces))
            for r, sent, received in ((self.rank, len(question), len(reply)), (helper_of[self.rank], len(reply), len(question))):
                self.p2p.setdefault(r, Traffic()).add(sent, received)
            return parse_metadata(reply, source=f"part of the metadata sent by rank {helper_of[self.rank]}", allow_subset=True)

        return protocol.Pairwise("metadata from helpers", exchange)


@dataclass
class TierRestoreSim:
    """A simulated restore from the node-local tier.

    Attributes:
        traffic: every rank's planning traffic (collectives), the check's and the load's.
        p2p: the planning bytes that went point to point (metadata from helpers), per rank.
        coordinator_seconds: the coordinator's time in its steps: open, check and load.
        open_seconds / check_seconds / load_seconds: of it, in the tier's open and listing of
            its steps (nodes, steps on the nodes, steps), in the check (survey, record, checks)
            and in the load.
        excluded: per rank of the job, how many data files the check kept it from reading.
        remote_servers: per rank, how many ranks serve it bytes.
        plans: per rank, its load plan (its ops and servers), kept with ``keep_plans``.
        lost / why: as ``LocalTier._check`` returns them (the coordinator's); gone: the writers
            of the files it names as from lost nodes.
        log: every collective of the open, the check, then the load, as ``SimWorld.log`` has it.
    """

    traffic: dict[int, Traffic]
    p2p: dict[int, Traffic]
    coordinator_seconds: float
    open_seconds: float
    check_seconds: float
    load_seconds: float
    excluded: dict[int, int] = field(default_factory=dict)
    remote_servers: dict[int, int] = field(default_factory=dict)
    lost: tuple[int, ...] = ()
    gone: frozenset = frozenset()
    why: str = ""
    log: list = field(default_factory=list)
    plans: dict = field(default_factory=dict)


def simulate_tier_restore(
    metadata_json: bytes,
    dirs: Sequence[NodeFiles | None],
    nodes: Sequence[Sequence[int]],
    layouts: Mapping[int, RankLayout],
    replicas: int = 1,
    coordinator: int = 0,
    keep_plans: bool = False,
) -> TierRestoreSim:
    """Restore the step of ``metadata_json`` into the job of ``layouts`` on ``nodes`` (its
    ranks per node), node j's local directory ``dirs[j]`` (None: a new node, empty). Runs the
    tier's open (the ranks' markers are written into ``dirs``), the check, then the load, as
    :meth:`~paddle_dcp.tiers.LocalTier.restore` does; the step must be whole on the nodes (no
    global tier is simulated)."""
    ranks = tuple(sorted(layouts))
    nodes = tuple(tuple(sorted(n)) for n in nodes)
    stores = [d if d is not None else NodeFiles(-1 - j, {}, {}) for j, d in enumerate(dirs)]  # a new node: empty
    store_of = {r: stores[j] for j, n in enumerate(nodes) for r in n}
    step = parse_metadata(metadata_json, lazy=True).unique_id
    memo: dict = {}
    tiers = {r: _SimTier(_SimComm(r, ranks, coordinator), nodes, store_of[r], replicas, r == coordinator, memo) for r in ranks}
    opened = SimWorld(ranks, coordinator)
    found = opened.run({r: _open_and_list(tiers[r]) for r in ranks}, timed=(coordinator,))
    if found[coordinator] != (nodes, step):
        raise ValueError(f"the tier's open found nodes and newest step {found[coordinator]!r:.200}, not the job's")
    check = SimWorld(ranks, coordinator)
    with _every_file_intact():
        checked = check.run({r: tiers[r]._check(step) for r in ranks}, timed=(coordinator,))
    why, _, lost, _, _, gone = checked[coordinator]
    if lost:
        raise ValueError(f"the step is not whole on the nodes: {why}")

    shared = parse_metadata(metadata_json, lazy=True)
    p2p: dict[int, Traffic] = {}
    answers: dict[int, bytes] = {}
    parsed: dict[int, Metadata] = {}
    read_bytes: dict[int, int] = {}
    starts: dict = {}

    def side_of(r: int) -> protocol.LoadRankProtocol:
        exclude = checked[r][1]  # as LocalTier.restore's LoadOptions(exclude=...)
        listing = storage.listing_of(set(store_of[r].list_names()) - exclude)
        return _NodeLoadRank(r, ranks, coordinator, listing, metadata_json, shared, layouts[r], wanted_of(layouts[r]),
                             read_bytes, starts, p2p, answers, layouts, parsed)

    load = SimWorld(ranks, coordinator)
    results = load.run({r: protocol.load(side_of(r)) for r in ranks}, timed=(coordinator,))
    worlds = (opened, check, load)
    traffic = {r: Traffic(sum(w.traffic[r].sent for w in worlds), sum(w.traffic[r].received for w in worlds),
                          sum(w.traffic[r].collectives for w in worlds)) for r in ranks}
    return TierRestoreSim(
        traffic=traffic,
        p2p=p2p,
        coordinator_seconds=sum(w.seconds[coordinator] for w in worlds),
        open_seconds=opened.seconds[coordinator],
        check_seconds=check.seconds[coordinator],
        load_seconds=load.seconds[coordinator],
        excluded={r: len(checked[r][1]) for r in ranks},
        remote_servers={r: len(results[r][1].plan.remote) for r in ranks},
        lost=tuple(lost),
        gone=frozenset((parse_data_name(name) or (-1,))[0] for name in gone),  # the check names files
        why=why,
        log=[(f"{what} {n}", a, b) for what, w in zip(("open", "check", "load"), worlds) for n, a, b in w.log],
        plans={r: results[r][1].plan for r in ranks} if keep_plans else {},
    )
