"""save_state_dict / load_state_dict: the protocol, step by step.

Save: flatten -> reduce Partial -> describe local pieces -> choose the id -> gather summaries
at the coordinator -> plan -> scatter assignments -> write data files -> gather checksums ->
the coordinator writes the metadata last. Load: flatten -> choose the id -> read metadata ->
match keys -> plan reads -> read, verify, copy -> set plain values. Every local step ends with
an agreement, so a failure anywhere raises on every rank instead of leaving one waiting.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import xxhash

from .core import aoa, load_plan, nested, save_plan
from .core.keys import match_keys, missing_message, reconcile
from .dist import exchange, protocol, wire
from .format import hf_dir
from .io import open_storage, storage
from .dist.comm import Comm, make_comm
from .dist.device import TargetBuffer, host_bytes, staged_copy
from .errors import DcpError, FormatError, MismatchError, PlanError, StorageError, UnsupportedError
from .core.metadata import DEFAULT_BLOCK_BYTES, Metadata
from .core.boxes import Box
from .dist.placements import describe, has_partial, is_sharded_weight, is_tensor, reduce_partial, rewrap
from .version import __version__

logger = logging.getLogger(__name__)


def _check_id(unique_id) -> None:
    if unique_id is not None and (type(unique_id) is not int or unique_id < 0):
        raise DcpError(f"unique_id must be a non-negative int or None, got {unique_id!r}")


COMM_METHODS = ("send_recv", "broadcast", "multi_group_broadcast", "grouped_send_recv", "parallel_broadcast")


def _worker_peers(worker_groups, comm_method: str) -> frozenset:
    """The global ranks that share one of ``worker_groups`` with this rank (see
    load_state_dict), after checking ``comm_method``."""
    if comm_method not in COMM_METHODS:
        raise UnsupportedError(f"comm_method must be one of {', '.join(COMM_METHODS)}; got {comm_method!r}")
    if worker_groups is None:
        return frozenset()
    if not isinstance(worker_groups, (list, tuple)):
        raise UnsupportedError(f"worker_groups must be a list of process groups or None, got {type(worker_groups).__name__}")
    import paddle.distributed as dist

    me, near = dist.get_rank(), set()
    for group in worker_groups:
        if group is None:
            continue
        ranks = getattr(group, "ranks", None)
        if ranks is None:
            raise UnsupportedError(f"worker_groups holds {type(group).__name__}, not a process group (dist.new_group)")
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
        async_save: return as soon as every rank's pieces are copied to host memory and
            finish writing in the background; returns an :class:`AsyncSave` handle (``wait()``).
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

    Raises:
        CollectiveError: on every rank, when a step failed on some rank (several ranks).
        DcpError: the failure itself (one rank).
    """
    wait_async_save()  # a save starts when the previous async one has finished (or raises its error)
    path = os.fspath(path)
    store = open_storage(path)
    comm = make_comm(process_group, coordinator_rank)
    started = time.perf_counter()
    state: dict[str, Any] = {}

    def prepare():
        _check_id(unique_id)
        state["flat"] = nested.flatten(state_dict, is_tensor, keep_values=False)
        store.create()
        state["tensors"] = dict(state["flat"].tensors)

    def reduce():
        state["reduced"] = {
            key: reduce_partial(key, value, comm.rank, comm)
            for key, value in state["tensors"].items()
            if has_partial(value)
        }

    def describe_all():
        held = [describe(k, v, comm.rank, flat_ok=True) for k, v in state["tensors"].items()]
        for h in held:
            if h.piece.key in state["reduced"] and h.local is not None:
                h.local = state["reduced"][h.piece.key]
        state["held"] = held
        # one row per piece: a flattened ShardedWeight is several pieces of one key
        state["rows"] = [(i, piece, at) for i, h in enumerate(held) for piece, at in h.pieces()]
        return state["flat"].skeleton, [piece for _, piece, _ in state["rows"]]

    def choose_id():
        return unique_id if unique_id is not None else _next_id(store)

    def prepare_id(uid):
        storage.remove_temporary(store, uid, comm.rank)
        if comm.is_coordinator:
            storage.remove_temporary(store, uid, -1)
        gens = store.list_checkpoints().generations(uid)
        return max(gens) if gens else -1

    def write(uid, generation, leaves):
        name = storage.data_file_name(comm.rank, uid, generation, "safetensors" if safetensors else "distcp")
        return _write_pieces(store, name, state["held"], state["rows"], leaves, durable, safetensors)

    def publish(meta):
        if safetensors:
            meta = hf_dir.rename_files(meta)
        store.write_atomic(storage.metadata_name(meta.unique_id), meta.to_json(), durable)

    def tidy(uid, generation):
        storage.remove_data(store, uid, comm.rank, keep_generation=generation)

    ctx = protocol.SaveRank(
        rank=comm.rank,
        ranks=comm.ranks,
        coordinator=comm.coordinator,
        prepare=prepare,
        reduce=reduce,
        describe=describe_all,
        choose_id=choose_id,
        prepare_id=prepare_id,
        write=write,
        values=lambda: state["flat"].values,
        publish=publish,
        tidy=tidy,
        block_bytes=DEFAULT_BLOCK_BYTES,
        created_by=f"paddle_dcp {__version__}",
        cache=_SAVE_PLANS,
        replicas=bool(save_replicas),
        layout=hf_dir.layout_plan if safetensors else None,
    )
    if not async_save:
        result = protocol.run(comm, protocol.save(ctx))
        _LAST_TRAFFIC["save"] = comm.traffic
        _log_saved(result, path, started)
        return None

    def stage(rows):
        for i in sorted({state["rows"][row][0] for row in rows.tolist()}):
            state["held"][i].local = staged_copy(state["held"][i].local)

    ctx.stage = stage
    run = protocol.save(ctx)
    protocol.run(comm, run, until_detach=True)
    background = comm.private() if comm.size > 1 else comm
    logger.info("async save to %s: state staged in %.3f s, writing in the background", path, time.perf_counter() - started)

    def finish():
        result = protocol.run(background, run)
        _log_saved(result, path, started)
        return result.unique_id

    handle = AsyncSave(finish)
    _PENDING.append(handle)
    return handle


