"""The save and load protocols: every rank's sequence of local steps and collectives.

A protocol is a generator run by one rank. It yields requests (a collective, an agreement
after a local step, or a pairwise exchange, see :mod:`paddle_dcp.parallel.requests`) and receives
their results; it never touches paddle, files or other ranks itself: the rank, an object
implementing :class:`SaveRankProtocol` / :class:`LoadRankProtocol`, does the local work
(:mod:`paddle_dcp.parallel.ranks` holds a real rank's).

Two drivers run these same generators:
  * :func:`run` for a real rank, executing each request on a :class:`~paddle_dcp.parallel.comm.Comm`;
  * :func:`paddle_dcp.parallel.simworld.SimWorld.run` for every rank of a job in one process, advancing all
    generators in lockstep, so that a simulation of thousands of ranks executes the very steps
    and messages of a real save or load (``python scripts/bench scale``).

Every local step ends with an agreement (``Agree``): when it failed on any rank, every rank
raises the same CollectiveError, so no rank is left waiting in the next collective.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Mapping, Protocol as _Protocol, Sequence

import numpy as np
import xxhash

from . import servers, wire
from .requests import (  # noqa: F401 - protocol.Gather...
    Agree, AllGather, AllMax, Broadcast, Detach, Gather, Pairwise, ReduceAmong, Reduction, Scatter,
)
from ..core import load_plan, metafile, nested, save_plan
from ..core.boxes import Box
from ..core.compress import Policy
from ..errors import FormatError, StorageError
from ..core.metadata import Metadata

logger = logging.getLogger(__name__)


Protocol = Generator[Any, Any, Any]


def quiet_collector(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with Python's cyclic garbage collector paused: the coordinator's planning
    and commit make millions of short-lived objects (a job of a hundred thousand tensors), which
    would wake the collector again and again to traverse everything alive (at 8192 ranks it
    took more time than the planning itself). Nothing they make is a cycle to collect."""
    if not gc.isenabled():
        return fn(*args)
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()


def local(step: str, fn: Callable[[], Any], detach: bool = False, star: bool = False) -> Protocol:
    """A local step followed by its agreement; returns ``fn()``'s value. With ``detach``, a
    Detach comes between the step and its agreement: the caller of an async save returns as
    soon as its own step is done, and a failure anywhere is agreed on in the background. With
    ``star``, the agreement goes point to point through the coordinator (ranks that may
    finish far apart; see :mod:`paddle_dcp.parallel.agree`)."""
    value, _ = yield from local_max(step, fn, lambda value: (), 0, detach, star)
    return value


def local_max(
    step: str,
    fn: Callable[[], Any],
    reduce: Callable[[Any], Sequence[int]],
    width: int,
    detach: bool = False,
    star: bool = False,
) -> Protocol:
    """A local step whose agreement also takes the maximum over the ranks of ``width``
    integers, ``reduce(fn())``; returns (``fn()``'s value, the maxima)."""
    started = time.perf_counter()
    try:
        value, error = fn(), None
        values = tuple(int(v) for v in reduce(value))
        if len(values) != width:
            raise ValueError(f"step {step}: {len(values)} values to reduce, expected {width}")
    except Exception as exc:  # noqa: BLE001 - agreed on, then re-raised by the driver
        value, error, values = None, exc, (0,) * width
    logger.debug("step %s: %.4f s", step, time.perf_counter() - started)
    if detach:
        yield Detach()
    maxima = yield Agree(step, error, values, star)
    return value, maxima


def run(comm: Any, protocol: Protocol, until_detach: bool = False) -> Any:
    """Drive one rank's protocol on a real comm; returns the protocol's value. With
    ``until_detach``, stop at a Detach request and return it: the caller continues the same
    generator later (``run(other_comm, protocol)``), e.g. in a background thread. A request
    that fails (an agreement on a failure) raises inside the generator, which may release what
    it holds before the error leaves it."""
    result, failed = None, None
    while True:
        try:
            request = protocol.send(result) if failed is None else protocol.throw(failed)
        except StopIteration as stop:
            return stop.value
        if isinstance(request, Detach):
            if until_detach:
                return request
            result, failed = None, None
            continue
        try:
            result, failed = comm.execute(request), None
        except BaseException as exc:  # noqa: BLE001 - raised inside the protocol
            result, failed = None, exc


