"""Import a checkpoint of ``paddle.distributed.save_state_dict`` into this format, piece for
piece: read paddle's metadata, plan the pieces of every rank file, write our data files, build
our metadata (written last). Unpickles paddle's files: for files you trust only.
"""
from __future__ import annotations

import logging
import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..core import checksums, metafile
from ..core.dtypes import as_bytes
from ..core.boxes import Box, flat_range_boxes
from ..core.dtypes import DTYPE_NAMES, storage_dtype
from ..core.metadata import DEFAULT_BLOCK_BYTES, FileEntry, Metadata, PieceTable, TensorEntry, aligned
from ..core.metadata_parse import parse_metadata
from ..core.naming import METADATA_RE, data_file_name, metadata_name
from ..errors import ArgumentError, DcpError, FormatError, StorageError, UnsupportedError
from ..format import safetensors
from ..io import datafile, is_url, open_storage, storage
from ..version import __version__
from .console import EXIT_OK, ProgressBar, UsageError, _directory, _ids, _one_line, _out, _progress_enabled

logger = logging.getLogger(__name__)

_PADDLE_DATA_RE = re.compile(r"^([0-9]+)_([0-9]+)\.(distcp|safetensors)\Z")


def _import_paddle_module():
    try:
        import paddle
    except ImportError as exc:
        raise UnsupportedError(f"importing a paddle checkpoint needs paddle to read its pickled files ({exc})") from None
    return paddle


def _paddle_dtype(key: str, dtype: Any) -> str:
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in DTYPE_NAMES:
        raise FormatError(f"{key}: paddle dtype {dtype} has no paddle_dcp equivalent; supported: {', '.join(DTYPE_NAMES)}")
    return name


def _structure_of(keys: Sequence[str], mapping: Any) -> dict:
    """The skeleton of the nested dict paddle flattened (``flat_mapping``: key -> path)."""
    root: dict = {}
    leaf = object()
    for key in keys:
        path = mapping.get(key) if isinstance(mapping, dict) else None
        if not isinstance(path, tuple) or not path or ".".join(str(p) for p in path) != key:
            path = (key,)
        node = root
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
            if node is leaf:
                raise FormatError(f"{key}: its path {path} runs through another tensor")
        if path[-1] in node:
            raise FormatError(f"{key}: its path {path} is used twice")
        node[str(path[-1])] = leaf

    def skeleton(node) -> dict:
        if node is leaf:
            return {"t": 0}
        return {"d": [[k, skeleton(v)] for k, v in node.items()]}

    return skeleton(root)


def _paddle_file_arrays(paddle, full: str) -> dict:
    if full.endswith(".safetensors"):
        return safetensors.read_arrays(full)
    try:
        arrays = paddle.load(full, return_numpy=True)
    except Exception as exc:  # noqa: BLE001 - anything unpickling raises
        raise FormatError(f"{full}: paddle.load failed ({type(exc).__name__}: {_one_line(exc)})") from None
    if not isinstance(arrays, dict):
        raise FormatError(f"{full}: holds a {type(arrays).__name__}, not the dict of tensors paddle saves")
    return arrays


