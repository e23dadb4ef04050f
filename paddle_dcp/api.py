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

from . import nested, planner, storage, wire
from .comm import Comm, make_comm
from .device import TargetBuffer, host_bytes
from .errors import DcpError, FormatError, MismatchError, StorageError
from .metadata import DEFAULT_BLOCK_BYTES, Metadata
from .placements import describe, has_partial, is_tensor, reduce_partial
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
    """Fill a (nested) state dict in place from a checkpoint.

    Each rank reads only the byte ranges its own pieces need, checks their checksums, and
    copies them into its tensors; plain values are replaced by the checkpoint's. Keys of the
    state dict that the checkpoint lacks are left as they are, with a warning naming them.

    Args:
        state_dict: nested dicts / lists / tuples of paddle tensors (dist or not), numpy
            arrays and plain values, shaped as the checkpoint's tensors.
        path: the checkpoint directory.
        process_group: the group of ranks that load; default: all ranks.
        coordinator_rank: global rank that coordinates.
        unique_id: which checkpoint; default: the highest complete one in ``path``.
        offload: keep loaded values in CPU memory (see docs).
        mw_name_compatibility: load ``master_weights.X`` from ``X_fp32_master_0`` and back,
            as paddle.distributed does.

    Raises:
        MismatchError: a shape or dtype differs (the message names the key and both).
        FormatError / StorageError: no or a damaged checkpoint.
        CollectiveError: on every rank, when a step failed on some rank (several ranks).
    """
    path = os.fspath(path)
    comm = make_comm(process_group, coordinator_rank)
    started = time.perf_counter()
    latest = -1
    with comm.step("inspect"):
        _check_id(unique_id)
        flat = nested.flatten(state_dict, is_tensor)
        if not os.path.isdir(path):
            raise StorageError(f"checkpoint directory {path} does not exist", path)
        listing = storage.list_checkpoints(path)
        latest = listing.latest if listing.latest is not None else -1
    uid = unique_id if unique_id is not None else comm.call("choose id", lambda: comm.all_max([latest]))[0]
    meta: Metadata | None = None
    with comm.step("read metadata"):
        if uid < 0:
            raise FormatError(f"no complete checkpoint in {path}: no *.metadata file was found")
        if uid not in listing.complete:
            raise StorageError(
                f"checkpoint {uid} is not complete in {path}: no {storage.metadata_name(uid)}; "
                f"complete checkpoints there: {sorted(listing.complete) or 'none'}",
                path,
            )
        meta = storage.read_metadata(path, uid)
    with comm.step("plan"):
        reads = _plan_load(comm, flat, meta, path, offload, mw_name_compatibility)
    with comm.step("read"):
        ops, files, buffers, fills = reads
        try:
            storage.execute_reads(ops, files, [b.array for b in buffers])
        finally:
            files.close()
        for buffer, fill in zip(buffers, fills):
            if fill is not None:
                buffer.fill(fill)
            buffer.finish()
    with comm.step("values"):
        for key, buffer in zip(flat.tensors, buffers):
            if buffer.replacement is not None:
                nested.set_tensor(state_dict, flat.paths[key], buffer.replacement)
        saved_values = meta.values()
        nested.set_values(state_dict, flat, {k: saved_values[k] for k in flat.values if k in saved_values})
    logger.info(
        "loaded checkpoint %d from %s: %d bytes read by this rank in %.3f s",
        uid, path, sum(op.nbytes for op in ops), time.perf_counter() - started,
    )


def _plan_load(comm: Comm, flat: nested.Flat, meta: Metadata, path: str, offload: bool, mw: bool):
    saved_values = meta.values()
    wanted = list(flat.tensors) + [k for k in flat.values]
    match = planner.match_keys(list(flat.tensors), list(meta.tensors), mw)
    missing = list(match.missing) + [k for k in flat.values if k not in saved_values]
    for key in match.missing:
        if key in saved_values:
            raise MismatchError(f"{key}: the checkpoint holds a plain value here, the state_dict a tensor")
    for key in flat.values:
        if key in meta.tensors:
            raise MismatchError(f"{key}: the checkpoint holds a tensor here, the state_dict a plain value")
    unexpected = [k for k in match.unexpected if k not in wanted] + [
        k for k in saved_values if k not in flat.values and k not in flat.tensors
    ]
    if missing:
        logger.warning("keys of the state_dict not found in checkpoint %s (left unchanged): %s", path, missing)
    if unexpected:
        logger.warning("keys of checkpoint %s not in the state_dict (not loaded): %s", path, unexpected)
    targets, buffers, fills, index = [], [], [], []
    for key, value in flat.tensors.items():
        held = describe(key, value, comm.rank)
        source = match.source.get(key)
        if held.local is None or source is None:
            buffers.append(_NoTarget())
            fills.append(None)
            continue
        buffer = TargetBuffer(held.local, offload) if not isinstance(held.local, np.ndarray) else _NumpyTarget(held.local)
        buffers.append(buffer)
        fill = _partial_fill(held)
        fills.append(fill)
        piece = held.piece
        target = planner.TargetPiece(source, piece.dtype, piece.global_shape, piece.box)
        if fill is None:
            targets.append(target)
            index.append(len(buffers) - 1)
        else:  # nothing to read, but the shape and dtype must still agree
            planner.check_targets(meta, [target])
    ops = planner.plan_reads(meta, targets)
    # ops refer to targets by their position in `targets`; map to buffers
    ops = [_retarget(op, index) for op in ops]
    files = storage.FileSet(path, meta)
    for f in sorted({op.file for op in ops}):
        files.fd(f)  # every file opened and its size checked before any byte moves
    return ops, files, buffers, fills


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