# ====================================================================== save
@dataclass(frozen=True)
class Described:
    """What a rank holds, described for the plan (the ``describe`` step's value).

    Attributes:
        skeleton: the state dict's nesting without plain values (see core.nested).
        pieces: the rank's pieces in skeleton order, one row each (the rows the plan assigns).
        sources: where the rank finds the pieces' bytes (a real rank's
            :class:`~paddle_dcp.parallel.ranks.PieceSources`), opaque to the protocol, which
            carries it to ``stage`` and ``write``.
        derived: master weight key -> the parameter key it derives from, for the keys the
            ``compress`` policy derives (:func:`paddle_dcp.core.derive.find_sources`).
    """

    skeleton: dict
    pieces: tuple[save_plan.LocalPiece, ...]
    sources: Any = None
    derived: Mapping[str, str] = field(default_factory=dict)


class SaveRankProtocol(_Protocol):
    """One rank's side of a save: what :func:`save` asks of it, step by step. A rank holds
    only its inputs; each step's result is a value the protocol passes to later steps.

    Attributes:
        rank / ranks / coordinator: global ranks.
        block_bytes / created_by: recorded in the metadata.
        cache: where the rank keeps its last save plan (the process state's in a real job).
        replicas: every holder writes its copy of a replicated piece (``save_replicas``).
        staged: an async save: ``stage`` copies the pieces of the given leaves to host
            memory (or, while some rank ``can_stage`` them not, each writes its file first);
            the protocol then yields Detach and may finish in the background.
        layout: the coordinator's last word on where pieces go in their files (safetensors
            rank files put a header first); None: the plan's own layout.
        compress: which keys are stored quantized (:class:`~paddle_dcp.core.compress.Policy`;
            None: none); every rank's the same.
    """

    rank: int
    ranks: tuple[int, ...]
    coordinator: int
    block_bytes: int
    created_by: str
    cache: dict
    replicas: bool
    staged: bool
    layout: Callable[[save_plan.SavePlan], save_plan.SavePlan] | None
    compress: Policy | None

    def prepare(self) -> tuple[Any, tuple[Reduction, ...]]:
        """The state dict flattened (opaque to the protocol), and the all-reductions its
        Partial tensors need (run next, by the protocol); raise on what cannot be saved."""

    def describe(self, prepared: Any) -> Described:
        """What this rank holds (its Partial tensors reduced), described."""

    def choose_id(self) -> tuple[int, Any]:
        """The coordinator's choice of id (called on the coordinator only), and the
        directory's listing it was chosen from (None when the caller gave the id)."""

    def prepare_id(self, uid: int, listing: Any) -> tuple[int, Any]:
        """The highest generation of ``uid`` this rank sees (-1: none), and the listing it used
        (``listing`` when given: the coordinator's from ``choose_id``)."""

    def claim_id(self, uid: int, generation: int, listing: Any) -> tuple[int, int]:
        """The coordinator claims (``uid``, ``generation``) or, when another save holds it, the
        next free one (:mod:`paddle_dcp.io.claims`); returns what it claimed."""

    def can_stage(self, described: Described, leaves: np.ndarray) -> bool:
        """True when this rank has staging memory for the pieces of ``leaves`` already (asked
        when ``staged``)."""

    def stage(self, described: Described, leaves: np.ndarray) -> Described:
        """``described`` with the pieces of ``leaves`` copied to host memory (when ``staged``)."""

    def reserve(self, described: Described, leaves: np.ndarray) -> None:
        """Make the staging memory the next async save of these pieces needs (after an async
        save that wrote without staging)."""

    def write(self, described: Described, uid: int, generation: int, leaves: np.ndarray) -> tuple[int, list[int]]:
        """Write the pieces of ``leaves``: (file size, block checksums)."""

    def values(self, prepared: Any) -> dict:
        """The coordinator's plain values, flat key -> value."""

    def publish(self, meta: Metadata, generation: int) -> None:
        """The coordinator writes the metadata of the save that wrote ``generation`` (the
        :func:`publish` step)."""

    def tidy(self, uid: int, generation: int, listing: Any) -> None:
        """Remove this rank's data files of older generations of ``uid``, once the new
        metadata is in place (``listing``: the one ``prepare_id`` returned)."""


