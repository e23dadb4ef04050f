"""A save's claim of the id and generation it writes: ``{id}.{generation}.claim``, created
exclusively (:meth:`~paddle_dcp.io.storage.Storage.create_exclusive`) by the coordinator before
any rank writes a file of that generation. Two saves to one directory then never write under
the same names: a save that asked for no particular id and finds its id claimed takes the next
id; a save of a given id takes the next generation of it (docs/reliability.md, "Two saves to
one directory"). A claim is an empty file (saves stay byte for byte the same), and stays as
long as its generation's files: the save that replaces a generation (``tidy``), retention and
``clean`` remove it with them.
"""
from __future__ import annotations

import logging

from ..errors import StorageError
from .storage import Listing, Storage, claim_name, list_checkpoints

logger = logging.getLogger(__name__)

ATTEMPTS = 64  # ids or generations tried before a save gives up


def claim(store: Storage, unique_id: int, generation: int, listing: Listing | None, fresh: bool) -> tuple[int, int]:
    """Claim (``unique_id``, ``generation``) in ``store``, or the nearest free one: with
    ``fresh`` (the caller gave no id) the first id from ``unique_id`` on that ``listing`` shows
    nothing of (no metadata, data file or claim), at generation 0; else the next generation of
    ``unique_id``. Returns what was claimed.

    Raises:
        StorageError: nothing free after :data:`ATTEMPTS` tries (naming the directory).
    """
    listing = listing or list_checkpoints(store)
    if fresh:
        unique_id, generation = _unused(listing, unique_id), 0
    for _ in range(ATTEMPTS):
        if store.create_exclusive(claim_name(unique_id, generation), b""):
            return unique_id, generation
        logger.info("%s is claimed by another save: trying the next %s",
                    store.resolve(claim_name(unique_id, generation)), "id" if fresh else "generation")
        listing = list_checkpoints(store)
        if fresh:
            unique_id = _unused(listing, unique_id + 1)
        else:
            generation = max(generation + 1, first_free(listing, unique_id))
    raise StorageError(f"{store.path}: no free id to save under after {ATTEMPTS} tries (every one claimed by another save)",
                       store.path)


def _unused(listing: Listing, unique_id: int) -> int:
    """The first id from ``unique_id`` on that ``listing`` shows nothing of. Two saves that
    listed the directory at different moments then never claim two generations of one id."""
    while unique_id in listing.complete or unique_id in listing.data or listing.claimed(unique_id):
        unique_id += 1
    return unique_id


def first_free(listing: Listing, unique_id: int, seen: int = -1) -> int:
    """The generation after every one of ``unique_id``'s data files and claims in ``listing``
    (and after ``seen``)."""
    gens = [g for _, g in listing.data.get(unique_id, ())] + listing.claimed(unique_id)
    return max(gens + [seen]) + 1


def check_latest(store: Storage, unique_id: int, generation: int) -> None:
    """Raise when a later save claimed a newer generation of ``unique_id`` while this one ran:
    its metadata would replace the newer save's (called by the coordinator just before it
    commits; a claim is never taken back, so one look at the next generation's name is enough)."""
    newer = claim_name(unique_id, generation + 1)
    if store.size(newer) is not None:
        raise StorageError(
            f"checkpoint {unique_id} in {store.path} is being saved again by another save ({newer}) since this one "
            f"started: this save (generation {generation}) is not committed, so as not to replace a newer one",
            store.resolve(newer),
        )
