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