@dataclass
class SaveResult:
    """A save's outcome on one rank.

    Attributes:
        metadata: the metadata, once the coordinator built it (:meth:`built`, in the step
            that follows the write: :func:`publish`'s commit); None on the other ranks.
        generation / listing: the generation of the id's data files this save wrote, and
            the listing its ``prepare_id`` made (for ``tidy``, once the metadata is in place).
        build: the coordinator's: builds the metadata from every writer's report (None on the
            other ranks).
    """

    unique_id: int
    bytes_written: int
    plan_reused: bool
    metadata: Metadata | None = None
    generation: int = 0
    listing: Any = None
    build: Callable[[], Metadata] | None = None

    def built(self) -> Metadata:
        """The metadata, built once (on the coordinator)."""
        if self.metadata is None:
            assert self.build is not None, "only the coordinator builds the metadata"
            self.metadata = quiet_collector(self.build)
        return self.metadata


Step = Callable[["SaveResult"], Protocol]  # what follows a written save, given its result


def save(side: SaveRankProtocol, after: Sequence[Step] | None = None) -> Protocol:
    """The save protocol of one rank; ``side`` does that rank's local steps: the data files
    written and every writer's report with the coordinator, then each step of ``after`` in
    turn, given the result; the first builds the metadata (``result.built()``). Default:
    :func:`publish`; a CheckpointManager composes its own (a node-local tier's copies, the
    upload, the manifest, retention). Returns the save's result."""
    result, last = yield from _written(side)
    for step in (lambda r: publish(side, r),) if after is None else after:
        yield from step(result)
    last()  # this rank's own memory, last: no rank waits on it
    return result


def _written(side: SaveRankProtocol) -> Protocol:
    """A save up to the writers' reports, gathered by the coordinator; returns the result
    (whose ``build`` makes the metadata on the coordinator) and what the rank does last (after
    every step that follows)."""
    is_coord = side.rank == side.coordinator
    prepared, reductions = yield from local("prepare", side.prepare)
    yield ReduceAmong("reduce partial", reductions)  # agreed on like a local step
    described: Described = yield from local("describe", lambda: side.describe(prepared))
    summary = wire.encode_summary(
        save_plan.SaveSummary.from_pieces(side.rank, described.skeleton, described.pieces, described.derived)
    )
    # a plan is reused when no rank's layout changed since the last save of this group
    key = (tuple(side.ranks), side.coordinator, side.replicas, side.layout is not None, side.compress)
    digest = xxhash.xxh3_128_digest(summary)
    cached = side.cache.get(key)
    changed = (yield AllMax((0 if cached is not None and cached["digest"] == digest else 1,)))[0]
    uid, listing = yield from local("choose id", side.choose_id if is_coord else (lambda: (-1, None)))
    uid = int((yield Broadcast(str(uid).encode() if is_coord else b"", side.coordinator)))
    # a save to an id whose files exist writes the next generation beside them: the old
    # checkpoint stays loadable until the new metadata replaces its metadata
    (_, listing), (seen,) = yield from local_max("prepare id", lambda: side.prepare_id(uid, listing), lambda r: (r[0],), 1)
    # the coordinator claims the id and generation (the next free ones when another save holds
    # them): no two saves write under the same names
    claimed = yield from local("claim id", (lambda: side.claim_id(uid, seen + 1, listing)) if is_coord else (lambda: None))
    uid, generation = map(int, (yield Broadcast(b"%d %d" % claimed if is_coord else b"", side.coordinator)).split())
    if changed:
        blobs = yield Gather(summary, side.coordinator)
        plan, parts = yield from local(
            "plan",
            (lambda: quiet_collector(plan_from_summaries, side.ranks, blobs, side.replicas, side.layout, side.compress))
            if is_coord else (lambda: (None, None)),
        )
        leaves = wire.decode_assignment((yield Scatter(parts, side.coordinator)))
        side.cache[key] = {"digest": digest, "leaves": leaves, "plan": plan}
    else:
        plan, leaves = cached["plan"], cached["leaves"]
    # an async save copies the pieces to host memory, then detaches (finishes in the
    # background); while some rank has no staging memory for its pieces yet (the first async
    # save of a process), every rank writes its file first: a copy into fresh memory costs
    # what writing into the page cache costs, so the copy would only add to the call. Each
    # rank detaches once its own step is done; the agreement on it follows in the background.
    direct = side.staged and (yield AllMax((0 if side.can_stage(described, leaves) else 1,)))[0]
    if side.staged and not direct:
        described = yield from local("stage", lambda: side.stage(described, leaves), detach=True)
    written = yield from local("write", lambda: side.write(described, uid, generation, leaves), detach=bool(direct))
    size, sums = written or (0, [])
    reports = yield Gather(wire.encode_report(size, np.asarray(sums, np.uint64)), side.coordinator)

    def build():
        return metadata_from_reports(
            plan, side.ranks, reports, side.values(prepared), uid, side.block_bytes, side.created_by, generation
        )

    last = (lambda: side.reserve(described, leaves)) if direct else (lambda: None)
    return SaveResult(uid, size, not changed, None, generation, listing, build if is_coord else None), last


