"""An in-memory storage: every file a bytes value in a dict, a second implementation of
``paddle_dcp.io.storage.Storage`` written from the Protocol alone (mypy checks that it is one:
:func:`memory_storage` is typed as returning a Storage; tests/integration/test_types.py)."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Sequence

import numpy as np

from paddle_dcp.core.metadata import FileEntry
from paddle_dcp.errors import FormatError, IntegrityError
from paddle_dcp.io import storage


class MemoryFiles:
    def __init__(self, blobs: dict, entries: Sequence[FileEntry]):
        self.blobs, self.entries = blobs, entries

    def _data(self, index: int) -> bytes:
        name = self.entries[index].name
        if name not in self.blobs:
            raise IntegrityError(f"data file {name} is missing")
        return self.blobs[name]

    def name(self, index: int) -> str:
        return self.entries[index].name

    def open(self, index: int) -> None:
        self._data(index)

    def read_into(self, index: int, offset: int, out: memoryview) -> None:
        out[:] = self._data(index)[offset : offset + len(out)]

    @contextmanager
    def mapped(self, index: int, start: int, stop: int, again: bool = False):
        yield np.frombuffer(self._data(index), np.uint8, count=stop - start, offset=start)

    def advise(self, index: int, start: int, length: int, again: bool = False) -> None:
        pass

    def check_unchanged(self) -> None:
        pass

    def close(self) -> None:
        pass


class MemoryStream:
    def __init__(self, blobs: dict, name: str):
        self.blobs, self.name = blobs, name
        self.buf = bytearray()

    def write_at(self, data: memoryview, offset: int, keep=None) -> None:
        assert offset >= len(self.buf)
        self.buf += bytes(offset - len(self.buf)) + bytes(data.cast("B"))

    def commit(self, size: int, durable: bool = False) -> None:
        assert size == len(self.buf)
        self.blobs[self.name] = bytes(self.buf)

    def abort(self) -> None:
        pass


class MemoryRanges:
    def __init__(self, blobs: dict):
        self.blobs = blobs

    def read_into(self, name: str, start: int, out: memoryview) -> None:
        if name not in self.blobs:
            raise IntegrityError(f"data file {name} is missing")
        data = self.blobs[name][start : start + len(out)]
        if len(data) != len(out):
            raise IntegrityError(f"data file {name} ends before {start + len(out)}")
        out[:] = data

    def close(self) -> None:
        pass


_CREATING = threading.Lock()


class MemoryStorage:
    """Every file a bytes value in a dict: a second implementation of ``storage.Storage``
    (mypy checks that it is one: :func:`memory_storage`)."""

    seen_by_all = False

    def __init__(self, path: str, blobs: dict):
        self.path, self.blobs = path, blobs

    def create(self) -> None:
        pass

    def list_names(self, temporary: bool = True) -> list[str]:
        return list(self.blobs)

    def size(self, name: str) -> int | None:
        return len(self.blobs[name]) if name in self.blobs else None

    def open_files(self, entries: Sequence[FileEntry], whose: str = "") -> MemoryFiles:
        return MemoryFiles(self.blobs, entries)

    def range_reader(self) -> MemoryRanges:
        return MemoryRanges(self.blobs)

    def write_atomic(self, name: str, data: bytes, durable: bool = False) -> None:
        self.blobs[name] = bytes(data)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        with _CREATING:  # ranks in threads share the blobs
            if name in self.blobs:
                return False
            self.blobs[name] = bytes(data)
            return True

    def open_stream(self, name: str, depth: int = 2) -> MemoryStream:
        return MemoryStream(self.blobs, name)

    def remove(self, names) -> list[str]:
        return [n for n in names if self.blobs.pop(n, None) is not None]

    def resolve(self, name: str) -> str:
        return name

    def read_file(self, name: str, limit: int | None = None) -> bytes | None:
        data = self.blobs.get(name)
        if data is not None and limit is not None and len(data) > limit:
            raise FormatError(f"{name}: {len(data)} bytes is over the {limit}-byte limit for this file")
        return data


def memory_storage(path: str, storage_options: dict | None = None, *, blobs: dict) -> storage.Storage:
    """``open_storage`` of the in-memory storage (typed, so mypy checks MemoryStorage against
    the Storage protocol: a missing or different method is a type error)."""
    return MemoryStorage(path, blobs)
