"""One safetensors file (as :func:`paddle_dcp.save_gathered` writes it) -> a state dict, in place.

The header is read and checked by :mod:`paddle_dcp.format.safetensors` (the one strict
reader) before any byte of a tensor is read. ``save_gathered`` puts the state dict's nesting
and plain values in its ``__metadata__`` (``structure``: the skeleton of
:mod:`paddle_dcp.core.nested`, as JSON). No pickle anywhere.

Each process reads only what it holds: the box of every dist tensor its rank holds, the whole
of plain tensors and numpy arrays, in bounded reads straight into the tensors' host memory.
"""
from __future__ import annotations

import logging
import math
import os
import time

import numpy as np

from .core import nested
from .core.keys import Reconciled, reconcile, report
from .core.boxes import Box, element_span, is_contiguous
from .dist.gather_plan import METADATA_FORMAT, METADATA_VERSION  # noqa: F401 - what save_gathered writes
from .errors import FormatError, MismatchError, StorageError
from .format.safetensors import (  # noqa: F401 - re-exported: the reader this module used to hold
    DTYPE_OF_CODE,
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    Entry,
    Header,
    parse_header,
    read_header,
)

logger = logging.getLogger(__name__)

_BAND_BYTES = 64 << 20  # at most this many bytes staged per read of a strided box
_MAX_READ = 1 << 30  # one pread at most (Linux caps a read near 2 GiB)


def _pread_into(fd: int, offset: int, out: np.ndarray, path: str) -> None:
    """Fill the uint8 array ``out`` from ``offset`` of the file ``fd``."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc}", path) from exc
        if n == 0:
            raise FormatError(f"{path}: the file ends at byte {offset + done}, its header says more: truncated?")
        done += n


class _Reader:
    """Reads boxes of a file's tensors into C-contiguous arrays, staging at most one band."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path
        self._stage = np.empty(0, dtype=np.uint8)

    def stage(self, nbytes: int) -> np.ndarray:
        if len(self._stage) < nbytes:
            self._stage = np.empty(nbytes, dtype=np.uint8)
        return self._stage[:nbytes]

    def read_box(self, base: int, shape: tuple[int, ...], box: Box, out: np.ndarray) -> None:
        """``out`` (shape ``box.shape``, C order) <- ``box`` of the C-order tensor of ``shape``
        whose bytes start at ``base``."""
        if box.volume == 0:
            return
        itemsize = out.dtype.itemsize
        if is_contiguous(shape, box):
            first, _ = element_span(shape, box)
            _pread_into(self.fd, base + first * itemsize, out.reshape(-1).view(np.uint8), self.path)
            return
        row = math.prod(shape[1:]) * itemsize  # bytes of one index of dim 0
        lo, hi = box.offsets[0], box.end[0]
        if row > _BAND_BYTES:  # one row is too big to stage: go down a dimension
            inner = Box(box.offsets[1:], box.shape[1:])
            for i in range(lo, hi):
                self.read_box(base + i * row, shape[1:], inner, out[i - lo])
            return
        rows = max(1, _BAND_BYTES // row)
        rest = (slice(None),) + box.slices()[1:]
        for a in range(lo, hi, rows):
            b = min(a + rows, hi)
            band = self.stage((b - a) * row)
            _pread_into(self.fd, base + a * row, band, self.path)
            out[a - lo : b - lo] = band.view(out.dtype).reshape((b - a,) + tuple(shape[1:]))[rest]


def load_file(
    state_dict: dict, path: str, offload: bool = False, mw_name_compatibility: bool = True, strict: bool = True
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
        offload: put every loaded tensor in CPU memory (see :func:`paddle_dcp.load_state_dict`).
        mw_name_compatibility: load ``master_weights.X`` from ``X_fp32_master_0`` and back.
        strict: a state-dict key the file lacks raises MismatchError; ``False`` warns.

    Raises:
        MismatchError: a shape or dtype differs (the message names the key and both), or a
            key is a tensor on one side and a plain value on the other.
        FormatError: a malformed or truncated file.
        StorageError: the file cannot be read.
    """
    from .dist.placements import describe, is_tensor

    path = os.fspath(path)
    started = time.perf_counter()
    header = read_header(path)
    flat = nested.flatten(state_dict, is_tensor)
    rank = _rank(flat)
    held = [describe(k, v, rank) for k, v in flat.tensors.items()]
    keys = _reconcile(flat, header, path, mw_name_compatibility, strict)
    work = _checked(held, header, keys.match)  # every check before any byte moves
    nbytes = _read(path, work, flat, state_dict, offload)
    for value_path, node in keys.plain:
        nested.assign_subtree(state_dict, value_path, node)
    logger.info("loaded %d tensors (%d bytes) from %s in %.3f s", len(work), nbytes, path, time.perf_counter() - started)


def _reconcile(flat: nested.Flat, header: Header, path: str, mw: bool, strict: bool) -> Reconciled:
    """The state dict's keys against the file's: raise on (or warn of) missing ones."""
    structure = header.structure if header.structure is not None else {"d": []}
    keys = reconcile(list(flat.tensors), flat.skeleton, list(header.entries), structure, mw, "file")
    report(keys.missing, keys.unexpected, path, strict, logger)
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


def _read(path: str, work, flat: nested.Flat, state_dict: dict, offload: bool) -> int:
    """Read every box of ``work`` into its target's buffer (the load's own buffers: see
    dist.loadwork.target_buffer); returns the bytes read."""
    from .dist.loadwork import target_buffer
    from .dist.placements import partial_fill

    nbytes = 0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise StorageError(f"cannot open {path}: {exc}", path) from exc
    try:
        reader = _Reader(fd, path)
        for h, entry in work:
            buffer = target_buffer(h, flat.tensors[h.piece.key], offload)
            fill = partial_fill(h)
            if fill is None:
                reader.read_box(entry.begin, entry.shape, h.piece.box, buffer.array)
                nbytes += buffer.array.nbytes
            else:
                buffer.fill(fill)
            buffer.finish()
            if buffer.replacement is not None:
                nested.set_tensor(state_dict, flat.paths[h.piece.key], buffer.replacement)
    finally:
        os.close(fd)
    return nbytes


def _rank(flat: nested.Flat) -> int:
    """This process's global rank when the state dict holds dist tensors, else 0."""
    if all(isinstance(v, np.ndarray) or not v.is_dist() for v in flat.tensors.values()):
        return 0
    import paddle.distributed as dist

    return dist.get_rank()