def publish(side: SaveRankProtocol, result: SaveResult) -> Protocol:
    """The coordinator builds the metadata of a written save and writes it (one step, the
    commit); then every rank removes its data files of older generations of the id, which the
    metadata replaced."""
    yield from local("commit", (lambda: side.publish(result.built(), result.generation)) if side.rank == side.coordinator else (lambda: None))
    yield from tidy(side, result)


def tidy(side: SaveRankProtocol, result: SaveResult) -> Protocol:
    """Every rank removes its data files of older generations of the saved id, once the
    metadata that replaces them is in place (after :func:`publish`, or a node-local tier's
    publishing on every node)."""
    yield from local("tidy", lambda: side.tidy(result.unique_id, result.generation, result.listing))


def plan_from_summaries(
    ranks: Sequence[int],
    blobs: Sequence[bytes],
    replicas: bool = False,
    layout: Callable[[save_plan.SavePlan], save_plan.SavePlan] | None = None,
    compress: Policy | None = None,
) -> tuple[save_plan.SavePlan, list[bytes]]:
    """The coordinator's half of planning a save: decode every summary (each distinct layout
    once), plan (the keys ``compress`` names at their stored sizes; then ``layout`` places the
    pieces in their files), and encode every rank's assignment."""
    summaries = wire.decode_summaries(ranks, blobs)
    plan = save_plan.plan_save(summaries, replicas, compress)
    if layout is not None:
        plan = layout(plan)
    parts = [wire.encode_assignment(plan.writes.get(s.rank, np.zeros(0, np.int64)), len(s.boxes)) for s in summaries]
    return plan, parts


def metadata_from_reports(
    plan: save_plan.SavePlan,
    ranks: Sequence[int],
    reports: Sequence[bytes],
    values: dict,
    uid: int,
    block_bytes: int,
    created_by: str = "",
    generation: int = 0,
) -> Metadata:
    """The coordinator's last step: check every writer's report and assemble the metadata."""
    checks = {}
    for r, blob in zip(ranks, reports):
        nbytes, sums = wire.decode_report(blob, r)
        if r in plan.file_bytes:
            if nbytes != plan.file_bytes[r]:
                raise StorageError(f"rank {r} wrote {nbytes} bytes, the plan says {plan.file_bytes[r]}")
            checks[r] = sums
    places = plan.static.get("placeholders")
    if places is None:  # found once for the saves of a plan
        places = plan.static["placeholders"] = nested.placeholders(plan.skeleton)
    structure, dropped = nested.fill_at(plan.skeleton, places, values)
    if dropped:
        logger.warning("not saved: plain values held only by ranks other than the coordinator: %s", dropped)
    return save_plan.build_metadata(plan, checks, structure, uid, len(ranks), block_bytes, created_by, generation)


