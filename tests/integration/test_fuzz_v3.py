"""Fuzz (issue 38, point 7): the version 3 metadata of a real checkpoint (grid and explicit
layouts, 36 pieces of one tensor in two groups, int8 and int4 quantized tensors, a derived
master weight and its float16 source, a scalar, plain values), cut into its fields by an
independent codec (tests/metafields.py, written from docs/format.md), one or two fields edited
(types, numbers, counts, boxes and cuts, file names, dtypes, encodings, derived sources, keys,
digests), written back with every length, offset and digest made to match (or one left stale),
then loaded by ``paddle_dcp.load_state_dict`` in one process, the metadata read whole or (as a
large file is) in parts.

Every load either raises a ``paddle_dcp.DcpError`` and leaves the state dict as it was (every
byte of every target the sentinel, the plain values as they were), or succeeds with exactly
the saved values: numpy's arrays, dequantized by the reference quantizer of tests/unit/helpers
(written from the format's definition), the master weight its source cast; a key the mutated
file no longer lists (as tests/metadoc.py reads it) untouched; plain values the mutated head's
outline's. No other exception, no hang (fuzzcheck's watchdog), no large allocation
(tracemalloc's peak under 64 MiB).

A second fuzz edits the document (tests/metadoc.py) and writes it with metadoc's own writer:
every tensor's pieces as boxes, all digests valid, values the library's writer never makes
(pieces that overlap, leave gaps, lie outside their file; checksums, encodings, sources).
"""
from __future__ import annotations

import json
import os

import metadoc
import metafields
import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import fuzzcheck
import paddle_dcp
from paddle_dcp.core import metafile_layout

from unit.helpers import expected_tensor, save_checkpoint, saved_boxes

MESH = (36,)
rng = np.random.default_rng(38)
ARRAYS = {
    "w": np.arange(40, dtype=np.float32).reshape(8, 5) * 1.5 - 7,
    "b": np.arange(600, dtype=np.int64) * 3 - 1000,  # 36 pieces: two groups
    "q": (rng.standard_normal((6, 300)) * 10.0 ** rng.uniform(-2, 2, (6, 1))).astype(np.float32),
    "q4": rng.standard_normal((3, 70)).astype(np.float16),
    "p": (rng.standard_normal((4, 10)) * 3).astype(np.float16),
    "p.w_0": np.zeros((4, 10), np.float32),  # derived: not what a load gives
    "s": np.array(2.5),
}
DTYPES = {"w": "float32", "b": "int64", "q": "float32", "q4": "float16", "p": "float16", "p.w_0": "float32", "s": "float64"}
PLACEMENTS = {"w": (0,), "b": (0,), "q": (None,), "q4": (1,), "p": (0,), "p.w_0": (None,), "s": (None,)}
COMPRESS = {paddle_dcp.MASTER_WEIGHTS: "derived", r"^model\.q$": "int8", r"^model\.q4$": "int4"}
VALUES = {"step": 3, "sched": {"lr": [0.5, float("inf")], "name": "cos"}}
SENTINEL = -7

# what a load gives each key (the oracle): quantized tensors through the reference quantizer
ORACLE = {
    "model.w": ARRAYS["w"], "model.b": ARRAYS["b"], "model.p": ARRAYS["p"], "model.s": ARRAYS["s"],
    "model.p.w_0": ARRAYS["p"].astype(np.float32),
    "model.q": expected_tensor(ARRAYS["q"], "float32", "int8", saved_boxes(ARRAYS["q"].shape, MESH, PLACEMENTS["q"])),
    "model.q4": expected_tensor(ARRAYS["q4"], "float16", "int4", saved_boxes(ARRAYS["q4"].shape, MESH, PLACEMENTS["q4"])),
}  # fmt: skip