def import_paddle_checkpoint(src: str, out: str, unique_id: int | None = None, progress: bool = False) -> Metadata:
    """Convert a checkpoint of ``paddle.distributed.save_state_dict`` in ``src`` into ours in
    ``out``, piece for piece: every rank file ``{rank}_{id}.distcp`` (or ``.safetensors``)
    becomes our ``{rank}_{id}.distcp`` holding the same pieces (a flattened piece of sharding
    stage 2 becomes the boxes its flat range makes), under the same id and keys; the metadata
    is written last. Unpickles paddle's files (``paddle.load``): only for files you trust.
    Holds one rank file's tensors in memory at a time.

    Raises:
        ArgumentError: no such id in ``src``, ``out`` is ``src``, or ``out`` holds that id.
        FormatError: not such a checkpoint, or pieces that do not tile their tensors.
    """
    uid = _checked_id(src, out, unique_id)
    paddle = _import_paddle_module()
    meta_file = os.path.join(src, metadata_name(uid))
    pmeta, sdm, stm = _read_paddle_metadata(paddle, meta_file)
    info, local_shapes = _tensor_info(sdm, meta_file)
    by_file, ranks = _plan_pieces(stm, info, local_shapes, meta_file, uid)
    written: list[str] = []  # names of the data files written, removed if the import fails
    store = open_storage(out)  # a directory, or a URL prefix
    store.create()
    try:
        pieces, files = _write_files(paddle, src, store, uid, info, by_file, ranks, written, progress)
        meta = _build_metadata(uid, info, pieces, files, ranks, getattr(pmeta, "flat_mapping", None))
        blob = metafile.encode(meta)
        # validated as any reader will: pieces inside their tensors, tiling them exactly
        parse_metadata(blob, source=f"the metadata imported from {meta_file}")
        storage.commit_metadata(store, uid, blob)
    except BaseException:
        try:
            store.remove(written)
        except DcpError as exc:  # the import's own failure is the one to report
            logger.warning("could not remove the files of the failed import from %s: %s", out, exc)
        raise
    return meta


def _checked_id(src: str, out: str, unique_id: int | None) -> int:
    """The id to import: ``unique_id`` or the newest of ``src``, which ``out`` must not hold."""
    try:
        names = os.listdir(src)
    except OSError as exc:
        raise StorageError(f"cannot list {src}: {exc}", src) from exc
    ids = sorted(int(m.group(1)) for m in map(METADATA_RE.match, names) if m)
    if not ids:
        raise FormatError(f"{src} has no *.metadata file: not a checkpoint of paddle.distributed.save_state_dict")
    uid = max(ids) if unique_id is None else unique_id
    if uid not in ids:
        raise ArgumentError(f"{src} has no {metadata_name(uid)}; ids with metadata: {_ids(ids)}")
    if not is_url(out) and os.path.realpath(src) == os.path.realpath(out):
        raise ArgumentError("OUT must be another directory than PATH: paddle's files and ours have the same names")
    out_listing = storage.list_checkpoints(open_storage(out))
    if uid in out_listing.complete or uid in out_listing.data:
        raise ArgumentError(f"{out} already holds files of checkpoint {uid}; import into another directory")
    return uid


def _read_paddle_metadata(paddle: Any, meta_file: str) -> tuple[Any, dict, dict]:
    """paddle's metadata object, its ``state_dict_metadata`` and its ``storage_metadata``."""
    try:
        pmeta = paddle.load(meta_file)
    except Exception as exc:  # noqa: BLE001 - anything unpickling raises
        raise FormatError(f"{meta_file}: paddle.load failed ({type(exc).__name__}: {_one_line(exc)})") from None
    sdm = getattr(pmeta, "state_dict_metadata", None)
    stm = getattr(pmeta, "storage_metadata", None)
    if not isinstance(sdm, dict) or not isinstance(stm, dict):
        raise FormatError(f"{meta_file}: not the metadata of paddle.distributed.save_state_dict ({type(pmeta).__name__})")
    return pmeta, sdm, stm


_Info = Dict[str, Tuple[str, Optional[Tuple[int, ...]]]]  # key -> (dtype, global shape or None)


def _tensor_info(sdm: dict, meta_file: str) -> tuple[_Info, dict[tuple, tuple[int, ...]]]:
    """Every tensor's dtype and global shape, and the local shape of every described piece
    by (key, offset, flattened range)."""
    info: _Info = {}
    local_shapes: dict[tuple, tuple[int, ...]] = {}
    for key, metas in sdm.items():
        metas = metas if isinstance(metas, list) else [metas]
        dtype, shape = None, None
        for lm in metas:
            d = _paddle_dtype(key, lm.dtype)
            s = tuple(int(x) for x in lm.global_shape) if getattr(lm, "global_shape", None) is not None else None
            if (dtype is not None and d != dtype) or (shape is not None and s is not None and s != shape):
                raise FormatError(f"{meta_file}: {key}: pieces disagree on dtype or global shape")
            dtype, shape = d, shape or s
            fr = getattr(lm, "flattened_range", None)
            local_shapes[(key, tuple(lm.global_offset), tuple(fr) if fr is not None else None)] = tuple(lm.local_shape)
        if dtype is None:
            raise FormatError(f"{meta_file}: {key}: no pieces")
        info[key] = (dtype, shape)
    return info, local_shapes


