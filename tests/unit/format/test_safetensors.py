"""paddle_dcp.format.safetensors, the one strict reader and writer: hostile headers refused,
header length bounds, files of the ``safetensors`` package read and ours opened by it.
Files are written here from the specification or by the ``safetensors`` package, and read back
by it: neither side is the code under test."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paddle_dcp.format import safetensors
from paddle_dcp.errors import FormatError, StorageError


def raw_file(path, header, data: bytes = b"") -> str:
    """A file of the given header (a dict, or raw bytes) and data, from the specification."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + data)
    return str(path)


def entry(code, shape, begin, end):
    return {"dtype": code, "shape": shape, "data_offsets": [begin, end]}


HOSTILE = {
    "not json": (b"{nope", b""),
    "not an object": (b"[1, 2]", b""),
    "duplicate key": (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', bytes(2)),
    "unknown dtype": ({"a": entry("F33", [1], 0, 4)}, bytes(4)),
    "negative shape": ({"a": entry("F32", [-1], 0, 4)}, bytes(4)),
    "bool offsets": ({"a": entry("U8", [1], False, True)}, bytes(1)),
    "length differs from shape": ({"a": entry("F32", [2], 0, 4)}, bytes(4)),
    "past the end": ({"a": entry("F32", [2], 0, 8)}, bytes(4)),
    "overlap": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, bytes(8)),
    "hole": ({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
    "trailing bytes": ({"a": entry("F32", [1], 0, 4)}, bytes(8)),
    "extra field": ({"a": {**entry("F32", [1], 0, 4), "x": 1}}, bytes(4)),
    "metadata not str": ({"__metadata__": {"a": 1}}, b""),
    "huge shape": ({"a": entry("U8", [1 << 40, 1 << 40], 0, 1)}, bytes(1)),
    "huge entry beside a zero": ({"a": entry("U8", [0, 10**30], 0, 0)}, b""),
    "65 dims": ({"a": entry("U8", [1] * 65, 0, 1)}, bytes(1)),
    "deeply nested": (b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", b""),
    "empty tensor of a huge entry": ({"__metadata__": {"empty_tensors": json.dumps({"e": {"dtype": "F32", "shape": [0, 10**30]}})}}, b""),
    "empty tensor of a list dtype": ({"__metadata__": {"empty_tensors": json.dumps({"e": {"dtype": ["F32"], "shape": [0]}})}}, b""),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_one_reader_refuses_hostile_headers(tmp_path, name):
    header, data = HOSTILE[name]
    path = raw_file(tmp_path / "x.safetensors", header, data)
    for read in (safetensors.read_header, safetensors.read_arrays):
        with pytest.raises(FormatError, match="x.safetensors"):
            read(path)


def test_header_length_bounds(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", safetensors.MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(FormatError, match="header of"):
        safetensors.read_header(str(path))
    path.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(FormatError, match="truncated"):
        safetensors.read_header(str(path))


def test_reader_takes_what_the_safetensors_package_writes(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64), "c": np.ones((), np.float16)}
    save_file(arrays, str(tmp_path / "m.safetensors"))
    got = safetensors.read_arrays(str(tmp_path / "m.safetensors"))
    assert sorted(got) == ["a", "b", "c"]
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v)
    codes = {k: e.code for k, e in safetensors.read_header(str(tmp_path / "m.safetensors")).entries.items()}
    assert codes == {"a": "F32", "b": "I64", "c": "F16"}


def test_writer_output_opens_in_the_safetensors_package(tmp_path):
    a, b = np.arange(3, dtype=np.int32), np.arange(8, dtype=np.float64).reshape(2, 4)
    header = safetensors.encode_header([("a", "I32", a.shape, a.nbytes), ("b", "F64", b.shape, b.nbytes)], {"k": "v"}, align=64)
    assert len(header) % 64 == 0
    (tmp_path / "w.safetensors").write_bytes(header + a.tobytes() + b.tobytes())
    got = load_file(str(tmp_path / "w.safetensors"))
    assert np.array_equal(got["a"], a) and np.array_equal(got["b"], b)


def test_a_fifo_in_place_of_a_safetensors_file_is_refused_at_once(tmp_path):
    """The command line's reader (import-paddle, consolidate) opens without waiting for a
    writer and reads regular files only: a FIFO is a StorageError naming it, not a hang."""
    import threading

    fifo = tmp_path / "0_0.safetensors"
    os.mkfifo(fifo)
    outcome = []

    def read():
        for fn in (safetensors.read_header, safetensors.read_arrays):
            try:
                fn(str(fifo))
            except StorageError as exc:
                outcome.append(str(exc))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO blocked"
    assert len(outcome) == 2 and all("not a regular file" in m and str(fifo) in m for m in outcome), outcome