def blank() -> dict:
    model = {k: np.full(a.shape, SENTINEL, a.dtype) for k, a in ARRAYS.items()}
    return {"model": model, "step": 0, "sched": {"lr": [0.0, 0.0], "name": ""}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, {"grid": the library's version 3 file, "explicit": metadoc's}), each loaded
    once unmutated, whole and in parts."""
    path = str(tmp_path_factory.mktemp("fuzz3") / "ck")
    os.makedirs(path)
    saved = save_checkpoint(path, ARRAYS, DTYPES, MESH, PLACEMENTS, block_bytes=64, values=VALUES, compress=COMPRESS)
    from paddle_dcp.core import metafile

    grid = metafile.encode(saved.meta)
    bases = {"grid": grid, "explicit": metadoc.write(metadoc.read(grid))}
    assert metafile_layout.is_packed(grid) and metafile_layout.is_packed(bases["explicit"])
    f = metafields.split(grid)
    assert len(f.groups) >= 3 and set(f.parts[0].cols[3]) == {0, 1, 2, 3} and 0 in f.parts[0].cols[5]
    assert metafields.join(metafields.split(grid)) == grid, "the independent codec writes the library's bytes"
    for base in bases.values():
        for in_parts in (False, True):
            sd = blank()
            load(path, base, in_parts, sd)
            check_success(sd, base, in_parts)
    return path, bases


def load(path: str, data: bytes, in_parts: bool, sd: dict) -> None:
    """Load checkpoint 0 of ``path``, its metadata file ``data``, into ``sd`` (``in_parts``:
    read in parts, as a file of at least PARTS_FROM bytes is)."""
    with open(os.path.join(path, "0.metadata"), "wb") as f:
        f.write(data)
    old = metafile_layout.PARTS_FROM
    metafile_layout.PARTS_FROM = 0 if in_parts else old
    try:
        paddle_dcp.load_state_dict(sd, path, unique_id=0)
    finally:
        metafile_layout.PARTS_FROM = old


# ------------------------------------------------------------------ the oracle
def check_untouched(sd: dict, error) -> None:
    fresh = blank()
    for k in ARRAYS:
        assert sd["model"][k].tobytes() == fresh["model"][k].tobytes(), (k, error)
    assert {k: v for k, v in sd.items() if k != "model"} == {k: v for k, v in fresh.items() if k != "model"}, error


def check_success(sd: dict, data: bytes, in_parts: bool) -> None:
    """The saved values of the keys the file lists (its tensor parts, as metafields reads them:
    a read in parts never reads the structure section), the others untouched; the plain values
    those of the structure filled from the outline (as metadoc reads it: a placeholder without
    a value dropped, in a list None), or of a read in parts the outline's (the structure
    section unread)."""
    listed = {k.decode() for p in metafields.split(data, groups=False).parts for k in p.keys}
    for key, want in ORACLE.items():
        got = sd["model"][key[len("model.") :]]
        if key in listed:
            assert got.dtype == want.dtype and got.tobytes() == np.asarray(want).tobytes(), key
        else:
            assert (got == SENTINEL).all(), key
    tree = json.loads(data[: data.index(b"\n")])["outline"] if in_parts else metadoc.read(data)["structure"]
    want_plain = plain_expected({k: v for k, v in blank().items() if k != "model"}, tree)
    for key, value in want_plain.items():
        assert same(sd[key], value), (key, sd[key], value)


def _plain(node: dict):
    (tag, v), = node.items()
    if tag == "v":
        return v
    if tag == "f":
        return float(v)
    if tag == "d":
        return {k: _plain(c) for k, c in v}
    if tag == "l":
        return [_plain(c) for c in v]
    if tag == "u":
        return tuple(_plain(c) for c in v)
    raise AssertionError(f"not a plain value: {node}")


def _holds_tensors(node: dict) -> bool:
    (tag, v), = node.items()
    if tag == "t":
        return True
    if tag == "d":
        return any(_holds_tensors(c) for _, c in v)
    return tag in ("l", "u") and any(_holds_tensors(c) for c in v)


def plain_expected(target: dict, outline: dict) -> dict:
    """The target's plain values after a load from ``outline``: a path the outline holds with
    no tensor below it is replaced whole by the outline's value; a dict the outline holds with
    tensors below is visited; other paths keep their value."""
    (tag, items), = outline.items()
    out = dict(target)
    if tag != "d":
        return out
    for k, child in items:
        if k not in target:
            continue
        if not _holds_tensors(child):
            out[k] = _plain(child)
        elif isinstance(target[k], dict):
            out[k] = plain_expected(target[k], child)
    return out


def same(a, b) -> bool:
    """Equal values of the same types all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def run(path: str, data: bytes, in_parts: bool, outcomes: fuzzcheck.Outcomes) -> None:
    sd = blank()
    error = fuzzcheck.guarded(lambda: load(path, data, in_parts, sd))
    outcomes.add(error)
    if error is not None:
        check_untouched(sd, error)
    else:
        check_success(sd, data, in_parts)


