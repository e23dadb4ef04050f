"""The save and load protocols: every rank's sequence of local steps and collectives.

A protocol is a generator run by one rank. It yields requests (a collective, an agreement
after a local step, or a pairwise exchange) and receives their results; it never touches paddle,
files or other ranks itself: the rank's ``SaveRank`` / ``LoadRank`` supplies the local work.

Two drivers run these same generators:
  * :func:`run` for a real rank, executing each request on a :class:`~paddle_dcp.dist.comm.Comm`;
  * :func:`paddle_dcp.dist.comm.SimWorld.run` for every rank of a job in one process, advancing all
    generators in lockstep, so that a simulation of thousands of ranks executes the very steps
    and messages of a real save or load (scripts/bench_scale.py).

Every local step ends with an agreement (``Agree``): when it failed on any rank, every rank
raises the same CollectiveError, so no rank is left waiting in the next collective.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence

import numpy as np
import xxhash

from . import wire
from ..core import nested, save_plan
from ..errors import FormatError, StorageError
from ..core.metadata import Metadata

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ requests
@dataclass(frozen=True)
class AllMax:
    values: tuple[int, ...]


@dataclass(frozen=True)
class Gather:
    data: bytes
    root: int


@dataclass(frozen=True)
class Scatter:
    parts: Sequence[bytes] | None
    root: int


@dataclass(frozen=True)
class Broadcast:
    data: bytes
    root: int


@dataclass(frozen=True)
class AllGather:
    data: bytes


@dataclass(frozen=True)
class Agree:
    """The end of a local step: did it fail on any rank? With ``values``, the same all-reduce
    also returns their maximum over the ranks (one collective instead of two)."""

    step: str
    error: BaseException | None
    values: tuple[int, ...] = ()


@dataclass(frozen=True)
class Pairwise:
    """Point-to-point work between some ranks (node-local loading): ``fn(comm)`` runs on the
    rank, its result or error is returned and then agreed on."""

    step: str
    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class Detach:
    """The rest of the protocol may go on in the background (async save): every rank's state
    is staged to host memory and nothing below reads the caller's tensors."""


Protocol = Generator[Any, Any, Any]


def local(step: str, fn: Callable[[], Any]) -> Protocol:
    """A local step followed by its agreement; returns ``fn()``'s value."""
    value, _ = yield from local_max(step, fn, lambda value: (), 0)
    return value


def local_max(step: str, fn: Callable[[], Any], reduce: Callable[[Any], Sequence[int]], width: int) -> Protocol:
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
    maxima = yield Agree(step, error, values)
    return value, maxima


def run(comm, protocol: Protocol, until_detach: bool = False):
    """Drive one rank's protocol on a real comm; returns the protocol's value. With
    ``until_detach``, stop at a Detach request and return it: the caller continues the same
    generator later (``run(other_comm, protocol)``), e.g. in a background thread."""
    result = None
    while True:
        try:
            request = protocol.send(result)
        except StopIteration as stop:
            return stop.value
        if isinstance(request, Detach):
            if until_detach:
                return request
            result = None
            continue
        result = comm.execute(request)


# ====================================================================== save
@dataclass
class SaveRank:
    """One rank's side of a save.

    Attributes:
        rank / ranks / coordinator: global ranks.
        prepare: flattens the state dict; raises on what cannot be saved.
        reduce: reduces Partial tensors (a collective of paddle's; entered by all together).
        describe: -> (skeleton without plain values, local pieces in skeleton order).
        choose_id: the coordinator's choice of id (called on the coordinator only).
        prepare_id: (unique id) -> the highest generation of that id's data files this rank
            sees (-1: none), after removing its own temporary files of crashed saves of it.
        write: (unique id, generation, leaf indices to write) -> (file size, block checksums).
        values: the coordinator's plain values, flat key -> value.
        publish: the coordinator writes the metadata; called last.
        tidy: (unique id, generation) -> removes this rank's data files of older generations
            of that id, once the new metadata is in place.
        cache: where the rank keeps its last save plan (module-level dict in a real job).
        stage: for an async save, copies the pieces of the given leaves to host memory; the
            protocol then yields Detach and may finish in the background.
        replicas: every holder writes its copy of a replicated piece (``save_replicas``).
        layout: the coordinator's last word on where pieces go in their files (safetensors
            rank files put a header first); None: the plan's own layout.
    """

    rank: int
    ranks: tuple[int, ...]
    coordinator: int
    prepare: Callable[[], None]
    reduce: Callable[[], None]
    describe: Callable[[], tuple[dict, list[save_plan.LocalPiece]]]
    choose_id: Callable[[], int]
    prepare_id: Callable[[int], int]
    write: Callable[[int, int, np.ndarray], tuple[int, list[int]]]
    values: Callable[[], dict]
    publish: Callable[[Metadata], None]
    tidy: Callable[[int, int], None]
    block_bytes: int
    created_by: str = ""
    cache: dict = field(default_factory=dict)
    stage: Callable[[np.ndarray], None] | None = None
    replicas: bool = False
    layout: Callable[[save_plan.SavePlan], save_plan.SavePlan] | None = None


