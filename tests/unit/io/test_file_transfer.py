"""A file copied between storages (io/file_transfer.py): the same bytes in chunks, the copy absent until
complete, a missing source named."""
from __future__ import annotations

import os

import numpy as np
import pytest

from paddle_dcp.errors import StorageError
from paddle_dcp.io import open_storage
from paddle_dcp.io.file_transfer import copy_file

from .memory_storage import MemoryStorage


@pytest.mark.parametrize("size, chunk", [(0, 8), (10, 3), (64, 64), (1000, 7)])
def test_the_copy_holds_the_same_bytes_in_any_chunking(tmp_path, size, chunk):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    source = MemoryStorage("src", {"0_1.distcp": data})
    target = open_storage(str(tmp_path / "dst"))
    target.create()
    assert copy_file(source, target, "0_1.distcp", chunk=chunk) == size
    with open(tmp_path / "dst" / "0_1.distcp", "rb") as f:
        assert f.read() == data
    assert os.listdir(tmp_path / "dst") == ["0_1.distcp"]  # no temporary file left


def test_a_missing_source_is_named_and_nothing_appears(tmp_path):
    target = open_storage(str(tmp_path / "dst"))
    target.create()
    with pytest.raises(StorageError, match="2_1.distcp is missing"):
        copy_file(MemoryStorage("src", {}), target, "2_1.distcp")
    assert os.listdir(tmp_path / "dst") == []


def test_a_source_that_ends_early_leaves_no_copy(tmp_path):
    class Short(MemoryStorage):
        def size(self, name):
            return 100  # says more than it holds

    target = open_storage(str(tmp_path / "dst"))
    target.create()
    with pytest.raises(Exception, match="ends before"):
        copy_file(Short("src", {"0_1.distcp": b"x" * 10}), target, "0_1.distcp", chunk=16)
    assert os.listdir(tmp_path / "dst") == []
