"""save_state_dict / load_state_dict: build this process's rank (:mod:`paddle_dcp.parallel.ranks`)
and run the protocol (:mod:`paddle_dcp.parallel.protocol`) on it.

Save: flatten -> reduce Partial -> describe local pieces -> choose the id -> gather summaries
at the coordinator -> plan -> scatter assignments -> write data files -> gather checksums ->
the coordinator writes the metadata last. Load: flatten -> list the ids and choose one -> read
the metadata (or the parts of it this rank needs) -> match keys and plan the reads -> route the
reads of files a rank cannot see to ranks that can -> verify every block to be read, before any
target changes -> read and copy into the targets (or exchange with the other ranks) -> set plain
values. Every local step ends with an agreement, so a failure anywhere raises on every rank
instead of leaving one waiting.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Sequence

from . import async_save as background_saves
from .async_save import AsyncSave, wait_async_save
from .core import aoa
from .core.compress import policy_of
from .core.keys import MissingKeys
from .parallel import protocol
from .parallel.comm import make_comm
from .parallel.state import STATE, ProcessState
from .parallel.options import LoadOptions, SaveOptions
from .parallel.ranks import LocalLoadRank, LocalSaveRank, check_id
from .core.metadata import Metadata
from .errors import ArgumentError, FormatError, UnsupportedError
from .io import is_file, open_storage, storage

logger = logging.getLogger(__name__)


COMM_METHODS = ("send_recv", "broadcast", "multi_group_broadcast", "grouped_send_recv", "parallel_broadcast")


def _worker_peers(worker_groups, comm_method: str) -> frozenset:
    """The global ranks that share one of ``worker_groups`` with this rank (see
    load_state_dict), after checking ``comm_method``."""
    if comm_method not in COMM_METHODS:
        raise ArgumentError(f"comm_method must be one of {', '.join(COMM_METHODS)}; got {comm_method!r}")
    if worker_groups is None:
        return frozenset()
    if not isinstance(worker_groups, (list, tuple)):
        raise ArgumentError(f"worker_groups must be a list of process groups or None, got {type(worker_groups).__name__}")
    import paddle.distributed as dist

    me, near = dist.get_rank(), set()
    for group in worker_groups:
        if group is None:
            continue
        ranks = getattr(group, "ranks", None)
        if ranks is None:
            raise ArgumentError(f"worker_groups holds {type(group).__name__}, not a process group (dist.new_group)")
        if me in ranks:
            near.update(int(r) for r in ranks)
    near.discard(me)
    return frozenset(near)


# ============================================================================ save
def save_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    unique_id: int | None = None,
    async_save: bool = False,
    safetensors: bool = False,
    save_replicas: bool = False,
    *,
    durable: bool = False,
    storage_options: dict | None = None,
    compress: "dict[str, str] | None" = None,
) -> "AsyncSave | None":
    """Save a (nested) state dict of dist tensors, plain tensors, ShardedWeights and plain values.

    Every rank writes the pieces assigned to it to ``{rank}_{unique_id}.distcp`` (or
    ``.safetensors``); replicated pieces are written once, by ranks chosen to balance the bytes. The coordinator writes
    ``{unique_id}.metadata`` last: a checkpoint without it is not complete.

    Args:
        state_dict: nested dicts / lists / tuples of paddle tensors (dist or not), numpy arrays,
            paddle's ``ShardedWeight`` (flattened ones included; saved under their state-dict
            key, as paddle does) and plain values (None, bool, int, float, str; taken from the
            coordinator).
        path: the checkpoint directory (created if needed).
        process_group: the group of ranks that save; default: all ranks.
        coordinator_rank: global rank that plans and writes the metadata.
        unique_id: the checkpoint's id; default: one more than the highest complete id in
            ``path`` (0 for the first).
        async_save: return as soon as this rank's pieces are copied to host memory (the
            first async save of a process: written to its data file) and finish in the
            background; returns an :class:`AsyncSave` handle (``wait()``), which raises any
            rank's failure after the planning.
        safetensors: write each rank's data file as a safetensors file,
            ``{rank}_{unique_id}.safetensors``, that other tools open (its header names every
            piece: the key, and the box in ``key[begin:end,...]`` when it is a part); the
            metadata still places every piece and a load reads it as any checkpoint.
        save_replicas: every holder of a replicated piece writes its own copy (instead of one
            holder for all), so that ranks whose node-local disk holds a copy load it without
            receiving it from another rank.
        durable: fsync every data file, the metadata and the directory before the save counts
            as done, so the checkpoint survives a power loss (the rename order alone already
            makes a crash of the process leave either the old or the new checkpoint).
        storage_options: for a URL ``path`` (``s3://bucket/prefix``): options passed to
            fsspec (e.g. ``endpoint_url``, ``key``, ``secret``), and paddle_dcp's own
            ``part_size``, ``parts_in_flight``, ``read_concurrency``, ``read_chunk_bytes``,
            ``read_ahead_bytes``, ``read_cache_bytes``, ``retries``, ``retry_deadline`` (see
            the guide's object storage section).
        compress: ``{regex: "int8" | "int4"}``: the float16, bfloat16 and float32 tensors
            whose flat key a regex matches (``re.search``; the first that matches wins) are
            stored quantized in blocks of 256 elements, each with its own minimum and step
            (``paddle_dcp.ADAMW_MOMENTS_INT8`` / ``ADAMW_MOMENTS_INT4``: AdamW's moments); a
            load dequantizes them into any layout. Every rank passes the same. Matched tensors
            of other dtypes are saved as they are (docs/guide.md, "Compressed checkpoints").

    Raises:
        ArgumentError: a bad ``compress`` (or ``compress`` with ``safetensors=True``, whose
            rank files hold raw tensors only).
        UnsupportedError: a tensor to compress holds a NaN or an infinity (naming its key).
        CollectiveError: on every rank, when a step failed on some rank (several ranks).
        DcpError: the failure itself (one rank).
    """
    policy = policy_of(compress)
    if policy is not None and safetensors:
        raise ArgumentError("compress cannot be used with safetensors=True: a safetensors rank file holds raw tensors only")
    wait_async_save()  # a save starts when the previous async one has finished (or raises its error)
    path = os.fspath(path)
    comm = make_comm(process_group, coordinator_rank)
    options = SaveOptions(safetensors, bool(save_replicas), durable, async_save, policy)
    rank = LocalSaveRank.of_process(comm, state_dict, open_storage(path, storage_options), unique_id, options)
    handle = run_save(comm, rank, path)
    return handle if async_save else None


def run_save(
    comm, rank: LocalSaveRank, path: str, after: "Sequence[protocol.Step] | None" = None
) -> "AsyncSave | protocol.SaveResult":
    """The one driver of a save: run the save of ``rank`` and the steps ``after`` it
    (:func:`paddle_dcp.parallel.protocol.save`; default: publishing its metadata) to the end,
    or, for an async save (``rank.staged``), until it detaches, the rest on the writer thread
    over the group's background comm. Returns the SaveResult, or the AsyncSave handle."""
    started = time.perf_counter()
    run = protocol.save(rank, after)
    if not rank.staged:  # the collector paused on the caller's thread only, never under the training's feet
        result = protocol.quiet_collector(protocol.run, comm, run)
        STATE.traffic["save"] = comm.traffic
        _log_saved(result, path, started)
        return result
    try:
        protocol.run(comm, run, until_detach=True)
    except BaseException:
        STATE.staging.done()
        raise
    logger.info("async save to %s: state staged in %.3f s, writing in the background", path, time.perf_counter() - started)

    def finish() -> int:
        try:  # the background group is made once per group of ranks, here, off the caller's path
            background = comm.private() if comm.size > 1 else comm
            result = protocol.run(background, run)
        finally:
            STATE.staging.done()
        _log_saved(result, path, started)
        return result.unique_id

    return background_saves.submit(finish)


def _log_saved(result, path: str, started: float) -> None:
    logger.info(
        "saved checkpoint %d to %s: %d bytes written by this rank in %.3f s%s",
        result.unique_id, path, result.bytes_written, time.perf_counter() - started,
        " (plan reused)" if result.plan_reused else "",
    )


# ============================================================================ load
def load_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    unique_id: int | None = None,
    offload: bool = False,
    mw_name_compatibility: bool = True,
    aoa_config: dict | None = None,
    safetensors: bool = False,
    worker_groups: list | None = None,
    comm_method: str = "broadcast",
    *,
    verify: bool = True,
    strict: bool = True,
    allow_missing: str | list[str] | None = None,
    storage_options: dict | None = None,
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
        offload: keep the checkpoint's data in host memory until it is copied into the state
            dict's tensors, in place, with no pinned memory (paddle's meaning; the tensors stay
            where they are; on the CPU nothing changes).
        mw_name_compatibility: load ``master_weights.X`` from ``X_fp32_master_0`` and back,
            as paddle.distributed does.
        aoa_config: paddle's AOA statements (``{"aoa_statements": [...]}``) saying how the
            checkpoint's tensors make the state dict's: renames, transposes, fused weights
            split or merged, casts. paddle's own engine interprets them; each rank still reads
            only the byte ranges its pieces need. Needs every rank to read the metadata.
        safetensors: ``path`` may also be a directory of safetensors files without a
            checkpoint of ours: a Hugging Face ``model.safetensors``, or shards and their
            ``model.safetensors.index.json`` (else every ``*.safetensors`` in it). Its tensors
            load into any layout, each rank reading only its byte ranges; those files have no
            checksums, so none are checked. A checkpoint of ours (``*.metadata``) loads as usual.
        worker_groups: process groups whose ranks this rank prefers as senders when it must
            receive bytes of a file it cannot read (node-local disks): a rank of one of its
            groups that can read the file serves it, else any rank that can. ``None`` entries
            are skipped.
        comm_method: paddle's names of its reshard transfers, all accepted: ``"send_recv"``,
            ``"grouped_send_recv"``, ``"broadcast"``, ``"multi_group_broadcast"``,
            ``"parallel_broadcast"``. paddle_dcp moves checkpoint bytes between ranks only when
            a rank cannot read a file, and then point to point over a connection of the two ranks,
            each receiving only its byte ranges, whichever value is given: a broadcast would
            send the same bytes to ranks that read them from storage themselves. Any other
            value raises ArgumentError (a ValueError) naming these.
        verify: check every block's checksum before any tensor changes (the default); off,
            damaged bytes would be loaded silently.
        strict: a state-dict key the checkpoint lacks raises MismatchError (the default);
            ``False`` warns and leaves it unchanged, as paddle.distributed does.
        allow_missing: regular expressions (one or a list), each searched in the flat key:
            keys they match may be missing from the checkpoint (a warning, left unchanged)
            while ``strict`` holds for every other key; e.g. ``"inv_freq$"``.
        storage_options: for a URL ``path``, as in :func:`save_state_dict`.

    Raises:
        MismatchError: a shape or dtype differs (the message names the key and both).
        FormatError / IntegrityError / StorageError: no or a damaged checkpoint.
        CollectiveError: on every rank, when a step failed on some rank (several ranks).
    """
    near = _check_load_arguments(path, aoa_config, worker_groups, comm_method, storage_options)
    missing = MissingKeys.of(strict, allow_missing)
    if is_file(path, storage_options):  # one safetensors file (save_gathered): each process reads its own part
        return _load_one_file(state_dict, path, offload, mw_name_compatibility, missing, storage_options)
    path = os.fspath(path)
    options = LoadOptions(offload, mw_name_compatibility, aoa_config, safetensors, near, verify, missing)
    rank = LocalLoadRank(
        make_comm(process_group, coordinator_rank), state_dict, path, open_storage(path, storage_options), unique_id, options,
    )
    rank.run()


def _load_one_file(state_dict, path, offload: bool, mw: bool, missing: MissingKeys, storage_options) -> None:
    from .singlefile import load_file

    load_file(state_dict, path, offload=offload, mw_name_compatibility=mw, missing=missing, storage_options=storage_options)


def _check_load_arguments(path, aoa_config, worker_groups, comm_method: str, storage_options=None) -> frozenset:
    """Check load_state_dict's arguments, after any pending async save of this process (a load
    never reads an older checkpoint than one this process asked to save); returns the worker
    groups' peers of this rank."""
    near = _worker_peers(worker_groups, comm_method)
    wait_async_save()
    if aoa_config is not None:
        aoa.check_config(aoa_config)
        if is_file(path, storage_options):
            raise UnsupportedError(f"aoa_config applies to a checkpoint directory; {path} is a file")
    return near


def read_metadata(path: str, unique_id: int | None = None, *, storage_options: dict | None = None) -> Metadata:
    """The metadata of a checkpoint (default: the highest complete one), validated. Reads one
    file, needs no process group; ``path`` may be a URL (``storage_options`` as in
    :func:`save_state_dict`)."""
    path = os.fspath(path)
    check_id(unique_id)
    store = open_storage(path, storage_options)
    listing = storage.list_checkpoints(store, temporary=False)
    if unique_id is None:
        if listing.latest is None:
            raise FormatError(f"no complete checkpoint in {path}: no *.metadata file was found")
        unique_id = listing.latest
    return storage.read_metadata(store, unique_id)


def process_state() -> ProcessState:
    """What paddle_dcp keeps in this process between calls, in one object: the save plans the
    next save of the same layout reuses (``save_plans``), the last save's and load's planning
    traffic (``traffic``), the async saves' staging memory (``staging``) and the gloo groups and
    connections it made (``groups``). ``reset()`` forgets and frees them (``close`` does that
    after waiting for the async saves)."""
    return STATE


def close() -> None:
    """Release what paddle_dcp keeps in this process between calls (:func:`process_state`):
    wait for its async saves (raising the first error), free their staging memory (pinned on a
    GPU), forget the save plans, and release the gloo groups and point-to-point connections it
    made. The next call makes what it needs again. Every rank of a group calls it (a group made
    again is made by all its members)."""
    background_saves.wait_async_save()
    STATE.reset()