def _log_saved(result, path: str, started: float) -> None:
    logger.info(
        "saved checkpoint %d to %s: %d bytes written by this rank in %.3f s%s",
        result.unique_id, path, result.bytes_written, time.perf_counter() - started,
        " (plan reused)" if result.plan_reused else "",
    )


class AsyncSave:
    """A save finishing in the background (``save_state_dict(..., async_save=True)``).

    The call that made it returned once every rank's pieces were copied to host memory; the
    tensors may change from then on. Its data files and metadata are written by a thread, over
    a process group of its own. :meth:`wait` (or the next save, or :func:`wait_async_save`)
    waits for it and raises its error, if it failed.
    """

    def __init__(self, fn):
        self._done = threading.Event()
        self._result: int | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="paddle_dcp-async-save", daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        """True once the save finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the save; returns its unique id.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            DcpError: the background save's own error.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the async save did not finish within {timeout} s")
        if self in _PENDING:
            _PENDING.remove(self)
        if self._error is not None:
            raise self._error
        return self._result


_PENDING: list[AsyncSave] = []


def wait_async_save(timeout: float | None = None) -> None:
    """Wait for every async save of this process to finish; raise the first error."""
    errors = []
    for handle in list(_PENDING):
        try:
            handle.wait(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)
    if errors:
        raise errors[0]


@atexit.register
def _finish_pending_saves() -> None:  # an interpreter exiting must not abandon a save
    for handle in list(_PENDING):
        try:
            handle.wait()
        except BaseException as exc:  # noqa: BLE001 - nobody is left to raise it to
            logger.error("an async save failed: %s", exc)


# A group's last save plan, reused while no rank's layout changes (see protocol.save).
_SAVE_PLANS: dict = {}
# The planning traffic of this process's last save and load (for the scale check).
_LAST_TRAFFIC: dict = {}


def _next_id(store: storage.Storage) -> int:
    latest = store.list_checkpoints().latest
    return 0 if latest is None else latest + 1


def _write_pieces(
    store: storage.Storage, name: str, held, rows, chosen: np.ndarray, durable: bool, safetensors: bool = False
) -> tuple[int, list[int]]:
    """Write the ``chosen`` rows (held index, piece, start in the flat local or None); a
    safetensors rank file starts with the header the coordinator's layout_plan counted."""
    if not len(chosen):
        return 0, []
    sums: list[int] = []
    if safetensors:
        pieces = [rows[row][1] for row in chosen.tolist()]
        header = hf_dir.rank_header([(p.key, p.dtype, p.box.offsets, p.box.shape, p.global_shape) for p in pieces])
        writer = store.data_writer(name, DEFAULT_BLOCK_BYTES, header=header, alignment=1)
    else:
        writer = store.data_writer(name, DEFAULT_BLOCK_BYTES)
    last, data = None, None
    try:
        for row in chosen.tolist():
            i, piece, at = rows[row]
            if i != last:  # the pieces of a flattened ShardedWeight share one host copy
                last, data = i, host_bytes(held[i].local)
            array = data.array if at is None else data.array.reshape(-1)[at : at + piece.box.volume]
            seed = storage.piece_seed(piece.key, piece.dtype, piece.box.offsets, piece.box.shape)
            sums.extend(writer.write(storage.as_bytes(array), keep=data, seed=seed))
        return writer.commit(durable), sums
    except BaseException:
        writer.abort()
        raise


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
            a rank cannot read a file, and then point to point over a group of the two ranks,
            each receiving only its byte ranges, whichever value is given: a broadcast would
            send the same bytes to ranks that read them from storage themselves. Any other
            value raises UnsupportedError (a ValueError) naming these.
        verify: check every block's checksum before any tensor changes (the default); off,
            damaged bytes would be loaded silently.
        strict: a state-dict key the checkpoint lacks raises MismatchError (the default);
            ``False`` warns and leaves it unchanged, as paddle.distributed does.

    Raises:
        MismatchError: a shape or dtype differs (the message names the key and both).
        FormatError / IntegrityError / StorageError: no or a damaged checkpoint.
        CollectiveError: on every rank, when a step failed on some rank (several ranks).
    """
    near = _worker_peers(worker_groups, comm_method)
    wait_async_save()  # never load an older checkpoint than one this process asked to save
    if aoa_config is not None:
        aoa.check_config(aoa_config)
        if os.path.isfile(path):
            raise UnsupportedError(f"aoa_config applies to a checkpoint directory; {path} is a file")
    if os.path.isfile(path):  # one safetensors file (save_gathered): each process reads its own part
        from . import singlefile

        return singlefile.load_file(
            state_dict, path, offload=offload, mw_name_compatibility=mw_name_compatibility, strict=strict
        )
    path = os.fspath(path)
    store = open_storage(path)
    comm = make_comm(process_group, coordinator_rank)
    started = time.perf_counter()
    state: dict[str, Any] = {}

    def inspect():
        _check_id(unique_id)
        state["flat"] = nested.flatten(state_dict, is_tensor)
        state["held"] = [describe(k, v, comm.rank, flat_ok=True) for k, v in state["flat"].tensors.items()]
        listing = store.list_checkpoints()
        if safetensors and listing.latest is None:  # a directory of safetensors files
            state["directory"] = True
            names, _ = hf_dir.shard_names(path)
            uid = unique_id if unique_id is not None else 0
            return storage.Listing(frozenset({uid}), {}, names=frozenset(names))
        return listing

    def read_metadata(uid):
        if state.get("directory"):
            return hf_dir.directory_metadata(path, uid)
        return store.read_metadata(uid, lazy=True)

    def helpers(readers, meta):
        if aoa_config is not None:  # every rank knows the readers: all raise the same error
            others = [r for r in comm.ranks if r not in readers]
            raise UnsupportedError(
                f"aoa_config needs every rank to read the metadata of the checkpoint in {path}; "
                f"ranks {others} cannot (node-local disks): copy it to them"
            )
        return protocol.Pairwise(
            "metadata from helpers",
            lambda c: _metadata_from_helpers(c, readers, meta, state["flat"], state["held"], mw_name_compatibility),
        )

    def plan(meta, uid, listing, statuses):
        remap = None
        if aoa_config is not None:
            from .dist.aoa_paddle import Remap

            remap = Remap(aoa_config, aoa.source_shards(meta), state["all_targets"])
        checks = verify and meta.checksum_algorithm != hf_dir.NO_CHECKSUMS
        work = _plan_load(
            comm, state["flat"], state["held"], meta, path, offload, mw_name_compatibility, checks, strict,
            _visible_files(listing, uid), remap,
        )
        work.split(comm, uid, listing, statuses, near)
        work.state_dict = state_dict
        return work

    ctx = protocol.LoadRank(
        rank=comm.rank,
        ranks=comm.ranks,
        coordinator=comm.coordinator,
        unique_id=unique_id,
        path=path,
        inspect=inspect,
        read_metadata=read_metadata,
        metadata_from_helpers=helpers,
        plan=plan,
    )
    if aoa_config is not None:  # paddle's engine needs every rank's targets
        ctx.targets = lambda: wire.encode_json(
            aoa.encode_targets((h.piece.key, h.piece.dtype, h.piece.global_shape, h.piece.box) for h in state["held"] if h.piece.box is not None)
        )
        ctx.all_targets = lambda blobs: state.update(all_targets=aoa.merge_targets(wire.decode_json(b) for b in blobs))
    uid, work = protocol.run(comm, protocol.load(ctx))
    _LAST_TRAFFIC["load"] = comm.traffic
    logger.info(
        "loaded checkpoint %d from %s: %d bytes by this rank in %.3f s",
        uid, path, sum(op.nbytes for op in work.ops), time.perf_counter() - started,
    )


def _metadata_from_helpers(comm: Comm, readers, meta, flat, held, mw: bool) -> Metadata:
    """Ranks without the metadata file get the part they need from a rank that has it."""
    non_readers = [r for r in comm.ranks if r not in readers]
    helper_of = {r: readers[i % len(readers)] for i, r in enumerate(non_readers)}
    my_helper = helper_of.get(comm.rank)
    my_clients = [r for r, h in helper_of.items() if h == comm.rank]
    request = b""
    if my_helper is not None:
        pieces = [piece for h in held for piece, _ in h.pieces()]
        request = wire.encode_summary(save_plan.SaveSummary.from_pieces(comm.rank, flat.skeleton, pieces))

    def answer(client: int, question: bytes) -> bytes:
        summary = wire.decode_summary(question, client)
        keys = nested.tensor_keys(summary.skeleton)
        match = match_keys(keys, list(meta.tensors), mw)
        targets = []
        for row, i in enumerate(summary.leaves_of_rows().tolist()):
            key, box = keys[i], summary.piece_box(row)
            if box is not None and key in match.source:
                targets.append(load_plan.TargetPiece(match.source[key], summary.dtypes[i], summary.global_shapes[i], box))
        plain = reconcile(keys, summary.skeleton, list(meta.tensors), meta.structure, mw).plain
        return load_plan.restrict(meta, targets, list(match.source.values()), [p for p, _ in plain]).to_json()

    reply = exchange.ask_for_metadata(comm, my_helper, request, my_clients, answer)
    if reply is not None:
        meta = Metadata.from_json(reply, source=f"part of the metadata sent by rank {my_helper}", allow_subset=True)
    return meta


def _visible_files(listing, uid: int) -> set[str]:
    """Names of the data files of checkpoint ``uid`` that this rank sees (with a directory of
    safetensors files, every file of it)."""
    return set(listing.data_names(uid)) | {n for n in listing.names if storage.parse_data_name(n) is None}


class _LoadPlan:
    """One rank's load: read ops, the buffers they fill, and what finishes each buffer.

    ``buffers`` / ``fills`` are per state-dict tensor; ``views`` are the arrays the ops'
    copies name (one per target box, views of the buffers), followed by one staging array
    per ``staged`` part of an aoa_config mapping."""

    def __init__(self, flat, meta, ops, files, buffers, fills, views, verify: bool = True, staged=()):
        self.flat, self.meta = flat, meta
        self.ops, self.files, self.buffers, self.fills, self.views = ops, files, buffers, fills, views
        self.verify = verify
        self.staging = storage.Staging()
        self.local, self.remote = list(ops), {}
        self.checks: list | None = None  # this rank's share of the checks, when shared
        self.state_dict = None
        self.plain: tuple = ()  # the checkpoint's subtrees without tensors, restored whole
        self.store: storage.Storage | None = None  # where ``files`` are (ranges served to others)
        self.staged = list(staged)  # aoa_config parts: read here, then permuted / cast into views
        self.arrays = list(views) + aoa.staging_arrays(self.staged)
        self.run = lambda op, fetch: storage.execute_op(op, files, self.arrays, self.staging, verify, fetch)

    def split(self, comm: Comm, uid: int, listing, statuses, near: frozenset = frozenset()) -> None:
        """Ops on files this rank can read, and the others by the rank that will serve them
        (one of the ranks ``near``, the worker groups', when one can). Every local file is
        opened (and its size checked) before any byte moves."""
        mine = _visible_files(listing, uid)
        self.local, self.remote = [], {}
        for op in self.ops:
            name = self.meta.files[op.file].name
            if name in mine:
                self.local.append(op)
                continue
            writer, _, gen = storage.parse_data_name(name) or (-1, -1, -1)
            servers = [  # no "f": every rank sees the same files as this one
                r for r, s in zip(comm.ranks, statuses)
                if r != comm.rank and wire.in_runs(s.get("f", {}).get(str(gen), ()), writer)
            ]
            if not servers:
                keys = sorted({seg.piece.key for seg in op.segments})
                raise StorageError(f"no rank can read data file {name} of checkpoint {uid}, needed for {keys}")
            servers = [r for r in servers if r in near] or servers
            self.remote.setdefault(servers[comm.rank % len(servers)], []).append(op)
        for f in sorted({op.file for op in self.local}):
            try:
                self.files.open(f)
            except DcpError as exc:
                keys = sorted({seg.piece.key for op in self.local if op.file == f for seg in op.segments})
                raise type(exc)(f"{exc}; it holds {keys}") from None

    def _read_keys(self) -> list[str]:
        """The checkpoint's tensors this rank reads from its own files, sorted."""
        return sorted({seg.piece.key for op in self.local for seg in op.segments})

    @property
    def share_key(self) -> tuple[int, bool]:
        """(digest of the tensors this rank reads, whether it may share their checks): ranks
        that agree on both check the blocks of those tensors once between them."""
        keys = self._read_keys()
        digest = xxhash.xxh3_64_intdigest("\0".join(keys).encode()) >> 1  # fits an int64
        # every piece of these tensors is dealt out: worth it only when the rank reads a fair
        # part of them (a few ranks resharding), not one piece in thousands (a large job)
        pieces = sum(self.meta.tensors[k].pieces.count for k in keys)
        own = sum(len(op.segments) for op in self.local)
        # with replicas, ranks on other nodes read other copies: nothing to share
        shared = not self.meta.subset and not self.meta.replicas
        return digest, bool(self.verify and keys and shared and pieces <= 8 * own + 65536)

    def share_checks(self, index: int, count: int) -> None:
        """Check only this rank's share of the blocks (see load_plan.plan_shared_checks); every
        rank reads the same files and tensors, and the verify step's agreement covers them all."""
        self.checks = load_plan.plan_shared_checks(self.meta, self._read_keys(), index, count)

    def verify_local(self) -> None:
        """Check the checksum of every block this rank will read from its own files (or its
        share of them), before any target changes."""
        if not self.verify:
            return
        for op in storage.read_ahead(self.files, self.local if self.checks is None else self.checks):
            storage.execute_op(op, self.files, [], self.staging, check_only=True)

    def verify_remote(self, comm: Comm, clients) -> None:
        """The same for the blocks other ranks will send: their servers hash them first."""
        if not self.verify:
            return
        blocks = lambda op: [b for seg in op.segments for b in storage.segment_blocks(self.meta, seg)]  # noqa: E731
        exchange.check_remote(comm, self.store, self.remote, clients, blocks, lambda i: self.meta.files[i].name)

    def read_local(self) -> None:
        """Copy from the local files. Their blocks were checked in the verify step, so they are
        not hashed again; a file written since it was opened is refused once the copy ends."""
        try:
            for op in storage.read_ahead(self.files, self.local):
                storage.execute_op(op, self.files, self.arrays, self.staging, verify=False)
            self.files.check_unchanged()
        finally:
            if not self.remote:
                self.files.close()

    def exchange(self, comm: Comm, clients) -> None:
        try:
            exchange.fetch_remote(comm, self.store, self.remote, clients, lambda i: self.meta.files[i].name, self.run)
        finally:
            self.files.close()

    def finish(self) -> None:
        """Fill constants, copy host buffers to their devices, put offloaded tensors and the
        checkpoint's plain values into the state dict."""
        aoa.apply(self.staged, self.arrays)
        for buffer, fill in zip(self.buffers, self.fills):
            if fill is not None:
                buffer.fill(fill)
            buffer.finish()
        for key, buffer in zip(self.flat.tensors, self.buffers):
            if buffer.replacement is None:
                continue
            value = self.flat.tensors[key]
            if is_sharded_weight(value):  # the ShardedWeight stays, holding the offloaded tensor
                value.local_tensor = buffer.replacement
            else:
                nested.set_tensor(self.state_dict, self.flat.paths[key], buffer.replacement)
        for path, node in self.plain:
            nested.assign_subtree(self.state_dict, path, node)


def _plan_load(
    comm: Comm,
    flat: nested.Flat,
    held,
    meta: Metadata,
    path: str,
    offload: bool,
    mw: bool,
    verify: bool = True,
    strict: bool = True,
    visible: set[str] = frozenset(),
    remap=None,
) -> _LoadPlan:
    # keys the aoa_config fills are not missing; checkpoint keys it reads are not unexpected
    mapped, used = remap.filled(list(flat.tensors), meta.tensors) if remap is not None else (set(), set())
    tensor_keys = [k for k in flat.tensors if k not in mapped]
    keys = reconcile(tensor_keys, flat.skeleton, list(meta.tensors), meta.structure, mw)
    match, unexpected = keys.match, [k for k in keys.unexpected if k not in used]
    where = f"checkpoint {meta.unique_id} in {path}"
    if keys.missing and strict:
        raise MismatchError(missing_message(keys.missing, where))
    if keys.missing:
        logger.warning("keys of the state_dict not found in %s (left unchanged): %s", where, list(keys.missing))
    if unexpected and not meta.subset:  # a part lists only what this rank asked for
        logger.warning("keys of %s not in the state_dict (not loaded): %s", where, unexpected)
    meta.prefetch(list(match.source.values()) + sorted(used))
    targets, slots, buffers, fills, views, remapped = [], [], [], [], [], []
    for h in held:
        source = match.source.get(h.piece.key, h.piece.key if h.piece.key in mapped else None)
        if h.local is None or source is None:
            buffers.append(_NoTarget())
            fills.append(None)
            continue
        value = flat.tensors[h.piece.key]
        buffer = _NumpyTarget(h.local) if isinstance(h.local, np.ndarray) else TargetBuffer(h.local, offload, rewrap(value))
        buffers.append(buffer)
        fill = _partial_fill(h)
        fills.append(fill)
        boxes = _key_targets(h, buffer)
        if h.piece.key in mapped:
            if fill is None:
                p = h.piece
                for box, view in boxes:
                    local = aoa.LocalTarget(len(views), p.key, p.dtype, p.global_shape, box)
                    remapped.append((local, remap.maps(p.key, p.dtype, p.global_shape, box)))
                    views.append(view)
            continue
        whole = load_plan.TargetPiece(source, h.piece.dtype, h.piece.global_shape, h.piece.box)
        if fill is not None or not boxes:  # nothing to read, but the shape and dtype must still agree
            load_plan.check_targets(meta, [whole])
            continue
        for box, view in boxes:
            targets.append(load_plan.TargetPiece(source, h.piece.dtype, h.piece.global_shape, box))
            slots.append(len(views))
            views.append(view)
    reads = aoa.plan(meta, remapped, first_slot=len(views))
    targets, slots = targets + reads.pieces, slots + reads.slots
    source = os.path.join(path, storage.metadata_name(meta.unique_id)) if not meta.subset else "the metadata part"
    readable = np.array([f.name in visible for f in meta.files], dtype=bool)
    try:
        ops = load_plan.plan_reads(meta, targets, slots=slots, readable=readable)
    except PlanError as exc:  # the checkpoint's pieces overlap or leave a gap
        raise FormatError(f"{source}: {exc}") from None
    meta.check_digest()  # after the structure of what this rank uses, before any byte moves
    store = open_storage(path)
    work = _LoadPlan(flat, meta, ops, store.open_files(meta), buffers, fills, views, verify, reads.staged)
    work.plain, work.store = keys.plain, store
    return work


def _key_targets(held, buffer) -> list[tuple[Box, np.ndarray]]:
    """What this rank fills of one state-dict tensor: every box (in_global) with the host array
    it lands in, a view of the tensor's buffer (the one place a key's targets are built). A
    flattened ShardedWeight fills the boxes its range covers, each a segment of its flat local
    tensor; any other tensor fills its one box."""
    if held.parts is not None:
        flat = buffer.array.reshape(-1)
        return [(box, flat[at : at + box.volume].reshape(box.shape)) for box, at in held.parts]
    box = held.piece.box
    return [(box, buffer.array.reshape(box.shape))]


def _partial_fill(held) -> Any:
    """For a target with Partial placements: the constant this rank holds instead of the
    value (0 for SUM off the first coordinate, 1 for PROD), or None to load the value."""
    for mesh_dim, reduce_type in held.partial:
        if held.mesh_coord[mesh_dim] != 0:
            if reduce_type == "sum":
                return 0
            if reduce_type == "prod":
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
    store = open_storage(path)
    listing = store.list_checkpoints()
    if unique_id is None:
        if listing.latest is None:
            raise FormatError(f"no complete checkpoint in {path}: no *.metadata file was found")
        unique_id = listing.latest
    return store.read_metadata(unique_id)
