"""One rank's load of a checkpoint directory: the plan of its reads and the buffers they
fill (:class:`LoadPlan`, data), and the steps the load protocol runs to carry it out
(:class:`LocalLoadWork`, a :class:`~paddle_dcp.parallel.protocol.LoadWork`).

:func:`plan_load` matches the state dict's keys with the checkpoint's, builds one target per
state-dict tensor (:func:`paddle_dcp.parallel.targets.target_buffer`), and plans the byte
ranges to read into views of them; it opens no file.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np
import xxhash

from ..core import checksums
from ..io import reads
from . import exchange, servers
from .comm import Comm
from .options import LoadOptions
from .device import PinnedStage
from .placements import buffer_like, partial_fill
from .targets import NoTarget, key_targets, target_buffer
from ..core import aoa, load_plan, nested
from ..core.keys import MissingKeys, reconcile, report
from ..core.metadata import Metadata
from ..format.hf_dir import NO_CHECKSUMS
from ..errors import DcpError, FormatError, PlanError, StorageError
from ..io import storage

logger = logging.getLogger(__name__)


def visible_files(listing, uid: int) -> set[str]:
    """Names of the data files of checkpoint ``uid`` that this rank sees (with a directory of
    safetensors files, every file of it)."""
    return set(listing.data_names(uid)) | {n for n in listing.names if storage.parse_data_name(n) is None}


@dataclass(frozen=True, eq=False)
class LoadPlan:
    """One rank's load as data: no file is opened to make it. It is complete when planning
    ends but for the servers of the ops on files this rank cannot read (``elsewhere``), which
    the coordinator names afterwards (:meth:`served`: a new plan with ``remote``).
    :class:`LocalLoadWork` carries it out.

    Attributes:
        meta: the checkpoint's metadata (this rank's part of it).
        ops: every read op, as planned.
        local: the ops on files this rank reads itself.
        elsewhere: the ops on files this rank cannot read: other ranks read them for it.
        remote: server rank -> the ops of ``elsewhere`` that rank reads for this one.
        targets: per state-dict tensor, what it fills (a :class:`LoadTarget`).
        fills: per state-dict tensor, the value it is filled with instead of read (or None).
        views: the arrays the ops' copies name (one per target box, views of the targets'
            buffers).
        staged: aoa_config parts, read into arrays of their own, then permuted or cast into
            ``views``.
        plain: the checkpoint's subtrees without tensors (path, node), put into
            ``state_dict`` whole.
        verify: every block read is checked against its checksum first.
        state_dict: the caller's.
    """

    meta: Any = None
    ops: tuple = ()
    local: tuple = ()
    elsewhere: tuple = ()
    remote: Mapping[int, list] = field(default_factory=dict)
    targets: tuple = ()
    fills: tuple = ()
    views: tuple = ()
    staged: tuple = ()
    plain: tuple = ()
    verify: bool = False
    state_dict: dict = field(default_factory=dict)

    def served(self, answer: servers.Answer) -> "LoadPlan":
        """This plan with the servers the coordinator named (:func:`paddle_dcp.parallel.servers.
        assign`) for the ops ``elsewhere``; StorageError naming the file and the keys when no
        rank can read one."""
        remote: dict[int, list] = {}
        for op in self.elsewhere:
            name = self.meta.files[op.file].name
            server = answer.servers.get(servers.file_key(name))
            if server is None:
                raise _unreadable(name, self.meta.unique_id, op)
            remote.setdefault(server, []).append(op)
        return replace(self, remote=remote)

    @property
    def unreadable(self) -> list[str]:
        """The files of the ops ``elsewhere``, sorted."""
        return sorted({self.meta.files[op.file].name for op in self.elsewhere})

    def read_keys(self) -> list[str]:
        """The checkpoint's tensors this rank reads from its own files, sorted."""
        return sorted({seg.piece.key for op in self.local for seg in op.segments})

    @property
    def share_key(self) -> tuple[int, bool]:
        """(digest of the tensors this rank reads, whether it may share their checks): ranks
        that agree on both check the blocks of those tensors once between them."""
        keys = self.read_keys()
        digest = xxhash.xxh3_64_intdigest("\0".join(keys).encode()) >> 1  # fits an int64
        if not (self.verify and keys):
            return digest, False
        # every piece of these tensors is dealt out: worth it only when the rank reads a fair
        # part of them (a few ranks resharding), not one piece in thousands (a large job)
        pieces = sum(self.meta.tensors[k].pieces.count for k in keys)
        own = sum(len(op.segments) for op in self.local)
        # with replicas, ranks on other nodes read other copies: nothing to share
        shared = not self.meta.subset and not self.meta.replicas
        return digest, bool(shared and pieces <= 8 * own + 65536)


