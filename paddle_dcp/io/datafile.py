"""A data file's format, written once over any storage's byte stream.

A data file (``.distcp``, or a safetensors file the command line writes) is an optional header,
then the pieces one after another, each at the next multiple of ``alignment`` bytes (the gaps
are zeros), each with its block checksums (:func:`paddle_dcp.core.checksums.block_checksums`)
recorded by the caller in the metadata. :class:`DataFileWriter` lays the pieces out and sums
them; the storage only moves bytes (:meth:`paddle_dcp.io.storage.Storage.open_stream`): a file
on disk written by a thread of its own, an S3 multipart upload, an fsspec file.

Pieces smaller than ``SMALL_PIECE`` are copied into a batch of up to ``BATCH_BYTES`` handed to
the stream as one write: a state dict of many small tensors costs one hand-off and one system
call (or one buffer copy) per batch, not per piece.
"""
from __future__ import annotations

from ..core.checksums import block_checksums
from ..core.metadata import ALIGNMENT, aligned
from ..errors import StorageError
from .storage import ByteStream, Storage


class DataFileWriter:
    """One data file being written through ``stream``: absent under its final name until
    :meth:`commit`, gone after :meth:`abort`."""

    SMALL_PIECE = 64 << 10  # bytes
    BATCH_BYTES = 4 << 20  # bytes

    def __init__(self, stream: ByteStream, block_bytes: int, header: bytes = b"", alignment: int = ALIGNMENT):
        self.stream = stream
        self.block_bytes, self.alignment = block_bytes, alignment
        self.offset = 0  # bytes laid out so far: the end of the last piece
        self._batch: bytearray | None = None  # small pieces gathered, from file offset _batch_start on
        self._batch_start = self._batch_used = 0
        if header:
            try:
                stream.write_at(memoryview(header), 0)
            except StorageError:
                self.abort()  # no temporary file left behind
                raise
            self.offset = len(header)

    def write(self, data: memoryview, keep=None, seed: int = 0) -> list[int]:
        """Append one piece (bytes in C order; ``keep`` is whatever must stay alive until the
        bytes are written; ``seed`` its :func:`~paddle_dcp.core.checksums.piece_seed`); returns
        its block checksums (none when ``block_bytes`` is 0)."""
        view = data.cast("B") if data.format != "B" else data
        start = aligned(self.offset, self.alignment)
        sums = block_checksums(view, self.block_bytes, seed) if self.block_bytes else []
        if len(view) < self.SMALL_PIECE:
            self._gather(view, start)
        else:
            self._flush()
            self.stream.write_at(view, start, keep)
        self.offset = start + len(view)
        return sums

    def _gather(self, view: memoryview, start: int) -> None:
        """Copy a small piece into the batch (a new one when it does not fit)."""
        if self._batch is not None and start + len(view) - self._batch_start > len(self._batch):
            self._flush()
        if self._batch is None:
            self._batch = bytearray(self.BATCH_BYTES)  # zeros: the gaps between pieces
            self._batch_start = start
        at = start - self._batch_start
        self._batch[at : at + len(view)] = view
        self._batch_used = at + len(view)

    def _flush(self) -> None:
        """Hand the batch to the stream."""
        if self._batch is not None:
            batch, self._batch = self._batch, None
            self.stream.write_at(memoryview(batch)[: self._batch_used], self._batch_start, batch)

    def commit(self, durable: bool = False) -> int:
        """Make the file appear, whole, under its final name (with ``durable``: on stable
        storage first); returns its size."""
        self._flush()
        self.stream.commit(self.offset, durable)
        return self.offset

    def abort(self) -> None:
        """Drop the file (never raises)."""
        self._batch = None  # never written
        self.stream.abort()


def data_writer(
    store: Storage, name: str, block_bytes: int, depth: int = 2, header: bytes = b"", alignment: int = ALIGNMENT
) -> DataFileWriter:
    """A writer of data file ``name`` of ``store`` (``header`` first, then the pieces; at most
    ``depth`` writes waiting to be done where the storage writes from a thread)."""
    return DataFileWriter(store.open_stream(name, depth), block_bytes, header, alignment)