# ====================================================================== load
class LoadPlanView(_Protocol):
    """What the protocol reads of a rank's load plan (:class:`~paddle_dcp.parallel.loadwork.LoadPlan`).

    Attributes:
        unreadable: the data files this rank needs but cannot read (other ranks serve it).
        remote: server rank -> the read ops on those files (once the servers are named).
        share_key: (digest of the tensors it reads, whether it may share their checks).
    """

    @property
    def unreadable(self) -> Sequence[str]: ...

    @property
    def remote(self) -> Mapping[int, Sequence[load_plan.ReadOp]]: ...

    @property
    def share_key(self) -> tuple[int, bool]: ...


class LoadWork(_Protocol):
    """One rank's planned load, step by step (what :meth:`LoadRankProtocol.plan` returns):
    its complete ``plan``, carried out by the steps below; planning opened no file."""

    @property
    def plan(self) -> LoadPlanView: ...

    def serve_from(self, answer: servers.Answer) -> None:
        """Take the servers the coordinator named for the files this rank cannot read
        (StorageError when no rank can read one)."""

    def open_local(self) -> None:
        """Open the files this rank reads itself (the first step after planning)."""

    def verify_local(self, share: tuple[int, int] | None) -> None:
        """Check every block this rank reads from its own files, before any target changes
        (with ``share``, (index, count): only that share of them)."""

    def verify_remote(self, comm: Any, clients: Sequence[int]) -> None:
        """The same for the blocks its servers send (pairwise)."""

    def read_local(self) -> None:
        """Copy from this rank's own files (a load that moves no bytes between ranks)."""

    def exchange(self, comm: Any, clients: Sequence[int]) -> None:
        """Copy from this rank's own files, receive the remote bytes and serve ``clients``
        (pairwise)."""

    def finish(self) -> None:
        """Fill constants, finish the buffers, set the plain values."""


class LoadRankProtocol(_Protocol):
    """One rank's side of a load: what :func:`load` asks of it.

    Attributes:
        rank / ranks / coordinator: global ranks.
        unique_id: the id asked for, or None for the latest.
        path: the checkpoint (named in errors).
        shares_targets: with an aoa_config, every rank's targets (``targets``) are gathered
            after ``inspect`` and handed to ``all_targets`` (paddle's engine needs them all:
            patterns on target names, shard counts of fused weights).
        lists_for_all: every rank sees the same files (object storage): only the coordinator's
            ``inspect`` lists them (for the latest id) and reads the metadata (its bytes are
            broadcast), and there are no per-rank file lists to compare.
        near: the ranks this one prefers as servers of the files it cannot read.
    """

    rank: int
    ranks: tuple[int, ...]
    coordinator: int
    unique_id: int | None
    path: str
    shares_targets: bool
    lists_for_all: bool
    near: frozenset

    def inspect(self) -> tuple[Any, Any]:
        """Flatten the state dict, describe its pieces, list the directory: (what the rank
        found, opaque to the protocol and passed to the later steps, a storage.Listing)."""

    def read_metadata(self, view: Any, uid: int) -> Metadata:
        """The parsed metadata of ``uid`` (this rank sees the file)."""

    def metadata_bytes(self, view: Any, uid: int) -> bytes:
        """The content of ``uid``'s metadata file (the coordinator, when ``lists_for_all``)."""

    def in_parts(self, data: bytes) -> memoryview | None:
        """The metadata file in the coordinator's ``metadata_bytes`` when it is large enough
        to be read in parts (a version 3 file, :func:`paddle_dcp.core.metafile.worth_parts`),
        else None."""

    def metadata_start(self, blob: bytes, source: str) -> metafile.Start:
        """The start of a metadata file read in parts from what the coordinator broadcast
        (:func:`start_of`)."""

    def wanted(self, view: Any) -> Mapping[str, Sequence[Box]] | None:
        """The checkpoint keys this rank may read, with the boxes it fills of each (what it
        reads of a large metadata file: :func:`paddle_dcp.core.metafile.read_part`); None when
        it needs every key."""

    def parse_metadata(self, uid: int, data: bytes) -> Metadata:
        """``uid``'s metadata parsed from ``data``, the content another rank read."""

    def metadata_from_helpers(self, view: Any, readers: list[int], meta: Metadata | None) -> Pairwise:
        """Pairwise work giving this rank the part of the metadata it needs (node-local disks)."""

    def plan(self, view: Any, meta: Metadata, uid: int, listing: Any, every_target: Any) -> LoadWork:
        """The rank's load work, complete but for the servers of the files it cannot read
        (``every_target``: ``all_targets``' value, or None)."""

    def targets(self, view: Any) -> bytes:
        """This rank's targets, encoded (when ``shares_targets``)."""

    def all_targets(self, blobs: Sequence[bytes]) -> Any:
        """Every rank's targets, merged (when ``shares_targets``)."""


