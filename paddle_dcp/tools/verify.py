"""Verify a checkpoint without loading it: every file present with its size, every piece's
checksum blocks read and checked, every tensor tiled by its pieces (the ``verify`` command).
"""
from __future__ import annotations

import os

from . import consolidate
from ..core import metafile
from ..core.metadata_parse import check_entry
from ..core.metadata import TensorEntry
from ..core.naming import metadata_name
from ..errors import FormatError, StorageError
from ..io import open_storage, file_check
from ..io.storage import list_checkpoints, read_metadata
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
        meta = read_metadata(store, unique_id, lazy=True)
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
            if meta.format_version < metafile.VERSION:  # version 3's decode checked every tiling already
                check_entry(entry, meta.replicas)
        except FormatError as exc:
            problems.append(_located(meta_file, exc))
            continue
        entries[key] = entry
    counts["tensors"] = len(entries)
    counts["pieces"] = sum(e.pieces.count for e in entries.values())
    with _Progress(f"verify {unique_id}", progress) as bar:
        found = file_check.check_each_file(store, meta, progress=bar, entries=entries, window_bytes=consolidate.SLAB_BYTES)
    # files first: presence and size, then the pieces of those present
    problems += [p for check in found if not check.readable for p in check.problems]
    problems += [p for check in found if check.readable for p in check.problems]
    counts["files"] = sum(check.readable for check in found)
    counts["bytes"] = sum(check.checked for check in found)
    return problems, counts


class _Progress:
    """A progress bar drawn from the first bytes checked on, when the total is known."""

    def __init__(self, desc: str, enabled: bool):
        self.desc, self.enabled = desc, enabled
        self.bar: ProgressBar | None = None

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = ProgressBar(total, self.desc, self.enabled)
        self.bar.update(done - self.bar.done)


def _located(where: str, exc: BaseException) -> str:
    message = _one_line(str(exc))
    return message if message.startswith(where) else f"{where}: {message}"


def cmd_verify(args) -> int:
    path = _directory(args.path)
    listing = list_checkpoints(open_storage(path))
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
