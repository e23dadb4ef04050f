"""Writing a metadata file of format version 3 (:func:`encode`).

Everything but the checksums, the plain values and the names of the files is the same from one
save of a layout to the next; a save that reuses its plan reuses those bytes too (the
``static`` dict of :class:`~paddle_dcp.core.metadata.TensorColumns`), and pays only for the
checksums, their digests and the head.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import xxhash

from . import grids, nested, ragged, sorting
from .metadata import ColumnTensors, FileEntry, Metadata, TensorColumns, with_digest
from .metafile_layout import (
    DTYPE_CODE, ENCODING_CODE, EXPLICIT, FORMAT_NAME, GRID, GROUP, PART_BYTES, ROW, VERSION, deflate, shuffled, width,
)


def encode(meta: Metadata, grid: grids.GridCheck | None = None) -> bytes:
    """``meta`` as a version 3 file. ``grid``: :func:`~paddle_dcp.core.grids.find_grids` of its
    pieces when the caller has it (else the columns' own, else it is found here)."""
    cols = columns_of(meta)
    static = cols.static if cols.static is not None else {}
    if "parts" not in static:
        static.update(_static(meta, cols, grid if grid is not None else cols.grid))
    s: _Static = static["parts"]
    sums = np.ascontiguousarray(cols.checksums, "<u8").tobytes()
    digests = _group_digests(s, sums)
    parts, index = [], []
    for i, packed in enumerate(s.packed):
        part = packed + digests[s.part_groups[i] : s.part_groups[i + 1]].astype("<u8").tobytes()
        parts.append(part)
        index.append(xxhash.xxh3_64_intdigest(part))
    index_raw = b"".join([
        np.array([len(s.packed)], "<u8").tobytes(),
        shuffled(np.concatenate([s.first_key_len, [len(p) for p in parts], [len(p) for p in s.packed], s.raw, s.counts])),
        np.array(index, "<u8").tobytes(), s.first_keys,
    ])
    body: list[bytes] = []
    at = 0
    sections: dict[str, list] = {}
    files_raw = _files_raw(meta.files)
    for name, (packed, raw_len) in (("files", (deflate(files_raw), len(files_raw))), ("structure", s.structure),
                                    ("index", (deflate(index_raw), len(index_raw)))):
        sections[name] = [at, len(packed), raw_len, f"{xxhash.xxh3_64_intdigest(packed):016x}"]
        body.append(packed)
        at += len(packed)
    areas = {}
    for name, blobs in (("parts", parts), ("records", [s.records]), ("boxes", [s.boxes]), ("sums", [sums])):
        size = sum(len(b) for b in blobs)
        areas[name] = [at, size]
        body.extend(blobs)
        at += size
    head = {
        "format": FORMAT_NAME,
        "format_version": VERSION,
        "unique_id": meta.unique_id,
        "world_size": meta.world_size,
        "created_by": meta.created_by,
        "checksum": {"algorithm": meta.checksum_algorithm, "block_bytes": meta.block_bytes},
        "counts": {"tensors": len(cols.keys), "pieces": len(cols.files), "blocks": len(cols.checksums),
                   "files": len(meta.files), "parts": len(parts)},
        "widths": {"file": s.wf, "offset": s.wo},
        "outline": _outline_values(s, meta.structure),
        "holders": s.holders,
        "sections": sections,
        "areas": areas,
    }
    if meta.replicas:
        head["replicas"] = True
    line = with_digest(json.dumps(head, separators=(",", ":"), allow_nan=False).encode())
    return b"".join([line, b"\n", *body])  # one copy of the body, however large


@dataclass(frozen=True, eq=False)
class _Static:
    """What a plan's saves share: everything but the checksums, the values and the files."""

    wf: int
    wo: int
    records: bytes
    boxes: bytes
    packed: list[bytes]  # each part's compressed rows
    raw: np.ndarray  # their raw lengths
    counts: np.ndarray  # tensors per part
    part_groups: np.ndarray  # (parts + 1,) where each part's groups start
    first_keys: bytes
    first_key_len: np.ndarray
    structure: tuple[bytes, int]  # the skeleton, plain values as placeholders: compressed, raw length
    outline: dict  # the outline, plain values as placeholders
    holders: list
    has_values: bool
    groups: list  # every group's byte ranges: (records from, to, boxes from, to, checksums from, to)
    values_at: list  # (flat key, index path in the structure) of every plain value of the outline


def _static(meta: Metadata, cols: TensorColumns, grid: grids.GridCheck | None) -> dict:
    n_t, n_p = len(cols.keys), len(cols.files)
    ndims = np.array([len(s) for s in cols.shapes], dtype=np.int64)
    if meta.replicas or not n_p:  # copies repeat boxes: no grid
        kind, cuts = np.full(n_t, EXPLICIT, dtype=np.int64), None
    else:
        if grid is None:
            grid = grids.find_grids(cols.piece_start, cols.offsets, cols.extents, ndims, _extents(cols, ndims))
        kind, cuts = np.where(grid.grid, GRID, EXPLICIT).astype(np.int64), grid.cuts
    wf = width(int(cols.files.max()) if n_p else 0)
    wo = width(int(cols.byte_offsets.max()) if n_p else 0)
    records = np.concatenate(
        [np.ascontiguousarray(cols.files, "<i8").view(np.uint8).reshape(n_p, 8)[:, :wf],
         np.ascontiguousarray(cols.byte_offsets, "<i8").view(np.uint8).reshape(n_p, 8)[:, :wo]], axis=1).tobytes()
    counts = np.diff(cols.piece_start)
    tensor_of = np.repeat(np.arange(n_t, dtype=np.int64), counts)
    box_len = np.where(kind[tensor_of] == EXPLICIT, 16 * ndims[tensor_of], 0)
    box_at = np.concatenate([[0], np.cumsum(box_len)]).astype(np.int64)
    boxes = _boxes(cols, box_len, ndims, tensor_of, int(box_at[-1]))
    g_first, g_end = _groups(cols.piece_start)
    w = wf + wo
    groups = np.stack([g_first * w, g_end * w, box_at[g_first], box_at[g_end], 8 * cols.block_start[g_first],
                       8 * cols.block_start[g_end]], axis=1).tolist()
    first_box = box_at[cols.piece_start[:-1]]
    rows = np.stack([
        np.zeros(n_t, np.int64), np.zeros(n_t, np.int64),  # key and source lengths: filled per part
        np.array([DTYPE_CODE[d] for d in cols.dtypes], np.int64), np.array([ENCODING_CODE[e] for e in cols.encodings], np.int64),
        ndims, kind, counts, cols.piece_start[:-1], cols.block_start[cols.piece_start[:-1]],
        cols.block_start[cols.piece_start[1:]] - cols.block_start[cols.piece_start[:-1]], first_box,
    ])
    assert rows.shape[0] == len(ROW)
    packed, raw, per_part, part_groups, first_keys, first_key_len = _parts(cols, rows, ndims, kind, cuts)
    blank = _blank(meta.structure)
    outline, holders = outline_of(blank)
    structure_raw = json.dumps(blank, separators=(",", ":"), allow_nan=False).encode()
    return {"parts": _Static(
        wf=wf, wo=wo, records=records, boxes=boxes, packed=packed, raw=raw, counts=per_part, part_groups=part_groups,
        first_keys=first_keys, first_key_len=first_key_len, structure=(deflate(structure_raw), len(structure_raw)),
        outline=outline, holders=holders, has_values=_has_values(outline), groups=groups,
        values_at=_value_paths(outline, meta.structure),
    )}


def _group_digests(s: _Static, sums: bytes) -> np.ndarray:
    """The digest of every group: its records, boxes and checksums, in that order."""
    rec, box, sm = memoryview(s.records), memoryview(s.boxes), memoryview(sums)
    out = np.zeros(len(s.groups), dtype=np.uint64)
    for g, (ra, rb, ba, bb, sa, sb) in enumerate(s.groups):
        h = xxhash.xxh3_64(rec[ra:rb])
        if bb > ba:
            h.update(box[ba:bb])
        h.update(sm[sa:sb])
        out[g] = h.intdigest()
    return out


def _groups(piece_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every group of every tensor, in file order: (first piece, end piece)."""
    counts = np.diff(piece_start)
    ngroups = -(-counts // GROUP)
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), ngroups)
    g_in = ragged.positions(ngroups)
    first = piece_start[:-1][owner] + g_in * GROUP
    return first, np.minimum(first + GROUP, piece_start[1:][owner])


def _boxes(cols: TensorColumns, box_len: np.ndarray, ndims: np.ndarray, tensor_of: np.ndarray, total: int) -> bytes:
    """The explicit layouts' boxes, piece by piece: offsets, then shapes, int64."""
    out = np.zeros(total // 8, dtype="<i8")
    at = np.concatenate([[0], np.cumsum(box_len)])[:-1] // 8
    explicit = np.flatnonzero(box_len)
    for nd in np.unique(ndims[tensor_of[explicit]]).tolist():
        sel = explicit[ndims[tensor_of[explicit]] == nd]
        vals = np.concatenate([cols.offsets[sel, :nd], cols.extents[sel, :nd]], axis=1)
        out[(at[sel][:, None] + np.arange(2 * nd)).reshape(-1)] = vals.reshape(-1)
    return out.tobytes()


def _parts(
    cols: TensorColumns, rows: np.ndarray, ndims: np.ndarray, kind: np.ndarray, cuts: grids.Cuts | None
) -> tuple[list[bytes], np.ndarray, np.ndarray, np.ndarray, bytes, np.ndarray]:
    """The tensor rows cut into parts of about PART_BYTES raw bytes, compressed: (packed, raw
    lengths, tensors per part, where each part's groups start, first keys, their lengths)."""
    n_t = len(cols.keys)
    keys_b = [k.encode("utf-8") for k in cols.keys]
    srcs_b = [(s or "").encode("utf-8") for s in cols.sources]
    rows[0] = [len(k) for k in keys_b]
    rows[1] = [len(s) for s in srcs_b]
    ncuts, ncuts_start, gaps, gaps_start = _cut_columns(cuts, kind == GRID, ndims)
    ngroups = -(-np.diff(cols.piece_start) // GROUP)
    row_bytes = rows[0] + rows[1] + 8 * (len(ROW) + ndims + np.diff(ncuts_start) + np.diff(gaps_start))
    cum = np.cumsum(row_bytes)
    bounds = [0]
    while bounds[-1] < n_t:  # at least one tensor a part
        base = int(cum[bounds[-1] - 1]) if bounds[-1] else 0
        bounds.append(max(bounds[-1] + 1, int(np.searchsorted(cum, base + PART_BYTES, side="right"))))
    shape_flat = np.array([x for s in cols.shapes for x in s], dtype=np.int64)
    shape_start = np.concatenate([[0], np.cumsum(ndims)]).astype(np.int64)
    packed, raws = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        raw = b"".join([
            np.array([hi - lo], "<u8").tobytes(), shuffled(rows[:, lo:hi]), shuffled(shape_flat[shape_start[lo] : shape_start[hi]]),
            np.array([ncuts_start[hi] - ncuts_start[lo]], "<u8").tobytes(), shuffled(ncuts[ncuts_start[lo] : ncuts_start[hi]]),
            np.array([gaps_start[hi] - gaps_start[lo]], "<u8").tobytes(), shuffled(gaps[gaps_start[lo] : gaps_start[hi]]),
            b"".join(keys_b[lo:hi]), b"".join(srcs_b[lo:hi]),
        ])
        packed.append(deflate(raw))
        raws.append(len(raw))
    group_start = np.concatenate([[0], np.cumsum(ngroups)]).astype(np.int64)
    firsts = [keys_b[lo] for lo in bounds[:-1]]
    return (packed, np.array(raws, np.int64), np.diff(bounds).astype(np.int64), group_start[bounds],
            b"".join(firsts), np.array([len(k) for k in firsts], np.int64))


def _cut_columns(cuts: grids.Cuts | None, grid_t: np.ndarray, ndims: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every grid tensor's dims: how many cuts each has, and the gaps between successive cuts
    (the first cut is 0); with where each tensor's counts and gaps start: (ncuts,
    ncuts_start (T + 1,), gaps, gaps_start (T + 1,))."""
    n_t = len(grid_t)
    slots_per = np.where(grid_t, ndims, 0)
    ncuts_start = np.concatenate([[0], np.cumsum(slots_per)]).astype(np.int64)
    if cuts is None or not grid_t.any():
        return np.zeros(0, np.int64), ncuts_start, np.zeros(0, np.int64), np.zeros(n_t + 1, np.int64)
    t_of_slot = np.repeat(np.arange(n_t), slots_per)
    slots = cuts.slot_of[t_of_slot] + (np.arange(len(t_of_slot)) - ncuts_start[t_of_slot])
    ncuts = (cuts.start[slots + 1] - cuts.start[slots]).astype(np.int64)
    n_gaps = ncuts - 1
    take = ragged.indices(cuts.start[slots], n_gaps)
    gaps = (cuts.values[take + 1] - cuts.values[take]).astype(np.int64)
    per_t = np.bincount(np.repeat(t_of_slot, n_gaps), minlength=n_t)
    return ncuts, ncuts_start, gaps, np.concatenate([[0], np.cumsum(per_t)]).astype(np.int64)


def _files_raw(files: Sequence[FileEntry]) -> bytes:
    names = [f.name.encode("utf-8") for f in files]
    return b"".join([
        np.array([len(files)], "<u8").tobytes(),
        shuffled(np.array([f.nbytes for f in files], np.int64)),
        shuffled(np.array([len(n) for n in names], np.int64)),
        b"".join(names),
    ])


def _extents(cols: TensorColumns, ndims: np.ndarray) -> np.ndarray:
    out = np.zeros((len(cols.keys), cols.offsets.shape[1]), dtype=np.int64)
    for t in np.flatnonzero(ndims).tolist():
        out[t, : ndims[t]] = cols.shapes[t]
    return out


def _blank(structure: dict) -> dict:
    """The structure with every plain value a placeholder (``{"x": 0}``): the same from one
    save of a layout to the next."""
    def visit(node: dict) -> dict:
        (tag, body), = node.items()
        if tag == "d":
            return {"d": [[k, c if c is _TENSOR or c == _TENSOR else visit(c)] for k, c in body]}
        if tag in ("l", "u"):
            return {tag: [visit(c) for c in body]}
        return node if tag == "t" else {"x": 0}

    return visit(structure)


_TENSOR = {"t": 0}


def _has_values(outline: dict) -> bool:
    return any(tag == "x" for _, tag, _ in nested.walk(outline))


def _value_paths(outline: dict, structure: dict) -> list[tuple[str, tuple]]:
    """Where the outline's plain values lie in the structure: (flat key, the (index, dict key
    or None) of every container's item on the way), found once for the saves of a plan."""
    out: list[tuple[str, tuple]] = []

    def visit(node: dict, full: Any, key: str | None, at: tuple) -> None:
        (tag, body), = node.items()
        if tag == "x":
            out.append((key or "", at))
        elif tag == "d" and isinstance(full, dict) and "d" in full:
            where = {k: i for i, (k, _) in enumerate(full["d"])}
            for k, c in body:
                if k in where:
                    visit(c, full["d"][where[k]][1], k if key is None else f"{key}.{k}", at + ((where[k], k),))
        elif tag in ("l", "u") and isinstance(full, dict) and tag in full:
            for i, c in enumerate(body):
                if i < len(full[tag]):
                    visit(c, full[tag][i], str(i) if key is None else f"{key}.{i}", at + ((i, None),))

    visit(outline, structure, None, ())
    return out


def _outline_values(s: _Static, structure: dict) -> dict:
    """The outline with this save's plain values, taken from the structure at the places found
    for the plan (the whole outline walked again when the structure is not laid out as then)."""
    if not s.has_values:
        return s.outline
    values: dict[str, dict] = {}
    for key, at in s.values_at:
        node: Any = structure
        for i, name in at:
            (tag, body), = node.items()
            if i >= len(body) or (tag == "d") != (name is not None) or (name is not None and body[i][0] != name):
                return _filled(s.outline, structure)
            node = body[i][1] if tag == "d" else body[i]
        if type(node) is not dict or len(node) != 1 or ("v" not in node and "f" not in node):
            return _filled(s.outline, structure)
        values[key] = node
    filled = nested.fill_values(s.outline, {k: nested.decode_value(v, k) for k, v in values.items()})[0]
    return filled


def _filled(outline: dict, structure: dict) -> dict:
    """The outline (plain values as placeholders) with the values of ``structure`` at the same
    paths; a placeholder without one is dropped, as :func:`~paddle_dcp.core.nested.fill_values`
    drops it. Only the containers on the outline's paths are visited."""
    def visit(node: dict, full: dict) -> dict | None:
        (tag, body), = node.items()
        if tag == "x":
            return full if nested.kind(full) in ("v", "f") else None
        ftag = nested.kind(full)
        if tag == "d" and ftag == "d":
            children = dict((k, c) for k, c in full["d"])
            items = [[k, v] for k, c in body if k in children and (v := visit(c, children[k])) is not None]
            return {"d": items}
        if tag in ("l", "u") and ftag == tag:
            return {tag: [visit(c, f) or {"v": None} for c, f in zip(body, full[tag])]}
        return node

    return visit(outline, structure) or {"d": []}


def outline_of(structure: dict) -> tuple[dict, list[list]]:
    """What a reader of some tensors needs of the nesting: the structure without the tensors
    of its dicts (nor the dicts that hold only tensors), lists and tuples kept whole (their
    tensors as ``{"t": 0}``, their tensor-only containers empty), and the paths of the
    containers kept that hold tensors (:attr:`Metadata.holders`)."""
    holders: list[list] = []

    def visit(node: dict, path: list) -> tuple[bool, dict | None]:
        (tag, body), = node.items()
        if tag == "t":
            return True, None
        if tag not in ("d", "l", "u"):
            return False, node
        named = body if tag == "d" else list(enumerate(body))
        seen = [(k, c, visit(c, path + [k]) if c != _TENSOR else (True, None)) for k, c in named]
        if not any(h for _, _, (h, _) in seen):
            return False, node
        out: dict
        if tag == "d":
            kept = [[k, o] for k, _, (_, o) in seen if o is not None]
            if not kept and path:
                return True, None
            out = {"d": kept}
        else:
            out = {tag: [o if o is not None else (_TENSOR if c == _TENSOR else {nested.kind(c): []}) for _, c, (_, o) in seen]}
            holders.extend(path + [k] for k, c, (_, o) in seen if o is None and c != _TENSOR)
        if path:
            holders.append(path)
        return True, out

    _, outline = visit(structure, [])
    return outline or {"d": []}, sorted(holders, key=lambda p: [str(c) for c in p])


# ============================================================================ columns
def columns_of(meta: Metadata) -> TensorColumns:
    """``meta``'s tensors as columns, sorted by key, each tensor's pieces by their boxes (as a
    save plans them): the columns themselves when the metadata was built from them."""
    if isinstance(meta.tensors, ColumnTensors) and list(meta.tensors.columns.keys) == sorted(meta.tensors.columns.keys):
        return meta.tensors.columns
    keys = sorted(meta.tensors)
    entries = [meta.tensors[k] for k in keys]
    wide = max((len(e.shape) for e in entries), default=0)
    offsets, extents, files, byte_offsets, counts, nblocks = [], [], [], [], [], []
    sums: list[np.ndarray] = []
    for e in entries:
        p = e.pieces
        nd = len(e.shape)
        order = sorting.lexsort((p.files,) + tuple(p.shapes.T[::-1]) + tuple(p.offsets.T[::-1])) if p.count else np.zeros(0, np.int64)
        starts = e.block_starts()
        offsets.append(np.pad(p.offsets[order].reshape(p.count, nd), ((0, 0), (0, wide - nd))))
        extents.append(np.pad(p.shapes[order].reshape(p.count, nd), ((0, 0), (0, wide - nd))))
        files.append(p.files[order])
        byte_offsets.append(p.byte_offsets[order])
        sums.extend(p.checksums[starts[i] : starts[i + 1]] for i in order.tolist())
        counts.append(p.count)
        nblocks.append(np.diff(starts)[order])

    def cat(parts: list, shape: Any, dtype: Any = np.int64) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(shape, dtype)

    return TensorColumns(
        keys=tuple(keys),
        dtypes=tuple(e.dtype for e in entries),
        shapes=tuple(tuple(e.shape) for e in entries),
        encodings=tuple(e.encoding for e in entries),
        sources=tuple(e.source for e in entries),
        piece_start=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        offsets=cat(offsets, (0, wide)),
        extents=cat(extents, (0, wide)),
        files=cat(files, (0,)),
        byte_offsets=cat(byte_offsets, (0,)),
        block_start=np.concatenate([[0], np.cumsum(cat(nblocks, (0,)))]).astype(np.int64),
        checksums=cat(sums, (0,), np.uint64),
    )
