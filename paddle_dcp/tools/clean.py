"""The ``clean`` command: a checkpoint directory's temporary files removed and, on request, the
data files no metadata there uses (incomplete ids, generations a crashed re-save left)."""
from __future__ import annotations

import logging
import os

from ..errors import DcpError
from ..io import cleanup, is_url, open_storage, storage
from .console import EXIT_OK, _directory, _one_line, _out, incomplete_ids


logger = logging.getLogger(__name__)



def _superseded(path: str, listing: storage.Listing) -> list[str]:
    """Data files of complete checkpoints that their metadata does not list (generations a
    crashed re-save left behind). Ids whose metadata cannot be read are left alone."""
    names = []
    for uid in sorted(listing.complete):
        present = listing.data.get(uid, frozenset())
        if not present:
            continue
        try:
            meta = storage.read_metadata(open_storage(path), uid, lazy=True)
        except DcpError as exc:
            logger.warning("checkpoint %d: metadata unreadable, its files are left alone: %s", uid, _one_line(exc))
            continue
        listed = {f.name for f in meta.files}
        names += [n for n in listing.data_names(uid) if n not in listed]
    return names


def _sizes(path: str, names: list[str]) -> dict[str, int]:
    """name -> bytes of each of ``names`` present in ``path`` (one listing for a URL)."""
    if is_url(path):
        found = open_storage(path).sizes()
        return {n: int(found[n].get("size") or 0) if n in found else 0 for n in names}
    sizes = {}
    for name in names:
        try:
            sizes[name] = os.lstat(os.path.join(path, name)).st_size
        except OSError:
            sizes[name] = 0
    return sizes


def cmd_clean(args) -> int:
    path = _directory(args.path)
    listing = storage.list_checkpoints(open_storage(path))
    planned = list(listing.temporary)
    if args.incomplete:
        planned += [n for uid in incomplete_ids(listing) for n in listing.data_names(uid)]
        planned += listing.claim_names(lambda u, g: u not in listing.complete)
        planned += _superseded(path, listing)
    sizes = _sizes(path, planned)
    if args.dry_run:
        removed = planned
    else:
        removed = cleanup.remove_temporary(open_storage(path))
        if args.incomplete:
            removed += cleanup.remove_incomplete(open_storage(path))
            removed += open_storage(path).remove(_superseded(path, storage.list_checkpoints(open_storage(path))))
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        _out(f"{verb} {open_storage(path).resolve(name) if is_url(path) else os.path.join(path, name)}")
    if not removed:
        _out(f"nothing to remove in {path}")
    else:
        nbytes = sum(sizes.get(n, 0) for n in removed)
        _out(f"total: {len(removed)} files ({nbytes} bytes) {'would be removed' if args.dry_run else 'removed'}")
    return EXIT_OK