@dataclass
class SaveResult:
    unique_id: int
    bytes_written: int
    plan_reused: bool


def save(ctx: SaveRank) -> Protocol:
    """The save protocol of one rank."""
    is_coord = ctx.rank == ctx.coordinator
    yield from local("prepare", ctx.prepare)
    yield from local("reduce partial", ctx.reduce)

    def summarize():
        skeleton, pieces = ctx.describe()
        return wire.encode_summary(save_plan.SaveSummary.from_pieces(ctx.rank, skeleton, pieces))

    summary = yield from local("describe", summarize)
    # a plan is reused when no rank's layout changed since the last save of this group
    key = (tuple(ctx.ranks), ctx.coordinator, ctx.replicas, ctx.layout is not None)
    digest = xxhash.xxh3_128_digest(summary)
    cached = ctx.cache.get(key)
    changed = (yield AllMax((0 if cached is not None and cached["digest"] == digest else 1,)))[0]
    uid = yield from local("choose id", ctx.choose_id if is_coord else (lambda: -1))
    uid = int((yield Broadcast(str(uid).encode() if is_coord else b"", ctx.coordinator)))
    # a save to an id whose files exist writes the next generation beside them: the old
    # checkpoint stays loadable until the new metadata replaces its metadata
    seen = yield from local("prepare id", lambda: ctx.prepare_id(uid))
    generation = (yield AllMax((seen,)))[0] + 1
    if changed:
        blobs = yield Gather(summary, ctx.coordinator)
        plan, parts = yield from local(
            "plan", (lambda: plan_from_summaries(ctx.ranks, blobs, ctx.replicas, ctx.layout)) if is_coord else (lambda: (None, None))
        )
        leaves = wire.decode_assignment((yield Scatter(parts, ctx.coordinator)))
        ctx.cache[key] = {"digest": digest, "leaves": leaves, "plan": plan}
    else:
        plan, leaves = cached["plan"], cached["leaves"]
    if ctx.stage is not None:
        yield from local("stage", lambda: ctx.stage(leaves))
        yield Detach()
    size, sums = (yield from local("write", lambda: ctx.write(uid, generation, leaves))) or (0, [])
    reports = yield Gather(wire.encode_report(size, np.asarray(sums, np.uint64)), ctx.coordinator)

    def commit():
        meta = metadata_from_reports(
            plan, ctx.ranks, reports, ctx.values(), uid, ctx.block_bytes, ctx.created_by, generation
        )
        ctx.publish(meta)

    yield from local("commit", commit if is_coord else (lambda: None))
    yield from local("tidy", lambda: ctx.tidy(uid, generation))
    return SaveResult(uid, size, not changed)


def plan_from_summaries(
    ranks: Sequence[int],
    blobs: Sequence[bytes],
    replicas: bool = False,
    layout: Callable[[save_plan.SavePlan], save_plan.SavePlan] | None = None,
) -> tuple[save_plan.SavePlan, list[bytes]]:
    """The coordinator's half of planning a save: decode every summary (each distinct layout
    once), plan (then ``layout`` places the pieces in their files), and encode every rank's
    assignment."""
    cache: dict = {}
    summaries = [wire.decode_summary(b, r, cache) for r, b in zip(ranks, blobs)]
    plan = save_plan.plan_save(summaries, replicas)
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
    structure, dropped = nested.fill_values(plan.skeleton, values)
    if dropped:
        logger.warning("not saved: plain values held only by ranks other than the coordinator: %s", dropped)
    return save_plan.build_metadata(plan, checks, structure, uid, len(ranks), block_bytes, created_by, generation)


# ====================================================================== load
@dataclass
class LoadRank:
    """One rank's side of a load.

    Attributes:
        rank / ranks / coordinator: global ranks.
        unique_id: the id asked for, or None for the latest.
        inspect: flattens the state dict, describes its pieces, lists the directory ->
            storage.Listing.
        read_metadata: id -> the parsed metadata (this rank sees the file).
        metadata_from_helpers: (readers, meta or None) -> Pairwise work giving this rank the
            part of the metadata it needs (node-local disks).
        plan: (metadata, id, listing, statuses) -> the rank's load work: an object with
            ``remote`` (server rank -> ops), ``share_key`` ((digest, can share) of the tensors
            it reads), ``share_checks(index, count)``, ``verify_local()``,
            ``verify_remote(comm, clients)``, ``read_local()``, ``exchange(comm, clients)`` and
            ``finish()``.
        targets: with an aoa_config, the rank's targets as bytes; every rank's are then
            gathered after ``inspect`` and handed to ``all_targets`` (paddle's engine needs
            them all: patterns on target names, shard counts of fused weights).
    """

    rank: int
    ranks: tuple[int, ...]
    coordinator: int
    unique_id: int | None
    path: str
    inspect: Callable[[], Any]
    read_metadata: Callable[[int], Metadata]
    metadata_from_helpers: Callable[[list[int], Metadata | None], Pairwise]
    plan: Callable[[Metadata, int, Any, list[dict]], Any]
    targets: Callable[[], bytes] | None = None
    all_targets: Callable[[Sequence[bytes]], None] | None = None


