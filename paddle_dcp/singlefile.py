"""One safetensors file (as :func:`paddle_dcp.save_gathered` writes it) -> a state dict, in place.

The header is read and checked by :mod:`paddle_dcp.format.safetensors` (the one strict
reader) before any byte of a tensor is read. ``save_gathered`` puts the state dict's nesting
and plain values in its ``__metadata__`` (``structure``: the skeleton of
:mod:`paddle_dcp.core.nested`, as JSON). No pickle anywhere.

Each process reads only what it holds: the box of every dist tensor its rank holds, the whole
of plain tensors and numpy arrays, in bounded reads straight into the tensors' host memory. The
file is reached through its directory's storage (:func:`paddle_dcp.io.open_file`) and read
as a load from a checkpoint directory reads: the file's tensors become a checkpoint's metadata
(one piece each, as for a Hugging Face directory), :func:`~paddle_dcp.core.load_plan.plan_reads`
plans the reads, :func:`~paddle_dcp.io.storage.execute_op` carries them out.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np

from .io import reads
from .core import load_plan, nested
from .core.keys import MissingKeys, Reconciled, reconcile, report
from .parallel.gather_plan import METADATA_FORMAT, METADATA_VERSION  # noqa: F401 - what save_gathered writes
from .errors import MismatchError
from .format import hf_dir
from .format.safetensors import (  # noqa: F401 - re-exported: the file format's reader, for callers of this module
    DTYPE_OF_CODE,
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    Entry,
    Header,
    parse_header,
    read_header,
)
from .io import open_file, safetensors_files, storage

logger = logging.getLogger(__name__)


def load_file(
    state_dict: dict,
    path: str,
    offload: bool = False,
    mw_name_compatibility: bool = True,
    missing: MissingKeys = MissingKeys(),
    *,
    storage_options: dict | None = None,
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
    held = [describe(k, v, rank) for k, v in flat.tensors.items()]
    keys = _reconcile(flat, header, path, mw_name_compatibility, missing)
    work = _checked(held, header, keys.match)  # every check before any byte moves
    nbytes = _read(store, name, header, work, offload)
    for value_path, node in keys.plain:
        nested.assign_subtree(state_dict, value_path, node)
    logger.info("loaded %d tensors (%d bytes) from %s in %.3f s", len(work), nbytes, path, time.perf_counter() - started)


def _reconcile(flat: nested.Flat, header: Header, path: str, mw: bool, missing: MissingKeys) -> Reconciled:
    """The state dict's keys against the file's: raise on (or warn of) missing ones."""
    from .parallel.placements import buffer_like

    structure = header.structure if header.structure is not None else {"d": []}
    keys = reconcile(list(flat.tensors), flat.skeleton, list(header.entries), structure, mw, "file")
    report(keys.missing, keys.unexpected, path, missing, logger, buffer_like(flat.tensors, keys.missing))
    return keys


def _checked(held, header: Header, match) -> list[tuple[object, Entry]]:
    """(held piece, its entry in the file) of every tensor this process loads, after checking
    every matched key's dtype and shape."""
    work = []
    for h in held:
        source = match.source.get(h.piece.key)
        if source is None:
            continue
        entry = header.entries[source]
        if entry.dtype is None:
            raise MismatchError(f"{h.piece.key}: the file holds dtype {entry.code}, which paddle_dcp does not load")
        if entry.dtype != h.piece.dtype or entry.shape != h.piece.global_shape:
            raise MismatchError(
                f"{h.piece.key}: the file has {entry.dtype} of shape {entry.shape}, "
                f"the state_dict {h.piece.dtype} of shape {h.piece.global_shape}"
            )
        if h.local is not None and h.piece.box is not None:
            work.append((h, entry))
    return work


def _read(
    store: storage.Storage, name: str, header: Header, work, offload: bool
) -> int:
    """Read every box of ``work`` from file ``name`` of ``store`` into its target's buffer (the load's own buffers: see
    parallel.loadwork.target_buffer) on a load's machinery: the file's tensors as a checkpoint's
    metadata, the read ops that fill a box (bounded reads) and the storage's data files. One
    tensor at a time, its buffer finished before the next is read (on a GPU, one host buffer
    at a time); returns the bytes read."""
    from .parallel.device import PinnedStage
    from .parallel.loadwork import target_buffer
    from .parallel.placements import partial_fill

    meta = hf_dir.files_metadata([(name, header.file_bytes)], {e.key: hf_dir.tensor_entry(e, 0) for _, e in work})
    files = store.open_files(meta)
    staging = reads.Staging()
    stage = PinnedStage()
    nbytes = 0
    try:
        for h, entry in work:
            buffer = target_buffer(h, offload)
            fill = partial_fill(h)
            if fill is None:
                target = load_plan.TargetPiece(entry.key, entry.dtype, entry.shape, h.piece.box)
                view = buffer.array.reshape(h.piece.box.shape)
                ops = load_plan.plan_reads(meta, [target])
                for op in reads.read_ahead(files, ops):
                    reads.execute_op(op, files, [view], staging, verify=False)
                nbytes += view.nbytes
            else:
                buffer.fill(fill)
            buffer.finish(stage)
        files.check_unchanged()
    finally:
        files.close()
        stage.close()
    return nbytes


def _rank(flat: nested.Flat) -> int:
    """This process's global rank when the state dict holds dist tensors, else 0."""
    if all(isinstance(v, np.ndarray) or not v.is_dist() for v in flat.tensors.values()):
        return 0
    import paddle.distributed as dist

    return dist.get_rank()
