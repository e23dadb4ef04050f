"""A real rank's side of a save and of a load: the objects :func:`paddle_dcp.parallel.protocol.save`
and :func:`~paddle_dcp.parallel.protocol.load` drive (:class:`LocalSaveRank` implements
``SaveRankProtocol``, :class:`LocalLoadRank` ``LoadRankProtocol``), working on this process's
state dict and the checkpoint's directory.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from ..core import checksums, derive, quant
from ..core.compress import Policy
from ..io import claims, cleanup
from ..core.dtypes import as_bytes
from . import exchange, protocol, wire
from .comm import Comm
from .options import LoadOptions, SaveOptions
from .state import STATE
from .device import StagingArena, host_bytes, needs_host_copy, staged_copy
from .loadwork import LocalLoadWork, Sources, plan_load, visible_files
from .placements import HeldTensor, PartialPiece, describe, held_of, is_tensor, partial_pieces, reduced_value, tensor_name
from .requests import Reduction
from ..core import aoa, load_plan, metafile, nested, save_plan
from ..core.boxes import Box
from ..core.keys import match_keys, mw_compatible_name, reconcile
from ..core.metadata import DEFAULT_BLOCK_BYTES, Metadata
from ..core.metadata_parse import parse_metadata
from ..errors import ArgumentError, UnsupportedError
from ..format import hf_dir
from ..io import datafile, safetensors_files, storage
from ..version import __version__

logger = logging.getLogger(__name__)


def check_id(unique_id: Any) -> None:
    if unique_id is not None and (type(unique_id) is not int or unique_id < 0):
        raise ArgumentError(f"unique_id must be a non-negative int or None, got {unique_id!r}")


def next_id(store: storage.Storage, listing: storage.Listing | None = None) -> int:
    """One more than the highest complete checkpoint id in ``store`` (0 for the first)."""
    latest = (listing or storage.list_checkpoints(store)).latest
    return 0 if latest is None else latest + 1


# ============================================================================ save
@dataclass(frozen=True)
class PieceSources:
    """Where a save rank finds the bytes of its pieces (``Described.sources``): what it holds of
    each tensor (``held``), and one row per piece, (index in ``held``, piece, where its
    elements begin in the flat local tensor or None): a flattened ShardedWeight is several
    pieces of one tensor."""

    held: tuple[HeldTensor, ...]
    rows: tuple[tuple[int, save_plan.LocalPiece, int | None], ...]

    def chosen(self, leaves: np.ndarray) -> list[int]:
        """The indices in ``held`` of the tensors of the rows ``leaves``."""
        return sorted({self.rows[row][0] for row in leaves.tolist()})


@dataclass(frozen=True)
class Prepared:
    """A save rank's ``prepare`` step's value: its state dict flattened, and its share of
    reducing each Partial tensor (reduced in place by the protocol's next step)."""

    flat: nested.Flat
    partials: dict[str, PartialPiece]

    @property
    def reductions(self) -> tuple[Reduction, ...]:
        return tuple(r for p in self.partials.values() for r in p.reductions)

    def reduced(self) -> dict[str, Any]:
        """key -> the value each Partial tensor stands for (once its reductions ran)."""
        return {key: reduced_value(p) for key, p in self.partials.items()}


class LocalSaveRank:
    """This process's side of ``save_state_dict``: its inputs (the state dict, the storage, the
    options); every step's result is a value the protocol carries to the next step."""

    block_bytes = DEFAULT_BLOCK_BYTES
    created_by = f"paddle_dcp {__version__}"

    def __init__(
        self,
        comm: Comm,
        state_dict: dict,
        store: storage.Storage,
        unique_id: int | None,
        cache: dict,
        options: SaveOptions = SaveOptions(),
        staging: StagingArena | None = None,
    ):
        self.comm, self.state_dict, self.store, self.unique_id = comm, state_dict, store, unique_id
        self.rank, self.ranks, self.coordinator = comm.rank, comm.ranks, comm.coordinator
        self.cache, self.options, self.staging = cache, options, staging
        # what the protocol asks of every side (SaveRankProtocol)
        self.replicas, self.staged, self.compress = options.replicas, options.staged, options.compress
        self.layout = hf_dir.layout_plan if options.safetensors else None

    @classmethod
    def of_process(
        cls, comm: Comm, state_dict: dict, store: storage.Storage, unique_id: int | None, options: SaveOptions
    ) -> "LocalSaveRank":
        """The rank of a save of this process: the plans its saves reuse and, for an async
        save, its staging memory, taken from the process state."""
        return cls(comm, state_dict, store, unique_id, STATE.save_plans, options, STATE.staging if options.staged else None)

    def prepare(self) -> tuple[Prepared, tuple[Reduction, ...]]:
        check_id(self.unique_id)
        flat = nested.flatten(self.state_dict, is_tensor, keep_values=False)
        self.store.create()
        prepared = Prepared(flat, partial_pieces(flat.tensors, self.rank))
        return prepared, prepared.reductions

    def describe(self, prepared: Prepared) -> protocol.Described:
        flat = prepared.flat
        held = held_of(flat.tensors, prepared.reduced(), self.rank, flat_ok=True)
        rows = tuple((i, piece, at) for i, h in enumerate(held) for piece, at in h.pieces())
        pieces = tuple(piece for _, piece, _ in rows)
        return protocol.Described(flat.skeleton, pieces, PieceSources(tuple(held), rows), self._derived(flat, held))

    def _derived(self, flat: nested.Flat, held: Sequence[HeldTensor]) -> dict[str, str]:
        """Master weight -> parameter key of every tensor the policy derives (by paddle's
        tensor names or the keys, :mod:`paddle_dcp.core.derive`); raises MismatchError for one
        whose parameter this state dict lacks."""
        if self.compress is None or not self.compress.derives:
            return {}
        found = [
            derive.Candidate(h.piece.key, h.piece.dtype, tuple(h.piece.global_shape), tensor_name(flat.tensors[h.piece.key]))
            for h in held
        ]
        keys = [c.key for c in found if self.compress.encoding_of(c.key, c.dtype) == derive.DERIVED]
        return derive.find_sources(found, keys)

    def choose_id(self) -> tuple[int, storage.Listing | None]:
        if self.unique_id is not None:
            return self.unique_id, None
        listing = storage.list_checkpoints(self.store)
        return next_id(self.store, listing), listing

    def prepare_id(self, uid: int, listing: storage.Listing | None) -> tuple[int, storage.Listing | None]:
        """(the newest generation of ``uid`` this rank sees: of its data files, and of the
        claims on the coordinator's storage, -1 for none; the listing made for it). On storage
        every rank sees alike, the coordinator alone lists it (one LIST per save, not one per
        rank). Nothing is removed here: what a crashed save left may be another save's, still
        running (``tidy`` removes older generations once this save is committed)."""
        if self.store.seen_by_all and self.rank != self.coordinator:
            return -1, None
        listing = listing or storage.list_checkpoints(self.store)
        return claims.first_free(listing, uid) - 1, listing

    def claim_id(self, uid: int, generation: int, listing: storage.Listing | None) -> tuple[int, int]:
        return claims.claim(self.store, uid, generation, listing, fresh=self.unique_id is None)

    def can_stage(self, described: protocol.Described, leaves: np.ndarray) -> bool:
        pieces: PieceSources = described.sources
        return self.staging is None or self.staging.fits([pieces.held[i].local for i in pieces.chosen(leaves)])

    def reserve(self, described: protocol.Described, leaves: np.ndarray) -> None:
        """Make the staging memory the next async save of the same pieces needs (after a save
        that wrote without staging), off the caller's path."""
        if self.staging is not None:
            pieces: PieceSources = described.sources
            self.staging.reserve([pieces.held[i].local for i in pieces.chosen(leaves)])

    def stage(self, described: protocol.Described, leaves: np.ndarray) -> protocol.Described:
        pieces: PieceSources = described.sources
        chosen = pieces.chosen(leaves)
        if self.staging is None:
            copies = [staged_copy(pieces.held[i].local) for i in chosen]
        else:
            copies = self.staging.stage([pieces.held[i].local for i in chosen])
        held = list(pieces.held)
        for i, copy in zip(chosen, copies):
            held[i] = replace(held[i], local=copy)
        return replace(described, sources=replace(pieces, held=tuple(held)))

    def write(self, described: protocol.Described, uid: int, generation: int, leaves: np.ndarray) -> tuple[int, list[int]]:
        name = storage.data_file_name(self.rank, uid, generation, self.options.file_kind)
        pieces: PieceSources = described.sources
        o = self.options
        return write_pieces(self.store, name, pieces.held, pieces.rows, leaves, o.durable, o.safetensors, o.compress)

    def values(self, prepared: Prepared) -> dict:
        return prepared.flat.values

    def publish(self, meta: Metadata, generation: int) -> None:
        claims.check_latest(self.store, meta.unique_id, generation)
        if self.options.safetensors:
            meta = hf_dir.rename_files(meta)
        storage.commit_metadata(self.store, meta.unique_id, metafile.encode(meta), self.options.durable)

    def tidy(self, uid: int, generation: int, listing: storage.Listing | None) -> None:
        """Remove this rank's data files of older generations of ``uid`` (every rank's, by the
        coordinator alone, on storage every rank sees alike), found in ``listing`` when given,
        with their claims and the temporary files crashed saves of them left."""
        if not self.store.seen_by_all:  # every rank: a claim of a crashed save may be on any node
            cleanup.remove_older(self.store, uid, self.rank, generation, listing, claims=True)
        elif self.rank == self.coordinator:
            cleanup.remove_older(self.store, uid, None, generation, listing, claims=True)


def write_pieces(
    store: storage.Storage, name: str, held, rows, chosen: np.ndarray, durable: bool, safetensors: bool = False,
    compress: Policy | None = None,
) -> tuple[int, list[int]]:
    """Write the ``chosen`` rows (held index, piece, start in the flat local or None); a
    safetensors rank file starts with the header the coordinator's layout_plan counted. A
    piece whose key ``compress`` names is written as its encoded blocks (as the plan counted
    them, :func:`paddle_dcp.core.save_plan.plan_save`)."""
    if not len(chosen):
        return 0, []
    sums: list[int] = []
    # a piece on a device is copied to host memory whole: one copy alive at a time (its write
    # ends before the next copy), where host pieces overlap their writes with the next checksums
    depth = 0 if any(needs_host_copy(held[rows[row][0]].local) for row in chosen.tolist()) else 2
    if safetensors:
        pieces = [rows[row][1] for row in chosen.tolist()]
        header = hf_dir.rank_header([(p.key, p.dtype, p.box.offsets, p.box.shape, p.global_shape) for p in pieces])
        writer = datafile.data_writer(store, name, DEFAULT_BLOCK_BYTES, depth=depth, header=header, alignment=1)
    else:
        writer = datafile.data_writer(store, name, DEFAULT_BLOCK_BYTES, depth=depth)
    last, data = None, None
    try:
        for row in chosen.tolist():
            i, piece, at = rows[row]
            if i != last:  # the pieces of a flattened ShardedWeight share one host copy
                data = array = None  # the previous copy (and every view of it) goes first
                last, data = i, host_bytes(held[i].local)
            array = data.array if at is None else data.array.reshape(-1)[at : at + piece.box.volume]
            encoding = compress.encoding_of(piece.key, piece.dtype) if compress is not None else None
            assert encoding != derive.DERIVED, f"{piece.key}: the plan gives no writer to a derived tensor's pieces"
            if encoding is not None:  # the writer keeps the encoded copy until it is written
                array = quant.encode_piece(array, piece.dtype, encoding, piece.key)
            seed = checksums.piece_seed(piece.key, piece.dtype, piece.box.offsets, piece.box.shape)
            sums.extend(writer.write(as_bytes(array), keep=data if encoding is None else array, seed=seed))
        return writer.commit(durable), sums
    except BaseException:
        writer.abort()
        raise


# ============================================================================ load
@dataclass(frozen=True)
class Inspected:
    """What a load rank's ``inspect`` found, carried by the protocol to the later steps: its
    state dict flattened, what it holds of each tensor, and, when the checkpoint is a
    directory of safetensors files without metadata of ours, those files and their index
    (``safetensors_files.shard_names``; None otherwise)."""

    flat: nested.Flat
    held: tuple[HeldTensor, ...]
    shards: tuple[list[str], dict | None] | None = None


class LocalLoadRank:
    """This process's side of ``load_state_dict`` from a checkpoint directory: its inputs (the
    state dict, the storage, the options); every step's result is a value the protocol
    carries to the next step."""

    def __init__(
        self,
        comm: Comm,
        state_dict: dict,
        path: str,
        store: storage.Storage,
        unique_id: int | None,
        options: LoadOptions = LoadOptions(),
    ):
        self.comm, self.state_dict, self.path, self.unique_id = comm, state_dict, path, unique_id
        self.rank, self.ranks, self.coordinator = comm.rank, comm.ranks, comm.coordinator
        self.options, self.store = options, store
        self.shares_targets = options.aoa_config is not None  # paddle's engine needs every rank's targets
        # one store every rank sees alike (object storage): the coordinator alone lists it, to
        # find the latest id or, with safetensors, whether it is a directory of safetensors files
        self.lists_for_all = bool(store.seen_by_all)
        self.near = options.near

    def run(self) -> tuple[int, LocalLoadWork]:
        """The whole load on this rank's comm (:func:`protocol.load`): the traffic kept in
        ``STATE.traffic["load"]``, the bytes and time logged; returns (the checkpoint id, the
        work done). The one driver of a load: the api's, the manager's, the local tier's."""
        started = time.perf_counter()
        # the collector paused, as for a save's planning: a load of many tensors makes a few
        # objects per piece, each allocation burst woke it to traverse everything alive
        uid, work = protocol.quiet_collector(protocol.run, self.comm, protocol.load(self))
        STATE.traffic["load"] = self.comm.traffic
        nbytes = sum(op.nbytes for op in work.plan.ops)
        logger.info("loaded checkpoint %d from %s: %d bytes by this rank in %.3f s", uid, self.path, nbytes,
                    time.perf_counter() - started)
        return uid, work

    def inspect(self) -> tuple[Inspected, storage.Listing]:
        check_id(self.unique_id)
        flat = nested.flatten(self.state_dict, is_tensor)
        held = tuple(describe(k, v, self.rank, flat_ok=True) for k, v in flat.tensors.items())
        given = self.unique_id is not None and not self.options.safetensors
        if self.lists_for_all and (self.rank != self.coordinator or given):
            return Inspected(flat, held), storage.Listing(frozenset(), {})  # the latest id comes from the coordinator's
        listing = storage.list_checkpoints(self.store, temporary=False)
        if self.options.exclude:
            listing = storage.listing_of(listing.files - self.options.exclude)
        if self.options.safetensors and listing.latest is None:  # a directory of safetensors files
            shards = safetensors_files.shard_names(self.store, listing.files)
            uid = self.unique_id if self.unique_id is not None else 0
            return Inspected(flat, held, shards), _directory_listing(uid, shards[0])
        return Inspected(flat, held), listing

    def targets(self, view: Inspected) -> bytes:
        return wire.encode_json(aoa.encode_targets(
            (h.piece.key, h.piece.dtype, h.piece.global_shape, h.piece.box) for h in view.held if h.piece.box is not None
        ))

    def all_targets(self, blobs: Sequence[bytes]) -> Any:
        return aoa.merge_targets(wire.decode_json(b) for b in blobs)

    def wanted(self, view: Inspected) -> dict[str, list[Box]] | None:
        """The checkpoint keys this rank may read (its tensors' keys, and their master-weight
        spellings) with the boxes it fills of each; None when it must see every key (an
        aoa_config matches patterns against them)."""
        if self.options.aoa_config is not None or view.shards is not None:
            return None
        out: dict[str, list[Box]] = {}
        for h in view.held:
            boxes = [piece.box for piece, _ in h.pieces() if piece.box is not None] if h.local is not None else []
            for key in (h.piece.key, mw_compatible_name(h.piece.key) if self.options.mw_name_compatibility else None):
                if key is not None:
                    out.setdefault(key, []).extend(boxes)
        return out

    def read_metadata(self, view: Inspected, uid: int) -> Metadata:
        if view.shards is not None:
            return safetensors_files.metadata_from_blob(self._directory_blob(view), self.store.path, uid)
        wanted = self.wanted(view)
        name = storage.metadata_name(uid)
        size = self.store.size(name) if wanted is not None else None
        if size is not None and metafile.worth_parts(size):
            ranges = storage.FileRanges(self.store, name)
            try:
                if metafile.is_packed(ranges([(0, min(size, 64))])[0]):
                    return metafile.read_part(ranges, size, wanted, self.store.resolve(name))
            finally:
                ranges.close()
        return storage.read_metadata(self.store, uid, lazy=True)

    def _directory_blob(self, view: Inspected) -> bytes:
        return safetensors_files.directory_blob(self.store, *view.shards)

    def metadata_bytes(self, view: Inspected, uid: int) -> bytes:
        """Our metadata file's bytes after b"M", or a directory of safetensors files'
        description after b"D" (the mark is ours, not the file's: no file can make a rank take
        a checkpoint of ours for a directory whose files carry no checksums)."""
        if view.shards is not None:
            return b"D" + self._directory_blob(view)
        return b"M" + storage.metadata_bytes(self.store, uid)

    def metadata_start(self, blob: bytes, source: str) -> metafile.Start:
        return protocol.start_of(blob, source)

    def in_parts(self, data: bytes) -> memoryview | None:
        body = memoryview(data)[1:]
        return body if data[:1] == b"M" and metafile.is_packed(body) and metafile.worth_parts(len(body)) else None

    def parse_metadata(self, uid: int, data: bytes) -> Metadata:
        if data[:1] == b"D":
            return safetensors_files.metadata_from_blob(memoryview(data)[1:], self.store.path, uid)
        return storage.metadata_from_bytes(data[1:], uid, self.store.resolve(storage.metadata_name(uid)), lazy=True)

    def metadata_from_helpers(self, view: Inspected, readers: list[int], meta: Metadata | None) -> protocol.Pairwise:
        if self.options.aoa_config is not None:  # every rank knows the readers: all raise the same error
            others = [r for r in self.ranks if r not in readers]
            raise UnsupportedError(
                f"aoa_config needs every rank to read the metadata of the checkpoint in {self.path}; "
                f"ranks {others} cannot (node-local disks): copy it to them"
            )
        def part_for(uid: int, wanted: dict) -> Metadata:  # a helper that read only its own part reads the client's
            name = storage.metadata_name(uid)
            ranges = storage.FileRanges(self.store, name)
            try:
                return metafile.read_part(ranges, self.store.size(name) or 0, wanted, self.store.resolve(name))
            finally:
                ranges.close()

        return protocol.Pairwise(
            "metadata from helpers",
            lambda c: metadata_from_helpers(c, readers, meta, view.flat, view.held, self.options.mw_name_compatibility, part_for),
        )

    def plan(self, view: Inspected, meta: Metadata, uid: int, listing: storage.Listing, every_target: Any) -> LocalLoadWork:
        if self.lists_for_all:  # every file the metadata names is there for every rank
            names = [f.name for f in meta.files]
            directory = meta.checksum_algorithm == hf_dir.NO_CHECKSUMS  # safetensors files, no metadata of ours
            listing = _directory_listing(uid, names) if directory else storage.listing_of(names)
        remap = None
        if self.options.aoa_config is not None:
            from .aoa_paddle import Remap

            remap = Remap(self.options.aoa_config, aoa.source_shards(meta), every_target)
        sources = Sources(uid, frozenset(visible_files(listing, uid)))
        plan = plan_load(self.state_dict, view.flat, list(view.held), meta, self.path, self.store, self.options, sources, remap)
        return LocalLoadWork(plan, self.store)


def _directory_listing(uid: int, names: Sequence[str]) -> storage.Listing:
    """A directory of safetensors files seen as checkpoint ``uid`` holding ``names``."""
    return storage.Listing(frozenset({uid}), {}, names=frozenset(names))


def metadata_from_helpers(comm: Comm, readers, meta, flat, held, mw: bool, part_for=None) -> Metadata:
    """Ranks without the metadata file get the part they need from a rank that has it: cut
    from its metadata, or, when it read only its own part of a large file
    (:func:`paddle_dcp.core.metafile.read_part`), read for the client (``part_for(uid,
    wanted)``)."""
    non_readers = [r for r in comm.ranks if r not in readers]
    helper_of = {r: readers[i % len(readers)] for i, r in enumerate(non_readers)}
    my_helper = helper_of.get(comm.rank)
    my_clients = [r for r, h in helper_of.items() if h == comm.rank]
    request = b""
    if my_helper is not None:
        pieces = [piece for h in held for piece, _ in h.pieces()]
        request = wire.encode_summary(save_plan.SaveSummary.from_pieces(comm.rank, flat.skeleton, pieces))

    def answer(client: int, question: bytes) -> bytes:
        return helper_answer(meta, wire.decode_summary(question, client), mw, part_for)

    reply = exchange.ask_for_metadata(comm, my_helper, request, my_clients, answer)
    if reply is not None:
        meta = parse_metadata(reply, source=f"part of the metadata sent by rank {my_helper}", allow_subset=True)
    return meta


def helper_answer(meta: Metadata, summary: save_plan.SaveSummary, mw: bool, part_for=None) -> bytes:
    """What a helper that has ``meta`` sends the client that described its state dict in
    ``summary``: the part of the metadata it needs, as one JSON document (format version 1 or
    2, whatever version the file is: a client parses no packed file)."""
    keys = nested.tensor_keys(summary.skeleton)
    if meta.subset:
        part = part_for(meta.unique_id, _wanted_of(summary, keys, mw))
        return replace(part, format_version=1).to_json()  # to_json says 2 when it must
    match = match_keys(keys, list(meta.tensors), mw)
    targets = []
    for row, i in enumerate(summary.leaves_of_rows().tolist()):
        key, box = keys[i], summary.piece_box(row)
        if box is not None and key in match.source:
            targets.append(load_plan.TargetPiece(match.source[key], summary.dtypes[i], summary.global_shapes[i], box))
    plain = reconcile(keys, summary.skeleton, list(meta.tensors), meta.structure, mw).plain
    return load_plan.restrict(meta, targets, list(match.source.values()), [p for p, _ in plain]).to_json()


def _wanted_of(summary: save_plan.SaveSummary, keys: list[str], mw: bool) -> dict[str, list[Box]]:
    """A client's keys (and their master-weight spellings) with the boxes it fills, from the
    summary it sent."""
    out: dict[str, list[Box]] = {}
    for row, i in enumerate(summary.leaves_of_rows().tolist()):
        box = summary.piece_box(row)
        for key in (keys[i], mw_compatible_name(keys[i]) if mw else None):
            if key is not None:
                out.setdefault(key, []).extend([box] if box is not None else [])
    return out
