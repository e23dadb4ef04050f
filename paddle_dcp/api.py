"""save_state_dict / load_state_dict: the protocol, step by step.

Save: flatten -> reduce Partial -> describe local pieces -> choose the id -> gather summaries
at the coordinator -> plan -> scatter assignments -> write data files -> gather checksums ->
the coordinator writes the metadata last. Load: flatten -> choose the id -> read metadata ->
match keys -> plan reads -> read, verify, copy -> set plain values. Every local step ends with
an agreement, so a failure anywhere raises on every rank instead of leaving one waiting.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from . import exchange, nested, planner, storage, wire
from .comm import Comm, make_comm
from .device import TargetBuffer, host_bytes
from .errors import DcpError, FormatError, MismatchError, StorageError
from .metadata import DEFAULT_BLOCK_BYTES, Metadata
from .placements import describe, has_partial, is_tensor, reduce_partial, rewrap
from .version import __version__

logger = logging.getLogger(__name__)


def _check_id(unique_id) -> None:
    if unique_id is not None and (type(unique_id) is not int or unique_id < 0):
        raise DcpError(f"unique_id must be a non-negative int or None, got {unique_id!r}")


# ============================================================================ save
def save_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    unique_id: int | None = None,
    async_save: bool = False,
) -> None:
    """Save a (nested) state dict of dist tensors, plain tensors and plain values.

    Every rank writes the pieces assigned to it to ``{rank}_{unique_id}.distcp``; replicated
    pieces are written once, by ranks chosen to balance the bytes. The coordinator writes
    ``{unique_id}.metadata`` last: a checkpoint without it is not complete.

    Args:
        state_dict: nested dicts / lists / tuples of paddle tensors (dist or not), numpy arrays,
            and plain values (None, bool, int, float, str; taken from the coordinator).
        path: the checkpoint directory (created if needed).
        process_group: the group of ranks that save; default: all ranks.
        coordinator_rank: global rank that plans and writes the metadata.
        unique_id: the checkpoint's id; default: one more than the highest complete id in
            ``path`` (0 for the first).
        async_save: not available yet.

    Raises:
        CollectiveError: on every rank, when a step failed on some rank (several ranks).
        DcpError: the failure itself (one rank).
    """
    if async_save:
        raise NotImplementedError(
            "async_save=True is not implemented yet in paddle_dcp; call with async_save=False"
        )
    path = os.fspath(path)
    comm = make_comm(process_group, coordinator_rank)
    started = time.perf_counter()
    with comm.step("prepare"):
        _check_id(unique_id)
        flat = nested.flatten(state_dict, is_tensor, keep_values=comm.is_coordinator)
        os.makedirs(path, exist_ok=True)
        tensors = dict(flat.tensors)
        partial = [k for k, v in tensors.items() if has_partial(v)]
    with comm.step("reduce partial"):
        for key in partial:
            tensors[key] = reduce_partial(tensors[key])
    uid = -1
    with comm.step("describe"):
        held = [describe(k, v, comm.rank) for k, v in tensors.items()]
        summary = planner.SaveSummary.from_pieces(comm.rank, flat.skeleton, [h.piece for h in held])
        if comm.is_coordinator:
            uid = unique_id if unique_id is not None else _next_id(path)
    uid = int(comm.call("choose id", lambda: comm.broadcast(str(uid).encode(), comm.coordinator)))
    blobs = comm.call("gather summaries", lambda: comm.gather(wire.encode_summary(summary), comm.coordinator))
    parts = plan = None
    with comm.step("plan"):
        if comm.is_coordinator:
            cache: dict = {}
            summaries = [wire.decode_summary(b, r, cache) for r, b in zip(comm.ranks, blobs)]
            plan = planner.plan_save(summaries)
            parts = [
                wire.encode_assignment(plan.writes.get(s.rank, np.zeros(0, np.int64)), len(s.dtypes))
                for s in summaries
            ]
    mine = wire.decode_assignment(comm.call("assign", lambda: comm.scatter(parts, comm.coordinator)))
    size, sums = _write_pieces(comm, path, uid, held, mine)
    reports = comm.call(
        "report", lambda: comm.gather(wire.encode_report(size, np.asarray(sums, np.uint64)), comm.coordinator)
    )
    with comm.step("commit"):
        if comm.is_coordinator:
            checks = {}
            for r, blob in zip(comm.ranks, reports):
                nbytes, rank_sums = wire.decode_report(blob, r)
                if r in plan.file_bytes:
                    if nbytes != plan.file_bytes[r]:
                        raise StorageError(f"rank {r} wrote {nbytes} bytes, the plan says {plan.file_bytes[r]}")
                    checks[r] = rank_sums
            structure, dropped = nested.fill_values(plan.skeleton, flat.values)
            if dropped:
                logger.warning("not saved: plain values held only by ranks other than the coordinator: %s", dropped)
            meta = planner.build_metadata(
                plan, checks, structure, uid, len(comm.ranks), DEFAULT_BLOCK_BYTES, f"paddle_dcp {__version__}"
            )
            storage.write_atomic(path, storage.metadata_name(uid), meta.to_json())
    logger.info(
        "saved checkpoint %d to %s: %d bytes written by this rank in %.3f s",
        uid, path, size, time.perf_counter() - started,
    )


def _next_id(path: str) -> int:
    latest = storage.list_checkpoints(path).latest
    return 0 if latest is None else latest + 1


def _write_pieces(comm: Comm, path: str, uid: int, held, leaves: np.ndarray) -> tuple[int, list[int]]:
    size, sums = 0, []
    with comm.step("write"):
        if len(leaves):
            writer = storage.DataWriter(path, planner.data_file_name(comm.rank, uid), DEFAULT_BLOCK_BYTES)
            try:
                for leaf in leaves.tolist():
                    data = host_bytes(held[leaf].local)
                    sums.extend(writer.write(storage.as_bytes(data.array)))
                size = writer.commit()
            except BaseException:
                writer.abort()
                raise
    return size, sums


# ============================================================================ load
def load_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    unique_id: int | None = None,
    offload: bool = False,
    mw_name_compatibility: bool = True,
) -> None:
    """Fill a (nested) state dict in place from a checkpoint, on any layout.

    Each rank intersects its own pieces with the saved ones, reads only the byte ranges it
    needs, checks their checksums, and copies them into its tensors; plain values are replaced
    by the checkpoint's. A rank that cannot read a file (node-local disks) receives the bytes
    from a rank that can; a rank that cannot read the metadata receives the part it needs.
    Keys of the state dict that the checkpoint lacks are left as they are, with a warning
    naming them, as are keys of the checkpoint that the state dict lacks.

    Args:
        state_dict: nested dicts / lists / tuples of paddle tensors (dist or not), numpy
            arrays and plain values, shaped as the checkpoint's tensors.
        path: the checkpoint directory.
        process_group: the group of ranks that load; default: all ranks.
        coordinator_rank: global rank that coordinates.
        unique_id: which checkpoint; default: the highest complete one in ``path``.
        offload: put every loaded tensor in CPU memory (on a GPU, the state dict's tensors are
            replaced by CPU ones; on the CPU nothing changes).
        mw_name_compatibility: load ``master_weights.X`` from ``X_fp32_master_0`` and back,
            as paddle.distributed does.

    Raises:
        MismatchError: a shape or dtype differs (the message names the key and both).
        FormatError / IntegrityError / StorageError: no or a damaged checkpoint.
        CollectiveError: on every rank, when a step failed on some rank (several ranks).
    """
    path = os.fspath(path)
    comm = make_comm(process_group, coordinator_rank)
    started = time.perf_counter()
    latest = -1
    with comm.step("inspect"):
        _check_id(unique_id)
        flat = nested.flatten(state_dict, is_tensor)
        held = [describe(k, v, comm.rank) for k, v in flat.tensors.items()]
        listing = storage.list_checkpoints(path)
        latest = listing.latest if listing.latest is not None else -1
    uid = unique_id if unique_id is not None else comm.call("choose id", lambda: comm.all_max([latest]))[0]
    meta: Metadata | None = None
    with comm.step("read metadata"):
        if uid < 0:
            where = "" if os.path.isdir(path) else " (the directory does not exist)"
            raise FormatError(f"no complete checkpoint in {path}{where}: no *.metadata file was found")
        if uid in listing.complete:
            meta = storage.read_metadata(path, uid)
        status = wire.encode_json({"m": meta is not None, "f": wire.rle(listing.data_ranks.get(uid, ()))})
    statuses = [wire.decode_json(s) for s in comm.call("locate", lambda: comm.all_gather(status))]
    readers = [r for r, s in zip(comm.ranks, statuses) if s["m"]]
    with comm.step("check"):
        if not readers:
            raise StorageError(
                f"checkpoint {uid} is not complete in {path}: no rank finds {storage.metadata_name(uid)}"
                f"; complete checkpoints there: {sorted(listing.complete) or 'none'}",
                path,
            )
    if len(readers) < comm.size:
        meta = _metadata_from_helpers(comm, readers, meta, flat, held, mw_name_compatibility)
    with comm.step("plan"):
        plan = _plan_load(comm, flat, held, meta, path, offload, mw_name_compatibility)
        local, remote = _split_by_reader(comm, plan, meta, uid, listing, statuses)
    clients = _route(comm, remote)
    with comm.step("read"):
        run = plan.runner()
        try:
            for op in local:
                run(op, None)
            if clients is None:
                plan.finish()
        finally:
            if clients is None:
                plan.files.close()
    if clients is not None:
        with comm.step("exchange"):
            try:
                exchange.fetch_remote(comm, path, remote, clients, lambda i: meta.files[i].name, run)
                plan.finish()
            finally:
                plan.files.close()
    with comm.step("values"):
        for key, buffer in zip(flat.tensors, plan.buffers):
            if buffer.replacement is not None:
                nested.set_tensor(state_dict, flat.paths[key], buffer.replacement)
        saved_values = meta.values()
        nested.set_values(state_dict, flat, {k: saved_values[k] for k in flat.values if k in saved_values})
    logger.info(
        "loaded checkpoint %d from %s: %d bytes by this rank in %.3f s",
        uid, path, sum(op.nbytes for op in plan.ops), time.perf_counter() - started,
    )


def _metadata_from_helpers(comm: Comm, readers, meta, flat, held, mw: bool) -> Metadata:
    """Ranks without the metadata file get the part they need from a rank that has it."""
    non_readers = [r for r in comm.ranks if r not in readers]
    helper_of = {r: readers[i % len(readers)] for i, r in enumerate(non_readers)}
    my_helper = helper_of.get(comm.rank)
    my_clients = [r for r, h in helper_of.items() if h == comm.rank]
    request = b""
    if my_helper is not None:
        pieces = [h.piece for h in held]
        request = wire.encode_summary(planner.SaveSummary.from_pieces(comm.rank, flat.skeleton, pieces))

    def answer(client: int, question: bytes) -> bytes:
        summary = wire.decode_summary(question, client)
        keys = nested.tensor_keys(summary.skeleton)
        match = planner.match_keys(keys, list(meta.tensors), mw)
        targets = []
        for i, key in enumerate(keys):
            box = summary.piece_box(i)
            if box is not None and key in match.source:
                targets.append(planner.TargetPiece(match.source[key], summary.dtypes[i], summary.global_shapes[i], box))
        value_keys = [nested.flat_key(p) for p, tag, _ in nested.walk(summary.skeleton) if tag in ("v", "f", "x")]
        return planner.restrict(meta, targets, value_keys).to_json()

    with comm.step("metadata from helpers"):
        reply = exchange.ask_for_metadata(comm, my_helper, request, my_clients, answer)
        if reply is not None:
            meta = Metadata.from_json(reply, source=f"part of the metadata sent by rank {my_helper}", allow_subset=True)
    return meta


class _LoadPlan:
    """One rank's load: read ops, the buffers they fill, and what finishes each buffer."""

    def __init__(self, ops, files, buffers, fills):
        self.ops, self.files, self.buffers, self.fills = ops, files, buffers, fills
        self.staging = storage.Staging()

    def runner(self):
        arrays = [b.array for b in self.buffers]

        def run(op, fetch):
            storage.execute_op(op, self.files, arrays, self.staging, True, fetch)

        return run

    def finish(self):
        for buffer, fill in zip(self.buffers, self.fills):
            if fill is not None:
                buffer.fill(fill)
            buffer.finish()


