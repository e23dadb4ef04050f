"""Storage: byte ranges read into buffers, files written atomically. Imports ``format``,
``core`` and ``errors``."""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from .datafile import data_writer
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


def open_file(path: str, follow: bool = True, storage_options: dict | None = None) -> tuple[Storage, str]:
    """The storage of the directory that holds the file ``path`` (a URL: the prefix above the
    object), and the file's name in it. With ``follow``, a local path is resolved first: a
    symlink the caller names is read through (only names read from a checkpoint must stay
    inside its directory); a file to be written is not (its symlink is replaced, as a rename
    replaces it)."""
    path = os.fspath(path)
    if is_url(path):
        scheme, _, rest = path.partition("://")
        parent, _, name = rest.rstrip("/").rpartition("/")
        if not parent:
            from ..errors import ArgumentError

            raise ArgumentError(f"{path} names no object under a bucket")
        return open_storage(f"{scheme}://{parent}", storage_options), name
    if follow:
        path = os.path.realpath(path)
    parent, name = os.path.split(path)
    return open_storage(parent or ".", storage_options), name


def is_file(path: str, storage_options: dict | None = None) -> bool:
    """Whether ``path`` names a file, or an object under a URL (not a directory, not nothing)."""
    if is_url(path) and "/" not in os.fspath(path).partition("://")[2].rstrip("/"):
        return False  # a bucket
    store, name = open_file(path, storage_options=storage_options)
    return bool(name) and store.size(name) is not None


def open_output(path: str, header: bytes = b"", storage_options: dict | None = None):
    """A writer of the single file ``path`` (a local path, its directory created, or a URL)
    through its directory's storage: ``header`` first, then the bytes written back to back,
    each before the next ``write`` returns, no checksums or padding; the file appears, whole,
    at the writer's ``commit`` (a rename, or the end of a multipart upload)."""
    store, name = open_file(path, follow=False, storage_options=storage_options)
    store.create()
    return data_writer(store, name, block_bytes=0, depth=0, header=header, alignment=1)
