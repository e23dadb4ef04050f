"""Fixtures of the command-line tests: one 4-rank checkpoint of every dtype per test module,
and a private copy of it to damage."""
import os
import shutil

import numpy as np
import pytest

from ..helpers import random_array, save_checkpoint
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
