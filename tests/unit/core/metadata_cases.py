"""Metadata of any shape, made from docs/format.md for the tests of the metadata files: tensors
of every rank, split as grids or not (a piece merged with its neighbour), quantized and derived
ones, replicas, plain values in dicts, lists and tuples; and what a piece is, compared as data."""
from __future__ import annotations

import itertools
import math
import sys

import numpy as np
from hypothesis import strategies as st

from paddle_dcp.core.metadata import ColumnTensors, FileEntry, Metadata, PieceTable, TensorColumns, TensorEntry

BLOCK = 64
FLOATS = ("float16", "bfloat16", "float32")
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
            "float32": 4, "float64": 8, "complex64": 8, "complex128": 16}
ENCODED = {"int8": 264, "int4": 136}


def stored(dtype, encoding, shape) -> int:
    n = math.prod(shape)
    return n * ITEMSIZE[dtype] if encoding is None else -(-n // 256) * ENCODED[encoding]


def grid_boxes(shape, cuts):
    boxes = []
    for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
        boxes.append((tuple(cuts[d][i] for d, i in enumerate(cell)), tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell))))
    return boxes


@st.composite
def tensor_specs(draw, key):
    """(key, dtype, shape, encoding, boxes): a grid split, or one with two cells merged."""
    nd = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(nd))
    cuts = [sorted({0, n, *draw(st.lists(st.integers(1, max(1, n - 1)), max_size=2))}) for n in shape]
    boxes = grid_boxes(shape, cuts)
    if nd and draw(st.booleans()):
        for i, (o, s) in enumerate(boxes):
            j = next((j for j, (o2, s2) in enumerate(boxes) if o2[0] == o[0] + s[0] and o2[1:] == o[1:] and s2[1:] == s[1:]), None)
            if j is not None:
                boxes[i] = (o, (s[0] + boxes[j][1][0],) + s[1:])
                boxes.pop(j)
                break
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    encoding = draw(st.sampled_from([None, "int8", "int4"])) if dtype in FLOATS else None
    return key, dtype, shape, encoding, sorted(boxes)


STRUCTURE_VALUES = [("step", {"v": 7}), ("lr", {"l": [{"v": 0.5}, {"f": "nan"}, {"u": [{"v": None}, {"v": "x"}]}]})]


