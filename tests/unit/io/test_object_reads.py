"""ObjectFiles' fetching on a fake object store (no server): ranges split into GETs of at most
read_chunk_bytes, fetched ahead within read_ahead_bytes, kept within read_cache_bytes, bytes
compared with the object's."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from paddle_dcp.core.metadata import FileEntry
from paddle_dcp.errors import IntegrityError
from paddle_dcp.io.object_reads import ObjectFiles, ObjectRangeReader
from paddle_dcp.io.objects import ObjectOptions


class FakeStore:
    """One object "f" of ``data``; every ranged read recorded (start, stop)."""

    is_s3 = False
    limit: dict = {}  # no time limit per attempt (a synchronous filesystem)

    def __init__(self, data: bytes, **options):
        self.data, self.options = data, ObjectOptions(**options)
        self.gets: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.fs = self

    def full(self, name):
        return f"b/p/{name}"

    def resolve(self, name):
        return f"mem://b/p/{name}"

    def call(self, what, fn, fatal=()):
        return fn()

    def info(self, full, refresh=True):
        return {"size": len(self.data), "ETag": "e1"}

    def cat_file(self, full, start, end):
        with self.lock:
            self.gets.append((start, end))
        return self.data[start:end]


def _files(store, nbytes=None):
    return ObjectFiles(store, [FileEntry("f", len(store.data) if nbytes is None else nbytes)])


DATA = np.random.default_rng(0).integers(0, 255, 1000, dtype=np.uint8).tobytes()


def test_ranges_are_fetched_ahead_in_order_within_the_bytes_ahead_and_split_into_chunks():
    store = FakeStore(DATA, read_chunk_bytes=64, read_ahead_bytes=300, read_cache_bytes=0)
    files = _files(store)
    ranges = [(at, at + 100) for at in range(0, 1000, 100)]
    for start, stop in ranges:
        files.advise(0, start, stop - start)
        assert files._ahead_bytes <= 300
    assert len(files._ahead) == 3 and len(files._queue) == 7  # the rest waits for room
    for start, stop in ranges:
        with files.mapped(0, start, stop) as buf:
            assert buf.tobytes() == DATA[start:stop]
            assert files._ahead_bytes <= 300  # the range in use counts
    files.close()
    assert all(stop - start <= 64 for start, stop in store.gets), store.gets
    assert sorted(store.gets) == sorted({g for g in store.gets})  # no byte fetched twice
    assert sum(stop - start for start, stop in store.gets) == 1000


def test_a_range_longer_than_the_bytes_ahead_is_fetched_alone_and_the_cache_is_bounded():
    store = FakeStore(DATA, read_chunk_bytes=128, read_ahead_bytes=100, read_cache_bytes=250, spill_dir=None)
    files = _files(store)
    files.advise(0, 0, 400)
    files.advise(0, 400, 50)
    assert list(files._ahead) == [(0, 0, 400)]  # the second waits
    for start, stop in ((0, 400), (400, 450)):
        with files.mapped(0, start, stop, again=True) as buf:
            assert buf.tobytes() == DATA[start:stop]
    assert files._kept_bytes == 50  # 400 bytes would not fit in 250
    before = len(store.gets)
    with files.mapped(0, 410, 420) as buf:  # inside a kept range: no GET
        assert buf.tobytes() == DATA[410:420]
    assert len(store.gets) == before
    with files.mapped(0, 0, 400) as buf:  # not kept, no spill file: fetched again
        assert buf.tobytes() == DATA[:400]
    assert len(store.gets) == before + 4
    files.close()


def test_ranges_read_again_are_fetched_into_the_spill_file_and_read_back_from_it(tmp_path):
    store = FakeStore(DATA, read_chunk_bytes=128, read_ahead_bytes=1000, read_cache_bytes=100, spill_dir=str(tmp_path))
    files = _files(store)
    ranges = [(0, 80), (80, 400), (400, 450), (450, 1000)]
    for start, stop in ranges:  # the check: read again for the copy
        files.advise(0, start, stop - start, again=True)
    for start, stop in ranges:
        with files.mapped(0, start, stop, again=True) as buf:
            assert buf.tobytes() == DATA[start:stop]
    fetched = sorted(store.gets)
    assert sum(b - a for a, b in fetched) == 1000 and files._kept_bytes == 0  # not in memory
    for start, stop in ranges:  # the copy: no GET, also for what read_ahead advises
        files.advise(0, start, stop - start)
        with files.mapped(0, start, stop) as buf:
            assert buf.tobytes() == DATA[start:stop]
    with files.mapped(0, 70, 1000) as buf:  # cut otherwise than the check: still no GET
        assert buf.tobytes() == DATA[70:1000]
    assert sorted(store.gets) == fetched
    files.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_fetch_is_not_read_back_from_the_spill_file(tmp_path):
    store = FakeStore(DATA, read_chunk_bytes=128, spill_dir=str(tmp_path))
    store.info = lambda full, refresh=True: {"size": 1200, "ETag": "e1"}  # HEAD says 1200...
    files = _files(store, nbytes=1200)  # ...but the GETs end at 1000
    with pytest.raises(IntegrityError, match="ends at 1000"):
        with files.mapped(0, 900, 1200, again=True):
            pass
    assert not files._spill.covers(0, 900, 1000)
    files.close()


def test_ranges_read_once_are_not_kept(tmp_path):
    store = FakeStore(DATA, read_chunk_bytes=128, read_cache_bytes=1000, spill_dir=str(tmp_path))
    files = _files(store)
    with files.mapped(0, 0, 500) as buf:
        assert buf.tobytes() == DATA[:500]
    assert files._kept_bytes == 0 and not files._spill.covers(0, 0, 1)
    files.close()


def test_an_object_shorter_than_the_metadata_says_is_an_integrity_error():
    store = FakeStore(DATA[:500], read_chunk_bytes=64)
    files = _files(store, nbytes=500)
    with pytest.raises(IntegrityError, match="ends at 500 bytes, before the 600"):
        with files.mapped(0, 400, 600):
            pass
    out = bytearray(200)
    with pytest.raises(IntegrityError, match="ends at 500"):
        files.read_into(0, 400, memoryview(out))
    with pytest.raises(IntegrityError, match="a reader asked for"):
        ObjectRangeReader(store).read_into("f", 450, memoryview(out))
    files.close()