def _plan_pieces(
    stm: dict, info: _Info, local_shapes: dict[tuple, tuple[int, ...]], meta_file: str, uid: int
) -> tuple[dict[str, list[tuple]], dict[str, int]]:
    """The pieces of every paddle data file as (key, offset, local shape, flattened range),
    one copy of each (replicas saved with save_replicas are skipped), and each file's rank.
    Fills in the global shape of tensors whose metadata lacks it (their pieces' extent)."""
    by_file: dict[str, list[tuple]] = {}
    for idx, fname in stm.items():
        replica = getattr(idx, "replica_id", None)
        if replica not in (None, 0):
            continue
        key = idx.tensor_key
        if key not in info:
            raise FormatError(f"{meta_file}: {key}: stored but not described in state_dict_metadata")
        offset = tuple(int(x) for x in idx.global_offset)
        fr = getattr(idx, "flattened_range", None)
        fr = (int(fr[0]), int(fr[1])) if fr is not None else None
        local = getattr(idx, "local_shape", None)
        local = tuple(int(x) for x in local) if local is not None else local_shapes.get((key, offset, fr))
        if local is None:
            raise FormatError(f"{meta_file}: {key}: piece at offset {offset} has no local shape")
        by_file.setdefault(str(fname), []).append((key, offset, local, fr))
    ranks = {}
    for fname in by_file:
        m = _PADDLE_DATA_RE.match(fname)
        if m is None or int(m.group(2)) != uid:
            raise FormatError(f"{meta_file}: data file name {fname!r} is not {{rank}}_{uid}.distcp")
        ranks[fname] = int(m.group(1))
    for key, (dtype, shape) in list(info.items()):
        if shape is None:  # metadata without global shapes: the pieces' extent
            ends = [tuple(o + s for o, s in zip(off, loc)) for items in by_file.values() for k, off, loc, _ in items if k == key]
            info[key] = (dtype, tuple(max(e) for e in zip(*ends)) if ends else ())
    return by_file, ranks


_Row = Tuple[Tuple[int, ...], Tuple[int, ...], int, int, List[int]]  # box offsets, shape, file, start, sums


def _write_files(
    paddle: Any,
    src: str,
    store: storage.Storage,
    uid: int,
    info: _Info,
    by_file: dict[str, list[tuple]],
    ranks: dict[str, int],
    written: list[str],
    progress: bool,
) -> tuple[dict[str, list[_Row]], list[FileEntry]]:
    """Our data files in ``store``: the same pieces, rank by rank (their names appended to
    ``written`` as they are committed). Returns every key's pieces and the files."""
    total = sum(
        ((fr[1] - fr[0]) if fr is not None else math.prod(loc)) * storage_dtype(info[k][0]).itemsize
        for items in by_file.values()
        for k, _, loc, fr in items
    )
    key_order = {k: i for i, k in enumerate(info)}
    pieces: dict[str, list[_Row]] = {k: [] for k in info}
    files: list[FileEntry] = []
    with ProgressBar(total, f"import {uid}", progress) as bar:
        for fname in sorted(by_file, key=lambda n: ranks[n]):
            full = os.path.join(src, fname)
            arrays = _paddle_file_arrays(paddle, full)
            name = data_file_name(ranks[fname], uid)
            writer = datafile.data_writer(store, name, DEFAULT_BLOCK_BYTES)
            try:
                for key, offset, local, fr in sorted(by_file[fname], key=lambda it: (key_order[it[0]], it[1], it[3] or ())):
                    flat = _piece_array(full, key, arrays.get(key), storage_dtype(info[key][0]), local, fr)
                    _write_piece(writer, key, info[key][0], offset, local, fr, flat, len(files), pieces[key])
                    bar.update(flat.nbytes)
                size = writer.commit()
            except BaseException:
                writer.abort()
                raise
            written.append(name)
            files.append(FileEntry(name, size))
            del arrays
    return pieces, files


