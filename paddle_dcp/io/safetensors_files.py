"""Safetensors files read through a :class:`~paddle_dcp.io.storage.Storage`: a file's header,
and the metadata of a Hugging Face directory (its index and headers; the rules are
:mod:`paddle_dcp.format.hf_dir`'s and :mod:`paddle_dcp.format.safetensors`'s)."""
from __future__ import annotations

from ..core.metadata import Metadata
from ..errors import FormatError
from ..format import hf_dir
from ..format.safetensors import Header, header_from
from .storage import Storage, read_range


def where(store: Storage, name: str) -> str:
    """File ``name`` of ``store`` as messages name it."""
    return f"{store.path.rstrip('/')}/{name}"


def read_header(store: Storage, name: str, source: str | None = None) -> Header:
    """Read and validate the header of safetensors file ``name`` (named ``source`` in messages).

    Raises:
        FormatError: a malformed or truncated file. StorageError: it cannot be read.
    """
    source = source or where(store, name)
    size = store.size(name)
    if size is None:
        raise FormatError(f"{source}: no such file")
    return header_from(lambda start, n: read_range(store, name, start, max(0, min(n, size - start))), size, source)


def shard_names(store: Storage) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of the directory that hold tensors, and the index's weight_map
    (None without an index): the files the one ``*.safetensors.index.json`` names, else every
    ``*.safetensors`` but rank data files of ours.

    Raises:
        FormatError: no safetensors file, more than one index, a malformed index.
    """
    names = store.list_checkpoints().files
    index = hf_dir.index_name(names, store.path)
    if index is None:
        return hf_dir.shard_files(names, store.path), None
    size = store.size(index) or 0
    raw = read_range(store, index, 0, min(size, hf_dir.MAX_INDEX_BYTES + 1))
    weight_map = hf_dir.parse_index(raw, where(store, index))
    return sorted(set(weight_map.values())), weight_map


def directory_metadata(store: Storage, unique_id: int = 0) -> Metadata:
    """The metadata of a directory of safetensors files (see :func:`shard_names` and
    :func:`paddle_dcp.format.hf_dir.headers_metadata`).

    Raises:
        FormatError: a malformed header or index; an index naming a missing file or a tensor
            its file does not hold, or a file holding a tensor the index does not list; one
            name in two files.
        StorageError: a file cannot be read.
    """
    names, weight_map = shard_names(store)
    headers = []
    for name in names:
        if weight_map is not None and store.size(name) is None:
            raise FormatError(f"{store.path}: the index names {name}, which is missing")
        headers.append(read_header(store, name))
    return hf_dir.headers_metadata(store.path, names, headers, weight_map, unique_id)
