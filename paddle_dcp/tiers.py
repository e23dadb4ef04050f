"""The node-local tier of a CheckpointManager: steps saved often to a directory each node has
for itself, each rank's data file copied to ranks of other nodes, and a restore that takes
every file from the nearest copy that verifies.

A local step is an ordinary checkpoint of id ``step`` in every node's local directory: each
rank writes its data file on its own node (:meth:`LocalTier.save_rank`; the CheckpointManager
runs the save with the tier's steps after it, :meth:`LocalTier.after_save`), then copies of
every data file go, under the same name, to ranks of ``replicas`` other nodes
(:mod:`paddle_dcp.core.replica_plan`, :mod:`paddle_dcp.parallel.replicate`), and only then does
every node get the metadata: a step whose metadata a node holds has every original and every
copy written. Which ranks share a node is learned at open: ranks that see each other's marker
files in the local directory (:meth:`LocalTier.open`).

A restore of a local step first checks, node by node, every data file it holds against the
metadata's checksums (:func:`paddle_dcp.io.file_check.check_files`, the node's ranks sharing the
work); the step is restorable when every data file has an intact copy on some node. The load
then reads nothing from a file found damaged (it is left out of that node's listing): the bytes
come from the node itself, else from a rank of another node that holds an intact copy (the
load's own transfer between ranks). Every byte it reads has just been checked, so the load
does not hash them again. None of this depends on the job that restores having the layout of
the one that saved: any number of ranks, on any nodes and meshes, restores a step, each rank
planning its reads from the metadata as any load does.

Each node keeps a record of the steps it saved (``paddle_dcp_tier.json``, written by its
first rank once its ranks' files are written, before the copies and the step's metadata, so a
node that gets the metadata only when a restarted job completes the step has it too): the
layout the step was saved on
(:class:`paddle_dcp.core.job_layout.JobLayout`) and which ranks' originals the node holds. A
restore reads it to report that layout and the files whose original node is gone
(:class:`RestoreReport`).
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field

import xxhash

from .core.compress import Policy
from .core.job_layout import JobLayout
from .core import metafile
from .core.replica_plan import check_replicas, copies_per_file, copies_warning, copy_holders, nodes_of
from .core.retention import Manifest, StepEntry, to_delete
from .core.tier_check import Survey, TierCheck
from .core.naming import metadata_name, parse_data_name
from .core.metadata_parse import parse_metadata
from .core.json_text import parse_json
from .errors import ArgumentError, DcpError, FormatError, IntegrityError
from .io import cleanup, is_url, open_storage, storage
from .io.file_transfer import copy_file
from .io.storage import Storage, metadata_from_bytes
from .parallel import protocol, wire
from .parallel.comm import Comm
from .parallel.options import LoadOptions, SaveOptions
from .parallel.ranks import LocalLoadRank, LocalSaveRank
from .parallel.replicate import copy_files

logger = logging.getLogger(__name__)

MARKER = "paddle_dcp_node.{rank}"  # a rank's marker file in the local directory
_MARKER_RE = re.compile(r"^paddle_dcp_node\.([0-9]+)\Z")
# what a crash while writing a marker or the record leaves (io.local's temporary names)
_TIER_TMP_RE = re.compile(r"^(?:paddle_dcp_node\.[0-9]+|paddle_dcp_tier\.json)\.tmp\.[0-9a-f]+\Z")
RECORD = "paddle_dcp_tier.json"  # a node's record of the local steps it published (docs/format.md)
RECORD_FORMAT, RECORD_VERSION = "paddle_dcp_tier", 1


@dataclass(frozen=True)
class RestoreReport:
    """What one rank's last restore did.

    Attributes:
        step: the step restored.
        tier: ``"local"`` or ``"global"``.
        bytes: bytes this rank took from each source: ``"local"`` (its own node's local
            directory), ``"peer"`` (a copy on another node, received from a rank there) and
            ``"global"`` (the global tier).
        refused: (source, step, reason) of every source tried before, newest first.
        saved_on: the layout the step was saved on: its number of ranks (the metadata's), and
            the meshes and nodes recorded with it (None when the step has no such record: saved
            by an older paddle_dcp, or, for nodes, without a local tier). The meshes are those
            of the state dict of the rank that recorded them (a node's first rank; the global
            tier's coordinator): the same on every rank unless ranks hold tensors of different
            meshes, as pipeline stages do.
        restored_into: this job's layout: its number of ranks, the meshes of the state dict
            restored into on this rank, and its nodes (None without a local tier).
        from_lost_nodes: the data files the step's record places on a node that no node of
            this job is (the node was lost or replaced), all taken from copies: on another
            node, or from the global tier (sorted; empty when no node was lost, or the step
            has no record).
    """

    step: int
    tier: str
    bytes: dict = field(default_factory=dict)
    refused: tuple[tuple[str, int, str], ...] = ()
    saved_on: JobLayout | None = None
    restored_into: JobLayout | None = None
    from_lost_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Restored:
    """What the restore of one step did on this rank, as far as the tier read it.

    Attributes:
        bytes: bytes by source, as :attr:`RestoreReport.bytes`.
        saved_on: the layout the step was saved on.
        from_lost_nodes: as :attr:`RestoreReport.from_lost_nodes`.
    """

    bytes: dict
    saved_on: JobLayout
    from_lost_nodes: tuple[str, ...] = ()


class LocalTier:
    """The local tier of one manager: its directory (the same path string on every rank, each
    node's own), the nodes, and the copies' placement. Every rank of the group calls its
    methods together."""

    def __init__(self, directory: str, comm: Comm, replicas: int, max_to_keep: int, durable: bool = False):
        if is_url(directory):
            raise ArgumentError(f"local_directory must be a path each node has for itself, not a URL: {directory}")
        check_replicas(replicas)  # refused before any rank waits for another
        self.directory, self.comm, self.replicas, self.max_to_keep = os.fspath(directory), comm, replicas, max_to_keep
        self.durable = durable
        self.store = open_storage(self.directory)
        self.nodes: tuple[tuple[int, ...], ...] = ((comm.rank,),)

    # ------------------------------------------------------------------ open
    def open(self) -> None:
        """Learn the nodes (every rank writes a marker holding a token of this job, then lists
        the markers it sees), warn when they cannot hold ``replicas`` copies (a job restarted
        on the nodes left: its saves keep as many as they can), and remove what crashed saves
        left (data of steps no node has the metadata of; temporary files) and the markers of
        earlier jobs."""
        self.nodes, stale = protocol.run(self.comm, self._discover())
        shortfall = copies_warning(self.replicas, len(self.nodes))
        if shortfall is not None:
            logger.warning("local tier %s: %s", self.directory, shortfall)
        logger.info("local tier %s: %d nodes %s, %d copies of each rank's data", self.directory,
                    len(self.nodes), [list(n) for n in self.nodes], copies_per_file(self.replicas, len(self.nodes)))
        steps = protocol.run(self.comm, self._complete_everywhere())

        def tidy() -> None:
            if self.is_leader:
                listing = storage.list_checkpoints(self.store)
                orphans = [n for uid in listing.data if uid not in steps for n in listing.data_names(uid)]
                orphans += listing.claim_names(lambda u, g: u not in steps)
                self.store.remove(orphans + cleanup.temporary_names(listing) + stale)

        protocol.run(self.comm, protocol.local("local tier: tidy", tidy))

    def _complete_everywhere(self) -> protocol.Protocol:
        """The local steps complete on some node; a node that holds data of such a step but
        not its metadata (a crash between two nodes' publishing: every copy was committed
        before the first) gets the metadata from a node that has it."""
        def look() -> bytes:
            listing = storage.list_checkpoints(self.store)
            return wire.encode_json({"complete": sorted(listing.complete), "data": sorted(listing.data)})

        def plan(blobs: list[bytes]) -> list[bytes]:
            by_rank = {r: wire.decode_json(b) for r, b in zip(self.comm.ranks, blobs)}
            steps = sorted({s for doc in by_rank.values() for s in doc["complete"]})
            todo = []  # (step, the rank whose node has its metadata, the first ranks of nodes lacking it)
            for step in steps:
                lacking = [n[0] for n in self.nodes if step not in by_rank[n[0]]["complete"] and step in by_rank[n[0]]["data"]]
                if lacking:
                    todo.append([step, min(r for r, doc in by_rank.items() if step in doc["complete"]), lacking])
            return [wire.encode_json({"steps": steps, "todo": todo})] * len(blobs)

        mine = yield from protocol.local("local tier: list steps", look)
        told = wire.decode_json((yield from self._tell("local tier: steps on the nodes", mine, plan)))
        for step, source, lacking in told["todo"]:
            data = yield from protocol.local(
                "local tier: read metadata", lambda: storage.metadata_bytes(self.store, step) if self.comm.rank == source else b""
            )
            data = yield protocol.Broadcast(data, source)

            def publish(step=step, data=data) -> None:
                if self.comm.rank in lacking:
                    storage.commit_metadata(self.store, step, data, self.durable)

            yield from protocol.local("local tier: publish", publish)
            logger.info("local tier %s: step %d's metadata written again on the nodes of ranks %s", self.directory, step, lacking)
        return frozenset(told["steps"])

    def _discover(self) -> protocol.Protocol:
        token = os.urandom(8).hex().encode() if self.comm.is_coordinator else b""
        token = yield protocol.Broadcast(token, self.comm.coordinator)

        def mark() -> None:
            self.store.create()
            self.store.write_atomic(MARKER.format(rank=self.comm.rank), token)

        yield from protocol.local("local tier: mark node", mark)

        stale: list[str] = []  # markers of earlier jobs and temporary files of crashed writes, removed by the node's leader at open

        def seen() -> bytes:
            ranks = []
            for name in storage.list_checkpoints(self.store).files:
                m = _MARKER_RE.match(name)
                if m and self.store.read_file(name) == token:
                    ranks.append(int(m.group(1)))
                elif m or _TIER_TMP_RE.match(name):
                    stale.append(name)
            return json.dumps(sorted(ranks)).encode()

        def nodes(blobs: list[bytes]) -> list[bytes]:
            try:
                found = {"nodes": wire.pack_nodes(nodes_of({r: json.loads(b) for r, b in zip(self.comm.ranks, blobs)}))}
            except ArgumentError as exc:  # raised on every rank, as it is
                found = {"error": str(exc)}
            return [wire.encode_json(found)] * len(blobs)

        mine = yield from protocol.local("local tier: find node", seen)
        told = wire.decode_json((yield from self._tell("local tier: nodes", mine, nodes)))
        if "error" in told:
            raise ArgumentError(told["error"])
        return wire.unpack_nodes(told["nodes"]), stale

    @property
    def node(self) -> tuple[int, ...]:
        return next(n for n in self.nodes if self.comm.rank in n)

    @property
    def is_leader(self) -> bool:
        """The rank that writes and removes what its node holds in common (the metadata)."""
        return self.comm.rank == self.node[0]

    def _all_steps(self) -> protocol.Protocol:
        """The local steps complete on some node (every rank gets the same set)."""
        def union(blobs: list[bytes]) -> list[bytes]:
            return [wire.encode_json(sorted({s for b in blobs for s in json.loads(b)}))] * len(blobs)

        mine = yield from protocol.local(
            "local tier: list steps", lambda: json.dumps(sorted(storage.list_checkpoints(self.store).complete)).encode()
        )
        return frozenset(wire.decode_json((yield from self._tell("local tier: steps", mine, union))))

    def steps(self, comm: Comm | None = None) -> frozenset:
        return protocol.run(comm or self.comm, self._all_steps())

    def whole_steps(self) -> frozenset:
        """The local steps every data file of which some node holds, of the metadata's size
        (whether their bytes verify is the restore's to find): each node's first rank looks."""
        return protocol.run(self.comm, self._whole_steps())

    def _whole_steps(self) -> protocol.Protocol:
        def look() -> bytes:
            found: dict[int, dict] = {}
            if not self.is_leader:
                return wire.encode_json(found)
            listing = storage.list_checkpoints(self.store, temporary=False)
            for step in sorted(listing.complete):
                try:
                    meta = storage.read_metadata(self.store, step, lazy=True)
                except Exception:  # noqa: BLE001 - unusable here: another node's may serve
                    continue
                writer = {f.name: ((parse_data_name(f.name) or (-1,))[0], f.nbytes) for f in meta.files}
                here = [writer[n][0] for n in listing.data_names(step) if n in writer and self.store.size(n) == writer[n][1]]
                found[step] = {"need": wire.rle(w for w, _ in writer.values()), "have": wire.rle(here)}
            return wire.encode_json(found)

        def whole(blobs: list[bytes]) -> list[bytes]:
            need: dict[int, set] = {}
            have: dict[int, set] = {}
            for doc in map(wire.decode_json, blobs):
                for step, d in doc.items():
                    need.setdefault(int(step), wire.from_runs(d["need"]))
                    have.setdefault(int(step), set()).update(wire.from_runs(d["have"]))
            return [wire.encode_json(sorted(s for s in need if need[s] <= have[s]))] * len(blobs)

        mine = yield from protocol.local("local tier: find whole steps", look)
        return frozenset(wire.decode_json((yield from self._tell("local tier: whole steps", mine, whole))))

    # ------------------------------------------------------------------ save
    def save_rank(self, step: int, state_dict: dict, staged: bool, compress: Policy | None = None) -> LocalSaveRank:
        """The rank that saves ``step`` to this node's local directory (the keys ``compress``
        names stored quantized; an async save when ``staged``); its metadata is published by
        :meth:`after_save`'s step, once the copies are in place."""
        return LocalSaveRank.of_process(
            self.comm, state_dict, self.store, step, SaveOptions(durable=self.durable, staged=staged, compress=compress)
        )

    def after_save(self, rank: LocalSaveRank, layout: JobLayout) -> tuple[protocol.Step, ...]:
        """The steps that follow the local save of ``rank`` (see
        :func:`paddle_dcp.parallel.protocol.save`): copies of every data file on ranks of
        other nodes, then ``layout`` recorded and the metadata on every node, last, then
        retention."""
        return (lambda result: self._replicate(rank, result, layout),)

    def _replicate(self, rank: LocalSaveRank, result: protocol.SaveResult, layout: JobLayout) -> protocol.Protocol:
        """The node's record of the step (``layout``), copies of every data file on ranks of
        other nodes, then the metadata on every node, last; then ``rank``'s older generations
        of the id, and the steps past ``max_to_keep``, removed."""
        comm = self.comm
        data = yield from protocol.local("commit", lambda: metafile.encode(result.built()) if comm.is_coordinator else b"")
        data = yield protocol.Broadcast(data, comm.coordinator)
        def plan() -> tuple[dict[int, str], dict[int, str]]:
            if self.is_leader:  # before any copy: a node whose metadata comes later (_complete_everywhere) has it too
                self._record(result.unique_id, layout, _digest(data))
            return self._copies(comm.rank, data)

        sends, receives = yield from protocol.local("local tier: record, plan copies", plan)
        writers = yield protocol.Pairwise("local tier: copy", lambda c: copy_files(c, self.store, sends, receives))
        try:
            yield from protocol.local("local tier: commit copies", lambda: [w.commit(self.durable) for w in writers])
        except BaseException:
            for w in writers:
                w.abort()
            raise

        def publish() -> None:
            if self.is_leader:
                storage.commit_metadata(self.store, result.unique_id, data, self.durable)

        yield from protocol.local("local tier: publish", publish)
        yield from protocol.tidy(rank, result)
        yield from self._retain(keep=result.unique_id)

    def _record(self, step: int, layout: JobLayout, digest: int) -> None:
        """Record, in this node's RECORD, ``step``'s layout, this node's ranks (whose originals
        it holds) and ``digest`` (of the metadata it goes with); the entries of steps whose
        metadata the node no longer holds are dropped."""
        complete = storage.list_checkpoints(self.store, temporary=False).complete
        steps = {s: e for s, e in self._records().items() if s in complete and s != step}
        steps[step] = {"layout": layout.to_json(), "node": list(self.node), "digest": digest}
        doc = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "steps": {str(s): steps[s] for s in sorted(steps)}}
        self.store.write_atomic(RECORD, json.dumps(doc).encode(), self.durable)

    def _records(self) -> dict[int, dict]:
        """step -> this node's record of it (none when the node has no readable RECORD: a
        record is what a restore reports, never what it needs)."""
        try:
            data = self.store.read_file(RECORD)
            if data is None:
                return {}
            doc = parse_json(data, self.store.resolve(RECORD), "the local tier's record")
            if not isinstance(doc, dict) or (doc.get("format"), doc.get("version")) != (RECORD_FORMAT, RECORD_VERSION):
                raise FormatError(f"{self.store.resolve(RECORD)}: not a record of version {RECORD_VERSION}")
            steps = {}
            for s, e in doc["steps"].items():
                JobLayout.from_json(e["layout"], self.store.resolve(RECORD))  # checked: it goes into reports
                if not (isinstance(e["node"], list) and all(type(r) is int for r in e["node"]) and type(e["digest"]) is int):
                    raise FormatError(f"{self.store.resolve(RECORD)}: bad entry of step {s}")
                steps[int(s)] = e
            return steps
        except (DcpError, KeyError, TypeError, ValueError, AttributeError) as exc:
            logger.warning("local tier %s: its record of steps is unreadable, not used: %s", self.directory, exc)
            return {}

    def _copies(self, me: int, data: bytes) -> tuple[dict[int, str], dict[int, str]]:
        """(holder -> this rank's file to send it, writer -> the file to receive from it)."""
        view = memoryview(data)  # the files alone: the head and one section of it
        start = metafile.read_start(lambda ranges: [view[a:b] for a, b in ranges], len(data), "the local step's metadata")
        files = {}
        for f in start.files:
            parsed = parse_data_name(f.name)
            if parsed is not None:
                files[parsed[0]] = (f.name, f.nbytes)
        holders = copy_holders(self.nodes, self.replicas, {r: n for r, (_, n) in files.items()})
        sends = {h: files[me][0] for h in holders.get(me, ())} if me in files else {}
        receives = {r: files[r][0] for r, hs in holders.items() if me in hs and r in files}
        return sends, receives

    def _retain(self, keep: int) -> protocol.Protocol:
        """Keep the ``max_to_keep`` newest local steps (``keep`` among them), chosen as the
        manager's retention chooses (:func:`paddle_dcp.core.retention.to_delete`): the
        metadata of the others goes first on every node, then their files."""
        steps = yield from self._all_steps()
        held = Manifest({s: StepEntry(s, "complete") for s in steps})
        doomed = to_delete(held, self.max_to_keep, protected=(keep,))
        if not doomed:
            return

        def forget() -> None:
            if self.is_leader:
                self.store.remove([metadata_name(s) for s in doomed])

        def remove() -> None:
            if self.is_leader:
                cleanup.remove_steps(self.store, doomed)

        yield from protocol.local("local tier: retention, metadata", forget)
        yield from protocol.local("local tier: retention, data", remove)
        logger.info("local tier %s: deleted steps %s", self.directory, doomed)

    def upload_step(self, step: int, target: Storage, durable: bool = False) -> protocol.Step:
        """The step that copies local ``step`` to the global tier ``target`` (after
        :meth:`after_save`'s): every rank copies its own data file, then the coordinator
        writes the metadata, last."""
        return lambda result: self._upload(self.comm, step, target, durable)

    def _upload(self, comm: Comm, step: int, target: Storage, durable: bool) -> protocol.Protocol:
        def prepare() -> None:  # what a crashed copy left, removed before any rank writes
            target.create()
            if not target.seen_by_all:
                target.remove(cleanup.temporary_names(storage.list_checkpoints(target), step, comm.rank))
            elif comm.is_coordinator:  # one listing for every rank's
                target.remove(cleanup.temporary_names(storage.list_checkpoints(target), step))

        yield from protocol.local("global tier: prepare", prepare)

        def copy() -> bytes:  # the metadata read once: parsed here, committed as it is by publish
            data = storage.metadata_bytes(self.store, step)
            meta = metadata_from_bytes(data, step, self.store.resolve(metadata_name(step)), lazy=True)
            for f in meta.files:
                if (parse_data_name(f.name) or (-1,))[0] == comm.rank:
                    copy_file(self.store, target, f.name, durable)
            return data

        data = yield from protocol.local("global tier: copy the local step", copy)

        def publish() -> None:
            if comm.is_coordinator:
                storage.commit_metadata(target, step, data, durable)

        yield from protocol.local("global tier: publish", publish)

    # ------------------------------------------------------------------ restore
    def restore(self, state_dict: dict, step: int, fallback: Storage | None = None) -> tuple[Restored | None, str]:
        """Load local ``step`` into ``state_dict`` (whatever the ranks, nodes and meshes of
        the job that saved it), each file from the nearest intact copy: its own node, another
        node, else (when no node has one) the global tier ``fallback`` holding the same step,
        from which a rank of this job copies it back into its node first (the file's writer
        when it is one). Returns (what it did, "") or (None, why the step cannot be restored
        from this tier), the same on every rank."""
        why, exclude, lost, digest, recorded, lost_files = protocol.run(self.comm, self._check(step))
        repaired: dict[int, list] = {}
        if lost:
            if fallback is None:
                return None, why
            repaired = protocol.run(self.comm, self._repair(step, lost, digest, fallback))
            exclude = exclude - {name for r, got in repaired.items() if r in self.node for name, _ in got}
        # every byte it reads was checked just now, by its own node's ranks or the serving
        # node's: the load does not hash them a second time
        options = LoadOptions(verify=False, exclude=frozenset(exclude))
        rank = LocalLoadRank(self.comm, state_dict, self.directory, self.store, step, options)
        _, work = rank.run()
        meta = work.plan.meta
        nbytes = {
            "local": sum(op.nbytes for op in work.plan.local),
            "peer": sum(op.nbytes for ops in work.plan.remote.values() for op in ops),
            "global": sum(n for _, n in repaired.get(self.comm.rank, ())),
        }
        saved_on = JobLayout(meta.world_size) if recorded is None else recorded
        return Restored(nbytes, saved_on, lost_files), ""

    def _check(self, step: int) -> protocol.Protocol:
        """The step's files checked, node by node (its ranks share them). First every node
        says which originals (the files of its own ranks) it holds at their size; then each
        checks, in one pass, its originals and its copies of the writers whose original no
        node holds; only for a writer whose original failed its check are that writer's
        copies checked after. Returns (why the step is not whole on the nodes, or ""; the
        files this rank must not read: damaged ones and copies left unchecked; the writers
        whose file has no intact copy on any node; the digest of the nodes' metadata; the
        layout the step's record holds, or None; the data files of writers whose node no
        node of this job is, by the records). Each pass's findings go to the coordinator
        (:class:`~paddle_dcp.core.tier_check.TierCheck`), which answers each rank with a few
        runs of ranks and the names its node must not read."""
        found, copies, mine = yield from protocol.local(f"local tier: look at step {step}", lambda: self._survey(step))
        book = TierCheck(self.nodes) if self.comm.is_coordinator else None

        def survey(blobs: list[bytes]) -> list[bytes]:
            return self._answers(*book.survey(self.comm.ranks, [_decode_survey(b) for b in blobs]))

        told = yield from self._ask(f"local tier: survey of step {step}", _encode_survey(found), survey)
        bad = set(told["bad"])
        if not told["known"]:
            return f"no node holds an intact {metadata_name(step)}", frozenset(bad), (), 0, None, ()
        digest = told["digest"]
        saved_on, gone = yield from self._saved_on(told, mine)
        writers, originals, usable = wire.from_runs(told["absent"]), True, set()
        while True:
            what = f"local tier: check step {step}" if originals else f"local tier: check copies of step {step}"
            doc, ok = yield from protocol.local(what, lambda: self._check_files(step, writers, originals))

            def checked(blobs: list[bytes], originals: bool = originals) -> list[bytes]:
                docs = [wire.decode_json(b) for b in blobs]
                good = [frozenset(wire.from_runs(d["good"])) for d in docs]
                return self._answers(*book.checked(self.comm.ranks, good, [d["bad"] for d in docs], originals))

            told = yield from self._ask(what + ": findings", wire.encode_json(doc), checked)
            bad |= set(told["bad"])
            usable |= ok
            if told["next"] is None:
                break
            writers, originals = wire.from_runs(told["next"]), False
        lost = wire.from_runs(told["lost"])
        why = f"no intact copy of the data files of ranks {wire.rle(lost)} on any node" if lost else ""
        return why, frozenset(bad | (copies - usable)), tuple(sorted(lost)), digest, saved_on, gone

    def _ask(self, step: str, data: bytes, answer) -> protocol.Protocol:
        """``data`` of every rank to the coordinator, which answers (``answer``, its parts);
        returns this rank's part, decoded."""
        return wire.decode_json((yield from self._tell(step, data, answer)))

    def _tell(self, step: str, data: bytes, answer) -> protocol.Protocol:
        """The same, this rank's part as bytes."""
        return (yield from protocol.ask_coordinator(self.comm.rank, self.comm.coordinator, step, data, answer))

    def _answers(self, common: dict, per_node: list[dict]) -> list[bytes]:
        """Each rank's answer: ``common`` and its node's part, encoded once a node (sets of
        ranks as runs)."""
        shared = {k: wire.rle(v) if isinstance(v, (set, frozenset)) else v for k, v in common.items()}
        blobs = [wire.encode_json(dict(shared, **part)) for part in per_node]
        node = {r: i for i, n in enumerate(self.nodes) for r in n}
        return [blobs[node[r]] for r in self.comm.ranks]

    def _saved_on(self, told: dict, mine: dict | None) -> protocol.Protocol:
        """(the layout the step's record holds, or None when no node has a record of it; the
        data files of the writers the coordinator found no record placing on a node of this
        job (``told["gone"]``): their node is gone, or () without records), broadcast from the
        first rank whose node has a record (``told["holder"]``): it holds the whole metadata,
        which a rank of a new node may not (a load sends it only the part it reads)."""
        holder = told["holder"]
        if holder is None:
            return None, ()

        def say() -> bytes:
            if self.comm.rank != holder:
                return b""
            layout = JobLayout.from_json(mine["layout"], RECORD)
            names = mine["names"]
            return wire.encode_json({"layout": wire.encode_layout(layout),
                                     "lost": wire.pack_names(sorted(names[w] for w in wire.from_runs(told["gone"])))})

        said = yield from protocol.local("local tier: the step's record", say)
        doc = wire.decode_json((yield protocol.Broadcast(said, holder)))
        return wire.decode_layout(doc["layout"]), tuple(wire.unpack_names(doc["lost"]))

    def _repair(self, step: int, lost: tuple[int, ...], digest: int, fallback: Storage) -> protocol.Protocol:
        """The ``lost`` files copied from the global tier's same step (the same metadata,
        ``digest``) into a node, checked, each by its writer when that is a rank of this job,
        else by the rank its writer's number picks (a job with fewer ranks than the saving
        one); returns rank -> [(name, bytes)] of the files each rank of this rank's node
        copied."""
        from .io.file_check import check_files

        ranks = self.comm.ranks
        mine = [w for w in lost if (w if w in ranks else ranks[w % len(ranks)]) == self.comm.rank]

        def fetch() -> bytes:
            if not mine:
                return b""
            data = storage.metadata_bytes(fallback, step)
            if _digest(data) != digest:
                raise IntegrityError(f"step {step} of the global tier is another save than the local tier's")
            meta = parse_metadata(data, source=fallback.resolve(metadata_name(step)), lazy=True)
            names = [f.name for f in meta.files if (parse_data_name(f.name) or (-1,))[0] in mine]
            got = [(name, copy_file(fallback, self.store, name)) for name in names]
            problems = {n: p for n, p in check_files(self.store, meta, names).items() if p is not None}
            if problems:
                self.store.remove(sorted(problems))
                raise IntegrityError(f"the global tier's copy fails its check too: {'; '.join(problems.values())}")
            return json.dumps(got).encode()

        def by_node(blobs: list[bytes]) -> list[bytes]:  # each rank learns what its node's ranks copied
            parts = [{str(r): json.loads(b) for r, b in zip(self.comm.ranks, blobs) if b and r in node} for node in self.nodes]
            return self._answers({}, [{"got": p} for p in parts])

        done = yield from protocol.local("local tier: files from the global tier", fetch)
        told = yield from self._ask("local tier: files copied on each node", done, by_node)
        return {int(r): [tuple(x) for x in got] for r, got in told["got"].items()}

    def _step_files(self, step: int):
        """(the node's metadata of ``step`` and its bytes, writer of each data file, the
        step's data files on this node) or None when the node has no usable metadata (then
        also the names to keep away from)."""
        listing = storage.list_checkpoints(self.store, temporary=False)
        if step not in listing.complete:
            return None, []
        try:  # read once: parsed, and fingerprinted by the survey
            data = storage.metadata_bytes(self.store, step)
            meta = metadata_from_bytes(data, step, self.store.resolve(metadata_name(step)), lazy=True)
            meta.check_digest()
        except Exception as exc:  # noqa: BLE001 - a damaged metadata file: another node's serves
            logger.warning("local tier %s: %s unusable on this node: %s", self.directory, metadata_name(step), exc)
            return None, [metadata_name(step)] + listing.data_names(step)
        writer = {f.name: (parse_data_name(f.name) or (-1,))[0] for f in meta.files}
        return (meta, data, writer, sorted(n for n in listing.data_names(step) if n in writer)), []

    def _survey(self, step: int) -> tuple[Survey, set, dict | None]:
        """What this node holds of ``step``, before any byte is hashed: its
        :class:`~paddle_dcp.core.tier_check.Survey` (the node's first rank alone says what the
        node's record of this metadata places here), the names of the copies here, and with a
        record: {"layout": the layout it holds, "names": each writer's data file}."""
        found, bad = self._step_files(step)
        if found is None:
            return Survey(False, bad=tuple(bad)), set(), None
        meta, data, writer, present = found
        size = {f.name: f.nbytes for f in meta.files}
        here = [writer[n] for n in present if writer[n] in self.node and self.store.size(n) == size[n]]
        copies = {n for n in present if writer[n] not in self.node}
        digest = _digest(data)
        record = self._records().get(step) if self.is_leader else None
        if record is not None and record.get("digest") != digest:
            record = None  # a record of another save of this step
        survey = Survey(True, frozenset(writer.values()), frozenset(here), (), digest,
                        None if record is None else frozenset(record["node"]))
        if record is None:
            return survey, copies, None
        names = {w: n for n, w in writer.items()}  # to name the files of lost nodes, if this rank says
        return survey, copies, {"layout": record["layout"], "names": names}

    def _check_files(self, step: int, writers: set, originals: bool) -> tuple[dict, set]:
        """This rank's share of its node's check of ``step``: the originals (with
        ``originals``) and the copies it holds of ``writers``' files, on as many threads as
        the node's ranks leave cores. Returns ({"good": writers whose file this rank found
        intact (runs), "bad": names of files it found damaged or unusable}, the names of the
        copies its node checks in this pass, found intact by this rank or a node-mate's
        share, so as readable)."""
        from .io.file_check import check_files

        found, bad = self._step_files(step)
        if found is None:
            return {"good": [], "bad": bad}, set()
        meta, _, writer, present = found
        names = [n for n in present if (originals and writer[n] in self.node) or (writer[n] not in self.node and writer[n] in writers)]
        mine = names[self.node.index(self.comm.rank):: len(self.node)]
        workers = max(1, (os.cpu_count() or 1) // len(self.node))
        result = check_files(self.store, meta, mine, workers=workers)
        failed = sorted(n for n, why in result.items() if why is not None)
        for n in failed:
            logger.warning("local tier %s: %s", self.directory, result[n])
        doc = {"good": wire.rle(writer[n] for n in mine if n not in failed), "bad": failed}
        return doc, {n for n in names if writer[n] not in self.node} - set(failed)


def _encode_survey(s: Survey) -> bytes:
    """A survey as it goes to the coordinator: sets of writers as runs."""
    return wire.encode_json({"meta": s.meta, "need": wire.rle(s.need), "good": wire.rle(s.good), "bad": list(s.bad),
                             "digest": s.digest, "recorded": None if s.recorded is None else wire.rle(s.recorded)})


def _decode_survey(blob: bytes) -> Survey:
    d = wire.decode_json(blob)
    recorded = None if d["recorded"] is None else frozenset(wire.from_runs(d["recorded"]))
    return Survey(d["meta"], frozenset(wire.from_runs(d["need"])), frozenset(wire.from_runs(d["good"])),
                  tuple(d["bad"]), d["digest"], recorded)


def _digest(data: bytes) -> int:
    """A metadata file's fingerprint (fits a JSON number and an int64)."""
    return xxhash.xxh3_64_intdigest(data) >> 1
