"""Reading byte ranges into the buffers that need them (io/reads.py): the read-ahead window,
and a small read of a named file."""
import numpy as np

from paddle_dcp.io import local, reads


def test_read_ahead_asks_for_the_next_ranges_in_order_within_its_window(tmp_path, monkeypatch):
    from types import SimpleNamespace

    asked = []
    monkeypatch.setattr(local.os, "posix_fadvise", lambda fd, start, length, advice: asked.append((start, length)))
    files = SimpleNamespace(fd=lambda index: 3, advise=lambda *args: local.FileSet.advise(files, *args))
    ops = [SimpleNamespace(file=0, start=100 * i, stop=100 * i + 100) for i in range(10)]
    done = 0
    seen = []
    for op in reads.read_ahead(files, ops, window=250):
        assert (op.start, 100) in asked  # the op itself was asked for before it runs
        assert sum(length for _, length in asked) - done <= 250 + 100  # never more than the window ahead
        seen.append(op)
        done += 100
    assert seen == ops
    assert asked == [(100 * i, 100) for i in range(10)]  # each range once, in order


def test_read_range_returns_exactly_the_bytes_asked_for(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    (tmp_path / "0_0.distcp").write_bytes(data)
    store = local.LocalStorage(str(tmp_path))
    for start, length in ((0, 8), (4990, 10), (1234, 0), (100, 4000)):
        assert reads.read_range(store, "0_0.distcp", start, length) == data[start : start + length]


def test_a_region_of_a_quantized_piece_is_its_blocks_decoded_and_cast_to_the_dtype():
    import pytest

    from paddle_dcp.core import quant
    from paddle_dcp.core.boxes import Box
    from paddle_dcp.core.metadata import SavedPiece, TensorEntry
    from paddle_dcp.errors import FormatError

    from ..helpers import dequantized, from_float32

    values = np.random.default_rng(4).standard_normal((7, 100)).astype(np.float32)  # blocks cross rows
    stored = quant.encode(values, "int8")
    buf = np.concatenate([np.zeros(40, np.uint8), stored])  # the piece at byte 40 of the buffer
    piece = SavedPiece("k", 0, Box((0, 0), (7, 100)), 0, 40, len(stored), 0, 1)
    entry = TensorEntry("k", "bfloat16", (7, 100), None, 1 << 20, "int8")
    region = Box((2, 30), (3, 45))  # elements 230 .. 474: the end of block 0 and part of block 1
    got = reads.saved_region(buf, 0, piece, region, entry)
    want = from_float32(dequantized(values, "int8"), "bfloat16")[region.slices()]
    assert got.dtype == np.uint16 and got.tobytes() == want.tobytes()
    # only the blocks the region lies in are needed: blocks 0 and 1, the buffer starting at block 0
    assert reads.saved_region(buf[: 40 + 2 * 264], 0, piece, region, entry).tobytes() == want.tobytes()
    with pytest.raises(FormatError, match=r"k: piece at offset \(0, 0\).*blocks need"):
        reads.saved_region(buf[: 40 + 264], 0, piece, region, entry)
