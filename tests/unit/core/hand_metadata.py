"""A checkpoint's metadata written by hand from docs/format.md, and its JSON document: the
builders the metadata and parse tests share."""
import base64
import copy
import json
import math
import zlib

import numpy as np

from paddle_dcp.core.metadata import FileEntry, Metadata, PieceTable, TensorEntry


BLOCK = 64


STRUCTURE = {
    "d": [
        ["m", {"d": [["w", {"t": 0}], ["b", {"t": 0}], ["s", {"t": 0}]]}],
        ["step", {"v": 3}],
        ["lr", {"l": [{"v": 0.5}, {"f": "nan"}, {"f": "-inf"}, {"v": None}, {"v": "adam"}, {"v": True}]}],
    ]
}


def roundup(n, k):
    return -(-n // k) * k


def hand_meta(rows: int = 100, seed: int = 0) -> Metadata:
    """``m.w`` (rows x 3 float32) saved one row per piece in file 0; ``m.b`` (5 int64) in two
    pieces and ``m.s`` (a float64 scalar) in file 1. Written by hand from docs/format.md."""
    rng = np.random.default_rng(seed)

    def table(offsets, shapes, file, itemsize, start=0):
        nbytes = [math.prod(s) * itemsize for s in shapes]
        byte_offsets, at = [], start
        for n in nbytes:
            byte_offsets.append(at)
            at = roundup(at + n, 64)
        nblocks = sum(max(1, -(-n // BLOCK)) for n in nbytes)
        t = PieceTable(
            offsets=np.array(offsets, dtype=np.int64).reshape(len(offsets), -1),
            shapes=np.array(shapes, dtype=np.int64).reshape(len(shapes), -1),
            files=np.full(len(offsets), file, dtype=np.int64),
            byte_offsets=np.array(byte_offsets, dtype=np.int64),
            checksums=rng.integers(0, 2**64, size=nblocks, dtype=np.uint64),
        )
        return t, byte_offsets[-1] + nbytes[-1]

    w, w_end = table([[i, 0] for i in range(rows)], [[1, 3]] * rows, 0, 4)
    b, b_end = table([[0], [3]], [[3], [2]], 1, 8)
    s, s_end = table([[]], [[]], 1, 8, start=roundup(b_end, 64))
    tensors = {
        "m.w": TensorEntry("m.w", "float32", (rows, 3), w, BLOCK),
        "m.b": TensorEntry("m.b", "int64", (5,), b, BLOCK),
        "m.s": TensorEntry("m.s", "float64", (), s, BLOCK),
    }
    return Metadata(
        unique_id=7,
        world_size=4,
        files=(FileEntry("0_7.distcp", w_end), FileEntry("1_7.distcp", s_end)),
        tensors=tensors,
        structure=copy.deepcopy(STRUCTURE),
        block_bytes=BLOCK,
        created_by="unit test",
    )


def doc_of(meta: Metadata) -> dict:
    return json.loads(meta.to_json())


def unpack(column: str, dtype: str) -> np.ndarray:
    """A packed column, decoded from the format's definition: z: + base64(zlib(LE 64-bit))."""
    assert column.startswith("z:")
    return np.frombuffer(zlib.decompress(base64.b64decode(column[2:])), dtype=dtype)


# bytes of one stored block of 256 elements: its float32 minimum and step, then the codes
QUANT_BLOCK_BYTES = {"int8": 8 + 256, "int4": 8 + 128}


def _one_file_tensors(rows, seed: int) -> tuple[dict, int]:
    """Entries of ``rows`` (key, dtype, shape, encoding, pieces as (offset, shape)) laid out one
    after the other in one file, each piece at a multiple of 64 bytes, of their stored sizes
    (docs/format.md: raw bytes, or whole blocks); and the file's size."""
    rng = np.random.default_rng(seed)
    tensors, at = {}, 0
    for key, dtype, shape, encoding, pieces in rows:
        itemsize = {"float32": 4, "bfloat16": 2, "int64": 8}[dtype]
        nbytes = [
            itemsize * math.prod(s) if encoding is None else -(-math.prod(s) // 256) * QUANT_BLOCK_BYTES[encoding]
            for _, s in pieces
        ]
        starts = []
        for n in nbytes:
            starts.append(at)
            at = roundup(at + n, 64)
        table = PieceTable(
            offsets=np.array([o for o, _ in pieces], dtype=np.int64),
            shapes=np.array([s for _, s in pieces], dtype=np.int64),
            files=np.zeros(len(pieces), dtype=np.int64),
            byte_offsets=np.array(starts, dtype=np.int64),
            checksums=rng.integers(0, 2**64, size=sum(-(-n // BLOCK) for n in nbytes), dtype=np.uint64),
        )
        tensors[key] = TensorEntry(key, dtype, shape, table, BLOCK, encoding)
    return tensors, at


def encoded_meta(seed: int = 0) -> Metadata:
    """``q.a`` (20 x 40 float32, int8) in two row pieces of 400 elements (two blocks each),
    ``q.b`` (300 bfloat16, int4) in one piece (two blocks), ``q.p`` (5 int64) plain; one file.
    Stored sizes from docs/format.md: whole blocks."""
    tensors, at = _one_file_tensors([
        ("q.a", "float32", (20, 40), "int8", [((0, 0), (10, 40)), ((10, 0), (10, 40))]),
        ("q.b", "bfloat16", (300,), "int4", [((0,), (300,))]),
        ("q.p", "int64", (5,), None, [((0,), (5,))]),
    ], seed)  # fmt: skip
    structure = {"d": [["q", {"d": [["a", {"t": 0}], ["b", {"t": 0}], ["p", {"t": 0}]]}]]}
    return Metadata(7, 1, (FileEntry("0_7.distcp", at),), tensors, structure, block_bytes=BLOCK, created_by="unit test")


def derived_meta(seed: int = 0) -> Metadata:
    """``m.p`` (20 x 40 bfloat16) in two row pieces and ``o.q`` (5 float32) in one, stored;
    ``o.p.w_0`` (20 x 40 float32) derived from ``m.p``: no pieces, ``encoding`` "derived" and
    ``source`` "m.p" (docs/format.md, "Derived tensors"). One file."""
    tensors, at = _one_file_tensors([
        ("m.p", "bfloat16", (20, 40), None, [((0, 0), (10, 40)), ((10, 0), (10, 40))]),
        ("o.q", "float32", (5,), None, [((0,), (5,))]),
    ], seed)  # fmt: skip
    none = PieceTable(*(np.zeros((0, 2), np.int64),) * 2, *(np.zeros(0, np.int64),) * 2, np.zeros(0, np.uint64))
    tensors["o.p.w_0"] = TensorEntry("o.p.w_0", "float32", (20, 40), none, BLOCK, "derived", "m.p")
    structure = {"d": [["m", {"d": [["p", {"t": 0}]]}], ["o", {"d": [["q", {"t": 0}], ["p.w_0", {"t": 0}]]}]]}
    return Metadata(7, 1, (FileEntry("0_7.distcp", at),), tensors, structure, block_bytes=BLOCK, created_by="unit test")
