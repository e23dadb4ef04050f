"""Checkpoints in safetensors files: a Hugging Face directory read as a checkpoint's metadata,
and each rank's data file written as a safetensors file.

A Hugging Face directory holds ``model.safetensors``, or shards and an index
``model.safetensors.index.json`` whose ``weight_map`` names the shard of every tensor. Its
headers (read through the storage by :mod:`paddle_dcp.io.safetensors_files`) become a :class:`~paddle_dcp.core.metadata.Metadata` (each tensor one piece at its byte
range in its shard), so a load plans, reads only its byte ranges, exchanges and reshards
exactly as for a checkpoint of ours. Those files carry no checksums: the metadata says so
(``checksum_algorithm`` ``"none"``) and the load checks none.

A save with ``safetensors=True`` writes ``{rank}_{id}.safetensors``: a safetensors header naming
every piece the rank writes (its key, and its box when it is not the whole tensor), then the
pieces back to back. The coordinator works out every header from the save plan, so the
metadata's byte offsets point past it, and the metadata stays the one record of where every
piece belongs. Pure: stdlib and numpy.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Sequence

import numpy as np

from ..core.dtypes import itemsize
from ..errors import FormatError, UnsupportedError
from ..core.metadata import FileEntry, Metadata, PieceTable, TensorEntry, check_file_name
from ..core.naming import data_file_name, parse_data_name
from ..core.save_plan import SavePlan
from .safetensors import MAX_HEADER_BYTES, Entry, Header, code_of, encode_header, no_duplicates
from ..core.json_text import parse_json

logger = logging.getLogger(__name__)

INDEX_SUFFIX = ".safetensors.index.json"
SINGLE_FILE = "model.safetensors"
NO_CHECKSUMS = "none"  # the checksum_algorithm of metadata made from safetensors headers
MAX_INDEX_BYTES = 64 << 20
RANK_FILE_METADATA = {"format": "np", "paddle_dcp": "a rank's data file: the checkpoint's metadata places each piece"}


# ---------------------------------------------------------------------- load
def parse_index(raw: bytes, source: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of the index ``source`` whose bytes
    are ``raw``, checked: JSON object, no duplicate names, plain shard file names.

    Raises:
        FormatError: a malformed index.
    """
    if len(raw) > MAX_INDEX_BYTES:
        raise FormatError(f"{source}: more than the {MAX_INDEX_BYTES} bytes allowed for an index")
    doc = parse_json(raw, source, "the index", no_duplicates("the index"))
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise FormatError(f"{source}: an index must be a JSON object with a weight_map object")
    for key, shard in weight_map.items():
        if not isinstance(shard, str):
            raise FormatError(f"{source}: weight_map[{key!r}] must be a file name")
        check_file_name(shard, f"{source}: weight_map[{key!r}]")
    return weight_map


def index_name(names: Iterable[str], path: str) -> str | None:
    """The one ``*.safetensors.index.json`` among the files ``names`` of directory ``path``.

    Raises:
        FormatError: more than one index.
    """
    indexes = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
    if len(indexes) > 1:
        raise FormatError(f"{path}: more than one safetensors index ({', '.join(indexes)}): which one is meant?")
    return indexes[0] if indexes else None


def shard_files(names: Iterable[str], path: str) -> list[str]:
    """The files of a directory without an index that hold tensors: every ``*.safetensors``
    but rank data files of ours, sorted.

    Raises:
        FormatError: none.
    """
    files = sorted(n for n in names if n.endswith(".safetensors") and parse_data_name(n) is None)
    if not files:
        raise FormatError(
            f"no checkpoint in {path}: no *.metadata, no {SINGLE_FILE} or other *.safetensors file, no *{INDEX_SUFFIX}"
        )
    return files


def headers_metadata(
    path: str,
    names: Sequence[str],
    headers: Sequence[Header],
    weight_map: dict[str, str] | None,
    unique_id: int = 0,
    structure: dict | None = None,
) -> Metadata:
    """The metadata of a directory of safetensors files ``names`` whose headers are
    ``headers`` (one file: a single safetensors file): every tensor one piece, at its byte
    range in its file; no checksums. Tensors of a dtype paddle_dcp does not load (FP8,
    unsigned wider than 8 bits) are left out, with a warning. ``structure``: the nesting and
    plain values a file's writer stored (``save_gathered``); else every tensor at the root.

    Raises:
        FormatError: an index naming a tensor its file does not hold, or a file holding a
            tensor the index does not list; one name in two files.
    """
    found: dict[str, int] = {}
    for i, header in enumerate(headers):
        for key in header.entries:
            if key in found:
                raise FormatError(f"{path}: tensor {key!r} is in both {names[found[key]]} and {names[i]}")
            found[key] = i
            if weight_map is not None and weight_map.get(key) != names[i]:
                raise FormatError(f"{path}: {names[i]} holds {key!r}, which the index places in {weight_map.get(key)}")
    if weight_map is not None:
        lost = sorted(k for k in weight_map if k not in found)
        if lost:
            raise FormatError(f"{path}: the index places {lost[:5]} in files that do not hold them")
    tensors, skipped = {}, []
    for key, i in found.items():
        entry = headers[i].entries[key]
        if entry.dtype is None:
            skipped.append(f"{key} ({entry.code})")
            continue
        tensors[key] = tensor_entry(entry, i)
    if skipped:
        logger.warning("%s: tensors of a dtype paddle_dcp does not load, left out: %s", path, skipped)
    return files_metadata([(n, h.file_bytes) for n, h in zip(names, headers)], tensors, unique_id, structure)


