"""paddle_dcp.core.dtypes: the format's dtype names, their little-endian numpy storage types and
safetensors codes, and bfloat16 as bit patterns. Oracles: IEEE bit patterns written out here
(bfloat16 is the top 16 bits of a float32, rounded to the nearest, ties to even)."""
import numpy as np
import pytest

from paddle_dcp.core import dtypes
from paddle_dcp.errors import FormatError

from ..helpers import STORAGE


def test_every_name_of_the_format_has_its_storage_type_and_size():
    assert dtypes.DTYPE_NAMES == tuple(STORAGE)
    for name, storage in STORAGE.items():
        assert dtypes.storage_dtype(name) == storage and dtypes.itemsize(name) == storage.itemsize


def test_an_unknown_name_is_a_format_error_listing_the_known_ones():
    with pytest.raises(FormatError, match="unknown dtype 'float128'; supported: bool, uint8"):
        dtypes.storage_dtype("float128")


@pytest.mark.parametrize("numpy_dtype, name", [
    ("bool", "bool"), ("u1", "uint8"), ("i1", "int8"), (">i4", "int32"), ("<i8", "int64"),
    ("f2", "float16"), ("f4", "float32"), (">f8", "float64"), ("c8", "complex64"), ("c16", "complex128"),
])  # fmt: skip
def test_the_name_of_a_numpy_dtype_is_by_kind_and_size_whatever_its_byte_order(numpy_dtype, name):
    assert dtypes.name_of_numpy(np.dtype(numpy_dtype)) == name


@pytest.mark.parametrize("numpy_dtype", ["u2", "u4", "f16" if hasattr(np, "float128") else "U3", "O"])
def test_a_numpy_dtype_the_format_lacks_is_refused_and_uint16_is_never_bfloat16(numpy_dtype):
    with pytest.raises(FormatError, match="has no checkpoint dtype"):
        dtypes.name_of_numpy(np.dtype(numpy_dtype))


def test_bfloat16_bits_widen_to_float32_exactly():
    bits = np.array([0x3F80, 0xC000, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7FC1], np.uint16)
    got = dtypes.bf16_to_float32(bits)
    assert got.dtype == np.float32
    assert got.view(np.uint32).tolist() == [int(b) << 16 for b in bits.tolist()]  # NaN payload kept
    assert got[:6].tolist() == [1.0, -2.0, 0.0, -0.0, np.inf, -np.inf]


def test_float32_narrows_to_bfloat16_rounding_to_the_nearest_ties_to_even():
    words = np.array([
        0x3F800000,  # 1.0
        0x3F808000,  # halfway between 0x3F80 and 0x3F81: to the even 0x3F80
        0x3F818000,  # halfway between 0x3F81 and 0x3F82: to the even 0x3F82
        0x3F808001,  # above halfway: up
        0x3F807FFF,  # below halfway: down
        0x7F7FFFFF,  # the largest float32 rounds past bfloat16's largest: inf
        0xFF800000,  # -inf
        0x7FC00001,  # a NaN
        0xFFC00000,  # another NaN
    ], np.uint32).view(np.float32)  # fmt: skip
    assert dtypes.float32_to_bf16(words).tolist() == [
        0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0xFF80, 0x7FFF, 0x7FFF,
    ]  # fmt: skip


def test_cast_goes_through_float32_for_bfloat16_and_returns_the_array_when_nothing_changes():
    a = np.array([1.5, -3.0], np.float32)
    assert dtypes.cast(a, "float32", "float32") is a
    bf = dtypes.cast(a, "float32", "bfloat16")
    assert bf.dtype == np.uint16 and bf.tolist() == [0x3FC0, 0xC040]
    assert dtypes.cast(bf, "bfloat16", "float64").tolist() == [1.5, -3.0]
    assert dtypes.cast(bf, "bfloat16", "float64").dtype == np.dtype("<f8")
    assert dtypes.cast(np.array([2.5], np.float16), "float16", "bfloat16").tolist() == [0x4020]


def test_safetensors_codes_cover_every_dtype_but_complex128_both_ways():
    assert set(dtypes.SAFETENSORS_CODES) == set(dtypes.DTYPE_NAMES) - {"complex128"}
    for name, code in dtypes.SAFETENSORS_CODES.items():
        assert dtypes.DTYPE_OF_SAFETENSORS_CODE[code] == name
    assert dtypes.SAFETENSORS_CODES["bfloat16"] == "BF16" and dtypes.SAFETENSORS_CODES["bool"] == "BOOL"


def test_as_bytes_views_a_contiguous_array_without_a_copy():
    a = np.arange(6, dtype="<i4").reshape(2, 3)
    view = dtypes.as_bytes(a)
    assert view.nbytes == 24 and bytes(view[:8]) == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    a[0, 0] = 7
    assert view[0] == 7  # the array's own memory
    with pytest.raises(ValueError, match="C-contiguous"):
        dtypes.as_bytes(a.T)


def test_finite_reads_bfloat16_bit_patterns_and_numpy_floats():
    from paddle_dcp.core.dtypes import finite

    assert finite(np.array([0x3F80, 0x7F7F, 0xFF7F], np.uint16), "bfloat16")  # 1, max, -max
    for bits in (0x7F80, 0xFF80, 0x7FC0):  # inf, -inf, nan
        assert not finite(np.array([0x3F80, bits], np.uint16), "bfloat16")
    assert finite(np.array([65504, -1], np.float16), "float16") and not finite(np.array([np.inf], np.float16), "float16")
    assert finite(np.zeros(0, np.float32), "float32")
