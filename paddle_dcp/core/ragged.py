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


def joined(parts: list[np.ndarray]) -> np.ndarray:
    """The ``parts`` stacked end to end (as ``np.concatenate``): a view, without a copy, when
    they are views of one array lying end to end in its memory, in order (summaries decoded
    into one table); else a new array."""
    held = [p for p in parts if len(p)]  # (an empty view's address is not where it stands)
    if held and _end_to_end(held):
        first = held[0]
        rows = sum(len(p) for p in held)  # one run of the base's memory: every byte in some part
        view = np.lib.stride_tricks.as_strided(first, (rows, *first.shape[1:]), first.strides)
        view.flags.writeable = False
        return view
    return np.concatenate(parts)


def _end_to_end(parts: list[np.ndarray]) -> bool:
    """Whether the non-empty ``parts`` are C-contiguous views of one array, alike, lying end
    to end in its memory."""
    first = parts[0]
    if first.base is None or not all(
        p.base is first.base and p.flags.c_contiguous and p.shape[1:] == first.shape[1:] and p.dtype == first.dtype
        for p in parts
    ):
        return False
    row_bytes = first.itemsize * int(np.prod(first.shape[1:], dtype=np.int64))
    starts = np.array([p.__array_interface__["data"][0] for p in parts], dtype=np.int64)
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    return bool((np.diff(starts) == lengths[:-1] * row_bytes).all())
