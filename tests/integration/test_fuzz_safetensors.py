"""Fuzz (issue 38, point 7): a Hugging Face directory (two safetensors shards and their index
``model.safetensors.index.json``, or one ``model.safetensors``), written by the ``safetensors``
package, its headers and index mutated, then loaded by ``paddle_dcp.load_state_dict(...,
safetensors=True)`` in one process. Every load either raises a ``paddle_dcp.DcpError`` and
leaves the state dict as it was (every byte of every target still the sentinel), or succeeds
with exactly what the mutated files hold, as this test reads them with ``json`` alone: a key
the headers list has the bytes of its ``data_offsets`` (and the target's dtype and shape), a
key they do not list is untouched. No other exception, no hang (fuzzcheck's watchdog), no
large allocation (tracemalloc's peak under 64 MiB for files of a few hundred bytes).

Mutations of a header, as JSON: a tensor's dtype (other codes, junk), shape (huge, negative,
10**30, nested lists, 65 dims, floats, zero), data_offsets (swapped, overlapping, past the
end, reversed, junk), __metadata__ (junk, non-str values, its "structure" and
"empty_tensors"), duplicate keys, keys dropped, added or renamed; as bytes: the length field,
non-UTF-8 bytes, deep nesting, the file cut or grown. Of the index: weight_map values naming
missing files, "../x", absolute paths, non-strings, huge names; keys dropped, added, duplicated;
the index no object, not UTF-8, nested deeply.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzzcheck
import paddle_dcp

from unit.format.hf_dirs import hf_directory

ARRAYS = {
    "embed.w": np.arange(48, dtype=np.float32).reshape(8, 6) * 0.25 - 3,
    "head.b": np.arange(5, dtype=np.int64) * 7 - 2,
    "norm": np.linspace(0, 1, 7).astype(np.float16),
}
CODES = {"float32": "F32", "int64": "I64", "float16": "F16"}
SHARDS = [["embed.w"], ["head.b", "norm"]]
INDEX = "model.safetensors.index.json"
SENTINEL = 9


def blank() -> dict:
    return {"embed": {"w": np.full((8, 6), SENTINEL, np.float32)}, "head.b": np.full(5, SENTINEL, np.int64),
            "norm": np.full(7, SENTINEL, np.float16)}  # fmt: skip


def target_of(sd: dict, key: str) -> np.ndarray:
    return sd["embed"]["w"] if key == "embed.w" else sd[key]


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """{"sharded": {file name: bytes}, "single": {...}}, each loaded once unmutated."""
    out = {}
    for kind, shards in (("sharded", SHARDS), ("single", None)):
        d = hf_directory(tmp_path_factory.mktemp("hf") / kind, ARRAYS, shards)
        sd = blank()
        paddle_dcp.load_state_dict(sd, str(d), safetensors=True)
        for key, want in ARRAYS.items():
            assert target_of(sd, key).tobytes() == want.tobytes()
        out[kind] = {p.name: p.read_bytes() for p in d.iterdir()}
    return out


# ------------------------------------------------------------------ mutations
junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=6),
    st.sampled_from([0, 1, -1, 2**31, 2**62, 2**63, 2**64, 10**30, [], {}, [0], [1, 2, 3], "F32", "x" * 300]),
    st.lists(st.integers(-3, 50), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
)
CODE_JUNK = ["F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL", "F8_E4M3",
             "F8_E5M2", "C64", "f32", "", "F32 "]
SHAPE_JUNK = [[], [0], [-1], [10**30], [2**62], [2**63 - 1], [2**64], [1] * 65, [1] * 64, [2**31, 2**31], [[8, 6]],
              [8.0, 6.0], ["8", 6], [True, 6], [2**40, 0], [0, 2**61, 2**61], [48], [6, 8], [4, 12], [1, 8, 6]]


def deep(n: int) -> str:
    return "[" * n + "]" * n


@st.composite
def header_edit(draw, doc: dict) -> tuple[dict, list]:
    """One edit of a header document (key order kept); returns (doc, duplicated members
    [(key, value, first)] to write twice)."""
    keys = [k for k in doc if k != "__metadata__"] or ["ghost"]
    key = draw(st.sampled_from(keys))
    entry = doc.get(key)
    how = draw(st.sampled_from(["dtype", "shape", "offsets", "offsets", "metadata", "duplicate", "drop", "add",
                                "rename", "entry_junk", "extra_field"]))
    if not isinstance(entry, dict) or not _offsets_ok(entry) or any(not _offsets_ok(doc.get(k)) for k in keys):
        how = "entry_junk"  # an earlier edit left no entry to edit field by field
    dups: list = []
    if how == "dtype":
        entry["dtype"] = draw(st.one_of(st.sampled_from(CODE_JUNK), junk))
    elif how == "shape":
        entry["shape"] = draw(st.one_of(st.sampled_from(SHAPE_JUNK), st.lists(st.integers(-2, 2**63), max_size=4), junk))
    elif how == "offsets":
        begin, end = entry["data_offsets"]
        other = doc[draw(st.sampled_from(keys))]["data_offsets"]
        entry["data_offsets"] = draw(st.sampled_from([
            [end, begin], [begin + 1, end + 1], [begin - 1, end - 1], [begin, end + 8], [begin, end - 1], list(other),
            [other[0], other[0] + end - begin], [0, end - begin], [begin, 2**64], [2**63, 2**63 + end - begin],
            [-8, end - begin - 8], [begin], [begin, end, end], [str(begin), end], [begin, float(end)], None,
        ]))  # fmt: skip
    elif how == "metadata":
        doc["__metadata__"] = draw(st.one_of(junk, st.sampled_from([
            {"format": "pt"}, {"format": 1}, {"structure": "{"}, {"structure": '{"d": []}'},
            {"structure": '{"d": [["embed.w", {"t": 0}]]}'}, {"structure": deep(5000)},
            {"empty_tensors": '{"z": {"dtype": "F32", "shape": [0]}}'}, {"empty_tensors": '{"z": {"dtype": "F32", "shape": [3]}}'},
            {"empty_tensors": json.dumps({key: {"dtype": "F32", "shape": [0, 4]}})}, {"empty_tensors": "[]"},
            {"empty_tensors": '{"z": {"dtype": "F32", "shape": [0], "x": 1}}'}, {"empty_tensors": deep(5000)},
        ])))  # fmt: skip
    elif how == "duplicate":
        dups.append((key, draw(st.sampled_from([entry, doc[draw(st.sampled_from(keys))], {"dtype": "F32"}])), draw(st.booleans())))
    elif how == "drop":
        del doc[key]
    elif how == "add":
        doc[draw(st.sampled_from(["ghost", "embed.w", "__metadata__x", "é", "a" * 300]))] = draw(st.sampled_from([
            {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, dict(entry), {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        ]))  # fmt: skip
    elif how == "rename":
        new = draw(st.sampled_from(["ghost", "__metadata__", "", "embed.w", "head.b", "norm", "embed", "embed.w.x", "\u0000"]))
        doc = {(new if k == key else k): v for k, v in doc.items()}
    elif how == "entry_junk":
        doc[key] = draw(junk)
    else:
        entry[draw(st.sampled_from(["offsets", "dtype ", "x"]))] = draw(junk)
    return doc, dups


def _offsets_ok(entry) -> bool:
    o = entry.get("data_offsets") if isinstance(entry, dict) else None
    return isinstance(o, list) and len(o) == 2 and all(type(x) is int for x in o)


def encode(doc: dict, dups: list) -> bytes:
    items = [json.dumps(k) + ":" + json.dumps(v) for k, v in doc.items()]
    for key, value, first in dups:
        extra = json.dumps(key) + ":" + json.dumps(value)
        items = [extra] + items if first else items + [extra]
    return ("{" + ",".join(items) + "}").encode()


@st.composite
def mutated_file(draw, data: bytes) -> bytes:
    """A safetensors file with a mutated header (or length field, or data section)."""
    (n,) = struct.unpack("<Q", data[:8])
    raw, body = data[8 : 8 + n], data[8 + n :]
    how = draw(st.sampled_from(["json"] * 6 + ["length", "bytes", "deep", "cut", "grow"]))
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if how == "json" and isinstance(doc, dict):
        dups: list = []
        for _ in range(draw(st.integers(1, 2))):
            doc, more = draw(header_edit(doc))
            dups += more
        raw = encode(doc, dups)
        return struct.pack("<Q", len(raw)) + raw + body
    if how == "length":
        k = draw(st.sampled_from([0, 1, 2, n - 1, n + 1, n + 8, len(data), 2**32, 100_000_001, 2**63, 2**64 - 1]))
        return struct.pack("<Q", max(0, min(k, 2**64 - 1))) + raw + body
    if how in ("bytes", "json"):
        at = draw(st.integers(0, len(raw)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80", b"\"", b"}", b"\\u", b"\n"]))
        raw = raw[:at] + bad + raw[at + draw(st.integers(0, 1)) :]
        return struct.pack("<Q", len(raw)) + raw + body
    if how == "deep":
        raw = draw(st.sampled_from([deep(100_000), '{"a":' * 50_000 + "1" + "}" * 50_000, "1" * 5000, "[]", "null"])).encode()
        return struct.pack("<Q", len(raw)) + raw + body
    if how == "cut":
        return data[: draw(st.integers(0, len(data) - 1))]
    return data + b"\x00" * draw(st.integers(1, 64))


@st.composite
def mutated_index(draw, raw: bytes) -> bytes:
    doc = json.loads(raw)
    wm = doc["weight_map"]
    how = draw(st.sampled_from(["value", "value", "drop", "add", "duplicate", "map", "text", "other", "other", "other"]))
    if how == "other":  # what a reader ignores: the other members, the map's order
        doc[draw(st.sampled_from(["metadata", "total_size", "weight_map_x", ""]))] = draw(junk)
        doc["weight_map"] = dict(sorted(wm.items(), reverse=draw(st.booleans())))
        return json.dumps(doc).encode()
    if how == "value":
        key = draw(st.sampled_from(sorted(wm)))
        wm[key] = draw(st.one_of(junk, st.sampled_from([
            "missing.safetensors", "../x", "../model-00001-of-00002.safetensors", "/etc/passwd", "/tmp/x.safetensors",
            "sub/model.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "x" * 100_000, ".", "..", "", "model.safetensors.index.json", "a\u0000b", "é.safetensors",
        ])))  # fmt: skip
        return json.dumps(doc).encode()
    if how == "drop":
        del wm[draw(st.sampled_from(sorted(wm)))]
        return json.dumps(doc).encode()
    if how == "add":
        wm[draw(st.sampled_from(["ghost", "embed.w.x", "", "__metadata__"]))] = draw(st.sampled_from(sorted(set(wm.values()))))
        return json.dumps(doc).encode()
    if how == "duplicate":
        key = draw(st.sampled_from(sorted(wm)))
        text = json.dumps(doc)
        return text.replace('"weight_map": {', '"weight_map": {' + json.dumps(key) + ": " + json.dumps(wm[key]) + ", ").encode()
    if how == "map":
        doc["weight_map"] = draw(junk)
        return json.dumps(doc).encode()
    return draw(st.sampled_from([b"\xff\xfe", b"[]", b"null", b"{", deep(100_000).encode(),
                                 b'{"weight_map": ' + deep(50_000).encode() + b"}", raw[: len(raw) // 2]]))


# ------------------------------------------------------------------ the oracle
def expected(files: dict[str, bytes]) -> dict[str, bytes | None]:
    """What a successful load must give each key, read from the files with ``json`` alone:
    the bytes at its data_offsets, or None (untouched) when no header lists it."""
    out: dict[str, bytes | None] = dict.fromkeys(ARRAYS)
    for name, data in files.items():
        if not name.endswith(".safetensors"):
            continue
        (n,) = struct.unpack("<Q", data[:8])
        doc = json.loads(data[8 : 8 + n])
        for key in ARRAYS:
            if key in doc:
                e = doc[key]
                assert e["dtype"] == CODES[str(ARRAYS[key].dtype)] and e["shape"] == list(ARRAYS[key].shape), (key, e)
                begin, end = e["data_offsets"]
                out[key] = data[8 + n + begin : 8 + n + end]
    return out


def check(sd: dict, files: dict[str, bytes], error) -> None:
    if error is not None:
        fresh = blank()
        for key in ARRAYS:
            assert target_of(sd, key).tobytes() == target_of(fresh, key).tobytes(), (key, error)
        return
    for key, want in expected(files).items():
        got = target_of(sd, key)
        if want is None:
            assert (got == SENTINEL).all(), key
        else:
            assert got.tobytes() == want, key


def load(path: Path, files: dict[str, bytes], outcomes: fuzzcheck.Outcomes) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    sd = blank()
    error = fuzzcheck.guarded(lambda: paddle_dcp.load_state_dict(sd, str(path), safetensors=True))
    outcomes.add(error)
    check(sd, files, error)


# no deadline: the watchdog (20 s) catches a hang, and a busy machine is no failure
FUZZ = settings(max_examples=fuzzcheck.examples(300), deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])  # fmt: skip


def test_mutated_safetensors_headers_load_exactly_or_raise_our_error(originals, tmp_path):
    outcomes = fuzzcheck.Outcomes()

    @FUZZ
    @given(data=st.data())
    def example(data):
        files = dict(originals[data.draw(st.sampled_from(["sharded", "single"]))])
        names = sorted(n for n in files if n.endswith(".safetensors"))
        for name in data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True)):
            files[name] = data.draw(mutated_file(files[name]))
        load(tmp_path / "hf", files, outcomes)

    example()
    outcomes.check_both(kinds=2)


def test_mutated_hf_indexes_load_exactly_or_raise_our_error(originals, tmp_path):
    outcomes = fuzzcheck.Outcomes()

    @FUZZ
    @given(data=st.data())
    def example(data):
        files = dict(originals["sharded"])
        files[INDEX] = data.draw(mutated_index(files[INDEX]))
        if data.draw(st.integers(0, 3)) == 0:  # and a header too
            name = data.draw(st.sampled_from(sorted(n for n in files if n.endswith(".safetensors"))))
            files[name] = data.draw(mutated_file(files[name]))
        load(tmp_path / "hf", files, outcomes)

    example()
    outcomes.check_both(kinds=2)
