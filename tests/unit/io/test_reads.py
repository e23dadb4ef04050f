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
