"""The command-line tests' shared checkpoint (its tensors, values and mesh), the runner of a
command, and the damage done to a checkpoint's files to see what verify, convert and a load
say of it."""
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from paddle_dcp.io import local
from paddle_dcp.tools import cli
from paddle_dcp.core.metadata import TensorEntry
from paddle_dcp.io import storage as dcp_storage

from ..helpers import coords, ref_box, same_bits


REPO = Path(__file__).resolve().parents[3]


# name -> (dtype, global shape, placements on a (2, 2) mesh): several pieces per tensor,
# uneven splits, a scalar, every dtype safetensors holds
TENSORS = {
    "w": ("float32", (6, 10), (0, 1)),
    "e": ("bfloat16", (5, 3), (1, None)),
    "i": ("int64", (7,), (0, None)),
    "b": ("bool", (4, 4), (None, 1)),
    "h": ("float16", (3, 5, 2), (2, 0)),
    "c": ("complex64", (4,), (None, 0)),
    "q": ("int8", (9, 2), (0, 0)),
    "s": ("float64", (), (None, None)),
}


VALUES = {"step": 5, "lr": float("nan"), "name": "run-1", "done": None}


MESH = (2, 2)


def expected_pieces(shape, placements) -> int:
    """Distinct non-empty boxes the ranks of MESH hold: what a save writes once each."""
    boxes = {ref_box(shape, MESH, placements, c) for c in coords(MESH)}
    return len([b for b in boxes if b.volume > 0 or not b.shape])


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def bf16_as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def piece_location(path, key, index=0):
    meta = dcp_storage.read_metadata(local.LocalStorage(path), 0)
    p = meta.tensors[key].pieces
    return os.path.join(path, meta.files[int(p.files[index])].name), int(p.byte_offsets[index])


def flip_byte(path, key):
    name, offset = piece_location(path, key)
    with open(name, "r+b") as f:
        f.seek(offset + 1)
        b = f.read(1)
        f.seek(offset + 1)
        f.write(bytes([b[0] ^ 0x40]))
    return name


def truncate(path, key):
    name, _ = piece_location(path, key)
    os.truncate(name, os.path.getsize(name) - 3)
    return name


def remove(path, key):
    name, _ = piece_location(path, key)
    os.unlink(name)
    return name


def overlap(path, key):
    """Metadata whose pieces of ``key`` overlap: the second piece moved onto the first."""
    name = os.path.join(path, "0.metadata")
    meta = dcp_storage.read_metadata(local.LocalStorage(path), 0)
    entry = meta.tensors[key]
    offsets = entry.pieces.offsets.copy()
    offsets[1] = offsets[0]
    pieces = replace(entry.pieces, offsets=offsets)
    tensors = dict(meta.tensors)
    tensors[key] = TensorEntry(key, entry.dtype, entry.shape, pieces, entry.block_bytes)
    with open(name, "wb") as f:
        f.write(replace(meta, tensors=tensors).to_json())
    return name


def garbage(path, key):
    name = os.path.join(path, "0.metadata")
    with open(name, "wb") as f:
        f.write(b'{"format": "paddle_dcp", "format_version": 1, "tens')
    return name


def edit_value(path, key):
    """A plain value changed by hand in the metadata, which stays valid JSON of a valid
    checkpoint: only its digest tells."""
    name = os.path.join(path, "0.metadata")
    with open(name, "rb") as f:
        data = f.read()
    assert data.count(b'"run-1"') == 1
    with open(name, "wb") as f:
        f.write(data.replace(b'"run-1"', b'"run-2"'))
    return name


def remove_metadata(path, key):
    name = os.path.join(path, "0.metadata")
    os.unlink(name)
    return name


def check_all(loaded: dict, oracle: dict, keys=None):
    keys = sorted(oracle) if keys is None else keys
    assert sorted(loaded) == sorted(keys)
    for key in keys:
        assert same_bits(np.asarray(loaded[key]), oracle[key]), key