def tensor_entry(entry: Entry, file: int) -> TensorEntry:
    """The metadata entry of tensor ``entry`` of a safetensors file (index ``file`` of the
    metadata's files): one piece, the whole tensor, no checksums.

    Raises:
        UnsupportedError: a dtype paddle_dcp does not load.
    """
    if entry.dtype is None:
        raise UnsupportedError(f"{entry.key}: the file holds dtype {entry.code}, which paddle_dcp does not load")
    nd = len(entry.shape)
    pieces = PieceTable(
        offsets=_frozen(np.zeros((1, nd), dtype=np.int64)),
        shapes=_frozen(np.array([entry.shape], dtype=np.int64).reshape(1, nd)),
        files=_frozen(np.array([file], dtype=np.int64)),
        byte_offsets=_frozen(np.array([entry.begin], dtype=np.int64)),
        checksums=_frozen(np.zeros(0, dtype=np.uint64)),
    )
    # one-byte "blocks": the load's reads round to blocks, and there is nothing to check
    return TensorEntry(entry.key, entry.dtype, entry.shape, pieces, block_bytes=1)


def files_metadata(
    files: Sequence[tuple[str, int]], tensors: dict[str, TensorEntry], unique_id: int = 0, structure: dict | None = None
) -> Metadata:
    """The metadata of safetensors files ``files`` ((name, bytes) each) holding ``tensors``
    (:func:`tensor_entry`): no checksums; ``structure`` as given, else every tensor at the
    root."""
    return Metadata(
        unique_id=unique_id,
        world_size=1,
        files=tuple(FileEntry(n, size) for n, size in files),
        tensors=tensors,
        structure=structure if structure is not None else {"d": [[k, {"t": 0}] for k in tensors]},
        block_bytes=1,
        checksum_algorithm=NO_CHECKSUMS,
        created_by="safetensors files",
    )


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# ---------------------------------------------------------------------- save
def piece_name(key: str, offsets: Sequence[int], shape: Sequence[int], global_shape: Sequence[int]) -> str:
    """A piece's name in a rank's safetensors file: its key for the whole tensor, else the key
    and its box, ``key[begin:end,...]`` in elements (``w[0:4,8:16]``)."""
    if tuple(shape) == tuple(global_shape) and not any(offsets):
        return key
    return f"{key}[{','.join(f'{o}:{o + s}' for o, s in zip(offsets, shape))}]"


def rank_header(pieces: Sequence[tuple]) -> bytes:
    """The safetensors header of a rank's data file holding ``pieces`` back to back, each
    (key, dtype, offsets, shape, global shape); the data starts 64-byte aligned.

    Raises:
        UnsupportedError: a dtype safetensors cannot hold, two pieces of one name, or a header larger
            than safetensors reads.
    """
    tensors = []
    for key, dtype, offsets, shape, global_shape in pieces:
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
        tensors.append((piece_name(key, offsets, shape, global_shape), code_of(key, dtype), shape, nbytes))
    header = encode_header(tensors, RANK_FILE_METADATA, align=64)
    if len(header) - 8 > MAX_HEADER_BYTES:
        raise UnsupportedError(
            f"the safetensors header of a rank's file would take {len(header) - 8} bytes, over the "
            f"{MAX_HEADER_BYTES} safetensors reads: save with safetensors=False"
        )
    return header


def layout_plan(plan: SavePlan) -> SavePlan:
    """The save plan with every writer's file laid out as a safetensors file: its header
    (:func:`rank_header` of its pieces in file order), then its pieces back to back."""
    n = len(plan.piece_key)
    offsets = np.zeros(n, dtype=np.int64)
    file_bytes = {}
    for rank in plan.writes:
        rows = np.flatnonzero(plan.piece_writer == rank)
        rows = rows[np.argsort(plan.piece_leaf[rows], kind="stable")]
        pieces = []
        for row in rows.tolist():
            k = int(plan.piece_key[row])
            nd = len(plan.shapes[k])
            offs = tuple(plan.piece_offsets[row, :nd].tolist())
            shape = tuple(plan.piece_shapes[row, :nd].tolist())
            pieces.append((plan.keys[k], plan.dtypes[k], offs, shape, plan.shapes[k]))
        header = len(rank_header(pieces))
        sizes = plan.piece_nbytes[rows]
        offsets[rows] = header + np.cumsum(sizes) - sizes
        file_bytes[rank] = header + int(sizes.sum())
    return dataclasses.replace(plan, piece_byte_offset=offsets, file_bytes=file_bytes)


def rename_files(meta: Metadata) -> Metadata:
    """The metadata of a save with ``safetensors=True``: its data files are ``.safetensors``."""
    files = []
    for f in meta.files:
        parsed = parse_data_name(f.name)
        if parsed is None:  # a save names its files with data_file_name
            raise FormatError(f"{f.name!r} is not the name of a data file of a save")
        rank, uid, generation = parsed
        files.append(FileEntry(data_file_name(rank, uid, generation, "safetensors"), f.nbytes))
    return dataclasses.replace(meta, files=tuple(files))