def load(ctx: LoadRank) -> Protocol:
    """The load protocol of one rank."""
    # the agreement of each step carries the all-reduce that the next decision needs
    listing, (latest,) = yield from local_max(
        "inspect", ctx.inspect, lambda listing: (listing.latest if listing.latest is not None else -1,), 1
    )
    uid = ctx.unique_id if ctx.unique_id is not None else latest
    if ctx.targets is not None:
        mine = yield from local("describe targets", ctx.targets)
        ctx.all_targets((yield AllGather(mine)))

    def find_metadata():
        if uid < 0:
            raise FormatError(f"no complete checkpoint in {ctx.path}: no *.metadata file was found")
        meta = ctx.read_metadata(uid) if uid in listing.complete else None
        files = {str(g): wire.rle(ranks) for g, ranks in listing.generations(uid).items()}
        digest = xxhash.xxh3_64_intdigest(wire.encode_json(files)) >> 1  # fits an int64
        return meta, files, digest

    # which ranks read the metadata and which files each sees. On a shared file system all
    # see the same: one all-reduce proves it (every rank has the metadata, the digests of the
    # file lists agree), a few bytes per rank however large the job. Only when they differ
    # (node-local disks) are the statuses, and then the lists, gathered.
    (meta, files, digest), (no_meta, high, neg_low) = yield from local_max(
        "read metadata", find_metadata, lambda found: (0 if found[0] is not None else 1, found[2], -found[2]), 3
    )
    if no_meta == 0 and high == -neg_low:
        statuses = [{"m": True, "h": digest}] * len(ctx.ranks)
    else:
        statuses = _decode_statuses((yield AllGather(wire.encode_json({"m": meta is not None, "h": digest}))))
        if len({s["h"] for s in statuses}) > 1:
            lists = _decode_statuses((yield AllGather(wire.encode_json(files))))
            statuses = [dict(s, f=f) for s, f in zip(statuses, lists)]
    readers = [r for r, s in zip(ctx.ranks, statuses) if s["m"]]

    def check():
        if not readers:
            raise StorageError(
                f"checkpoint {uid} is not complete in {ctx.path}: no rank finds {uid}.metadata; "
                f"complete checkpoints this rank sees: {sorted(listing.complete) or 'none'}",
                ctx.path,
            )

    if not readers:  # every rank has the same statuses: all of them fail here
        yield from local("check", check)
    if len(readers) < len(ctx.ranks):
        meta = yield ctx.metadata_from_helpers(readers, meta)

    # with the plan's agreement: does any rank need bytes from another, and do all ranks read
    # the same tensors of a checkpoint they all see (then they share the checksum work)
    def plan_key(work):
        digest, can_share = work.share_key
        return 1 if work.remote else 0, digest, -digest, 0 if can_share else 1

    work, (any_remote, high, neg_low, cannot) = yield from local_max(
        "plan", lambda: ctx.plan(meta, uid, listing, statuses), plan_key, 4
    )
    if len(ctx.ranks) > 1 and not any_remote and not cannot and high == -neg_low:
        work.share_checks(ctx.ranks.index(ctx.rank), len(ctx.ranks))
    clients = yield from route(ctx, work.remote, any_remote)
    # every block is checked before any target changes: a damaged file leaves the state dict
    # as it was on every rank
    yield from local("verify", work.verify_local)
    if clients is None:  # copying and finishing: one step, one agreement
        yield from local("read", lambda: (work.read_local(), work.finish()))
        return uid, work
    yield Pairwise("verify remote", lambda comm: work.verify_remote(comm, clients))
    yield from local("read", work.read_local)
    yield Pairwise("exchange", lambda comm: work.exchange(comm, clients))
    yield from local("values", work.finish)
    return uid, work


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


def route(ctx, remote: dict, any_remote: int) -> Protocol:
    """Tell every server which ranks will ask it for bytes; None when no rank needs any
    (``any_remote`` 0, agreed by all ranks). The coordinator alone sees every rank's servers;
    each rank receives its own clients."""
    if len(ctx.ranks) == 1 or not any_remote:
        return None
    asked = yield Gather(wire.encode_json(sorted(remote)), ctx.coordinator)

    def invert():
        clients: dict[int, list[int]] = {r: [] for r in ctx.ranks}
        for client, blob in zip(ctx.ranks, asked):
            for server in wire.decode_json(blob):
                clients[int(server)].append(client)
        return [wire.encode_json(clients[r]) for r in ctx.ranks]

    parts = yield from local("route", invert if ctx.rank == ctx.coordinator else (lambda: None))
    return [int(c) for c in wire.decode_json((yield Scatter(parts, ctx.coordinator)))]