def load(side: LoadRankProtocol) -> Protocol:
    """The load protocol of one rank; ``side`` does that rank's local steps."""
    # the agreement of each step carries the all-reduce that the next decision needs
    (view, listing), (latest,) = yield from local_max(
        "inspect", side.inspect, lambda found: (found[1].latest if found[1].latest is not None else -1,), 1
    )
    uid = side.unique_id if side.unique_id is not None else latest
    every_target = None
    if side.shares_targets:
        mine = yield from local("describe targets", lambda: side.targets(view))
        every_target = side.all_targets((yield AllGather(mine)))

    lists = None  # at the coordinator, when ranks see different files: every rank's list
    if side.lists_for_all:
        meta = yield from _metadata_from_coordinator(side, view, uid)
    else:
        meta, lists = yield from _metadata_of_each(side, view, uid, listing)

    # with the plan's agreement: does any rank need bytes from another, and do all ranks read
    # the same tensors of a checkpoint they all see (then they share the checksum work)
    def plan_key(work):
        digest, can_share = work.plan.share_key
        return 1 if work.plan.unreadable else 0, digest, -digest, 0 if can_share else 1

    work, (any_remote, high, neg_low, cannot) = yield from local_max(
        "plan", lambda: side.plan(view, meta, uid, listing, every_target), plan_key, 4
    )
    shared = len(side.ranks) > 1 and not any_remote and not cannot and high == -neg_low
    share = (side.ranks.index(side.rank), len(side.ranks)) if shared else None
    answer = yield from route(side, work, lists, any_remote)
    clients = None if answer is None else list(answer.clients)

    # the plan opened nothing: this rank's files are opened here, and every block is checked
    # before any target changes (a damaged file leaves the state dict as it was on every rank)
    def verify():
        if answer is not None:
            work.serve_from(answer)
        work.open_local()
        work.verify_local(share)

    yield from local("verify", verify)
    if clients is None:  # copying and finishing: one step, one agreement
        yield from local("read", lambda: (work.read_local(), work.finish()))
        return uid, work
    yield Pairwise("verify remote", lambda comm: work.verify_remote(comm, clients))
    yield Pairwise("read and exchange", lambda comm: work.exchange(comm, clients))
    yield from local("values", work.finish)
    return uid, work


def _check_found(uid: int, path: str) -> None:
    if uid < 0:
        raise FormatError(f"no complete checkpoint in {path}: no *.metadata file was found")


def _metadata_from_coordinator(side: LoadRankProtocol, view: Any, uid: int) -> Protocol:
    """Every rank sees the same objects: the coordinator alone reads the metadata (a missing or
    unreadable object fails this step on every rank): one GET of it per load, not one per rank.
    A small file, or one some rank needs whole, is broadcast and every rank parses it; of a
    large one each rank receives only what it reads (:func:`_metadata_parts`)."""
    def read():
        _check_found(uid, side.path)
        return side.metadata_bytes(view, uid) if side.rank == side.coordinator else b""

    data, (parts, whole) = yield from local_max(
        "read metadata", read,
        lambda d: (1 if side.rank == side.coordinator and side.in_parts(d) is not None else 0,
                   1 if side.wanted(view) is None else 0), 2,
    )
    if parts and not whole:
        return (yield from _metadata_parts(side, view, uid, data))
    data = yield Broadcast(data, side.coordinator)
    return (yield from local("parse metadata", lambda: side.parse_metadata(uid, data)))


