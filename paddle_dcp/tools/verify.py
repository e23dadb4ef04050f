"""Verify a checkpoint without loading it: every file present with its size, every piece's
checksum blocks read and checked, every tensor tiled by its pieces (the ``verify`` command).
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from ..core import checksums
from . import consolidate
from ..core.metadata_parse import check_entry
from ..core.metadata import Metadata, TensorEntry, blocks_of
from ..core.naming import metadata_name
from ..errors import FormatError, StorageError
from ..io import open_storage, storage
from .console import (
    EXIT_OK,
    EXIT_PROBLEMS,
    ProgressBar,
    _directory,
    _ids,
    _one_line,
    _out,
    _progress_enabled,
    choose_id,
    incomplete_ids,
)


def _pieces_by_file(meta: Metadata, entries: dict[str, TensorEntry]) -> dict[int, dict[str, np.ndarray]]:
    """file index -> columns of the pieces it holds, sorted by byte offset: ``offset``,
    ``nbytes``, ``key`` (index into ``list(entries)``), ``piece``, ``first_block``."""
    cols: dict[int, list[np.ndarray]] = {}
    for k, entry in enumerate(entries.values()):
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
                p.files,
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


def _keys_list(keys: Sequence[str], limit: int = 5) -> str:
    keys = sorted(set(keys))
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


class _FileChecker:
    """Reads data file ``index`` of ``files`` in windows of the size of ``buf`` (reused for
    every file) and serves the checksum blocks of the pieces it holds from them."""

    def __init__(self, files: storage.DataFiles, index: int, name: str, size: int, buf: np.ndarray):
        self.files, self.index, self.name, self.size = files, index, name, size
        self.buf = buf
        self.lo = self.hi = 0

    def view(self, start: int, length: int) -> memoryview:
        if not (self.lo <= start and start + length <= self.hi):
            n = min(len(self.buf), self.size - start)
            n = max(n, length)
            if n > len(self.buf):  # a block larger than the window
                self.buf = np.empty(n, dtype=np.uint8)
            self.files.read_into(self.index, start, memoryview(self.buf)[:n])
            self.lo, self.hi = start, start + n
        return memoryview(self.buf)[start - self.lo : start - self.lo + length]


def verify_checkpoint(path: str, unique_id: int, progress: bool = False) -> tuple[list[str], dict]:
    """Check a checkpoint against its metadata: the metadata's digest, every tensor entry
    (types, bounds, pieces that tile the tensor exactly), every data file's presence and size,
    and every checksum block of every piece, reading with bounded memory.

    Returns:
        (problems, counts): one line per problem, naming the file and key; counts of tensors,
        pieces, files and bytes checked.
    """
    meta_file = os.path.join(path, metadata_name(unique_id))
    counts = {"tensors": 0, "pieces": 0, "files": 0, "bytes": 0}
    store = open_storage(path)
    try:
        meta = store.read_metadata(unique_id, lazy=True)
    except (FormatError, StorageError) as exc:
        return [_located(meta_file, exc)], counts
    problems: list[str] = []
    try:  # what a load checks before it moves a byte, so verify says OK only where a load would
        meta.check_digest()
    except FormatError as exc:
        problems.append(_located(meta_file, exc))
    entries: dict[str, TensorEntry] = {}
    for key in meta.tensors:
        try:
            entry = meta.tensors[key]
            check_entry(entry, meta.replicas)
        except FormatError as exc:
            problems.append(_located(meta_file, exc))
            continue
        entries[key] = entry
    keys = list(entries)
    by_file = _pieces_by_file(meta, entries)
    counts["tensors"] = len(entries)
    counts["pieces"] = sum(e.pieces.count for e in entries.values())
    # files first: presence and size, so the progress bar's total is what will be read
    readable: dict[int, tuple[str, int]] = {}
    for f, entry in enumerate(meta.files):
        held = [keys[k] for k in np.unique(by_file[f]["key"]).tolist()] if f in by_file else []
        problem, full, size = _file_problem(store, path, entry, f" (holds pieces of {_keys_list(held)})" if held else "")
        if problem:
            problems.append(problem)
        else:
            readable[f] = (full, size)
    total = sum(int(by_file[f]["nbytes"].sum()) for f in readable if f in by_file)
    window = max(consolidate.SLAB_BYTES, meta.block_bytes)
    largest = max((size for f, (_, size) in readable.items() if f in by_file), default=0)
    buf = np.empty(min(window, max(largest, 1)), dtype=np.uint8)
    files = store.open_files(meta)
    try:
        with ProgressBar(total, f"verify {unique_id}", progress) as bar:
            for f, (full, size) in readable.items():
                counts["files"] += 1
                if f not in by_file:
                    continue
                try:
                    checker = _FileChecker(files, f, full, size, buf)
                    problems += _check_pieces(checker, meta, entries, keys, by_file[f], bar, counts)
                except (FormatError, StorageError) as exc:  # an IntegrityError too: a file cut short
                    problems.append(f"{full}: {_one_line(exc)}")
    finally:
        files.close()
    return problems, counts


def _file_problem(store: storage.Storage, path: str, entry, holds: str) -> tuple[str, str, int]:
    """(what is wrong with data file ``entry``, or "", its full name, its size)."""
    full = os.path.join(path, entry.name)
    try:
        full = store.resolve(entry.name)
        size = store.size(entry.name)
    except (FormatError, StorageError) as exc:
        return f"{full}: {_one_line(exc)}{holds}", full, 0
    if size is None:
        return f"{full}: missing{holds}", full, 0
    if size != entry.nbytes:
        return f"{full}: has {size} bytes, the metadata says {entry.nbytes}{holds}", full, 0
    return "", full, size


def _check_pieces(checker, meta, entries, keys, cols, bar, counts) -> list[str]:
    problems = []
    block = meta.block_bytes
    pending = 0
    for off, nbytes, k, i, first in zip(
        cols["offset"].tolist(), cols["nbytes"].tolist(), cols["key"].tolist(), cols["piece"].tolist(),
        cols["first_block"].tolist(),
    ):
        entry = entries[keys[k]]
        sums = entry.pieces.checksums
        seed = checksums.piece_seed(entry.key, entry.dtype, entry.pieces.offsets[i].tolist(), entry.pieces.shapes[i].tolist())
        bad, first_bad, nblocks = 0, None, int(blocks_of(nbytes, block))
        for b, at, length in checksums.blocks(off, off + nbytes, off, block):
            if checksums.block_checksum(checker.view(at, length), seed, b) != int(sums[first + b]):
                bad += 1
                first_bad = first_bad or (at, at + length)
        counts["bytes"] += nbytes
        pending += nbytes
        if pending >= (1 << 20):
            bar.update(pending)
            pending = 0
        if bad:
            box = tuple(int(x) for x in entry.pieces.offsets[i])
            problems.append(
                f"{checker.name}: {keys[k]}: piece {i} at offset {box} ({nbytes} bytes from byte {off}): "
                f"{bad} of {nblocks} checksum blocks differ, the first at bytes [{first_bad[0]}, {first_bad[1]})"
            )
    bar.update(pending)
    return problems


def _located(where: str, exc: BaseException) -> str:
    message = _one_line(exc)
    return message if message.startswith(where) else f"{where}: {message}"


def cmd_verify(args) -> int:
    path = _directory(args.path)
    listing = open_storage(path).list_checkpoints()
    if args.all:
        ids = sorted(listing.complete)
        if not ids:
            choose_id(path, listing, None)  # raises: no complete checkpoint
        if incomplete_ids(listing):
            _out(f"incomplete ids (not verified, no metadata): {_ids(incomplete_ids(listing))}")
    else:
        ids = [choose_id(path, listing, args.unique_id)]
    failed = 0
    for uid in ids:
        problems, c = verify_checkpoint(path, uid, _progress_enabled(args))
        for p in problems:
            _out(p)
        what = f"{c['tensors']} tensors, {c['pieces']} pieces, {c['bytes']} bytes in {c['files']} files checked"
        if problems:
            failed += 1
            _out(f"checkpoint {uid}: {len(problems)} problem(s); {what}")
        else:
            _out(f"checkpoint {uid}: OK, {what}")
    return EXIT_PROBLEMS if failed else EXIT_OK
