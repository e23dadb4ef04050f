"""Storage: byte ranges read into buffers, files written atomically. Imports ``format``,
``core`` and ``errors``."""
from __future__ import annotations

from .storage import Storage


def open_storage(path: str) -> Storage:
    """The storage of the checkpoint directory ``path`` (today: always the local disk)."""
    from .local import LocalStorage

    return LocalStorage(path)
