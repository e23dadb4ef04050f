"""Which data files of a checkpoint hold exactly the bytes its metadata describes: each file
present with the size the metadata gives, and every checksum block of every piece it holds
matching, read through the storage in windows of bounded size (mapped from the page cache
on a local disk).

A load checks the blocks it reads (``core/checksums.py``, the one checksum scheme); this checks
whole files ahead of any load, without loading: ``paddle-dcp verify`` reports every problem
(:func:`check_each_file`), a node-local tier asks which of the files it holds are intact, to
read the damaged ones from another copy (:func:`check_files`). Metadata without checksums (a
Hugging Face directory: ``checksum_algorithm`` ``"none"``) has only its files' presence and
sizes checked: there is nothing else to check them against.
"""
from __future__ import annotations

import contextlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from ..core import checksums
from ..core.metadata import Metadata, TensorEntry
from ..errors import ArgumentError, FormatError, StorageError
from ..format.hf_dir import NO_CHECKSUMS
from .storage import DataFiles, Storage, open_data_files

WINDOW_BYTES = 64 << 20  # the most bytes of a data file held in memory at once

Progress = Callable[[int, int], None]  # (bytes of pieces checked so far, bytes to check in all)


@dataclass(frozen=True)
class FileCheck:
    """What checking one data file found.

    Attributes:
        name: the file's name in the checkpoint directory (``meta.files[i].name``).
        where: its full name (``store.resolve(name)``); every problem starts with it.
        readable: present with the size the metadata gives, so its pieces were read.
        problems: one line per problem: missing, wrong size, a piece whose checksum blocks
            differ (its key, box, byte range and the first failing block's bytes), a failed
            read; empty when the file is intact.
        checked: bytes of pieces whose checksum blocks were all checked, in bytes.
    """

    name: str
    where: str
    readable: bool
    problems: tuple[str, ...]
    checked: int = 0


def check_files(
    store: Storage,
    meta: Metadata,
    names: Iterable[str] | None = None,
    progress: Progress | None = None,
    *,
    window_bytes: int = WINDOW_BYTES,
    workers: int = 1,
) -> dict[str, str | None]:
    """Which data files of ``meta`` hold exactly the bytes it describes.

    Args:
        store: the storage of the checkpoint's directory (or of a copy of its data files).
        meta: the checkpoint's metadata; without checksums, only presence and sizes are checked.
        names: the data files to check (names in ``meta.files``); default: all of them.
        progress: called with (bytes checked so far, bytes to check in all) as pieces are read.
        window_bytes: the most bytes of a file held at once (one window, mapped or fetched).
        workers: threads checking files at once (each its own files, one window each).

    Returns:
        data file name -> None when it is present with the right size and every checksum block
        of every piece in it matches, else a one-line reason that starts with the file's full
        name (missing; its size and the metadata's; the byte range that fails its checksum and
        the key it belongs to; further problems counted).

    Raises:
        ArgumentError: a name in ``names`` is not a data file of ``meta``.
        FormatError: a tensor entry of a lazily parsed ``meta`` is malformed.
    """
    out: dict[str, str | None] = {}
    for found in check_each_file(store, meta, names, progress, window_bytes=window_bytes, workers=workers):
        more = len(found.problems) - 1
        first = found.problems[0] if found.problems else None
        if first and more:
            first += f" (and {more} more problem{'s' * (more > 1)} in this file)"
        out[found.name] = first
    return out


