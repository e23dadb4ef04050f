"""Cleaning a checkpoint directory up: the temporary files crashed saves left, data files
of ids without metadata, a rank's older generations.
"""
from __future__ import annotations

from typing import Iterable

from ..core.naming import TMP_RE, parse_data_name
from .storage import Listing, Storage, list_checkpoints


def temporary_names(listing: Listing, unique_id: int | None = None, rank: int | None = None) -> list[str]:
    """The temporary files of crashed saves in ``listing``: all of them, or those of one id
    (and, with ``rank``, only that rank's data files; the metadata's when ``rank`` is the
    coordinator's job: pass rank=-1)."""
    names = []
    for name in listing.temporary:
        m = TMP_RE.match(name)
        if m is None:  # a listing's temporary names all match
            continue
        owner = int(m.group(1)) if m.group(1) is not None else -1
        if unique_id is not None and int(m.group(2)) != unique_id:
            continue
        if rank is not None and owner != rank:
            continue
        names.append(name)
    return names


def remove_temporary(store: Storage, unique_id: int | None = None, rank: int | None = None) -> list[str]:
    """Remove the :func:`temporary_names` of ``store``'s listing. Returns the names removed."""
    return store.remove(temporary_names(list_checkpoints(store), unique_id, rank))


def remove_older(
    store: Storage, unique_id: int, rank: int | None, generation: int, listing: Listing | None = None,
    claims: bool = False,
) -> list[str]:
    """Remove ``rank``'s (None: every rank's) data files of older generations of ``unique_id``
    than ``generation``, and with ``claims`` their claims (a save's tidy step, once its
    metadata replaced theirs; ``listing``: the store's, when the caller has one). Newer
    generations, and every temporary file, may be another save's, still running: they stay
    (retention and ``clean`` remove what crashed saves left)."""
    listing = listing or list_checkpoints(store)
    names = []
    for name in listing.data_names(unique_id):
        writer, _, gen = parse_data_name(name) or (-1, -1, -1)
        if (rank is None or writer == rank) and gen < generation:
            names.append(name)
    if claims:
        names += listing.claim_names(lambda u, g: u == unique_id and g < generation)
    return store.remove(names)


def remove_steps(store: Storage, unique_ids: Iterable[int], rank: int | None = None) -> list[str]:
    """Remove the data files of ``unique_ids`` and the temporary files crashed saves of them
    left: ``rank``'s own, or (None) every rank's and the metadata's, from one listing (the
    retention of a manager and of its node-local tier, once the ids' metadata is gone)."""
    listing = list_checkpoints(store)
    names = []
    ids = list(unique_ids)
    for uid in ids:
        names += [n for n in listing.data_names(uid) if rank is None or (parse_data_name(n) or (-1,))[0] == rank]
        names += temporary_names(listing, uid, rank)
    wanted = set(ids)
    names += listing.claim_names(lambda u, g: u in wanted)  # where they are: the coordinator's directory
    return store.remove(names)


def remove_incomplete(store: Storage) -> list[str]:
    """Remove the data files of ids that have no metadata in ``store``. (On node-local disks a
    node without the metadata holds complete checkpoints' files too: only for shared storage.)"""
    listing = list_checkpoints(store)
    names = [n for uid in sorted(listing.data) if uid not in listing.complete for n in listing.data_names(uid)]
    names += listing.claim_names(lambda u, g: u not in listing.complete)
    return store.remove(names)
