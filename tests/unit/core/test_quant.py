"""Blockwise quantization (core/quant.py) against a reference quantizer written here in
numpy: the stored bytes byte for byte, the error bound, any run of elements decoded from its
blocks alone, and refusals (non-finite values, unknown encodings, short data)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.core import quant
from paddle_dcp.errors import ArgumentError, FormatError, UnsupportedError

from ..helpers import fast


def reference(values: np.ndarray, bits: int) -> bytes:
    """Block by block, in plain Python over numpy scalars: min, step, codes."""
    flat = [np.float32(v) for v in np.asarray(values, np.float32).reshape(-1)]
    out = bytearray()
    levels = (1 << bits) - 1
    for at in range(0, len(flat), quant.BLOCK):
        block = flat[at : at + quant.BLOCK]
        block = block + [block[0]] * (quant.BLOCK - len(block))
        low, high = min(block), max(block)
        step = np.float32((high - low) / np.float32(levels))
        codes = [0 if step == 0 else int(min(levels, max(0, np.rint((v - low) / step)))) for v in block]
        out += np.float32(low).tobytes() + step.tobytes()
        if bits == 8:
            out += bytes(codes)
        else:
            out += bytes(codes[i] | (codes[i + 1] << 4) for i in range(0, quant.BLOCK, 2))
    return bytes(out)


@pytest.mark.parametrize("name, bits", [("int8", 8), ("int4", 4)])
@pytest.mark.parametrize("size", [1, 255, 256, 257, 1000])
def test_the_stored_bytes_are_the_reference_quantizer_s(name, bits, size):
    values = np.random.default_rng(size).standard_normal(size).astype(np.float32) * 3
    stored = quant.encode(values, name)
    assert stored.tobytes() == reference(values, bits)
    assert len(stored) == quant.encoding(name).nbytes(size) == quant.blocks(size) * (8 + quant.BLOCK * bits // 8)


@fast(100)
@given(st.integers(1, 2000), st.sampled_from(["int8", "int4"]), st.data())
def test_any_run_decodes_from_its_blocks_alone_within_half_a_step(size, name, data):
    rng = np.random.default_rng(size)
    values = (rng.standard_normal(size) * rng.uniform(0.001, 100)).astype(np.float32)
    stored = quant.encode(values, name)
    first = data.draw(st.integers(0, size - 1))
    count = data.draw(st.integers(1, size - first))
    lo, hi = quant.byte_range(name, first, count)
    got = quant.decode(stored[lo:hi], name, first, count)
    want = values[first : first + count]
    # the bound: half the step of each element's block
    levels = (1 << quant.encoding(name).bits) - 1
    blocks = np.arange(first, first + count) // quant.BLOCK
    padded = np.concatenate([values, np.full(-size % quant.BLOCK, values[-(size % quant.BLOCK or quant.BLOCK)])])
    grid = padded.reshape(-1, quant.BLOCK)
    step = (grid.max(axis=1) - grid.min(axis=1)) / levels
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= step[blocks] / 2 * (1 + 1e-5) + 1e-30)
    assert np.array_equal(got, quant.decode(stored, name, 0, size)[first : first + count])


def test_a_constant_block_reads_back_exactly_and_zeros_stay_zeros():
    values = np.concatenate([np.full(256, 0.125, np.float32), np.zeros(100, np.float32)])
    for name in quant.ENCODINGS:
        assert np.array_equal(quant.decode(quant.encode(values, name), name, 0, values.size), values)


def test_bfloat16_and_float64_sources_are_read_as_float32():
    values = np.linspace(-1, 1, 300)
    assert np.array_equal(quant.encode(values, "int8"), quant.encode(values.astype(np.float32), "int8"))


def test_refusals():
    with pytest.raises(ArgumentError, match="not finite"):
        quant.encode(np.array([1.0, np.nan], np.float32), "int8")
    with pytest.raises(ArgumentError, match="not finite"):
        quant.encode(np.array([np.inf], np.float32), "int4")
    with pytest.raises(FormatError, match="unknown tensor encoding 'int3'"):
        quant.encode(np.ones(3, np.float32), "int3")
    stored = quant.encode(np.ones(600, np.float32), "int8")
    with pytest.raises(FormatError, match="blocks need"):
        quant.decode(stored[:100], "int8", 0, 600)
    assert quant.byte_range("int4", 5, 0) == (0, 0)
    assert quant.byte_range("int4", 255, 2) == (0, 2 * 136)


def test_a_piece_is_encoded_from_its_storage_dtype_bfloat16_bits_included():
    values = np.random.default_rng(1).standard_normal(600).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 by truncation: exact below
    as_float = (bits.astype(np.uint32) << 16).view(np.float32)
    assert quant.encode_piece(bits, "bfloat16", "int4", "k").tobytes() == reference(as_float, 4)
    half = values.astype(np.float16)
    assert quant.encode_piece(half, "float16", "int8", "k").tobytes() == reference(half.astype(np.float32), 8)
    assert quant.encode_piece(values.reshape(20, 30), "float32", "int8", "k").tobytes() == reference(values, 8)


def test_a_piece_with_a_non_finite_value_or_of_another_dtype_is_refused_naming_its_key():
    bad = np.ones(10, np.float32)
    bad[4] = np.nan
    with pytest.raises(UnsupportedError, match=r"opt\.w_moment1_0: 1 values are not finite.*without compress"):
        quant.encode_piece(bad, "float32", "int8", "opt.w_moment1_0")
    inf_bits = np.array([0x7F80], np.uint16)  # bfloat16 +inf
    with pytest.raises(UnsupportedError, match="not finite"):
        quant.encode_piece(inf_bits, "bfloat16", "int4", "k")
    with pytest.raises(UnsupportedError, match="k: dtype int64 cannot be stored as int8"):
        quant.encode_piece(np.arange(3), "int64", "int8", "k")


@pytest.mark.parametrize(
    "low, step", [(np.nan, 1.0), (0.0, np.nan), (np.inf, 0.0), (0.0, np.inf), (0.0, -0.5), (3e38, 3e37)]
)
def test_a_block_whose_minimum_or_step_cannot_have_been_written_is_refused(low, step):
    stored = quant.encode(np.linspace(0, 1, 300, dtype=np.float32), "int8")
    stored[264 : 264 + 8] = np.frombuffer(np.array([low, step], "<f4").tobytes(), np.uint8)
    assert np.isfinite(quant.decode(stored, "int8", 0, 256)).all()  # the first block is sound
    with pytest.raises(FormatError, match="int8 block"):
        quant.decode(stored, "int8", 250, 20)