def check_each_file(
    store: Storage,
    meta: Metadata,
    names: Iterable[str] | None = None,
    progress: Progress | None = None,
    *,
    entries: Mapping[str, TensorEntry] | None = None,
    window_bytes: int = WINDOW_BYTES,
    workers: int = 1,
) -> list[FileCheck]:
    """Every problem of each data file of ``meta`` (or of those in ``names``), in the order of
    ``meta.files``: presence and size of all of them first, then the pieces of the readable
    ones (so ``progress``'s total is what will be read).

    Args:
        store, meta, names, progress, window_bytes, workers: as for :func:`check_files`.
        entries: the tensor entries whose pieces to check; default: all of ``meta.tensors``.

    Returns:
        One :class:`FileCheck` per file checked.

    Raises:
        ArgumentError: a name in ``names`` is not a data file of ``meta``.
        FormatError: a tensor entry of a lazily parsed ``meta`` is malformed.
    """
    indices = _selected(meta, names)
    entries = meta.tensors if entries is None else entries
    listed = list(entries.values())
    by_file = _pieces_by_file(listed)
    held = {f: [listed[k].key for k in np.unique(cols["key"]).tolist()] for f, cols in by_file.items()}
    found = [_presence(store, meta, f, held.get(f, [])) for f in indices]
    sums = meta.checksum_algorithm != NO_CHECKSUMS
    to_read = {f for f, check in zip(indices, found) if sums and check.readable and f in by_file}
    total = sum(int(by_file[f]["nbytes"].sum()) for f in to_read)
    done, lock = 0, threading.Lock()

    def tick(nbytes: int) -> None:
        nonlocal done
        with lock:
            done += nbytes
            if progress is not None:
                progress(done, total)

    def check(jobs: list[tuple[int, int]]) -> None:  # (position in found, file index), one thread
        window = _Window(max(window_bytes, meta.block_bytes))
        files = open_data_files(store, meta)
        try:
            for n, f in jobs:
                window.start(files, f, meta.files[f].nbytes)
                found[n] = _read_pieces(found[n], window, meta.block_bytes, listed, by_file[f], tick)
        finally:
            window.close()
            files.close()

    jobs = [(n, f) for n, f in enumerate(indices) if f in to_read]
    parts = [jobs[i::workers] for i in range(max(1, min(workers, len(jobs))))]
    if len(parts) == 1:
        check(parts[0])
    else:  # the hash and the page-cache reads leave the GIL
        with ThreadPoolExecutor(len(parts), thread_name_prefix="paddle_dcp-check") as pool:
            list(pool.map(check, parts))
    return found


def _pieces_by_file(entries: Iterable[TensorEntry]) -> dict[int, dict[str, np.ndarray]]:
    """file index -> columns of the pieces of ``entries`` it holds, sorted by byte offset:
    ``offset`` and ``nbytes`` (in bytes), ``key`` (index into ``entries``), ``piece`` (index
    into the entry's pieces), ``first_block`` (index of its first checksum)."""
    cols: dict[int, list[np.ndarray]] = {}
    for k, entry in enumerate(entries):
        p = entry.pieces
        if not p.count:
            continue
        table = np.stack(
            [
                p.byte_offsets,
                entry.piece_nbytes(),
                np.full(p.count, k, dtype=np.int64),
                np.arange(p.count, dtype=np.int64),
                entry.block_starts()[:-1],
            ],
            axis=1,
        )
        for f in np.unique(p.files).tolist():
            cols.setdefault(int(f), []).append(table[p.files == f])
    out = {}
    for f, parts in cols.items():
        t = np.concatenate(parts)
        t = t[np.argsort(t[:, 0], kind="stable")]
        out[f] = {"offset": t[:, 0], "nbytes": t[:, 1], "key": t[:, 2], "piece": t[:, 3], "first_block": t[:, 4]}
    return out


def _selected(meta: Metadata, names: Iterable[str] | None) -> list[int]:
    """Indices into ``meta.files`` of the files ``names`` (all when None)."""
    if names is None:
        return list(range(len(meta.files)))
    wanted = set(names)
    unknown = wanted - {entry.name for entry in meta.files}
    if unknown:
        raise ArgumentError(
            f"checkpoint {meta.unique_id} has no data file named {', '.join(sorted(unknown))}; "
            f"its data files are named in its metadata"
        )
    return [f for f, entry in enumerate(meta.files) if entry.name in wanted]


