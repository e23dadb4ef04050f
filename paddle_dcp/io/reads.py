"""Reading byte ranges of a checkpoint's data files into the buffers that need them, every
block's checksum checked first (:mod:`paddle_dcp.core.checksums`): a load's read ops, a small
read of a named file, and the read-ahead that keeps the disk busy. :func:`saved_region` is the
one place stored bytes become a region's values (a view of raw bytes, or quantized blocks
decoded, :mod:`paddle_dcp.core.quant`).
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np

from ..core import quant
from ..core.boxes import Box, c_strides, element_span
from ..core.checksums import check_blocks
from ..core.dtypes import as_bytes, cast, finite, storage_dtype
from ..core.load_plan import ReadOp
from ..core.metadata import Metadata, SavedPiece, TensorEntry
from ..errors import FormatError
from .storage import DataFiles, Storage


def read_range(store: Storage, name: str, start: int, length: int) -> bytes:
    """Bytes [start, start + length) of file ``name`` (a small read: an index, a header)."""
    out = bytearray(length)
    reader = store.range_reader()
    try:
        reader.read_into(name, start, memoryview(out))
    finally:
        reader.close()
    return bytes(out)


def piece_view(buf: np.ndarray, buf_start: int, piece: SavedPiece, region: Box, dtype: np.dtype) -> np.ndarray:
    """A strided view of ``region`` (in_saved) of ``piece`` inside ``buf``, which holds the
    file's bytes from offset ``buf_start`` on. numpy checks that the view stays inside."""
    isz = dtype.itemsize
    if region.shape == piece.box.shape:  # the whole piece (a load into the layout saved): C order
        return np.ndarray(shape=region.shape, dtype=dtype, buffer=buf, offset=piece.byte_offset - buf_start)
    first = element_span(piece.box.shape, region)[0] if region.ndim else 0
    strides = tuple(s * isz for s in c_strides(piece.box.shape))
    return np.ndarray(
        shape=region.shape,
        dtype=dtype,
        buffer=buf,
        offset=piece.byte_offset + first * isz - buf_start,
        strides=strides,
    )


def saved_region(buf: np.ndarray, buf_start: int, piece: SavedPiece, region: Box, entry: TensorEntry) -> np.ndarray:
    """The values of ``region`` (in_saved) of ``piece`` of ``entry``, in the storage dtype of
    the entry's dtype, from ``buf`` (the file's bytes from offset ``buf_start`` on): a view of
    raw bytes (:func:`piece_view`), or, for a tensor stored with an encoding, the encoded
    blocks the region's elements lie in decoded and cast (a new array).

    Raises:
        FormatError: naming the key, when encoded blocks are short or do not decode to finite
            values (damaged bytes that passed no checksum: a load without ``verify``).
    """
    if entry.encoding is None:
        return piece_view(buf, buf_start, piece, region, storage_dtype(entry.dtype))
    first, stop = element_span(piece.box.shape, region)
    lo, hi = quant.byte_range(entry.encoding, first, stop - first)
    at = piece.byte_offset + lo - buf_start
    try:
        values = quant.decode(buf[at : at + (hi - lo)], entry.encoding, first, stop - first)
    except FormatError as exc:
        raise FormatError(f"{entry.key}: piece at offset {piece.box.offsets}: {exc}") from None
    strides = tuple(s * values.itemsize for s in c_strides(piece.box.shape))
    view = np.lib.stride_tricks.as_strided(values, region.shape, strides, writeable=False)
    out = cast(view, "float32", entry.dtype)
    if not finite(out, entry.dtype):
        raise FormatError(f"{entry.key}: piece at offset {piece.box.offsets}: its blocks decode to values past {entry.dtype}'s range")
    return out


def check_values(values: np.ndarray, dtype: str, key: str, source: str) -> None:
    """Refuse values of a ``dtype`` tensor that no tensor of it holds: a bool stored as a byte
    other than 0 and 1 (paddle would read 2 as true and its negation as true too)."""
    if dtype == "bool" and values.size and values.view(np.uint8).max() > 1:
        raise FormatError(f"{source}: tensor {key!r} holds bytes other than 0 and 1 in a bool piece")