def _write_piece(
    writer: Any, key: str, dtype: str, offset: tuple, local: tuple, fr: tuple | None, flat: np.ndarray,
    file_index: int, rows: list[_Row],
) -> None:
    """Write one paddle piece as the boxes it covers (one, or those of its flat range),
    appending a row per box written to ``rows``."""
    boxes = flat_range_boxes(local, *fr) if fr is not None else [Box((0,) * len(local), local)]
    at = 0
    for rel in boxes:
        n = rel.volume
        data = flat[at : at + n]
        at += n
        if n == 0:
            continue
        start = aligned(writer.offset)
        box_offsets = tuple(o + r for o, r in zip(offset, rel.offsets))
        seed = checksums.piece_seed(key, dtype, box_offsets, rel.shape)
        sums = writer.write(as_bytes(np.ascontiguousarray(data)), seed=seed)
        rows.append((box_offsets, rel.shape, file_index, start, sums))


def _build_metadata(
    uid: int, info: _Info, pieces: dict[str, list[_Row]], files: list[FileEntry], ranks: dict[str, int], mapping: Any
) -> Metadata:
    """Our metadata of the imported pieces."""
    tensors = {}
    for key, (dtype, shape) in info.items():
        assert shape is not None  # filled in by _plan_pieces
        rows = sorted(pieces[key], key=lambda r: r[0])
        nd = len(shape)
        table = PieceTable(
            offsets=np.array([r[0] for r in rows], dtype=np.int64).reshape(len(rows), nd),
            shapes=np.array([r[1] for r in rows], dtype=np.int64).reshape(len(rows), nd),
            files=np.array([r[2] for r in rows], dtype=np.int64),
            byte_offsets=np.array([r[3] for r in rows], dtype=np.int64),
            checksums=np.array([s for r in rows for s in r[4]], dtype=np.uint64),
        )
        tensors[key] = TensorEntry(key, dtype, shape, table, DEFAULT_BLOCK_BYTES)
    world = max(ranks.values()) + 1 if ranks else 1
    return Metadata(
        unique_id=uid,
        world_size=world,
        files=tuple(files),
        tensors=tensors,
        structure=_structure_of(list(info), mapping),
        block_bytes=DEFAULT_BLOCK_BYTES,
        created_by=f"paddle_dcp {__version__} import-paddle",
    )


def _piece_array(full: str, key: str, value: Any, dtype: np.dtype, local: tuple, fr) -> np.ndarray:
    """A stored piece as a flat array of the checkpoint's storage dtype, shape checked."""
    if value is None:
        raise FormatError(f"{full}: {key}: the metadata places a piece here, the file does not hold it")
    array = np.asarray(value)
    if array.dtype != dtype:
        if array.dtype.itemsize != dtype.itemsize or array.dtype.kind not in (dtype.kind, "u"):
            raise FormatError(f"{full}: {key}: stored as {array.dtype}, the metadata says {dtype}")
        array = np.ascontiguousarray(array).view(dtype)
    want = (fr[1] - fr[0]) if fr is not None else math.prod(local)
    if array.size != want or (fr is None and tuple(array.shape) != tuple(local) and array.ndim):
        raise FormatError(f"{full}: {key}: stored shape {tuple(array.shape)}, the metadata says {local}")
    return np.ascontiguousarray(array).reshape(-1)


def cmd_import_paddle(args) -> int:
    if not args.trust:
        raise UsageError(
            "import-paddle unpickles paddle's .metadata and .distcp files, which can run any code "
            "their author put there; pass --trust if you trust the files in " + str(args.path)
        )
    src = _directory(args.path)
    try:
        meta = import_paddle_checkpoint(src, args.out, args.unique_id, _progress_enabled(args))
    except ArgumentError as exc:
        raise UsageError(str(exc)) from None
    nbytes = sum(f.nbytes for f in meta.files)
    pieces = sum(t.pieces.count for t in meta.tensors.values())
    _out(
        f"imported checkpoint {meta.unique_id} of {src}: {len(meta.tensors)} tensors, {pieces} pieces, "
        f"{len(meta.files)} data files ({nbytes} bytes) into {args.out}"
    )
    return EXIT_OK