def _plan_load(comm: Comm, flat: nested.Flat, held, meta: Metadata, path: str, offload: bool, mw: bool) -> _LoadPlan:
    saved_values = meta.values()
    match = planner.match_keys(list(flat.tensors), list(meta.tensors), mw)
    for key in match.missing:
        if key in saved_values:
            raise MismatchError(f"{key}: the checkpoint holds a plain value here, the state_dict a tensor")
    for key in flat.values:
        if key in meta.tensors:
            raise MismatchError(f"{key}: the checkpoint holds a tensor here, the state_dict a plain value")
    missing = list(match.missing) + [k for k in flat.values if k not in saved_values]
    if missing:
        logger.warning("keys of the state_dict not found in checkpoint %s (left unchanged): %s", path, missing)
    if not meta.subset:
        unexpected = list(match.unexpected) + [k for k in saved_values if k not in flat.values]
        if unexpected:
            logger.warning("keys of checkpoint %s not in the state_dict (not loaded): %s", path, unexpected)
    targets, buffers, fills, index = [], [], [], []
    for h in held:
        source = match.source.get(h.piece.key)
        if h.local is None or source is None:
            buffers.append(_NoTarget())
            fills.append(None)
            continue
        value = flat.tensors[h.piece.key]
        buffers.append(
            _NumpyTarget(h.local) if isinstance(h.local, np.ndarray) else TargetBuffer(h.local, offload, rewrap(value))
        )
        fill = _partial_fill(h)
        fills.append(fill)
        target = planner.TargetPiece(source, h.piece.dtype, h.piece.global_shape, h.piece.box)
        if fill is None:
            targets.append(target)
            index.append(len(buffers) - 1)
        else:  # nothing to read, but the shape and dtype must still agree
            planner.check_targets(meta, [target])
    ops = [_retarget(op, index) for op in planner.plan_reads(meta, targets)]
    return _LoadPlan(ops, storage.FileSet(path, meta), buffers, fills)