def read_ahead(files: DataFiles, ops: Sequence, window: int = 128 << 20, again: bool = False) -> Iterator:
    """Yield ``ops`` in order, having asked the kernel to start reading the byte ranges of the
    next ones (:meth:`DataFiles.advise`) while the current one is hashed or copied: a
    checkpoint on disk rather than in the page cache is then read in large requests ahead of
    use, not a page fault at a time. At most ``window`` bytes are asked for ahead of the op
    being worked on; pages already cached cost a lookup. ``again``: the ops are read once more
    soon (see :meth:`DataFiles.mapped`)."""
    advised = done = 0  # bytes of ops asked for / finished
    following = 0  # first op not asked for yet
    for i, op in enumerate(ops):
        while following < len(ops) and (following <= i or advised - done < window):
            nxt = ops[following]
            files.advise(nxt.file, nxt.start, nxt.stop - nxt.start, again)
            advised += nxt.stop - nxt.start
            following += 1
        yield op
        done += op.stop - op.start


class Staging:
    """One reusable host buffer for reads that cannot land in place (bounded by the plan's
    largest read)."""

    def __init__(self):
        self.buf = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if len(self.buf) < nbytes:
            self.buf = np.empty(nbytes, dtype=np.uint8)
        return self.buf[:nbytes]


def execute_op(
    op: ReadOp,
    meta: Metadata,
    files: DataFiles,
    targets: Sequence[np.ndarray],
    staging: Staging,
    verify: bool = True,
    fetch: Callable[[ReadOp, memoryview], None] | None = None,
    check_only: bool = False,
    again: bool = False,
) -> None:
    """Carry out one read op of the checkpoint ``meta`` describes (``files``: its data files):
    check its blocks' checksums, then copy its regions into ``targets`` (host arrays of the
    target pieces, in storage dtype).

    Bytes of a local file are mapped, checked and copied straight out of the page cache (one
    copy, of the needed bytes only). Bytes from another rank (``fetch``) land in the target
    for a direct op, else in ``staging``.

    Args:
        fetch: fills a buffer with the op's bytes instead of reading the file (bytes received
            from another rank).
        check_only: only check the checksums (a load checks every block before it changes any
            target, so a damaged file leaves the state dict as it was).
        again: the op is carried out once more soon (the copy after a check_only pass).
    """
    if fetch is None:
        with files.mapped(op.file, op.start, op.stop, again) as buf:
            try:
                _verify_and_copy(op, meta, files, targets, buf, verify, check_only)
            finally:
                del buf  # no view may outlive the mapping (nor an error's traceback keep one)
        return
    if op.direct:
        seg = op.segments[0]
        copy = seg.copies[0]
        target = targets[copy.target]
        first = element_span(target.shape, copy.region_in_target)[0] if target.ndim else 0
        region = target.reshape(-1)[first : first + copy.region_in_target.volume]
        dest = as_bytes(region)
        fetch(op, dest)
        if verify:
            check_blocks(meta, seg, dest, files.name(op.file))
        check_values(region, meta.tensors[seg.piece.key].dtype, seg.piece.key, files.name(op.file))
        return
    buf = staging.get(op.nbytes)
    fetch(op, buf.data)
    _verify_and_copy(op, meta, files, targets, buf, verify, check_only)


def _verify_and_copy(op: ReadOp, meta: Metadata, files: DataFiles, targets, buf: np.ndarray, verify: bool, check_only: bool) -> None:
    where = files.name(op.file)  # what an error names
    if verify or check_only:
        for seg in op.segments:
            check_blocks(meta, seg, buf[seg.start - op.start : seg.stop - op.start].data, where)
    if check_only:
        return
    for seg in op.segments:
        entry = meta.tensors[seg.piece.key]
        for c in seg.copies:
            values = saved_region(buf, op.start, seg.piece, c.region_in_saved, entry)
            check_values(values, entry.dtype, entry.key, where)
            if c.dtype is not None:  # a derived tensor, read from its source
                values = cast(values, entry.dtype, c.dtype)
            targets[c.target][c.region_in_target.slices()] = values


def execute_reads(
    ops: Sequence[ReadOp],
    meta: Metadata,
    files: DataFiles,
    targets: Sequence[np.ndarray],
    verify: bool = True,
    staging: Staging | None = None,
) -> int:
    """Carry out read ops from local files (see :func:`execute_op`); returns bytes read."""
    staging = staging or Staging()
    for op in ops:
        execute_op(op, meta, files, targets, staging, verify)
    return sum(op.nbytes for op in ops)
