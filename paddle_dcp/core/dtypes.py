"""Dtype names of the format and their numpy storage types (bfloat16 included)."""
from __future__ import annotations

import functools

import numpy as np

from ..errors import FormatError

# name -> numpy dtype used to hold the raw little-endian bytes. bfloat16 has no numpy type:
# its bytes travel as uint16 and only paddle interprets them.
_STORAGE = {
    "bool": np.dtype("|b1"),
    "uint8": np.dtype("|u1"),
    "int8": np.dtype("|i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "complex64": np.dtype("<c8"),
    "complex128": np.dtype("<c16"),
}

DTYPE_NAMES = tuple(_STORAGE)


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype whose bytes equal the format's bytes for dtype ``name``."""
    try:
        return _STORAGE[name]
    except KeyError:
        raise FormatError(
            f"unknown dtype {name!r}; supported: {', '.join(DTYPE_NAMES)}"
        ) from None


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``."""
    return storage_dtype(name).itemsize


def name_of_numpy(dtype: np.dtype) -> str:
    """The format's name for a numpy array's dtype (uint16 is never read as bfloat16)."""
    return _name_of_kind(np.dtype(dtype))


@functools.lru_cache(maxsize=64)
def _name_of_kind(dtype: np.dtype) -> str:
    for name, storage in _STORAGE.items():
        if name != "bfloat16" and storage.kind == dtype.kind and storage.itemsize == dtype.itemsize:
            return name
    raise FormatError(f"numpy dtype {dtype} has no checkpoint dtype; supported: {', '.join(DTYPE_NAMES)}")


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) as float32 values: exact, NaN payloads kept."""
    wide = bits.astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16), as paddle casts them: rounded to the
    nearest, ties to even (overflow to inf), every NaN to 0x7fff."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FFF), rounded)


def cast(array: np.ndarray, source: str, target: str) -> np.ndarray:
    """An array in the storage dtype of ``source`` converted to that of ``target`` (a new array,
    or ``array`` itself when the dtypes are equal), with paddle's rounding: bfloat16 goes
    through float32, as paddle's cast does. (Paddle 3.3.1's CPU kernel turns some float32
    values below 2**-25 into nonzero float16 bits; IEEE, numpy and paddle's GPU cast give +-0,
    as this does.)"""
    if source == target:
        return array
    values = bf16_to_float32(array) if source == "bfloat16" else array
    if target == "bfloat16":
        return float32_to_bf16(values.astype(np.float32, copy=False))
    return values.astype(storage_dtype(target))


def finite(array: np.ndarray, dtype: str) -> bool:
    """Whether every value of ``array`` (the storage dtype of float ``dtype``; bfloat16 as bit
    patterns) is finite."""
    if dtype == "bfloat16":
        return not ((array & np.uint16(0x7F80)) == np.uint16(0x7F80)).any()
    return bool(np.isfinite(array).all())


# The format's dtype names -> safetensors' dtype codes (safetensors has no complex128).
SAFETENSORS_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
}
DTYPE_OF_SAFETENSORS_CODE = {code: name for name, code in SAFETENSORS_CODES.items()}


def as_bytes(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    return array.reshape(-1).view(np.uint8).data
