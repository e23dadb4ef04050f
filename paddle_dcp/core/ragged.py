"""Ragged arrays: runs of given lengths, end to end: the index arithmetic that
numpy code over many tensors, pieces or groups at once repeats."""
from __future__ import annotations

import numpy as np


def positions(counts: np.ndarray) -> np.ndarray:
    """For runs of ``counts`` elements end to end, each element's position within its run:
    ``[0, 1, .., counts[0] - 1, 0, 1, ..]``."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def indices(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices ``starts[i] .. starts[i] + counts[i] - 1`` of every i, end to end."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.repeat(np.asarray(starts, dtype=np.int64), counts) + positions(counts)