class LocalLoadWork:
    """Carries out one rank's :class:`LoadPlan` step by step (a
    :class:`~paddle_dcp.parallel.protocol.LoadWork`): opens the files it reads itself, checks
    their blocks (and has its servers check theirs), copies and exchanges the bytes, then fills
    the caller's tensors."""

    def __init__(self, plan: LoadPlan, store: storage.Storage):
        self.plan, self.store = plan, store  # ``store``: where the files are (ranges served to others)
        self.files = storage.open_data_files(store, plan.meta)  # opened by open_local
        self.staging = reads.Staging()
        self._lanes = threading.local()  # a staging buffer per thread receiving bytes (run_op)
        self.arrays = list(plan.views) + aoa.staging_arrays(plan.staged)

    def run_op(self, op, fetch) -> None:
        """Carry out one op whose bytes ``fetch`` receives from another rank (several threads
        at once, one per connection: each its own staging buffer)."""
        staging = getattr(self._lanes, "staging", None)
        if staging is None:
            staging = self._lanes.staging = reads.Staging()
        reads.execute_op(op, self.plan.meta, self.files, self.arrays, staging, self.plan.verify, fetch)

    def serve_from(self, answer: servers.Answer) -> None:
        self.plan = self.plan.served(answer)

    def open_local(self) -> None:
        """Open every file this rank reads itself (its size checked) before any byte moves;
        none stays open when one cannot be."""
        for f in sorted({op.file for op in self.plan.local}):
            try:
                self.files.open(f)
            except DcpError as exc:
                self.files.close()
                keys = sorted({seg.piece.key for op in self.plan.local if op.file == f for seg in op.segments})
                raise type(exc)(f"{exc}; it holds {keys}") from None

    def verify_local(self, share: tuple[int, int] | None = None) -> None:
        """Check the checksum of every block this rank will read from its own files, before any
        target changes; with ``share`` (index, count: every rank reads the same files and
        tensors, and the verify step's agreement covers them all), only that share of the
        blocks (see load_plan.plan_shared_checks)."""
        if not self.plan.verify:
            return
        ops = self.plan.local if share is None else load_plan.plan_shared_checks(self.plan.meta, self.plan.read_keys(), *share)
        try:
            for op in reads.read_ahead(self.files, ops, again=True):  # copied next (shared checks: in part)
                reads.execute_op(op, self.plan.meta, self.files, [], self.staging, check_only=True, again=True)
        except BaseException:  # the load ends here: its files are not read again (nor left open)
            self.files.close()
            raise

    def verify_remote(self, comm: Comm, clients) -> None:
        """The same for the blocks other ranks will send: their servers hash them first."""
        if not self.plan.verify:
            return
        meta = self.plan.meta
        blocks = lambda op: [b for seg in op.segments for b in checksums.segment_blocks(meta, seg)]  # noqa: E731
        exchange.check_remote(comm, self.store, self.plan.remote, clients, blocks, lambda i: meta.files[i].name)

    def read_local(self) -> None:
        """Copy from the local files. Their blocks were checked in the verify step, so they are
        not hashed again; a file written since it was opened is refused once the copy ends."""
        try:
            self._copy_local()
        finally:
            self.files.close()

    def _copy_local(self) -> None:
        staging = reads.Staging()  # its own: the copy may run beside run_op's threads
        for op in reads.read_ahead(self.files, self.plan.local):
            reads.execute_op(op, self.plan.meta, self.files, self.arrays, staging, verify=False)
        self.files.check_unchanged()

    def exchange(self, comm: Comm, clients) -> None:
        """Copy from the local files (in a helper thread: host memory only) while the bytes of
        other ranks' files cross on this one, in both directions: a rank that serves a copy
        of a file does not wait for its own reads first, nor its clients for them."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="paddle_dcp-read") as pool:
            copying = pool.submit(self._copy_local)
            try:
                exchange.fetch_remote(comm, self.store, self.plan.remote, clients, lambda i: self.plan.meta.files[i].name,
                                      self.run_op)
            finally:
                failed = copying.exception()  # waits for the copy
                self.files.close()
        if failed is not None:
            raise failed

    def finish(self) -> None:
        """Fill constants, copy host buffers into the caller's tensors (through one bounded
        pinned area, reused), put the checkpoint's plain values into the state dict."""
        plan = self.plan
        aoa.apply(list(plan.staged), self.arrays)
        with PinnedStage() as stage:
            for target, fill in zip(plan.targets, plan.fills):
                if fill is not None:
                    target.fill(fill)
                target.finish(stage)
        for path, node in plan.plain:
            nested.assign_subtree(plan.state_dict, path, node)


