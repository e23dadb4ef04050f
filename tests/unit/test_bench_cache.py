"""The benchmark's measure of how much of a checkpoint the page cache holds when a load starts."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench import io_worker  # noqa: E402


def test_cached_fraction_sees_pages_dropped_from_the_page_cache_and_read_back(tmp_path):
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise to drop pages")
    data = os.urandom(1 << 20)
    for name in ("0_0.distcp", "1_0.distcp"):
        with open(tmp_path / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # clean pages can be dropped
    (tmp_path / "0.metadata").write_bytes(b"")  # an empty file counts for nothing
    assert io_worker.cached_fraction(str(tmp_path)) == 1.0
    fd = os.open(tmp_path / "1_0.distcp", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    dropped = io_worker.cached_fraction(str(tmp_path))
    if dropped == 1.0:
        pytest.skip("this kernel kept the pages (DONTNEED is advice)")
    assert dropped <= 0.75  # most of the second file's pages are gone
    for rank in range(2):  # each rank reads its share of the files: all pages are back
        io_worker.read_files(str(tmp_path), rank, 2)
    assert io_worker.cached_fraction(str(tmp_path)) == 1.0