def _split_by_reader(comm: Comm, plan: "_LoadPlan", meta: Metadata, uid: int, listing, statuses):
    """Ops on files this rank can read, and the others by the rank that will serve them.
    Every local file is opened (and its size checked) before any byte moves."""
    mine = {planner.data_file_name(r, uid) for r in listing.data_ranks.get(uid, ())}
    local, remote = [], {}
    for op in plan.ops:
        name = meta.files[op.file].name
        if name in mine:
            local.append(op)
            continue
        m = storage.DATA_RE.match(name)
        writer = int(m.group(1)) if m else -1
        servers = [r for r, s in zip(comm.ranks, statuses) if r != comm.rank and wire.in_runs(s["f"], writer)]
        if not servers:
            keys = sorted({seg.piece.key for seg in op.segments})
            raise StorageError(f"no rank can read data file {name} of checkpoint {uid}, needed for {keys}")
        remote.setdefault(servers[comm.rank % len(servers)], []).append(op)
    for f in sorted({op.file for op in local}):
        plan.files.fd(f)
    return local, remote


def _route(comm: Comm, remote: dict) -> list[int] | None:
    """Tell every server which ranks will ask it for bytes; None when no rank needs any.
    The coordinator alone sees every rank's servers; each rank receives its own clients."""
    if comm.size == 1:
        return None
    if not comm.call("route", lambda: comm.all_max([1 if remote else 0]))[0]:
        return None
    asked = comm.call("route", lambda: comm.gather(wire.encode_json(sorted(remote)), comm.coordinator))
    parts = None
    if comm.is_coordinator:
        clients: dict[int, list[int]] = {r: [] for r in comm.ranks}
        for client, blob in zip(comm.ranks, asked):
            for server in wire.decode_json(blob):
                clients[int(server)].append(client)
        parts = [wire.encode_json(clients[r]) for r in comm.ranks]
    return [int(c) for c in wire.decode_json(comm.call("route", lambda: comm.scatter(parts, comm.coordinator)))]