def _presence(store: Storage, meta: Metadata, index: int, held: Sequence[str]) -> FileCheck:
    """Whether data file ``index`` is present with its size (``held``: the keys it has pieces of)."""
    entry = meta.files[index]
    where = entry.name
    holds = f" (holds pieces of {_keys_list(held)})" if held else ""
    try:
        where = store.resolve(entry.name)
        size = store.size(entry.name)
    except (FormatError, StorageError) as exc:
        return FileCheck(entry.name, where, False, (f"{where}: {_one_line(exc)}{holds}",))
    if size is None:
        return FileCheck(entry.name, where, False, (f"{where}: missing{holds}",))
    if size != entry.nbytes:
        problem = f"{where}: has {size} bytes, the metadata says {entry.nbytes}{holds}"
        return FileCheck(entry.name, where, False, (problem,))
    return FileCheck(entry.name, where, True, ())


def _keys_list(keys: Sequence[str], limit: int = 5) -> str:
    keys = sorted(set(keys))
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _one_line(exc: BaseException) -> str:
    return re.sub(r"\s*\n\s*", "; ", str(exc).strip())


class _Window:
    """The bytes of one data file, taken in windows of at most ``size`` bytes through
    :meth:`DataFiles.mapped` (on a local disk straight from the page cache, nothing copied) to
    serve the checksum blocks of its pieces in the order of their offsets. One window is held
    at a time; :meth:`close` releases the last."""

    def __init__(self, size: int):
        self.width = size
        self.files: DataFiles | None = None
        self.index = self.size = self.lo = self.hi = 0
        self._held: contextlib.ExitStack | None = None
        self._bytes = np.empty(0, dtype=np.uint8)

    def start(self, files: DataFiles, index: int, size: int) -> None:
        self.close()
        self.files, self.index, self.size = files, index, size
        self.lo = self.hi = 0

    def view(self, start: int, length: int) -> memoryview:
        assert self.files is not None, "start() names the file first"
        if not (self.lo <= start and start + length <= self.hi):
            n = max(min(self.width, self.size - start), length)  # a block larger than a window: whole
            self.close()
            held = contextlib.ExitStack()
            self._bytes = held.enter_context(self.files.mapped(self.index, start, start + n))
            self._held, self.lo, self.hi = held, start, start + n
        return self._bytes.data[start - self.lo : start - self.lo + length]

    def close(self) -> None:
        self._bytes = np.empty(0, dtype=np.uint8)
        if self._held is not None:
            self._held.close()
            self._held = None
        self.lo = self.hi = 0


def _read_pieces(
    found: FileCheck, window: _Window, block: int, entries: list[TensorEntry], cols: dict, tick: Callable[[int], None]
) -> FileCheck:
    """``found`` with the problems of the pieces ``cols`` (of ``entries``) of the file that
    ``window`` reads, and the bytes checked."""
    problems: list[str] = []
    checked = 0
    try:
        for off, nbytes, k, i, first in zip(
            cols["offset"].tolist(), cols["nbytes"].tolist(), cols["key"].tolist(), cols["piece"].tolist(),
            cols["first_block"].tolist(),
        ):  # fmt: skip
            problem = _piece_problem(window, block, entries[k], i, off, nbytes, first)
            if problem:
                problems.append(f"{found.where}: {problem}")
            checked += nbytes
            tick(nbytes)
    except (FormatError, StorageError) as exc:  # an IntegrityError too: a file cut short since
        problems.append(f"{found.where}: {_one_line(exc)}")
    return FileCheck(found.name, found.where, True, tuple(problems), checked)


def _piece_problem(window: _Window, block: int, entry: TensorEntry, i: int, off: int, nbytes: int, first: int) -> str:
    """What is wrong with piece ``i`` of ``entry`` (at bytes [off, off + nbytes)), or ""."""
    p = entry.pieces
    seed = checksums.piece_seed(entry.key, entry.dtype, p.offsets[i].tolist(), p.shapes[i].tolist())
    checked = checksums.piece_blocks(seed, p.checksums, first, off, off + nbytes, off, block)
    bad = checksums.failing(checked, checksums.hashed(checked, window.view))
    if not bad:
        return ""
    box = tuple(int(x) for x in p.offsets[i])
    return (
        f"{entry.key}: piece {i} at offset {box} ({nbytes} bytes from byte {off}): "
        f"{len(bad)} of {len(checked)} checksum blocks differ, the first at bytes "
        f"[{bad[0][0]}, {bad[0][0] + bad[0][1]})"
    )
