"""The tensors of the suites io and many, and their numpy oracle: stdlib + numpy only (no paddle, no torch).

The workload of issue 5 at a chosen total size: half the logical bytes in big tensors (64 MiB,
smaller when the total is too small to hold several), half in 1 MiB tensors, plus tiny ones
(biases of a few hundred bytes and scalars); about a fifth of the bytes bfloat16; big tensors
and most 1 MiB ones Shard(0) over a 1-D mesh of all ranks, every 8th 1 MiB tensor and most tiny
ones Replicate. The reshard target turns every 2-D Shard(0) into Shard(1).

Values come from positions: element ``pos`` (C order in the global tensor) of tensor ``seed``
has the bits of a multiplicative hash of ``(pos, seed)``, masked so that every value is a
normal number (no NaN, inf, zero or subnormal) and, for bfloat16, exact in bfloat16. The
oracle computes the whole global array and cuts each rank's slice out of it with its own
arithmetic (ceil-sized chunks, as paddle and torch split), so a loaded value is right only if
it sits at the right place of the right tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.units import MiB

BIG_BYTES = 64 * MiB
SMALL_BYTES = 1 * MiB
ITEMSIZE = {"float32": 4, "bfloat16": 2}

_MUL = np.uint32(0x9E3779B1)   # odd: pos -> pos * _MUL is a bijection mod 2**32
_SEED_MUL = 0x85EBCA77


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the workload.

    Fields:
        name: the state-dict key.
        shape: global shape, in elements.
        dtype: "float32" or "bfloat16".
        layout: placement on the 1-D mesh for save and same-layout load: "S0" or "R".
        reshard: placement for the reshard load: "S1", "S0" or "R".
        seed: picks the values (distinct per tensor).
    """

    name: str
    shape: tuple
    dtype: str
    layout: str
    reshard: str
    seed: int

    @property
    def nbytes(self) -> int:
        """Logical bytes (the global tensor's, counted once however it is laid out)."""
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _matrix(nbytes: int, dtype: str) -> tuple:
    """A 2-D shape of ``nbytes`` in ``dtype``, both sides powers of two, as square as can be."""
    k = (nbytes // ITEMSIZE[dtype]).bit_length() - 1
    return (1 << (k // 2), 1 << (k - k // 2))


def build(total_bytes: int) -> list[TensorSpec]:
    """The workload for ``total_bytes`` of logical bytes (at least 1 MiB)."""
    if total_bytes < MiB:
        raise ValueError(f"size {total_bytes} bytes is too small: use at least 1M")
    half = total_bytes // 2
    big = min(BIG_BYTES, _pow2_floor(half // 2))
    small = min(SMALL_BYTES, _pow2_floor(half // 16))
    specs: list[TensorSpec] = []
    sums = {"all": 0, "bf16": 0}

    def pick_dtype(nbytes: int) -> str:
        # bfloat16 whenever that keeps its share of the bytes so far at most a fifth
        sums["all"] += nbytes
        if 5 * (sums["bf16"] + nbytes) <= sums["all"]:
            sums["bf16"] += nbytes
            return "bfloat16"
        return "float32"

    def add(name, shape, dtype, layout, reshard):
        specs.append(TensorSpec(name, tuple(shape), dtype, layout, reshard, len(specs)))

    for i in range(half // big):
        dtype = pick_dtype(big)
        add(f"big_{i:03d}.weight", _matrix(big, dtype), dtype, "S0", "S1")
    n_small = (total_bytes - half) // small
    for i in range(n_small):
        dtype = pick_dtype(small)
        replicated = i % 8 == 7
        add(f"small_{i:04d}.weight", _matrix(small, dtype), dtype, "R" if replicated else "S0",
            "R" if replicated else "S1")
        if i % 4 == 3:  # a bias every 4th layer: 64 float32 (256 B), 1-D, sharded half the time
            sharded = i % 8 == 3
            add(f"small_{i:04d}.bias", (64,), "float32", "S0" if sharded else "R", "S0" if sharded else "R")
    for i in range(2):
        add(f"scalar_{i}", (), "float32", "R", "R")
    add("norm.weight", (96,), "bfloat16", "R", "R")  # 192 B
    return specs


def total_bytes(specs) -> int:
    return sum(s.nbytes for s in specs)


# ------------------------------------------------------------------------------ the oracle
def chunk(extent: int, parts: int, index: int) -> tuple:
    """[lo, hi) of chunk ``index`` when ``extent`` is cut into ``parts`` chunks of ceil(n/k)."""
    step = -(-extent // parts)
    return min(index * step, extent), min((index + 1) * step, extent)


def local_slices(shape, layout: str, rank: int, ranks: int) -> tuple:
    """The slice of the global tensor ``rank`` holds under ``layout`` ("R", "S0", "S1")."""
    out = [slice(0, n) for n in shape]
    if layout != "R":
        dim = int(layout[1:])
        lo, hi = chunk(shape[dim], ranks, rank)
        out[dim] = slice(lo, hi)
    return tuple(out)


def _hash(pos: np.ndarray, seed: int) -> np.ndarray:
    """uint32 hash of positions, in place on ``pos`` (uint32)."""
    np.multiply(pos, _MUL, out=pos)
    np.add(pos, np.uint32((seed * _SEED_MUL) & 0xFFFFFFFF), out=pos)
    return pos


def stored_values(spec: TensorSpec, slices=None) -> np.ndarray:
    """The tensor's values (``slices`` of it, default all) as stored: float32, or bfloat16 as
    its uint16 bit patterns. Exponent field in [64, 127]: normal, finite, |x| < 2."""
    shape = spec.shape
    slices = slices if slices is not None else tuple(slice(0, n) for n in shape)
    if not shape:
        pos = np.zeros((), dtype=np.uint32)
    elif len(shape) == 1 or all(s.start == 0 and s.stop == n for s, n in zip(slices[1:], shape[1:])):
        row = math.prod(shape[1:])
        lo, hi = slices[0].start * row, slices[0].stop * row
        pos = np.arange(lo, hi, dtype=np.uint32).reshape((slices[0].stop - slices[0].start,) + tuple(shape[1:]))
    else:  # 2-D, a column block
        rows = np.arange(slices[0].start, slices[0].stop, dtype=np.uint32) * np.uint32(shape[1])
        cols = np.arange(slices[1].start, slices[1].stop, dtype=np.uint32)
        pos = rows[:, None] + cols[None, :]
    h = _hash(pos, spec.seed)
    if spec.dtype == "float32":
        np.bitwise_and(h, np.uint32(0x9FFFFFFF), out=h)
        np.bitwise_or(h, np.uint32(0x20000000), out=h)
        return h.view(np.float32)
    bits = (h >> np.uint32(16)).astype(np.uint16)
    np.bitwise_and(bits, np.uint16(0x9FFF), out=bits)
    np.bitwise_or(bits, np.uint16(0x2000), out=bits)
    return bits


def as_float32(stored: np.ndarray, dtype: str) -> np.ndarray:
    """What to hand a framework to build the tensor: float32 (bfloat16 values exact in it)."""
    if dtype == "float32":
        return stored
    return (stored.astype(np.uint32) << np.uint32(16)).view(np.float32)


def source_local(spec: TensorSpec, layout: str, rank: int, ranks: int) -> np.ndarray:
    """float32 values of ``rank``'s piece under ``layout``, to build the tensor to save."""
    return as_float32(stored_values(spec, local_slices(spec.shape, layout, rank, ranks)), spec.dtype)


def expected_local(spec: TensorSpec, layout: str, rank: int, ranks: int) -> np.ndarray:
    """What ``rank`` must hold after a load into ``layout``: the whole global array is computed,
    then this rank's slice is cut out of it."""
    whole = stored_values(spec)
    return whole[local_slices(spec.shape, layout, rank, ranks)]


def check(actual: np.ndarray, spec: TensorSpec, layout: str, rank: int, ranks: int) -> None:
    """Raise AssertionError unless ``actual`` (storage dtype) is bit for bit the oracle's."""
    want = expected_local(spec, layout, rank, ranks)
    actual = np.asarray(actual)
    if actual.shape != want.shape or actual.itemsize != want.itemsize:
        raise AssertionError(
            f"{spec.name}: rank {rank} holds shape {actual.shape} itemsize {actual.itemsize}, "
            f"expected {want.shape} itemsize {want.itemsize} ({layout} over {ranks} ranks)"
        )
    wbits = np.ascontiguousarray(want).view(np.uint16 if want.itemsize == 2 else np.uint32)
    abits = np.ascontiguousarray(actual).view(wbits.dtype)
    if not np.array_equal(abits, wbits):
        bad = np.argwhere(abits != wbits)
        first = tuple(int(x) for x in bad[0]) if bad.ndim == 2 and len(bad) else ()
        raise AssertionError(
            f"{spec.name}: rank {rank}: {len(bad)} of {wbits.size} values differ from the oracle "
            f"({layout} over {ranks} ranks), first at local index {first}"
        )