def _retarget(op: planner.ReadOp, index: list[int]) -> planner.ReadOp:
    segments = tuple(
        planner.Segment(
            s.piece,
            s.start,
            s.stop,
            tuple(planner.Copy(index[c.target], c.region_in_saved, c.region_in_target) for c in s.copies),
        )
        for s in op.segments
    )
    return planner.ReadOp(op.file, op.start, op.stop, segments, op.direct)


def _partial_fill(held) -> Any:
    """For a target with Partial placements: the constant this rank holds instead of the
    value (0 for SUM off the first coordinate, 1 for PROD), or None to load the value."""
    for mesh_dim, reduce_type in held.partial:
        if held.mesh_coord[mesh_dim] != 0:
            if reduce_type == "kRedSum":
                return 0
            if reduce_type == "kRedProd":
                return 1
    return None


class _NoTarget:
    array = None
    replacement = None

    def finish(self):
        pass


class _NumpyTarget:
    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise MismatchError("numpy arrays loaded in place must be C-contiguous and writable")
        self.array = array
        self.replacement = None

    def fill(self, value):
        self.array[...] = value

    def finish(self):
        pass


def read_metadata(path: str, unique_id: int | None = None) -> Metadata:
    """The metadata of a checkpoint (default: the highest complete one), validated. Reads one
    file, needs no process group."""
    path = os.fspath(path)
    _check_id(unique_id)
    listing = storage.list_checkpoints(path)
    if unique_id is None:
        if listing.latest is None:
            raise FormatError(f"no complete checkpoint in {path}: no *.metadata file was found")
        unique_id = listing.latest
    return storage.read_metadata(path, unique_id)