# ------------------------------------------------------------------ field edits
BIG = [0, 1, -1, 2, 7, 8, 32, 33, 63, 64, 65, 255, 256, 2**31, 2**32, 2**62, 2**62 + 1, 2**63 - 1, -(2**63), -(2**62)]


def numbers(old: int | None = None):
    near = [] if old is None else [old + 1, old - 1, old * 2, -old, old + 64, old - 64, old + 2**32]
    return st.one_of(st.sampled_from(BIG + near), st.integers(-300, 300)).map(lambda v: max(-(2**63), min(v, 2**63 - 1)))


junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6), st.sampled_from([0, -1, 1, 2**63, 2**64, 10**30, [], {}, [0, 0], [0, 0, 0, "x"], "x" * 300]),
    st.lists(st.integers(-3, 70), max_size=4), st.dictionaries(st.sampled_from(["d", "l", "u", "t", "v", "f", "x"]), st.integers(0, 2), max_size=2),
)  # fmt: skip
NAMES = [b"", b"../x", b"/etc/passwd", b"a/b", b".", b"..", b"0_0.distcp", b"1_0.distcp", b"\xff\xfe", b"x" * 300,
         b"0.metadata", b"\xc3", "é.distcp".encode(), b"a\x00b", b"35_0.distcp"]
KEYS = [b"", b"model.w", b"model.b", b"model.p", b"model.p.w_0", b"model.q", b"model.q4", b"model.s", b"model.zz",
        b"model", b"\xff", b"model.w\x00", b"a", b"zzz", "model.é".encode(), b"model.p.w_0.x"]


def _pick(draw, seq):
    return draw(st.integers(0, len(seq) - 1)) if seq else None