@st.composite
def metadatas(draw, max_tensors: int = 6):
    """A checkpoint's metadata: its tensors under ``m``, one tensor in a list beside values, a
    derived one at times, plain values; files and byte offsets packed as a save lays them."""
    n = draw(st.integers(1, max_tensors))
    names = draw(st.lists(st.text("abcé.z", min_size=1, max_size=4), min_size=n, max_size=n, unique=True))
    specs = [draw(tensor_specs(f"m.{name}")) for name in names]
    replicas = draw(st.booleans())
    n_files = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ends = [0] * n_files
    tensors = {}
    for key, dtype, shape, encoding, boxes in specs:
        rows = []
        for box in boxes:
            copies = 2 if replicas and n_files > 1 else 1
            for f in rng.choice(n_files, size=copies, replace=False).tolist():
                at = -(-ends[f] // 64) * 64
                size = stored(dtype, encoding, box[1])
                ends[f] = at + size
                rows.append((box, f, at, max(1, -(-size // BLOCK))))
        nd = len(shape)
        table = PieceTable(
            offsets=np.array([r[0][0] for r in rows], np.int64).reshape(len(rows), nd),
            shapes=np.array([r[0][1] for r in rows], np.int64).reshape(len(rows), nd),
            files=np.array([r[1] for r in rows], np.int64),
            byte_offsets=np.array([r[2] for r in rows], np.int64),
            checksums=rng.integers(0, 2**64, size=sum(r[3] for r in rows), dtype=np.uint64),
        )
        tensors[key] = TensorEntry(key, dtype, shape, table, BLOCK, encoding)
    skeleton = [[k[2:], {"t": 0}] for k in tensors]
    sources = [k for k, t in tensors.items() if t.dtype in ("float16", "bfloat16") and t.encoding is None]
    if sources and draw(st.booleans()):
        src = sources[0]
        empty = PieceTable(np.zeros((0, len(tensors[src].shape)), np.int64), np.zeros((0, len(tensors[src].shape)), np.int64),
                           np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64))
        tensors["m.~master"] = TensorEntry("m.~master", "float32", tensors[src].shape, empty, BLOCK, "derived", src)
        skeleton.append(["~master", {"t": 0}])
    tensors["extra.0"] = TensorEntry("extra.0", "int8", (1,), PieceTable(
        np.zeros((1, 1), np.int64), np.ones((1, 1), np.int64), np.zeros(1, np.int64),
        np.array([-(-ends[0] // 64) * 64], np.int64), rng.integers(0, 2**64, size=1, dtype=np.uint64)), BLOCK)
    ends[0] = -(-ends[0] // 64) * 64 + 1
    structure = {"d": [["m", {"d": skeleton}], ["extra", {"l": [{"t": 0}, {"v": 3}]}], *map(list, STRUCTURE_VALUES)]}
    return Metadata(
        unique_id=draw(st.integers(0, 10**6)), world_size=n_files,
        files=tuple(FileEntry(f"{i}_0.distcp", e + draw(st.integers(0, 100))) for i, e in enumerate(ends)),
        tensors=tensors, structure=structure, block_bytes=BLOCK, created_by="tests", replicas=replicas,
    )


def pieces(entry: TensorEntry) -> list[tuple]:
    """Every piece of an entry as data: (offsets, shape, file, byte offset, checksums), sorted."""
    p, starts = entry.pieces, entry.block_starts()
    return sorted(
        (tuple(p.offsets[i].tolist()), tuple(p.shapes[i].tolist()), int(p.files[i]), int(p.byte_offsets[i]),
         tuple(p.checksums[starts[i] : starts[i + 1]].tolist()))
        for i in range(p.count)
    )


def entry_of(meta: Metadata, key: str) -> tuple:
    e = meta.tensors[key]
    return e.dtype, tuple(e.shape), e.encoding, e.source, pieces(e)


def columns_meta(n_tensors: int, seed: int = 0, step: int = 1) -> Metadata:
    """A checkpoint of ``n_tensors`` tensors of 4 x 8, each split in 4 rows over 2 files, held
    as columns (as a save builds it)."""
    rng = np.random.default_rng(seed)
    keys = tuple(sorted(f"model.layers.{i}.w" for i in range(n_tensors)))
    p = 4 * n_tensors
    offsets = np.zeros((p, 2), np.int64)
    offsets[:, 0] = np.tile(np.arange(4), n_tensors)
    extents = np.tile(np.array([[1, 8]], np.int64), (p, 1))
    files = np.tile(np.array([0, 0, 1, 1]), n_tensors)
    byte_offsets = np.zeros(p, np.int64)
    byte_offsets[files == 0] = 64 * np.arange((files == 0).sum())
    byte_offsets[files == 1] = 64 * np.arange((files == 1).sum())
    cols = TensorColumns(
        keys=keys, dtypes=("float32",) * n_tensors, shapes=((4, 8),) * n_tensors, encodings=(None,) * n_tensors,
        sources=(None,) * n_tensors, piece_start=np.arange(0, p + 1, 4), offsets=offsets, extents=extents, files=files,
        byte_offsets=byte_offsets, block_start=np.arange(p + 1), checksums=rng.integers(0, 2**64, p, dtype=np.uint64),
        static={},
    )
    structure = {"d": [["model", {"d": [[k[len("model."):], {"t": 0}] for k in keys]}], ["step", {"v": step}]]}
    return Metadata(3, 2, (FileEntry("0_3.distcp", 64 * p), FileEntry("1_3.distcp", 64 * p)), ColumnTensors(cols, 64),
                    structure, block_bytes=64)


def calls_of(fn) -> int:
    """The work ``fn()`` does, counted, not timed: the lines of Python it runs (every pass of
    a loop or comprehension included) and the calls it makes into C. A step whose work grows
    with tensors x ranks shows as such however its loops are written."""
    count = 0

    def lines(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return lines

    def calls(frame, event, arg):
        nonlocal count
        if event == "call":
            return lines
        return None

    def c_calls(frame, event, arg):
        nonlocal count
        if event == "c_call":
            count += 1

    sys.settrace(calls)
    sys.setprofile(c_calls)
    try:
        fn()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return count
