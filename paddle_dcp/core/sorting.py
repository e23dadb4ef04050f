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
    words = _packed(keys)
    if words is None:
        return np.lexsort(keys)
    return _order(words)


def groups(keys: Sequence[np.ndarray], dependent: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """:func:`lexsort`'s permutation, and per sorted row whether it starts a group of rows
    equal in every key (the first row always does). ``dependent``: how many of the first (least
    significant) keys usually follow from the others (a piece's shape from its key and
    offsets): the rows are sorted by the others, in fewer words, and by every key only when
    some group of equal others differs in them."""
    keys = [np.asarray(k) for k in keys]
    if 0 < dependent < len(keys):
        order, new = groups(keys[dependent:])
        if not (_changes(keys[:dependent], order) & ~new).any():  # equal within every group
            return order, new
    n = len(keys[0]) if keys else 0
    words = _packed(keys) if n > 1 else None
    if words is None:  # too few rows, or values past int64's: compared column by column
        words = keys
        order = np.lexsort(keys) if keys else np.zeros(0, np.int64)
    else:
        order = _order(words)
    return order, _changes(words, order)


def _changes(columns: list[np.ndarray], order: np.ndarray) -> np.ndarray:
    """Per row in ``order``, whether it differs from the row before in some column (the first
    row always does); each column taken in that order through one buffer per dtype."""
    new = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        new[1:] = False
        buffers: dict = {}
        for column in columns:
            if column.dtype not in buffers:
                buffers[column.dtype] = np.empty(len(order), dtype=column.dtype)
            s = buffers[column.dtype]
            np.take(column, order, out=s)
            new[1:] |= s[1:] != s[:-1]
    return new


def _order(words: list[np.ndarray]) -> np.ndarray:
    return np.argsort(words[0], kind="stable") if len(words) == 1 else np.lexsort(words[::-1])


def _packed(keys: list[np.ndarray]) -> list[np.ndarray] | None:
    """The keys packed primary first into 64-bit words (each key shifted to start at 0, as
    many keys to a word as their ranges allow), which sort and compare as the keys do; None
    for keys with values past int64's."""
    words: list[np.ndarray] = []
    word: np.ndarray | None = None
    used = 0
    for key in reversed(keys):  # primary first
        lo, hi = int(key.min()), int(key.max())
        bits = (hi - lo).bit_length()
        if hi >= 1 << 63:  # not int64 values (an int64 range always fits 64 bits)
            return None
        # wraps past 2**63 as uint64 does: the difference is exact modulo 2**64
        if word is None or used + bits > 64:
            if word is not None:
                words.append(word)
            word, used = np.subtract(key, np.int64(lo), dtype=np.int64).view(np.uint64), bits
        else:  # in place, modulo 2**64 (the key cast as it is read): no column of temporaries
            word <<= np.uint64(bits)
            word -= np.uint64(lo % (1 << 64))
            np.add(word, key, out=word, dtype=np.uint64, casting="unsafe")
            used += bits
    assert word is not None
    words.append(word)
    return words