@st.composite
def field_edit(draw, f: metafields.Fields) -> None:
    """One edit of ``f`` in place."""
    what = draw(st.sampled_from(["col", "col", "col", "col", "shape", "cuts", "key", "source", "source", "part_count",
                                 "file", "file", "structure", "index", "record", "record", "box", "box", "sum", "head",
                                 "head", "outline", "stale", "tail"]))  # fmt: skip
    p = f.parts[draw(st.integers(0, len(f.parts) - 1))]
    if what == "col":
        c = draw(st.integers(0, 10))
        t = _pick(draw, p.cols[c])
        if c in (2, 3, 5) and draw(st.booleans()):  # codes: the other meaningful ones first
            p.cols[c][t] = draw(st.integers(0, {2: 12, 3: 4, 5: 2}[c]))
        else:
            p.cols[c][t] = draw(numbers(p.cols[c][t]))
    elif what == "shape" and p.shapes:
        i = _pick(draw, p.shapes)
        p.shapes[i] = draw(numbers(p.shapes[i]))
    elif what == "cuts":
        seq = p.ncuts if draw(st.booleans()) or not p.gaps else p.gaps
        how = draw(st.sampled_from(["set", "insert", "drop"]))
        if how == "set" and seq:
            i = _pick(draw, seq)
            seq[i] = draw(numbers(seq[i]))
        elif how == "insert":
            seq.insert(draw(st.integers(0, len(seq))), draw(numbers()))
        elif seq:
            del seq[_pick(draw, seq)]
    elif what in ("key", "source"):
        seq, col = (p.keys, 0) if what == "key" else (p.sources, 1)
        t = _pick(draw, seq)
        seq[t] = draw(st.sampled_from(KEYS))
        if draw(st.integers(0, 4)):  # its length column follows, mostly
            p.cols[col][t] = len(seq[t])
        if what == "source" and seq[t] and draw(st.booleans()):
            p.cols[3][t] = 3  # made derived
    elif what == "part_count":
        name = draw(st.sampled_from(["n", "ncuts", "gaps"]))
        real = {"n": len(p.cols[0]), "ncuts": len(p.ncuts), "gaps": len(p.gaps)}[name]
        p.counts[name] = draw(st.sampled_from([real + 1, real - 1, 0, 2**32, 2**63, 2**64 - 1]).map(lambda v: v % 2**64))
    elif what == "file":
        how = draw(st.sampled_from(["size", "name", "count", "drop"]))
        i = _pick(draw, f.sizes)
        if how == "size":
            f.sizes[i] = draw(numbers(f.sizes[i]))
        elif how == "name":
            f.names[i] = draw(st.sampled_from(NAMES + [f.names[(i + 1) % len(f.names)]]))
        elif how == "count":
            f.counts["files"] = draw(st.sampled_from([len(f.names) + 1, len(f.names) - 1, 0, 2**40]))
        else:
            del f.sizes[i], f.names[i]
    elif what == "structure":
        text = f.structure.decode("utf-8", "replace")
        f.structure = draw(st.sampled_from([
            b"", b"{", b"\xff", b"[]", b'{"d": []}', b"[" * 100_000 + b"]" * 100_000,
            text.replace('{"t":0}', '{"x":0}', 1).encode(), text.replace('{"x":0}', '{"t":0}', 1).encode(),
            text.replace('["w",{"t":0}]', '["w",{"t":0}],["w",{"t":0}]', 1).encode(),
            text.replace('"w"', '"zz"', 1).encode(), text.replace('"d"', '"l"', 1).encode(),
            text.replace('{"x":0}', '{"v":1}', 1).encode(),
        ]))  # fmt: skip
    elif what == "index":
        how = draw(st.sampled_from(["col", "digest", "key", "count"]))
        if how == "col":
            c = draw(st.integers(0, 4))
            i = _pick(draw, f.index_cols[c])
            f.index_cols[c][i] = draw(numbers(f.index_cols[c][i]))
            f.fixed.add(("index", c, i))
        elif how == "digest":
            i = _pick(draw, f.index_digests)
            f.index_digests[i] ^= 1 << draw(st.integers(0, 63))
            f.stale.add(("part", i))
        elif how == "key":
            i = _pick(draw, f.first_keys)
            f.first_keys[i] = draw(st.sampled_from(KEYS))
            if draw(st.booleans()):
                f.index_cols[0][i] = len(f.first_keys[i])
        else:
            f.counts["index"] = draw(st.sampled_from([len(f.first_keys) + 1, 0, 2**40]))
    elif what == "record" and f.records:
        w = f.record_width
        r = draw(st.integers(0, len(f.records) // w - 1))
        b = bytearray(f.records)
        b[r * w : (r + 1) * w] = draw(st.binary(min_size=w, max_size=w))
        f.records = bytes(b)
    elif what == "box" and f.boxes:
        vals = np.frombuffer(f.boxes, "<i8").copy()
        i = draw(st.integers(0, len(vals) - 1))
        vals[i] = draw(numbers(int(vals[i])))
        f.boxes = vals.astype("<i8").tobytes()
    elif what == "sum" and f.sums:
        vals = np.frombuffer(f.sums, "<u8").copy()
        vals[draw(st.integers(0, len(vals) - 1))] ^= np.uint64(1 << draw(st.integers(0, 63)))
        f.sums = vals.astype("<u8").tobytes()
    elif what == "head":
        head_edit(draw, f)
    elif what == "outline":
        outline_edit(draw, f.head)
    elif what == "stale":
        f.stale.add(draw(st.sampled_from(["head", "files", "structure", "index", "groups", ("part", 0)])))
        if "groups" in f.stale:  # and a group's bytes changed under it
            f.sums = bytes([f.sums[0] ^ 1]) + f.sums[1:]
        elif "head" in f.stale:
            f.head["unique_id"] = 0 if f.head["unique_id"] else 1
        elif f.stale & {"files", "structure", "index"}:
            f.names[0] = b"1_0.distcp" if f.names[0] != b"1_0.distcp" else b"0_0.distcp"
            f.structure = f.structure.replace(b'"w"', b'"zz"', 1)
            f.first_keys[0] = f.first_keys[0] + b"\x00"
        else:
            f.parts[0].cols[2][0] ^= 1
    else:
        f.tail = draw(st.sampled_from([b"\x00", b"\n", b"x" * 64]))


HEAD_PATHS = [("unique_id",), ("world_size",), ("created_by",), ("checksum", "algorithm"), ("checksum", "block_bytes"),
              ("counts", "tensors"), ("counts", "pieces"), ("counts", "blocks"), ("counts", "files"), ("counts", "parts"),
              ("widths", "file"), ("widths", "offset"), ("replicas",), ("holders",), ("outline",), ("counts",),
              ("sections", "files"), ("sections", "index"), ("sections", "structure"), ("areas", "parts"),
              ("areas", "records"), ("areas", "boxes"), ("areas", "sums"), ("format_version",), ("extra",)]  # fmt: skip


def head_edit(draw, f: metafields.Fields) -> None:
    path = draw(st.sampled_from(HEAD_PATHS))
    parent = f.head
    for k in path[:-1]:
        parent = parent.get(k) if isinstance(parent, dict) else None
    if not isinstance(parent, dict):
        return  # an earlier edit took it away
    old = parent.get(path[-1])
    if path[0] in ("sections", "areas") and isinstance(old, list) and old:
        f.fixed.add(path)
        value = list(old)
        i = draw(st.integers(0, len(value) - 1))
        value[i] = draw(st.one_of(numbers(value[i]) if type(value[i]) is int else st.sampled_from(["0" * 16, "F" * 16, "x"]), junk))
        if draw(st.integers(0, 5)) == 0:
            value = draw(junk)
        parent[path[-1]] = value
    elif type(old) is int and draw(st.booleans()):
        parent[path[-1]] = draw(numbers(old))
    elif draw(st.integers(0, 5)) == 0 and path[-1] != "format_version":
        parent.pop(path[-1], None)
    else:
        parent[path[-1]] = draw(junk)


def outline_edit(draw, head: dict) -> None:
    """An edit of the outline's plain values or shape (a path taken in it)."""
    node = head.get("outline")
    parent, key = head, "outline"
    while isinstance(node, dict) and len(node) == 1:
        (tag, body), = node.items()
        if tag not in ("d", "l", "u") or not isinstance(body, list) or not body or draw(st.integers(0, 2)) == 0:
            break
        i = draw(st.integers(0, len(body) - 1))
        if tag == "d" and not (isinstance(body[i], list) and len(body[i]) == 2):
            break
        parent, key = (body[i], 1) if tag == "d" else (body, i)
        node = parent[key]
    parent[key] = draw(st.one_of(junk.map(lambda v: {"v": v}), st.sampled_from([
        {"f": "nan"}, {"f": "-inf"}, {"f": "x"}, {"x": 0}, {"t": 0}, {"v": 1, "f": "inf"}, {}, {"d": [["model", {"t": 0}]]},
        {"l": []}, {"u": [{"v": 1}]}, {"d": [["a", {"v": 1}], ["a", {"v": 2}]]}, {"v": [1, 2]}, {"v": {"a": 1}},
    ]), junk))  # fmt: skip


@st.composite
def field_mutated(draw, base: bytes) -> bytes:
    f = metafields.split(base)
    for _ in range(draw(st.integers(1, 2))):
        draw(field_edit(f))
    return metafields.join(f, base)


# no deadline: the watchdog (20 s) catches a hang, and a busy machine is no failure
FUZZ = settings(max_examples=fuzzcheck.examples(250), deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])  # fmt: skip


@pytest.mark.parametrize("in_parts", [False, True], ids=["whole", "in_parts"])
def test_edited_fields_of_v3_metadata_load_exactly_or_raise_our_error(checkpoint, in_parts):
    path, bases = checkpoint
    outcomes = fuzzcheck.Outcomes()

    @FUZZ
    @given(data=st.data())
    def example(data):
        base = bases[data.draw(st.sampled_from(["grid", "grid", "explicit"]))]
        run(path, data.draw(field_mutated(base)), in_parts, outcomes)

    example()
    outcomes.check_both(kinds=2)


# ------------------------------------------------------------------ document edits, metadoc's writer
@st.composite
def doc_mutated(draw, base: bytes) -> bytes:
    doc = metadoc.read(base)
    for _ in range(draw(st.integers(1, 2))):
        tensors = doc["tensors"]
        key = draw(st.sampled_from(sorted(tensors)))
        t = tensors[key]
        how = draw(st.sampled_from(["number", "number", "number", "dtype", "encoding", "source", "checksum", "drop_piece",
                                    "dup_piece", "drop_tensor", "rename", "file", "shape"]))  # fmt: skip
        nd = len(t["shape"])
        if how == "number":
            col = draw(st.sampled_from(["offsets", "shapes", "file", "byte_offset"]))
            if t[col]:
                i = _pick(draw, t[col])
                lo = 0 if col in ("file", "byte_offset") else -(2**63)
                t[col][i] = max(lo, draw(numbers(t[col][i])))
        elif how == "dtype":
            t["dtype"] = draw(st.sampled_from(metadoc.DTYPES))
        elif how == "encoding":
            enc = draw(st.sampled_from(metadoc.ENCODINGS))
            t.pop("encoding", None)
            if enc is not None:
                t["encoding"] = enc
        elif how == "source":
            t["source"] = draw(st.sampled_from(sorted(tensors) + ["model.zz", key]))
            if draw(st.booleans()):
                t["encoding"] = "derived"
        elif how == "checksum" and t["checksums"]:
            i = _pick(draw, t["checksums"])
            t["checksums"][i] = draw(st.sampled_from(["0" * 16, "f" * 16, t["checksums"][i - 1]]))
        elif how in ("drop_piece", "dup_piece") and t["count"]:
            i = _pick(draw, t["file"])
            cols = [("offsets", nd), ("shapes", nd), ("file", 1), ("byte_offset", 1)]
            if how == "drop_piece":
                for c, k in cols:
                    del t[c][i * k : (i + 1) * k]
                t["count"] -= 1
            else:
                for c, k in cols:
                    t[c][i * k : i * k] = t[c][i * k : (i + 1) * k]
                t["count"] += 1
                t["checksums"] += t["checksums"][:1]
        elif how == "drop_tensor":
            del tensors[key]
        elif how == "rename":
            tensors[draw(st.sampled_from(["model.zz", "model.w", "model.a"]))] = tensors.pop(key)
        elif how == "file":
            i = _pick(draw, doc["files"])
            doc["files"][i]["bytes"] = max(0, draw(numbers(doc["files"][i]["bytes"])))
        else:
            t["shape"] = [max(0, draw(numbers(s))) for s in t["shape"]]
    try:
        return metadoc.write(doc)
    except (OverflowError, ValueError, IndexError, KeyError, TypeError):
        reject()  # a document metadoc's writer cannot write (a negative offset, a dtype it lacks)


@pytest.mark.parametrize("in_parts", [False, True], ids=["whole", "in_parts"])
def test_edited_documents_written_anew_load_exactly_or_raise_our_error(checkpoint, in_parts):
    path, bases = checkpoint
    outcomes = fuzzcheck.Outcomes()

    @settings(FUZZ, max_examples=fuzzcheck.examples(150))
    @given(data=st.data())
    def example(data):
        run(path, data.draw(doc_mutated(bases["grid"])), in_parts, outcomes)

    example()
    outcomes.check_both(kinds=2)
