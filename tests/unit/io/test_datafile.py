"""io.datafile: a data file's layout (header, aligned pieces, zeros between) and block checksums,
written over a byte stream that records each write; the expected bytes built by hand."""
import numpy as np
import pytest
import xxhash

from paddle_dcp.errors import StorageError
from paddle_dcp.io import datafile

from .memory_storage import MemoryStorage


class Recording:
    """A byte stream keeping every write (offset, bytes) and its end state."""

    def __init__(self, fail_at: int | None = None):
        self.writes: list[tuple[int, bytes]] = []
        self.committed: int | None = None
        self.aborted = False
        self.fail_at = fail_at

    def write_at(self, data, offset, keep=None):
        if self.fail_at is not None and len(self.writes) == self.fail_at:
            raise StorageError("disk full", "f")
        assert not self.writes or offset >= self.writes[-1][0] + len(self.writes[-1][1])
        self.writes.append((offset, bytes(data)))

    def commit(self, size, durable=False):
        self.committed = size

    def abort(self):
        self.aborted = True

    def content(self) -> bytes:
        end = max((o + len(b) for o, b in self.writes), default=0)
        out = bytearray(end)
        for o, b in self.writes:
            out[o : o + len(b)] = b
        return bytes(out)


def _piece(i: int, n: int) -> np.ndarray:
    return ((np.arange(n) + i) % 251).astype(np.uint8)


def test_pieces_follow_the_header_at_aligned_offsets_with_zeros_between_and_block_sums():
    stream = Recording()
    w = datafile.DataFileWriter(stream, block_bytes=64, header=b"HEAD", alignment=64)
    a, b = _piece(0, 30), _piece(1, 100)
    sums_a = w.write(memoryview(a), seed=7)
    sums_b = w.write(memoryview(b), seed=0)
    assert w.commit() == 128 + 100 == stream.committed
    want = b"HEAD" + bytes(60) + a.tobytes() + bytes(34) + b.tobytes()
    assert stream.content() == want
    # block k of a piece is hashed with seed (piece seed + k)
    assert sums_a == [xxhash.xxh3_64_intdigest(a.tobytes(), seed=7)]
    assert sums_b == [xxhash.xxh3_64_intdigest(b.tobytes()[:64], seed=0), xxhash.xxh3_64_intdigest(b.tobytes()[64:], seed=1)]


def test_without_block_bytes_no_checksums_and_alignment_one_packs_pieces_back_to_back():
    stream = Recording()
    w = datafile.DataFileWriter(stream, block_bytes=0, alignment=1)
    assert w.write(memoryview(_piece(0, 5))) == [] and w.write(memoryview(_piece(1, 3))) == []
    assert w.commit() == 8 and stream.content() == _piece(0, 5).tobytes() + _piece(1, 3).tobytes()


def test_small_pieces_reach_the_stream_in_batches_and_large_ones_alone():
    big, batch = datafile.DataFileWriter.SMALL_PIECE, datafile.DataFileWriter.BATCH_BYTES
    sizes = [10, 3000, big, 7, big + 5, 64, 1, 3 * batch // 2, 5]
    stream = Recording()
    w = datafile.DataFileWriter(stream, block_bytes=0, alignment=64)
    want = bytearray()
    for i, n in enumerate(sizes):
        want += bytes(-len(want) % 64) + _piece(i, n).tobytes()
        w.write(memoryview(_piece(i, n)))
    assert w.commit() == len(want) and stream.content() == bytes(want)
    # batches [10, 3000], [7], [64, 1], [5] and the three large pieces alone
    assert len(stream.writes) == 7


def test_many_small_pieces_cost_one_write_per_batch_whatever_their_number():
    per_piece = []
    for n in (1_000, 10_000):
        stream = Recording()
        w = datafile.DataFileWriter(stream, block_bytes=0, alignment=64)
        for i in range(n):
            w.write(memoryview(_piece(i, 2000 + i % 97)))
        size = w.commit()
        assert len(stream.writes) <= -(-size // datafile.DataFileWriter.BATCH_BYTES) + 1
        per_piece.append(len(stream.writes) / n)
    assert per_piece[1] <= per_piece[0] <= 1 / 500, per_piece


def test_a_header_that_cannot_be_written_aborts_the_stream():
    stream = Recording(fail_at=0)
    with pytest.raises(StorageError, match="disk full"):
        datafile.DataFileWriter(stream, block_bytes=0, header=b"HEAD")
    assert stream.aborted and stream.committed is None


def test_abort_drops_the_batch_and_the_stream():
    stream = Recording()
    w = datafile.DataFileWriter(stream, block_bytes=0)
    w.write(memoryview(_piece(0, 10)))
    w.abort()
    assert stream.aborted and stream.writes == [] and stream.committed is None


def test_data_writer_opens_the_storage_s_stream():
    store = MemoryStorage("mem://x", {})
    w = datafile.data_writer(store, "0_0.distcp", 0, header=b"H", alignment=4)
    w.write(memoryview(b"abc"))
    assert "0_0.distcp" not in store.blobs
    assert w.commit() == 7 and store.blobs["0_0.distcp"] == b"H\0\0\0abc"
