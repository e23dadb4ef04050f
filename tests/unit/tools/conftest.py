"""Fixtures of the command-line tests: one 4-rank checkpoint of every dtype per test module,
and a private copy of it to damage."""
import os
import shutil

import numpy as np
import pytest

from ..helpers import expected_tensor, random_array, save_checkpoint, saved_boxes
from .commands import MESH, TENSORS, VALUES


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-rank checkpoint of every TENSORS entry (64-byte checksum blocks), and its oracle."""
    path = str(tmp_path_factory.mktemp("multi") / "ck")
    os.makedirs(path)
    rng = np.random.default_rng(7)
    arrays = {n: random_array(rng, d, s) for n, (d, s, _) in TENSORS.items()}
    save_checkpoint(
        path, arrays, {n: d for n, (d, _, _) in TENSORS.items()}, MESH,
        {n: p for n, (_, _, p) in TENSORS.items()}, block_bytes=64, values=dict(VALUES),
    )  # fmt: skip
    return path, {f"model.{n}": a for n, a in arrays.items()}


@pytest.fixture
def ck(saved, tmp_path):
    """A private copy of the checkpoint, to damage."""
    path = str(tmp_path / "ck")
    shutil.copytree(saved[0], path)
    return path


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """A 4-rank checkpoint with two tensors stored quantized (float32 int8 split by rows,
    bfloat16 int4 split by columns: blocks of 256 that cross rows) and an int64 one the policy
    matches but leaves plain; the values a load of each gives, from the reference quantizer."""
    path = str(tmp_path_factory.mktemp("compressed") / "ck")
    os.makedirs(path)
    rng = np.random.default_rng(11)
    arrays = {
        "m1": (rng.standard_normal((9, 70)) * 0.01).astype(np.float32),
        "m2": (rng.standard_normal((5, 300)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16),
        "n": np.arange(12, dtype=np.int64),
    }
    dtypes = {"m1": "float32", "m2": "bfloat16", "n": "int64"}
    placements = {"m1": (0, None), "m2": (None, 1), "n": (None, None)}
    save_checkpoint(path, arrays, dtypes, (2, 2), placements, block_bytes=64, compress={"m1": "int8", "m2|n": "int4"})
    encodings = {"m1": "int8", "m2": "int4"}
    loaded = {f"model.{k}": expected_tensor(a, dtypes[k], encodings[k], saved_boxes(a.shape, (2, 2), placements[k]))
              for k, a in arrays.items() if k in encodings}  # fmt: skip
    loaded["model.n"] = arrays["n"]
    return path, loaded


@pytest.fixture(scope="module")
def derived(tmp_path_factory):
    """A 4-rank checkpoint whose float32 master weight ``model.p.w_0`` (split by columns) is
    derived from its bfloat16 parameter ``model.p`` (split by rows) and not stored; ``model.q``
    (float32) is plain. The values a load gives: the master weight is the parameter, as float32."""
    path = str(tmp_path_factory.mktemp("derived") / "ck")
    os.makedirs(path)
    rng = np.random.default_rng(13)
    p = (rng.standard_normal((9, 70)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    arrays = {"p": p, "p.w_0": rng.standard_normal((9, 70)).astype(np.float32), "q": rng.standard_normal(7).astype(np.float32)}
    dtypes = {"p": "bfloat16", "p.w_0": "float32", "q": "float32"}
    placements = {"p": (0, None), "p.w_0": (None, 1), "q": (None, None)}
    save_checkpoint(path, arrays, dtypes, (2, 2), placements, block_bytes=64, compress={r"\.w_0$": "derived"})
    loaded = {"model.p": p, "model.p.w_0": (p.astype(np.uint32) << 16).view(np.float32), "model.q": arrays["q"]}
    return path, loaded
