"""Reading byte ranges of data objects (:class:`ObjectFiles`, :class:`ObjectRangeReader`).

Every range is fetched with ranged GETs of at most ``read_chunk_bytes`` each, several in flight
(``read_concurrency``), their bodies streamed straight into the buffer that the bytes end up
in: no whole-body ``bytes`` object is ever built (aiohttp's ``read()`` joins a body's chunks, a
second copy of every range in flight).

Memory of a load, bounded and documented (``docs/guide.md``, "Object storage"): the ranges
fetched ahead of use and the one in use, at most ``read_ahead_bytes`` together (a single range
larger than that alone), plus at most ``read_cache_bytes`` of ranges kept between the check of
their checksums and their copy, that only without a spill directory: by default the ranges
checked are fetched into local spill files (page cache, not the process's memory;
:mod:`paddle_dcp.io.spill`), so no byte is fetched twice.
"""
from __future__ import annotations

import bisect
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from ..core.metadata import FileEntry
from ..errors import IntegrityError
from .spill import NOTHING, SpillFiles, spill_directory

if TYPE_CHECKING:
    from .objects import ObjectStorage

STREAM_CHUNK = 1 << 20  # bytes taken from a response body at a time


async def _get_into_async(fs, bucket: str, key: str, start: int, out: memoryview) -> int:
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{start + len(out) - 1}")
    body = resp["Body"]
    got = 0
    try:
        while got < len(out):
            chunk = await body.read(min(STREAM_CHUNK, len(out) - got))
            if not chunk:
                break
            out[got : got + len(chunk)] = chunk
            got += len(chunk)
    finally:
        body.close()
    return got


def get_into(store: "ObjectStorage", name: str, start: int, out: memoryview) -> int:
    """Fill ``out`` with the bytes of object ``name`` from ``start`` with one ranged GET;
    returns the bytes received (fewer when the object ends first)."""
    if not len(out):
        return 0
    full, url = store.full(name), store.resolve(name)
    what = f"GET {url} bytes {start}-{start + len(out) - 1}"
    if store.is_s3:
        from fsspec.asyn import sync

        bucket, _, key = full.partition("/")
        fn = lambda: sync(store.fs.loop, _get_into_async, store.fs, bucket, key, start, out, **store.limit)  # noqa: E731
    else:
        def fn() -> int:
            data = store.fs.cat_file(full, start=start, end=start + len(out), **store.limit)
            out[: len(data)] = data
            return len(data)
    try:
        return store.call(what, fn)
    except FileNotFoundError:
        raise IntegrityError(f"data file {url} is missing") from None


def _short(url: str, start: int, got: int, want: int, whose: str) -> IntegrityError:
    return IntegrityError(f"data file {url} ends at {start + got} bytes, before the {start + want} {whose}")


class _Fetch:
    """One range being fetched into its buffer as chunk GETs on the pool: a mapped region of a
    spill file when the range is read again (the bytes land where the copy finds them), else
    memory."""

    def __init__(self, files: "ObjectFiles", index: int, start: int, stop: int, again: bool):
        self.region = files._spill.region(index, start, stop) if again and files._spill is not None else None
        self.buf = self.region.buf if self.region is not None else np.empty(stop - start, dtype=np.uint8)
        chunk = files.store.options.read_chunk_bytes
        name = files.entries[index].name
        view = self.buf.data
        self.parts: list[tuple[int, Future]] = [
            (at, files.pool().submit(get_into, files.store, name, start + at, view[at : at + chunk]))
            for at in range(0, len(self.buf), chunk)
        ]

    def release(self, kept: bool) -> None:
        """Done with the buffer; a spill region is unmapped (``kept``: its bytes are whole and
        may be read back)."""
        if self.region is not None:
            self.buf = NOTHING
            self.region.close(kept)

    def wait(self) -> int:
        """The bytes received in a row from the start (raises the first failure)."""
        got = 0
        for at, fut in self.parts:
            n = fut.result()
            if got == at:
                got += n
        return got

    def cancel(self) -> None:
        for _, fut in self.parts:
            fut.cancel()


