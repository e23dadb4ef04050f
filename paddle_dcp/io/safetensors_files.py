"""Safetensors files read through a :class:`~paddle_dcp.io.storage.Storage`: a file's header,
and the metadata of a Hugging Face directory (its index and headers; the rules are
:mod:`paddle_dcp.format.hf_dir`'s and :mod:`paddle_dcp.format.safetensors`'s)."""
from __future__ import annotations

import json
import struct
from typing import Iterable

from ..core.metadata import Metadata
from ..errors import FormatError
from ..format import hf_dir
from ..format.safetensors import MAX_HEADER_BYTES, Header, header_from
from .reads import read_range
from .storage import Storage, list_checkpoints
from ..core.json_text import parse_json


def where(path: str, name: str) -> str:
    """File ``name`` of the directory ``path`` as messages name it."""
    return f"{path.rstrip('/')}/{name}"


def head_bytes(store: Storage, name: str, size: int) -> bytes:
    """The bytes of safetensors file ``name`` (``size`` bytes long) that hold its header: the
    8-byte length and the JSON it counts, or only what comes before a length that cannot be
    right (:func:`~paddle_dcp.format.safetensors.header_from` then says what is wrong)."""
    head = read_range(store, name, 0, min(8, size))
    if len(head) < 8:
        return head
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        return head
    return head + read_range(store, name, 8, n)


def _header_of(head: bytes, size: int, source: str) -> Header:
    return header_from(lambda start, n: head[start:start + n], size, source)


def read_header(store: Storage, name: str, source: str | None = None) -> Header:
    """Read and validate the header of safetensors file ``name`` (named ``source`` in messages).

    Raises:
        FormatError: a malformed or truncated file. StorageError: it cannot be read.
    """
    source = source or where(store.path, name)
    size = store.size(name)
    if size is None:
        raise FormatError(f"{source}: no such file")
    return _header_of(head_bytes(store, name, size), size, source)


def shard_names(store: Storage, files: Iterable[str] | None = None) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of the directory that hold tensors, and the index's weight_map
    (None without an index): the files the one ``*.safetensors.index.json`` names, else every
    ``*.safetensors`` but rank data files of ours. ``files``: every file the directory holds,
    when a listing has them already.

    Raises:
        FormatError: no safetensors file, more than one index, a malformed index.
    """
    names = list(files) if files is not None else list_checkpoints(store).files
    index = hf_dir.index_name(names, store.path)
    if index is None:
        return hf_dir.shard_files(names, store.path), None
    size = store.size(index) or 0
    raw = read_range(store, index, 0, min(size, hf_dir.MAX_INDEX_BYTES + 1))
    weight_map = hf_dir.parse_index(raw, where(store.path, index))
    return sorted(set(weight_map.values())), weight_map


def directory_blob(store: Storage, names: list[str], weight_map: dict[str, str] | None) -> bytes:
    """What the metadata of a directory of safetensors files ``names`` (:func:`shard_names`)
    is made from, in one piece of bytes: the file names and sizes, the index's weight_map and
    every file's header bytes, unparsed. One rank reads it and every rank parses it
    (:func:`metadata_from_blob`), so that a load sends the directory's requests once, not once
    per rank.

    Raises:
        FormatError: the index names a missing file. StorageError: a file cannot be read.
    """
    sizes, heads = [], []
    for name in names:
        size = store.size(name)
        if size is None:
            if weight_map is not None:
                raise FormatError(f"{store.path}: the index names {name}, which is missing")
            raise FormatError(f"{where(store.path, name)}: no such file")
        sizes.append(size)
        heads.append(head_bytes(store, name, size))
    doc = json.dumps({"names": names, "weight_map": weight_map, "sizes": sizes, "heads": [len(h) for h in heads]})
    return struct.pack("<Q", len(doc)) + doc.encode() + b"".join(heads)


def metadata_from_blob(blob: bytes, path: str, unique_id: int = 0) -> Metadata:
    """The metadata of the directory ``path`` from its :func:`directory_blob` (every header
    validated here, by every rank that parses it; see
    :func:`paddle_dcp.format.hf_dir.headers_metadata`).

    Raises:
        FormatError: a malformed header or blob; an index naming a tensor its file does not
            hold, or a file holding a tensor the index does not list; one name in two files.
    """
    try:
        (n,) = struct.unpack_from("<Q", blob)
        doc = parse_json(blob[8:8 + n], path, "the description of its safetensors files")
        names, weight_map, sizes, lengths = doc["names"], doc["weight_map"], doc["sizes"], doc["heads"]
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{path}: the description of its safetensors files is malformed ({exc})") from None
    headers, at = [], 8 + n
    for name, size, length in zip(names, sizes, lengths):
        headers.append(_header_of(bytes(blob[at:at + length]), size, where(path, name)))
        at += length
    return hf_dir.headers_metadata(path, names, headers, weight_map, unique_id)


def directory_metadata(store: Storage, unique_id: int = 0) -> Metadata:
    """The metadata of a directory of safetensors files, read by this process alone (see
    :func:`directory_blob` and :func:`metadata_from_blob`)."""
    return metadata_from_blob(directory_blob(store, *shard_names(store)), store.path, unique_id)
