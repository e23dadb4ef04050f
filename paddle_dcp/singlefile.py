"""One safetensors file (as :func:`paddle_dcp.save_gathered` writes it) -> a state dict, in place.

The header is read and checked by :mod:`paddle_dcp.format.safetensors` (the one strict
reader) before any byte of a tensor is read. ``save_gathered`` puts the state dict's nesting
and plain values in its ``__metadata__`` (``structure``: the skeleton of
:mod:`paddle_dcp.core.nested`, as JSON). No pickle anywhere.

Each process reads only what it holds: the box of every dist tensor its rank holds, the boxes
a ShardedWeight states, the whole of plain tensors and numpy arrays, in bounded reads straight
into the tensors' host memory. The file is reached through its directory's storage
(:func:`paddle_dcp.io.open_file`) and loaded by the load of a checkpoint directory, in this
process alone: the file is a directory of one safetensors file
(:func:`~paddle_dcp.format.hf_dir.headers_metadata`, the structure ``save_gathered`` stored
included): :func:`~paddle_dcp.parallel.loadwork.match_load` matches the keys once, then each batch of
tensors is a one-rank load of the same protocol (:class:`_FileBatchRank`): planned by
:func:`~paddle_dcp.parallel.loadwork.plan_work`, opened, read and finished by its steps.
Tensors on a GPU are assembled in host buffers first: a batch holds at most
``host_batch_bytes`` of them (a larger tensor alone), so a process never holds the host copy
of its whole share; host tensors and numpy arrays are filled in place, in one batch.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .core import nested
from .core.metadata import Metadata
from .core.keys import MissingKeys
from .errors import MismatchError
from .format import hf_dir
from .io import open_file, safetensors_files
from .io.storage import Listing
from .parallel import protocol
from .parallel.comm import SoloComm
from .parallel.loadwork import LocalLoadWork, match_load, plan_work
from .parallel.ranks import Inspected, LocalLoadRank
from .parallel.targets import host_batches

logger = logging.getLogger(__name__)

HOST_BATCH_BYTES = 256 << 20  # host buffers of device tensors alive at once, at most (see above)


def load_file(
    state_dict: dict,
    path: str,
    offload: bool = False,
    mw_name_compatibility: bool = True,
    missing: MissingKeys = MissingKeys(),
    *,
    storage_options: dict | None = None,
    host_batch_bytes: int = HOST_BATCH_BYTES,
) -> None:
    """Fill a (nested) state dict in place from one safetensors file.

    ``paddle_dcp.load_state_dict(state_dict, path)`` comes here when ``path`` is a file. The
    tensors of the state dict may be plain paddle tensors, numpy arrays, or dist tensors
    (each process reads the box its rank holds; Partial targets receive the value at coordinate
    0 of their partial mesh dims and 0 (SUM) / 1 (PROD) / the value (others) elsewhere, as a
    load from a checkpoint directory does). Nothing is exchanged between processes. Plain values
    are set from the structure ``save_gathered`` stored; a file from another writer has none,
    and its keys are the state dict's flat keys (``model.fc1.weight``).

    Args:
        state_dict: nested dicts / lists / tuples of tensors and plain values.
        path: the file.
        offload: stage without pinned memory (see :func:`paddle_dcp.load_state_dict`).
        mw_name_compatibility: load ``master_weights.X`` from ``X_fp32_master_0`` and back.
        missing: what a state-dict key the file lacks is (see :class:`~paddle_dcp.core.keys.MissingKeys`).
        storage_options: for a URL ``path``, as in :func:`paddle_dcp.save_state_dict`.
        host_batch_bytes: bytes of host buffers (for tensors on a device) alive at once.

    Raises:
        MismatchError: a shape or dtype differs (the message names the key and both), or a
            key is a tensor on one side and a plain value on the other.
        FormatError: a malformed or truncated file.
        StorageError: the file cannot be read.
    """
    from .parallel.placements import describe, is_tensor

    path = os.fspath(path)
    started = time.perf_counter()
    store, name = open_file(path, storage_options=storage_options)
    header = safetensors_files.read_header(store, name, path)
    flat = nested.flatten(state_dict, is_tensor)
    rank = _rank(flat)
    held = [describe(k, v, rank, flat_ok=True) for k, v in flat.tensors.items()]
    for key in flat.tensors:  # left out of the metadata below: say why rather than "missing"
        entry = header.entries.get(key)
        if entry is not None and entry.dtype is None:
            raise MismatchError(f"{key}: the file holds dtype {entry.code}, which paddle_dcp does not load")
    meta = hf_dir.headers_metadata(path, [name], [header], None, structure=header.structure)
    # the load of a checkpoint directory, in this process alone (a world of one rank), a batch
    # at a time, the keys matched once for all batches
    matched = match_load(flat, meta, path, mw_name_compatibility, missing, kind="file")
    batches = host_batches(held, host_batch_bytes)
    nbytes = 0
    for i, batch in enumerate(batches):
        batch_rank = _FileBatchRank(state_dict, path, store, _FileBatch(flat, tuple(batch), meta, matched, offload,
                                                                      i == len(batches) - 1))
        _, work = protocol.run(batch_rank.comm, protocol.load(batch_rank))
        nbytes += sum(op.nbytes for op in work.plan.local)
        del work  # its host buffers go before the next batch's
    logger.info("loaded %d tensors (%d bytes) from %s in %.3f s", len(held), nbytes, path, time.perf_counter() - started)


@dataclass(frozen=True, eq=False)
class _FileBatch:
    """One batch of a single file's load: the state dict flattened, the tensors of the batch,
    the file's metadata (made from its header once), the keys matched once, and whether this
    batch also puts the plain values in place (the last one)."""

    flat: nested.Flat
    held: tuple
    meta: Metadata
    matched: Any
    offload: bool
    plain: bool


class _FileBatchRank(LocalLoadRank):
    """A batch of a single file's load as a one-rank load of the protocol
    (:func:`paddle_dcp.parallel.protocol.load`): the file is a directory of one safetensors
    file, checkpoint 0, whose metadata and key matching are the batch's; the protocol opens,
    reads and finishes as it does for a directory."""

    def __init__(self, state_dict: dict, path: str, store, batch: _FileBatch):
        super().__init__(SoloComm(), state_dict, path, store, 0)
        self.lists_for_all = False  # one rank: it reads the metadata itself, on any storage
        self.batch = batch

    def inspect(self) -> tuple[Inspected, Listing]:
        b = self.batch
        return Inspected(b.flat, b.held), Listing(frozenset({0}), {}, names=frozenset(f.name for f in b.meta.files))

    def read_metadata(self, view: Inspected, uid: int) -> Metadata:
        return self.batch.meta

    def plan(self, view: Inspected, meta: Metadata, uid: int, listing: Listing, every_target: Any) -> LocalLoadWork:
        b = self.batch
        plan = plan_work(self.state_dict, b.flat, list(b.held), meta, b.matched, self.path, self.store, b.offload, False,
                         plain=b.plain)
        return LocalLoadWork(plan, self.store)


def _rank(flat: nested.Flat) -> int:
    """This process's global rank when the state dict holds dist tensors, else 0 (numpy
    arrays, plain tensors and ShardedWeights state their boxes themselves)."""
    from .parallel.placements import is_sharded_weight

    if all(isinstance(v, np.ndarray) or is_sharded_weight(v) or not v.is_dist() for v in flat.tensors.values()):
        return 0
    import paddle.distributed as dist

    return dist.get_rank()