def _metadata_parts(side: LoadRankProtocol, view: Any, uid: int, data: bytes) -> Protocol:
    """Each rank's part of a large version 3 file that only the coordinator read: the start
    (head, files, index) broadcast, then the rounds of :func:`paddle_dcp.core.metafile.part_rounds`,
    each rank's ranges gathered and their bytes scattered back. Every part is checked against
    its digest by the rank that uses it."""
    coord = side.rank == side.coordinator
    body = side.in_parts(data) if coord else None
    body = body if body is not None else memoryview(b"")
    source = f"{side.path}: {uid}.metadata"

    def start_blob() -> bytes:
        asked: list[tuple[int, int]] = []
        metafile.read_start(lambda r: asked.extend(r) or [body[a:b] for a, b in r], len(body), source)
        return wire.encode_chunks([len(body)] + [x for r in asked for x in r], [body[a:b] for a, b in asked])

    blob = yield from local("metadata: start", start_blob if coord else (lambda: b""))
    blob = yield Broadcast(blob, side.coordinator)

    def begin():
        rounds = metafile.part_rounds(side.metadata_start(blob, source), side.wanted(view) or {}, source)
        return rounds, next(rounds)

    rounds, request = yield from local("metadata: begin", begin)
    for step in range(3):
        asked = yield Gather(wire.encode_chunks([x for r in request for x in r], []), side.coordinator)

        def serve():
            out = []
            for blob in asked:
                numbers, _ = wire.decode_chunks(blob)
                out.append(wire.encode_chunks([], [body[a:b] for a, b in _spans(numbers, len(body))]))
            return out

        answers = yield from local("metadata: serve", serve if coord else (lambda: None))
        got = wire.decode_chunks((yield Scatter(answers, side.coordinator)))[1]
        request = yield from local("metadata: parts", lambda: _advance(rounds, got, step == 2))
    return request


def start_of(blob: bytes, source: str) -> metafile.Start:
    """The head, files and index of a metadata file, from the ranges the coordinator read of it
    and broadcast (the file's size first, then each range and its bytes)."""
    numbers, chunks = wire.decode_chunks(blob)
    known = {(numbers[i], numbers[i + 1]): c for i, c in zip(range(1, len(numbers), 2), chunks)}

    def fetch(ranges):
        try:
            return [known[(a, b)] for a, b in ranges]
        except KeyError:
            raise FormatError(f"{source}: the coordinator did not send the start of the metadata") from None

    return metafile.read_start(fetch, numbers[0] if numbers else 0, source)


def _spans(numbers: Sequence[int], size: int) -> list[list[int]]:
    """The (start, stop) pairs a rank asked for, each inside the ``size``-byte metadata file."""
    pairs = np.asarray(numbers, dtype=np.int64)
    if len(pairs) % 2:
        raise FormatError("a rank asked for a byte range without its end")
    pairs = pairs.reshape(-1, 2)
    bad = np.flatnonzero((pairs[:, 0] < 0) | (pairs[:, 0] > pairs[:, 1]) | (pairs[:, 1] > size))
    if len(bad):
        start, stop = pairs[bad[0]].tolist()
        raise FormatError(f"a rank asked for bytes {start}..{stop} of a {size}-byte metadata file")
    return pairs.tolist()


def _advance(rounds: Any, got: list, last: bool) -> Any:
    """The next round's ranges, or after the last the metadata."""
    try:
        request = rounds.send(got)
    except StopIteration as stop:
        if not last:
            raise FormatError("the metadata's reader ended a round early") from None
        return stop.value
    if last:
        raise FormatError("the metadata's reader asked for a fourth round")
    return request