@dataclass(frozen=True)
class Sources:
    """Which files this rank reads itself: the files it sees (``visible``) of checkpoint
    ``uid``."""

    uid: int
    visible: frozenset


def split_ops(ops, meta: Metadata, sources: Sources) -> tuple[list, list]:
    """(the ops on files this rank can read, the ops on the others: their servers are the
    coordinator's to name, :func:`paddle_dcp.parallel.servers.assign`)."""
    local: list = []
    elsewhere: list = []
    for op in ops:
        name = meta.files[op.file].name
        if name in sources.visible:
            local.append(op)
        elif servers.file_key(name) is None:  # not a data file of ours: no other rank lists it
            raise _unreadable(name, sources.uid, op)
        else:
            elsewhere.append(op)
    return local, elsewhere


def _unreadable(name: str, uid: int, op) -> StorageError:
    """The error of an op on a data file no rank can read, naming the file and its tensors."""
    keys = sorted({seg.piece.key for seg in op.segments})
    return StorageError(f"no rank can read data file {name} of checkpoint {uid}, needed for {keys}")


@dataclass(frozen=True)
class Matched:
    """The state dict's keys matched with a checkpoint's, once per load (:func:`match_load`).

    Attributes:
        source: state-dict key -> the checkpoint's key it loads from.
        mapped: state-dict keys an aoa_config fills (``remap``), not read as they are.
        plain: the checkpoint's subtrees without tensors (path, node), restored whole.
    """

    source: dict
    mapped: frozenset
    plain: tuple


def match_load(flat: nested.Flat, meta: Metadata, path: str, mw: bool, missing: MissingKeys, remap=None,
               kind: str = "checkpoint") -> Matched:
    """Match the state dict's keys (flattened: ``flat``) with the checkpoint's, report the
    missing and unexpected ones (an error when ``missing`` says so), and parse the entries of
    the tensors that will be read."""
    # keys the aoa_config fills are not missing; checkpoint keys it reads are not unexpected
    mapped, used = remap.filled(list(flat.tensors), meta.tensors) if remap is not None else (set(), set())
    tensor_keys = [k for k in flat.tensors if k not in mapped]
    keys = reconcile(tensor_keys, flat.skeleton, list(meta.tensors), meta.structure, mw, kind, meta.holders)
    unexpected = [k for k in keys.unexpected if k not in used]
    where = f"checkpoint {meta.unique_id} in {path}" if kind == "checkpoint" else path
    # a part of the metadata lists only what this rank asked for: nothing there is unexpected
    report(keys.missing, () if meta.subset else unexpected, where, missing, logger, buffer_like(flat.tensors, keys.missing))
    meta.prefetch(list(keys.match.source.values()) + sorted(used))
    return Matched(dict(keys.match.source), frozenset(mapped), tuple(keys.plain))


