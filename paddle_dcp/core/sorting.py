"""Sorting many rows of small integers by several columns: :func:`lexsort` packs the columns
into as few 64-bit words as their ranges allow and sorts those, giving numpy's lexsort order
(stable) in one or two passes instead of one per column."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def lexsort(keys: Sequence[np.ndarray]) -> np.ndarray:
    """The permutation ``np.lexsort(keys)`` returns (the last key primary, ties kept in input
    order), for 1-D integer keys of equal length (int64 values)."""
    keys = [np.asarray(k) for k in keys]
    if not keys or len(keys[0]) < 2:
        return np.lexsort(keys) if keys else np.zeros(0, np.int64)
    words: list[np.ndarray] = []
    word: np.ndarray | None = None
    used = 0
    for key in reversed(keys):  # primary first
        lo, hi = int(key.min()), int(key.max())
        bits = (hi - lo).bit_length()
        if hi >= 1 << 63:  # not int64 values (an int64 range always fits 64 bits)
            return np.lexsort(keys)
        # wraps past 2**63 as uint64 does: the difference is exact modulo 2**64
        shifted = np.subtract(key.astype(np.int64, copy=False), np.int64(lo)).view(np.uint64)
        if word is None or used + bits > 64:
            if word is not None:
                words.append(word)
            word, used = shifted, bits
        else:
            word = (word << np.uint64(bits)) | shifted
            used += bits
    assert word is not None
    words.append(word)
    if len(words) == 1:
        return np.argsort(words[0], kind="stable")
    return np.lexsort(words[::-1])