class ObjectFiles:
    """The data objects of one checkpoint opened for reading (a :class:`DataFiles`): sizes
    checked against the metadata when first used (one HEAD per object), byte ranges read with
    ranged GETs; the ranges announced by :meth:`advise` are fetched ahead, in order, while
    the bytes fetched ahead and in use stay within ``read_ahead_bytes``.

    A load reads its ranges twice: once to check their checksums before any tensor changes,
    once to copy them. The ranges checked are fetched into local spill files
    (:mod:`paddle_dcp.io.spill`) and copied from there, so every byte costs one GET; without a
    spill directory, up to ``read_cache_bytes`` of them are kept in memory, the rest fetched
    again."""

    def __init__(self, store: "ObjectStorage", entries: Sequence[FileEntry], whose: str = ""):
        self.store, self.entries, self.whose = store, entries, whose
        self._infos: dict[int, tuple] = {}
        self._queue: deque[tuple[int, int, int]] = deque()  # advised, not started
        self._queued: dict[tuple[int, int, int], bool] = {}  # the same, with their ``again``
        self._ahead: dict[tuple[int, int, int], _Fetch] = {}  # started or in use
        self._ahead_bytes = 0
        self._kept: dict[int, list[tuple[int, int, np.ndarray]]] = {}  # file -> (start, stop, bytes), sorted
        self._kept_bytes = 0
        self._pool: ThreadPoolExecutor | None = None
        directory = spill_directory(store.options.spill_dir)
        self._spill = SpillFiles(directory) if directory else None

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.store.options.read_concurrency, thread_name_prefix="paddle_dcp-get")
        return self._pool

    def name(self, index: int) -> str:
        return self.store.resolve(self.entries[index].name)

    def _head(self, index: int) -> dict | None:
        """The object's size and ETag (None when it is missing)."""
        full = self.store.full(self.entries[index].name)
        try:
            return self.store.call(f"HEAD {self.name(index)}", lambda: self.store.fs.info(full, refresh=True, **self.store.limit))
        except FileNotFoundError:
            return None

    @staticmethod
    def _identity(info: dict) -> tuple:
        return (info.get("size"), info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("created"))

    def open(self, index: int) -> None:
        if index in self._infos:
            return
        entry = self.entries[index]
        info = self._head(index)
        if info is None:
            raise IntegrityError(f"data file {self.name(index)}{self.whose} is missing")
        if info.get("size") != entry.nbytes:
            raise IntegrityError(f"data file {self.name(index)} has {info.get('size')} bytes, the metadata says {entry.nbytes}")
        self._infos[index] = self._identity(info)

    def read_into(self, index: int, offset: int, out: memoryview) -> None:
        self.open(index)
        out = out.cast("B")
        got = get_into(self.store, self.entries[index].name, offset, out)
        if got < len(out):
            raise _short(self.name(index), offset, got, len(out), "the metadata promises")

    def advise(self, index: int, start: int, length: int, again: bool = False) -> None:
        """Queue a fetch of these bytes; it starts as soon as the bytes ahead allow
        (``again``: see :meth:`mapped`)."""
        key = (index, start, start + length)
        if length <= 0 or key in self._ahead or key in self._queued or self._is_kept(key):
            return
        self.open(index)
        self._queue.append(key)
        self._queued[key] = again
        self._pump()

    def _pump(self) -> None:
        limit = self.store.options.read_ahead_bytes
        while self._queue:
            key = self._queue[0]
            if self._ahead and self._ahead_bytes + key[2] - key[1] > limit:
                return
            self._queue.popleft()
            self._start(key, self._queued.pop(key))

    def _start(self, key: tuple[int, int, int], again: bool) -> _Fetch:
        fetch = self._ahead[key] = _Fetch(self, *key, again)
        self._ahead_bytes += key[2] - key[1]
        return fetch

    def _is_kept(self, key: tuple[int, int, int]) -> bool:
        return self._kept_range(*key) is not None or (self._spill is not None and self._spill.covers(*key))

    def _kept_range(self, index: int, start: int, stop: int) -> np.ndarray | None:
        """Bytes [start, stop) of file ``index`` from a range kept whole, or None."""
        kept = self._kept.get(index, [])
        at = bisect.bisect_right(kept, (start, float("inf"))) - 1
        if at >= 0 and kept[at][0] <= start and stop <= kept[at][1]:
            a = kept[at][0]
            return kept[at][2][start - a : stop - a]
        return None

    @contextmanager
    def mapped(self, index: int, start: int, stop: int, again: bool = False) -> Iterator[np.ndarray]:
        """The bytes [start, stop), fetched (or kept from an earlier read); ``again``: they are
        read once more soon (the copy after the check), so they are kept: fetched into the spill
        file when there is one, else in memory within ``read_cache_bytes``."""
        self.open(index)
        key = (index, start, stop)
        kept = self._kept_range(index, start, stop)
        if kept is not None:
            yield kept
            return
        if self._spill is not None and self._spill.covers(*key):
            with self._spill.mapped(*key) as data:
                yield data
            return
        fetch = self._ahead.get(key)
        if fetch is None:
            if key in self._queued:
                self._queue.remove(key)
                again = self._queued.pop(key) or again
            fetch = self._start(key, again)
        whole = False
        try:
            got = fetch.wait()
            if got != stop - start:
                raise _short(self.name(index), start, got, stop - start, "the metadata promises")
            whole = True
            yield fetch.buf
        finally:
            self._ahead.pop(key, None)
            self._ahead_bytes -= stop - start
            if fetch.region is None and whole and again:
                self._keep(key, fetch.buf)
            fetch.release(kept=whole)
            self._pump()

    def _keep(self, key: tuple[int, int, int], data: np.ndarray) -> None:
        """Without a spill file (or once it failed): in memory, within ``read_cache_bytes``."""
        if self._kept_bytes + len(data) <= self.store.options.read_cache_bytes:
            bisect.insort(self._kept.setdefault(key[0], []), (key[1], key[2], data), key=lambda e: e[:2])
            self._kept_bytes += len(data)

    def check_unchanged(self) -> None:
        """Raise IntegrityError when an object read was replaced since it was opened (its size
        or ETag moved)."""
        for index, before in self._infos.items():
            info = self._head(index)
            if info is None or self._identity(info) != before:
                raise IntegrityError(
                    f"data file {self.name(index)} was replaced while it was being loaded: the loaded "
                    f"values may mix old and new bytes"
                )

    def close(self) -> None:
        fetches = list(self._ahead.values())
        for fetch in fetches:
            fetch.cancel()
        self._ahead.clear()
        self._queue.clear()
        self._queued.clear()
        self._ahead_bytes = 0
        self._kept.clear()
        self._kept_bytes = 0
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for fetch in fetches:  # no GET writes into their buffers any more
            fetch.release(kept=False)
        self._infos.clear()
        if self._spill is not None:
            self._spill.close()


class ObjectRangeReader:
    """Byte ranges of named data objects, read for other ranks (a :class:`RangeSource`)."""

    def __init__(self, store: "ObjectStorage"):
        self.store = store

    def read_into(self, name: str, start: int, out: memoryview) -> None:
        out = out.cast("B")
        got = get_into(self.store, name, start, out)
        if got < len(out):
            raise _short(self.store.resolve(name), start, got, len(out), "a reader asked for")

    def close(self) -> None:
        pass
