"""Storage: byte ranges read into buffers, files written atomically. Imports ``format``,
``core`` and ``errors``."""
from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from .storage import Storage

# storage_options for URLs opened without any (the command line's --storage-option)
_DEFAULT_OPTIONS: ContextVar[dict | None] = ContextVar("paddle_dcp_storage_options", default=None)


@contextmanager
def default_storage_options(options: dict | None) -> Iterator[None]:
    """Inside the block, a URL opened without ``storage_options`` gets ``options``."""
    token = _DEFAULT_OPTIONS.set(options)
    try:
        yield
    finally:
        _DEFAULT_OPTIONS.reset(token)

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(path) -> bool:
    """Whether ``path`` is a URL ("protocol://..."), never to be taken for a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def open_storage(path: str, storage_options: dict | None = None) -> Storage:
    """The storage of the checkpoint directory ``path``: the objects under a URL
    ("s3://bucket/prefix", any fsspec protocol; ``storage_options`` go to fsspec, see
    :mod:`paddle_dcp.io.objects`), else the local directory. A local path never imports
    fsspec."""
    if is_url(path):
        from .objects import open_url

        return open_url(path, _DEFAULT_OPTIONS.get() if storage_options is None else storage_options)
    if storage_options:
        from ..errors import UnsupportedError

        raise UnsupportedError(f"storage_options apply to a URL (s3://bucket/prefix); {path!r} is a local path")
    from .local import LocalStorage

    return LocalStorage(path)
