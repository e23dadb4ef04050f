"""Blockwise quantization of a saved piece: its elements, in C order, cut into blocks of
``BLOCK`` elements, each stored as its own minimum and step (two little-endian float32) and
its elements' codes, so that any run of elements can be read and decoded from the bytes of
the blocks it touches alone.

Encodings (``ENCODINGS``): ``"int8"``, codes 0..255 (one byte each); ``"int4"``, codes 0..15
(two per byte, the first element in the low nibble). An element x of a block with minimum m
and step s is stored as round((x - m) / s) and read back as m + code * s: the error is at most
s / 2, with s = (max - min) / 255 or / 15 over the block. A block whose elements are all equal
has s = 0 and reads back exactly. The last block of a piece is padded with codes 0.

Non-finite values cannot be stored this way: :func:`encode` refuses them (the caller names the
key). Sources are float16, bfloat16 (its bit patterns, :func:`encode_piece`) or float32
(``ENCODABLE``); a load decodes to float32 and casts to the tensor's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import bf16_to_float32
from ..errors import ArgumentError, FormatError, UnsupportedError

BLOCK = 256  # elements per block
HEADER = 8  # bytes of a block's minimum and step
ENCODABLE = ("float16", "bfloat16", "float32")  # the dtypes an encoding may store


@dataclass(frozen=True)
class Encoding:
    """How one encoding stores a block.

    Attributes:
        name: as recorded in the metadata.
        bits: bits of one element's code.
    """

    name: str
    bits: int

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block: its header and ``BLOCK`` codes."""
        return HEADER + BLOCK * self.bits // 8

    def nbytes(self, elements: int) -> int:
        """Bytes of a piece of ``elements`` elements."""
        return blocks(elements) * self.block_bytes


ENCODINGS = {e.name: e for e in (Encoding("int8", 8), Encoding("int4", 4))}


def encoding(name: str) -> Encoding:
    """The encoding called ``name``.

    Raises:
        FormatError: an encoding this version does not know (a newer writer's).
    """
    found = ENCODINGS.get(name)
    if found is None:
        raise FormatError(f"unknown tensor encoding {name!r}: this paddle_dcp reads {sorted(ENCODINGS)}")
    return found


def blocks(elements: int) -> int:
    return -(-int(elements) // BLOCK)


def encode(values: np.ndarray, name: str) -> np.ndarray:
    """The stored bytes (uint8) of ``values`` (any float dtype, read as float32, in C order).

    Raises:
        ArgumentError: a NaN or infinity among the values.
    """
    enc = encoding(name)
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if not np.isfinite(flat).all():
        raise ArgumentError(f"{int((~np.isfinite(flat)).sum())} values are not finite: {name} cannot store them")
    n = blocks(flat.size)
    grid = np.zeros((n, BLOCK), np.float32)
    grid.reshape(-1)[: flat.size] = flat
    if flat.size % BLOCK:  # padding takes the block's own first value: it changes neither bound
        last = flat.size % BLOCK
        grid[-1, last:] = grid[-1, 0]
    low = grid.min(axis=1)
    step = (grid.max(axis=1) - low) / np.float32(enc.levels)
    safe = np.where(step > 0, step, np.float32(1))
    codes = np.clip(np.rint((grid - low[:, None]) / safe[:, None]), 0, enc.levels).astype(np.uint8)
    codes[step == 0] = 0
    out = np.empty((n, enc.block_bytes), np.uint8)
    out[:, :4] = low.astype("<f4").view(np.uint8).reshape(n, 4)
    out[:, 4:8] = step.astype("<f4").view(np.uint8).reshape(n, 4)
    out[:, HEADER:] = codes if enc.bits == 8 else codes[:, 0::2] | (codes[:, 1::2] << 4)
    return out.reshape(-1)


def decode(data: np.ndarray, name: str, first: int, count: int) -> np.ndarray:
    """Elements ``first`` .. ``first + count`` of a piece (float32), from ``data``: the stored
    bytes of the blocks they lie in, from the block of element ``first`` on.

    Raises:
        FormatError: ``data`` is shorter than those blocks, or a block's minimum or step is
            not finite, negative, or decodes to a value that is not (no writer stores these).
    """
    enc = encoding(name)
    start_block, skip = divmod(int(first), BLOCK)
    n = blocks(skip + count)
    if len(data) < n * enc.block_bytes:
        raise FormatError(f"{len(data)} bytes where {n} {name} blocks need {n * enc.block_bytes}")
    stored = np.asarray(data, np.uint8)[: n * enc.block_bytes].reshape(n, enc.block_bytes)
    low = stored[:, :4].copy().view("<f4").reshape(n)
    step = stored[:, 4:8].copy().view("<f4").reshape(n)
    body = stored[:, HEADER:]
    if enc.bits == 8:
        codes = body
    else:
        codes = np.empty((n, BLOCK), np.uint8)
        codes[:, 0::2] = body & 0x0F
        codes[:, 1::2] = body >> 4
    with np.errstate(over="ignore", invalid="ignore"):
        values = (low[:, None] + codes.astype(np.float32) * step[:, None]).reshape(-1)[skip : skip + count]
    if not (np.isfinite(values).all() and (step >= 0).all()):  # no writer stores these: damage
        raise FormatError(f"a {name} block holds a minimum or step that does not decode to finite values")
    return values


def byte_range(name: str, first: int, count: int) -> tuple[int, int]:
    """[start, stop) of the stored bytes, from the piece's first stored byte, that hold
    elements ``first`` .. ``first + count`` (whole blocks)."""
    enc = encoding(name)
    if count <= 0:
        return 0, 0
    lo = int(first) // BLOCK
    hi = (int(first) + int(count) - 1) // BLOCK + 1
    return lo * enc.block_bytes, hi * enc.block_bytes


def encode_piece(array: np.ndarray, dtype: str, name: str, key: str) -> np.ndarray:
    """The stored bytes of a saved piece: ``array`` in the storage dtype of ``dtype`` (one of
    ``ENCODABLE``; bfloat16 as its bit patterns), encoded as ``name``.

    Raises:
        UnsupportedError: a NaN or infinity in the piece (naming ``key``), or a dtype that
            cannot be encoded.
    """
    if dtype not in ENCODABLE:
        raise UnsupportedError(f"{key}: dtype {dtype} cannot be stored as {name}; encodable: {', '.join(ENCODABLE)}")
    values = bf16_to_float32(np.ascontiguousarray(array).reshape(-1)) if dtype == "bfloat16" else array
    try:
        return encode(values, name)
    except ArgumentError as exc:
        raise UnsupportedError(
            f"{key}: {exc} (a {name} checkpoint stores finite values only): save this key without compress"
        ) from None