def plan_load(
    state_dict: dict,
    flat: nested.Flat,
    held,
    meta: Metadata,
    path: str,
    store: storage.Storage,
    options: LoadOptions = LoadOptions(),
    sources: Sources | None = None,
    remap=None,
    kind: str = "checkpoint",
) -> LoadPlan:
    """This rank's complete load of ``meta`` into ``state_dict`` (flattened: ``flat``, its
    tensors' pieces: ``held``) as ``options`` ask: keys matched, targets' buffers, read ops
    split between the files this rank reads and the ranks that serve the others
    (``sources``; None: every file is this rank's); blocks are
    checked when ``options`` ask and the metadata has checksums (a Hugging Face directory's has
    none). ``kind`` names the source in messages ("checkpoint", "file")."""
    verify = options.verify and meta.checksum_algorithm != NO_CHECKSUMS
    matched = match_load(flat, meta, path, options.mw_name_compatibility, options.missing, remap, kind)
    return plan_work(state_dict, flat, held, meta, matched, path, store, options.offload, verify, sources, remap)


def plan_work(
    state_dict: dict,
    flat: nested.Flat,
    held,
    meta: Metadata,
    matched: Matched,
    path: str,
    store: storage.Storage,
    offload: bool,
    verify: bool = True,
    sources: Sources | None = None,
    remap=None,
    plain: bool = True,
) -> LoadPlan:
    """The load plan of the tensors ``held`` (all of this rank's, or a batch of them) from
    ``meta``, keys ``matched``: their buffers and read ops. With ``plain``, it also restores
    the checkpoint's plain values."""
    buffers, fills, views, targets, slots, remapped = [], [], [], [], [], []
    for h in held:
        source = matched.source.get(h.piece.key, h.piece.key if h.piece.key in matched.mapped else None)
        if h.local is None or source is None:
            buffers.append(NoTarget())
            fills.append(None)
            continue
        buffer = target_buffer(h, offload)
        buffers.append(buffer)
        fill = partial_fill(h)
        fills.append(fill)
        boxes = key_targets(h, buffer)
        if h.piece.key in matched.mapped:
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
    ops = _plan_ops(meta, targets + reads.pieces, slots + reads.slots, path, sources)
    local, elsewhere = split_ops(ops, meta, sources) if sources is not None else (ops, [])
    return LoadPlan(meta, tuple(ops), tuple(local), tuple(elsewhere), {}, tuple(buffers), tuple(fills), tuple(views),
                    tuple(reads.staged), matched.plain if plain else (), verify, state_dict)


def _plan_ops(meta: Metadata, targets: list, slots: list, path: str, sources: Sources | None) -> list:
    """The read ops of ``targets``, on the files this rank sees, the metadata's digest checked."""
    source = os.path.join(path, storage.metadata_name(meta.unique_id)) if not meta.subset else "the metadata part"
    visible = sources.visible if sources is not None else frozenset(f.name for f in meta.files)
    readable = np.array([f.name in visible for f in meta.files], dtype=bool)
    try:
        ops = load_plan.plan_reads(meta, targets, slots=slots, readable=readable)
    except PlanError as exc:  # the checkpoint's pieces overlap or leave a gap
        raise FormatError(f"{source}: {exc}") from None
    meta.check_digest()  # after the structure of what this rank uses, before any byte moves
    return ops