def _metadata_of_each(side: LoadRankProtocol, view: Any, uid: int, listing) -> Protocol:
    """Every rank reads the metadata if it sees it; ranks that do not (node-local disks) get
    their part from one that does. Returns (metadata, at the coordinator every rank's list of
    the files it sees when they differ, else None)."""
    def find_metadata():
        _check_found(uid, side.path)
        meta = side.read_metadata(view, uid) if uid in listing.complete else None
        files = {str(g): wire.rle(ranks) for g, ranks in listing.generations(uid).items()}
        digest = xxhash.xxh3_64_intdigest(wire.encode_json(files)) >> 1  # fits an int64
        return meta, files, digest

    # which ranks read the metadata and which files each sees. On a shared file system all
    # see the same: one all-reduce proves it (every rank has the metadata, the digests of the
    # file lists agree), a few bytes per rank however large the job. Only when they differ
    # (node-local disks) are the statuses and lists gathered, at the coordinator alone.
    (meta, files, digest), (no_meta, high, neg_low) = yield from local_max(
        "read metadata", find_metadata, lambda found: (0 if found[0] is not None else 1, found[2], -found[2]), 3
    )
    lists = None
    if no_meta == 0 and high == -neg_low:
        readers = list(side.ranks)
    else:  # the coordinator keeps every rank's list (for :func:`route`); every rank learns the readers
        statuses: list[dict] = []

        def readers_of(blobs: list[bytes]) -> list[bytes]:
            statuses.extend(_decode_statuses(blobs))
            told = wire.encode_json(wire.rle(r for r, s in zip(side.ranks, statuses) if s["m"]))
            return [told] * len(side.ranks)

        told = yield from ask_coordinator(side.rank, side.coordinator, "readers",
                                          wire.encode_json({"m": meta is not None, "f": files}), readers_of)
        readers = sorted(wire.from_runs(wire.decode_json(told)))
        lists = [s["f"] for s in statuses]

    def check():
        if not readers:
            raise StorageError(
                f"checkpoint {uid} is not complete in {side.path}: no rank finds {uid}.metadata; "
                f"complete checkpoints this rank sees: {sorted(listing.complete) or 'none'}",
                side.path,
            )

    if not readers:  # every rank has the same statuses: all of them fail here
        yield from local("check", check)
    if len(readers) < len(side.ranks):
        meta = yield side.metadata_from_helpers(view, readers, meta)
    return meta, lists


def _decode_statuses(blobs: Sequence[bytes]) -> list[dict]:
    """Every rank's status; equal ones (all of them on a shared file system) parsed once."""
    memo: dict[bytes, dict] = {}
    out = []
    for blob in blobs:
        status = memo.get(blob)
        if status is None:
            status = memo[blob] = wire.decode_json(blob)
        out.append(status)
    return out


def ask_coordinator(rank: int, coordinator: int, step: str, data: bytes,
                    answer: Callable[[list[bytes]], list[bytes]]) -> Protocol:
    """Every rank's ``data`` gathered at the coordinator, which answers each rank with its own
    part (``answer(every rank's data)``, parts in group order, computed in the local step
    ``step``, agreed on by all): a rank receives its part alone (every part padded to the
    longest), whatever the job's size. Returns this rank's part."""
    asked = yield Gather(data, coordinator)
    parts = yield from local(step, (lambda: answer(asked)) if rank == coordinator else (lambda: None))
    return (yield Scatter(parts, coordinator))


def route(side: LoadRankProtocol, work: LoadWork, lists: list[dict] | None, any_remote: int) -> Protocol:
    """Name the server of every file a rank cannot read and tell every server its clients
    (:mod:`paddle_dcp.parallel.servers`): each rank asks the coordinator, which alone holds
    every rank's file list (``lists``), and receives its own answer. None when no rank needs
    another's bytes (``any_remote`` 0, agreed by all ranks)."""
    if not any_remote:
        return None
    question = servers.asking(work.plan.unreadable, side.near)
    answer = yield from ask_coordinator(side.rank, side.coordinator, "route", question,
                                        lambda asks: servers.assign(side.ranks, lists, asks))
    return servers.answered(answer)
