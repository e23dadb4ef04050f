"""paddle_dcp.core.metadata_parse: the metadata's JSON read back (round trips, entries parsed
lazily one by one or many at once) and validation that refuses every malformed document with a
FormatError saying what is wrong; copies of save_replicas accepted only where the flag says so."""
import base64
import copy
import json
import math
import re
import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.errors import FormatError
from paddle_dcp.core.metadata import Metadata, with_digest
from paddle_dcp.core.metadata_parse import parse_metadata

from ..helpers import STORAGE, fast, get, nodes
from .hand_metadata import BLOCK, doc_of, hand_meta, unpack
from .replicas import meta_of, plan_of, replicated


def parse(doc) -> Metadata:
    """Parse a document; a dict is written with a matching digest (as if its edit were how it
    was saved), so each test reaches the check it is about; raw text is parsed as is."""
    if isinstance(doc, dict):
        body = json.dumps({k: v for k, v in doc.items() if k != "digest"}, separators=(",", ":"))
        data = with_digest(body.encode())
    else:
        data = doc
    return parse_metadata(data, source="ck/7.metadata")


def refused(doc, *words):
    with pytest.raises(FormatError) as info:
        parse(doc)
    message = str(info.value)
    for w in words:
        assert w in message, (w, message)
    return message


def assert_same(a: Metadata, b: Metadata):
    for field in ("unique_id", "world_size", "files", "structure", "block_bytes", "checksum_algorithm",
                  "created_by", "format_version"):
        assert getattr(a, field) == getattr(b, field), field
    assert list(a.tensors) == list(b.tensors)
    for key, ta in a.tensors.items():
        tb = b.tensors[key]
        assert (ta.key, ta.dtype, ta.shape, ta.block_bytes) == (tb.key, tb.dtype, tb.shape, tb.block_bytes)
        for col in ("offsets", "shapes", "files", "byte_offsets", "checksums"):
            x, y = getattr(ta.pieces, col), getattr(tb.pieces, col)
            assert x.shape == y.shape and x.dtype == y.dtype and (x == y).all(), (key, col)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("rows", [2, 64, 65, 100])
def test_json_round_trip_is_equal_field_by_field(rows):
    meta = hand_meta(rows)
    back = parse(meta.to_json())
    assert_same(meta, back)
    assert_same(back, parse(back.to_json()))
    assert back.values()["step"] == 3 and math.isnan(back.values()["lr.1"])


def test_parsed_columns_are_read_only():
    p = parse(hand_meta(70).to_json()).tensors["m.w"].pieces
    with pytest.raises(ValueError):
        p.offsets[0, 0] = 5


# ------------------------------------------------------------------ refusals
@pytest.fixture
def doc():
    return doc_of(hand_meta(100))


@pytest.fixture
def small():
    return doc_of(hand_meta(2))


def test_refuses_other_format_versions_naming_found_and_supported(small):
    small["format_version"] = 4
    message = refused(small, "format_version", "reads versions 1, 2, 3")
    assert re.search(r"format_version\W+4\b", message), message
    small["format_version"] = 0
    refused(small, "format_version", "0", "reads versions 1, 2, 3")
    small["format_version"] = 3  # version 3 is never one JSON document
    refused(small, "format_version 3", "head line")
    del small["format_version"]
    refused(small, "format_version")


@pytest.mark.parametrize(
    "version", [True, 1.0, "1", [1], None]
)
def test_refuses_a_format_version_that_is_not_the_integer_1(small, version):
    small["format_version"] = version
    refused(small, "format_version")


@pytest.mark.parametrize("data", [b"{not json", b"", b"\xff\xfe\x00", b"[1, 2", b'{"a": 1} x'])
def test_refuses_what_is_not_json(data):
    with pytest.raises(FormatError, match="not valid JSON"):
        parse(data)


@pytest.mark.parametrize("data", [b"[]", b"3", b'"paddle_dcp"', b"null"])
def test_refuses_json_that_is_not_an_object(data):
    with pytest.raises(FormatError, match="JSON object"):
        parse(data)


def test_refuses_another_format(small):
    small["format"] = "torch_dcp"
    refused(small, "not a paddle_dcp metadata file", "torch_dcp")


def test_refuses_an_unknown_dtype(small):
    small["tensors"]["m.b"]["dtype"] = "float8"
    refused(small, "m.b", "unknown dtype", "float8")


@pytest.mark.parametrize("entry", [-1, 2**63, 1.5, "5", None, True])
def test_refuses_a_shape_entry_that_is_not_a_small_non_negative_int(small, entry):
    small["tensors"]["m.b"]["shape"] = [entry]
    refused(small, "m.b", "shape")


def test_refuses_a_shape_whose_product_overflows(small):
    small["tensors"]["m.b"]["shape"] = [2**31, 2**31, 5]
    refused(small, "m.b", "too many elements")
    small["tensors"]["m.b"]["shape"] = [1] * 65
    refused(small, "m.b", "at most 64")


@pytest.mark.parametrize("name", ["../0_7.distcp", "/abs/0_7.distcp", "", "a/b", "..", ".", "x\x00y", "a\\b", "é", "a\nb", "0_0.distcp\n"])
def test_refuses_file_names_that_leave_the_directory_or_are_not_plain(small, name):
    small["files"][0]["name"] = name
    refused(small, "not a plain file name")


def test_refuses_a_file_listed_twice(small):
    small["files"][1]["name"] = small["files"][0]["name"]
    refused(small, "listed twice")


def test_refuses_a_piece_reading_past_the_end_of_its_file(small):
    small["files"][1]["bytes"] -= 1  # m.s is the last piece of file 1
    refused(small, "m.s", "past the end of its file")
    small["files"][1]["bytes"] += 1
    small["tensors"]["m.b"]["byte_offset"] = [0, -64]
    refused(small, "m.b")


def test_refuses_a_file_index_out_of_range(small):
    small["tensors"]["m.b"]["file"] = [1, 2]
    refused(small, "m.b", "file index outside")
    small["tensors"]["m.b"]["file"] = [-1, 1]
    refused(small, "m.b", "file index outside")


def test_refuses_a_wrong_number_of_checksums(small, doc):
    small["tensors"]["m.b"]["checksums"].pop()
    refused(small, "m.b", "checksums", "expected 2")
    small["tensors"]["m.b"]["checksums"] = ["00" * 8] * 3
    refused(small, "m.b", "checksums")
    small["tensors"]["m.b"]["checksums"] = ["XYZ", "00" * 8]
    refused(small, "m.b", "hex digits")
    # a packed checksum column one entry short
    sums = unpack(doc["tensors"]["m.w"]["checksums"], "<u8")[:-1]
    doc["tensors"]["m.w"]["checksums"] = "z:" + base64.b64encode(zlib.compress(sums.tobytes())).decode()
    refused(doc, "m.w", "checksums")


def test_refuses_structure_and_tensors_that_disagree(small):
    extra = copy.deepcopy(small)
    extra["structure"]["d"].append(["ghost", {"t": 0}])
    refused(extra, "disagree", "ghost")
    missing = copy.deepcopy(small)
    del missing["tensors"]["m.b"]
    refused(missing, "disagree", "m.b")
    value = copy.deepcopy(small)
    value["structure"]["d"][0][1]["d"][1][1] = {"v": 1}  # m.b is no longer a tensor leaf
    refused(value, "disagree", "m.b")


def test_refuses_a_placeholder_or_malformed_structure(small):
    s = copy.deepcopy(small)
    s["structure"]["d"][1][1] = {"x": 0}
    refused(s, "step", "no value")
    for bad in ({"q": 1}, {"d": "x"}, {"l": 1}, {"v": [1]}, {"f": "NaN"}, {"d": [["a"]]}, [], {"v": 1, "t": 0}):
        s = copy.deepcopy(small)
        s["structure"]["d"][1][1] = bad
        refused(s)


def test_refuses_pieces_that_do_not_tile(small):
    small["tensors"]["m.b"]["shapes"] = [3, 1]  # a gap at element 4
    refused(small, "m.b", "gap")
    small["tensors"]["m.b"]["shapes"] = [4, 2]  # overlaps, and runs out of the tensor
    refused(small, "m.b")


def test_refuses_a_packed_column_that_lies_about_its_count(doc):
    w = doc["tensors"]["m.w"]
    for count in (99, 101):
        d = copy.deepcopy(doc)
        d["tensors"]["m.w"]["count"] = count
        refused(d, "m.w", "entries")
    d = copy.deepcopy(doc)
    d["tensors"]["m.w"]["count"] = 1 << 40  # a count no small metadata file can describe
    refused(d, "m.w", "pieces cannot be described")
    for column, words in [
        ("z:!!!not base64", ["not base64"]),
        ("z:" + base64.b64encode(b"not zlib at all").decode(), ["does not decompress"]),
        ("z:" + base64.b64encode(zlib.compress(b"\0" * 8 * 199)).decode(), ["199 entries"]),
        ("z:" + base64.b64encode(zlib.compress(b"\0" * 8 * 201)).decode(), ["longer than"]),
        ("z:" + base64.b64encode(zlib.compress(b"\0" * 8 * 200)[:-6]).decode(), []),  # truncated stream
        ({"z": 1}, ["list or a 'z:'"]),
        ("y:abc", ["list or a 'z:'"]),
    ]:
        d = copy.deepcopy(doc)
        d["tensors"]["m.w"]["offsets"] = column
        refused(d, "m.w", "offsets", *words)
    assert w["offsets"].startswith("z:")


def test_refuses_deeply_nested_json_without_crashing():
    refused("[" * 100_000 + "]" * 100_000, "not valid JSON")
    deep = {"format": "paddle_dcp", "format_version": 1, "x": {}}
    node = deep["x"]
    for _ in range(100_000 // 200):
        node["a"] = {}
        node = node["a"]
    refused(deep)


@pytest.mark.parametrize("depth", [500, 5000])
def test_refuses_a_deeply_nested_structure(small, depth):
    small["structure"] = "@"
    deep = '{"l":[' * depth + '{"v":1}' + "]}" * depth
    refused(json.dumps(small).replace('"@"', deep), "ck/7.metadata")


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.pop("unique_id"),
        lambda d: d.update(unique_id=-1),
        lambda d: d.update(world_size=0),
        lambda d: d.update(created_by=5),
        lambda d: d.update(checksum={"algorithm": "md5", "block_bytes": 64}),
        lambda d: d.update(checksum={"algorithm": "xxh3_64", "block_bytes": 63}),
        lambda d: d.update(checksum=[]),
        lambda d: d.update(files={}),
        lambda d: d.update(files=[["0_7.distcp", 5]]),
        lambda d: d.update(tensors=[]),
        lambda d: d["tensors"].update({"m.b": []}),
        lambda d: d["tensors"]["m.b"].update(count=-1),
        lambda d: d["tensors"]["m.b"].update(offsets=[0, 3.0]),
        lambda d: d["tensors"]["m.b"].update(offsets=[0, True]),
        lambda d: d["tensors"]["m.s"].update(count=2),
        lambda d: d["files"][0].update(bytes=-5),
    ],
)
def test_refuses_fields_of_the_wrong_type_or_range(small, edit):
    edit(small)
    refused(small)


def test_refuses_metadata_over_the_size_limit(monkeypatch):
    import paddle_dcp.core.metadata_parse as md

    monkeypatch.setattr(md, "MAX_METADATA_BYTES", 100)
    with pytest.raises(FormatError, match="limit"):
        parse(hand_meta(2).to_json())


def test_refuses_a_non_finite_plain_value(small):
    small["structure"]["d"][1][1] = {"v": float("nan")}
    refused(json.dumps(small), "step")


def test_byte_range_check_does_not_overflow():
    doc = {
        "format": "paddle_dcp", "format_version": 1, "unique_id": 0, "world_size": 1,
        "checksum": {"algorithm": "xxh3_64", "block_bytes": 1 << 30},
        "files": [{"name": "0_0.distcp", "bytes": 0}],
        "structure": {"d": [["w", {"t": 0}]]},
        "tensors": {"w": {"dtype": "complex128", "shape": [2**58], "count": 1, "offsets": [0],
                          "shapes": [2**58], "file": [0], "byte_offset": [2**62], "checksums": []}},
    }  # fmt: skip
    # the piece is 2**62 bytes at offset 2**62 of an empty file: the range check must catch it
    # (instead the parse gets as far as asking for 2**32 checksums)
    refused(doc, "past the end of its file")


def test_refuses_a_piece_whose_box_overflows(small):
    big = 1 << 62
    small["tensors"]["m.b"] = {"dtype": "uint8", "shape": [4, 4], "count": 2, "offsets": [0, 0, big, 0],
                               "shapes": [4, 4, big, 4], "file": [1, 1], "byte_offset": [0, 0],
                               "checksums": ["00" * 8, "00" * 8]}  # fmt: skip
    refused(small, "m.b")


# ------------------------------------------------------------------ fuzz
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.sampled_from([0, 1, -1, 63, 64, 2**62, 2**62 + 1, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["z:", "z:eJw=", "../x", "float32", "t", "d"]),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.sampled_from(["d", "l", "u", "t", "v", "f", "x", "name", "bytes"]), st.integers(0, 2), max_size=2),
)


@st.composite
def mutated_docs(draw):
    doc = copy.deepcopy(draw(st.sampled_from([SMALL_DOC, PACKED_DOC])))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(nodes(doc))[1:]
        path = draw(st.sampled_from(paths))
        parent, last = get(doc, path[:-1]), path[-1]
        node = parent[last]
        how = draw(st.sampled_from(["replace", "nudge", "drop", "duplicate"]))
        if how == "nudge" and type(node) is int:
            parent[last] = node + draw(st.sampled_from([-1, 1, 64, -64, 2**40]))
        elif how == "drop":
            del parent[last]
        elif how == "duplicate" and isinstance(parent, list):
            parent.insert(last, copy.deepcopy(node))
        else:
            parent[last] = draw(junk)
    return doc


SMALL_DOC = doc_of(hand_meta(2))
PACKED_DOC = doc_of(hand_meta(70))


@fast(400)
@given(mutated_docs())
def test_mutated_documents_parse_or_raise_format_error(doc):
    try:
        meta = parse(doc)
    except FormatError:
        return
    # whatever is accepted is a consistent checkpoint description that writes back
    assert_same(meta, parse(meta.to_json()))


@fast(150)
@given(st.sampled_from([SMALL_DOC, PACKED_DOC]), st.data())
def test_truncated_or_flipped_bytes_parse_or_raise_format_error(doc, data):
    raw = bytearray(json.dumps(doc).encode())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        parse(bytes(raw))
    except FormatError:
        pass


def test_every_dtype_of_the_format_round_trips(small):
    for name, dt in STORAGE.items():
        d = copy.deepcopy(small)
        d["tensors"]["m.b"]["dtype"] = name
        d["files"][1]["bytes"] = 10_000
        d["tensors"]["m.b"]["checksums"] = ["00" * 8] * sum(max(1, -(-n * dt.itemsize // BLOCK)) for n in (3, 2))
        assert parse(d).tensors["m.b"].itemsize == dt.itemsize


# ------------------------------------------------------------------ entries parsed together
def lazy(doc) -> Metadata:
    body = json.dumps({k: v for k, v in doc.items() if k != "digest"}, separators=(",", ":"))
    return parse_metadata(with_digest(body.encode()), source="ck/7.metadata", lazy=True)


@pytest.mark.parametrize("rows", [1, 2, 31, 33, 100])
def test_entries_parsed_together_equal_entries_parsed_one_by_one(rows):
    doc = doc_of(hand_meta(rows, seed=rows))
    together, alone = lazy(doc), lazy(doc)
    together.prefetch(list(doc["tensors"]))
    taken = set(together.tensors._done)
    plain = {k for k, t in doc["tensors"].items() if all(isinstance(t[c], list) for c in ("offsets", "shapes", "checksums"))}
    assert taken == plain and "m.b" in taken and "m.s" in taken  # packed columns are left for one by one
    assert_same(together, alone)
    for key in doc["tensors"]:
        assert not together.tensors[key].pieces.offsets.flags.writeable


BAD_EDITS = [
    lambda t: t.update(offsets=[0, 3.0]),
    lambda t: t.update(offsets=[0, True]),
    lambda t: t.update(offsets=[0, 2**63]),
    lambda t: t.update(offsets=[0, -(2**63)]),
    lambda t: t.update(offsets=[0, 4]),  # past the end of the tensor
    lambda t: t.update(offsets=[-1, 3]),
    lambda t: t.update(shapes=[3, 0]),
    lambda t: t.update(shapes=[3]),
    lambda t: t.update(count=3),
    lambda t: t.update(count=-1),
    lambda t: t.update(count=True),
    lambda t: t.update(file=[1, 2]),
    lambda t: t.update(file=[1, -1]),
    lambda t: t.update(byte_offset=[0, 10**9]),
    lambda t: t.update(byte_offset=[0, -64]),
    lambda t: t.update(checksums=[c.upper() for c in t["checksums"]]),
    lambda t: t.update(checksums=t["checksums"][:-1]),
    lambda t: t.update(checksums=t["checksums"] + t["checksums"][:1]),
    lambda t: t.update(checksums=[c[:15] + "g" for c in t["checksums"]]),
    lambda t: t.update(checksums=[c[:15] for c in t["checksums"]]),
    lambda t: t.update(checksums=[int(c, 16) for c in t["checksums"]]),
    lambda t: t.update(dtype="float128"),
    lambda t: t.update(shape=[5.0]),
    lambda t: t.update(shape=[True]),
    lambda t: t.update(shape=[2**62, 2**62]),
    lambda t: t.pop("file"),
    lambda t: t.update(offsets="z:AAAA"),
]


@pytest.mark.parametrize("edit", range(len(BAD_EDITS)))
def test_an_entry_refused_one_by_one_is_never_taken_together_and_keeps_its_error(edit):
    doc = doc_of(hand_meta(2))
    BAD_EDITS[edit](doc["tensors"]["m.b"])
    alone = lazy(doc)
    with pytest.raises(FormatError) as expected:
        alone.tensors["m.b"]
    together = lazy(doc)
    together.prefetch(list(doc["tensors"]))
    assert "m.b" not in together.tensors._done
    with pytest.raises(FormatError) as got:
        together.tensors["m.b"]
    assert str(got.value) == str(expected.value)
    assert (together.tensors["m.w"].pieces.offsets == alone.tensors["m.w"].pieces.offsets).all()


def _many_pass_refuses(doc: dict, key: str) -> bool:
    """Whether the many-entry pass, by itself, refuses entry ``key`` of ``doc``."""
    from paddle_dcp.core import metadata_parse

    sizes = np.array([f["bytes"] for f in doc["files"]], dtype=np.int64)
    rows, packed, refused = metadata_parse._plain_rows([key], doc["tensors"], 1 << 30)
    assert packed == []
    return refused == [key] or metadata_parse._vectorised(rows, sizes, doc["checksum"]["block_bytes"]) is None


@pytest.mark.parametrize("edit", range(len(BAD_EDITS) - 1))  # the last edit packs a column
def test_every_check_of_the_per_entry_parse_is_made_by_the_many_entry_pass(edit):
    doc = doc_of(hand_meta(2))
    BAD_EDITS[edit](doc["tensors"]["m.b"])
    with pytest.raises(FormatError, match=r"\bm\.b\b") as alone:
        lazy(doc).tensors["m.b"]
    assert _many_pass_refuses(doc, "m.b"), alone.value
    together = lazy(doc)
    together.prefetch(list(doc["tensors"]))  # the one refused is worded by the per-entry parse
    with pytest.raises(FormatError) as got:
        together.tensors["m.b"]
    assert type(got.value) is type(alone.value) and str(got.value) == str(alone.value)
    assert not _many_pass_refuses(doc, "m.w")


def test_an_entry_refused_together_but_accepted_alone_is_an_error_not_a_fallback():
    from paddle_dcp.core import metadata_parse

    doc = doc_of(hand_meta(2))
    doc["tensors"]["m.b"]["byte_offset"] = [0, 10**9]
    sizes = np.array([f["bytes"] for f in doc["files"]], dtype=np.int64)
    accepts_all = lambda key: None  # noqa: E731 - a per-entry parse that would disagree
    with pytest.raises(FormatError, match="refused together"):
        metadata_parse._parse_many(list(doc["tensors"]), doc["tensors"], sizes, doc["checksum"]["block_bytes"], 1 << 30, accepts_all)


def test_replicas_metadata_round_trips_and_without_them_is_unchanged():
    meta = meta_of(plan_of(replicated(), replicas=True))
    doc = json.loads(meta.to_json())
    assert doc["replicas"] is True and doc["tensors"]["w"]["count"] == 2
    back = parse_metadata(meta.to_json())
    assert back.replicas and back.tensors["w"].pieces.count == 2
    plain = meta_of(plan_of(replicated()))
    assert "replicas" not in json.loads(plain.to_json()) and not parse_metadata(plain.to_json()).replicas


def edit(meta, fn):
    doc = json.loads(meta.to_json())
    del doc["digest"]
    fn(doc)
    return json.dumps(doc).encode()


def test_copies_are_refused_without_the_replicas_flag_or_in_one_file():
    meta = meta_of(plan_of(replicated(), replicas=True))
    with pytest.raises(FormatError, match="overlap"):
        parse_metadata(edit(meta, lambda d: d.pop("replicas")))
    with pytest.raises(FormatError, match="same file"):
        parse_metadata(edit(meta, lambda d: d["tensors"]["w"].__setitem__("file", [0, 0])))
    with pytest.raises(FormatError, match="replicas"):
        parse_metadata(edit(meta, lambda d: d.__setitem__("replicas", 1)))


def test_a_copy_that_only_overlaps_is_refused_even_with_replicas():
    meta = meta_of(plan_of(replicated(), replicas=True))

    def shift(d):  # second copy of w one row shorter: not an equal box, so it overlaps
        d["tensors"]["w"]["shapes"] = [4, 5, 3, 5]

    with pytest.raises(FormatError, match="overlap"):
        parse_metadata(edit(meta, shift))


def test_encoded_entries_parse_back_the_same_one_by_one_and_many_at_once():
    from .hand_metadata import encoded_meta

    data = encoded_meta().to_json()
    full = parse_metadata(data)
    lazy = parse_metadata(data, lazy=True)
    lazy.prefetch(["q.a", "q.b", "q.p"])  # the vectorised pass takes them all, or raises
    assert lazy.tensors.parsed_count == 3 and lazy.format_version == full.format_version == 2
    for key in ("q.a", "q.b", "q.p"):
        a, b = full.tensors[key], lazy.tensors[key]
        assert a.encoding == b.encoding == encoded_meta().tensors[key].encoding
        assert a.piece_nbytes().tolist() == b.piece_nbytes().tolist()
        assert a.block_starts().tolist() == b.block_starts().tolist()


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d["tensors"]["q.a"].update(encoding="fp8"), ["'q.a'", "'fp8'", "int4, int8"]),
        (lambda d: d["tensors"]["q.a"].update(encoding=["int8"]), ["'q.a'", "encoding"]),
        (lambda d: d["tensors"]["q.p"].update(encoding="int8"), ["'q.p'", "int64"]),
        (lambda d: d.update(format_version=1), ["'q.a'", "format_version 1"]),
        (lambda d: d["tensors"]["q.b"]["checksums"].pop(), ["'q.b'", "checksums"]),
        (lambda d: d["tensors"]["q.a"].pop("encoding"), ["'q.a'"]),  # raw bytes would need 1600: past the file's end
    ],
)
def test_a_bad_encoding_is_refused_naming_the_key_by_either_parse(edit, words):
    from .hand_metadata import encoded_meta

    doc = doc_of(encoded_meta())
    edit(doc)
    _refused_by_either_parse(doc, words, next(w for w in words if w.startswith("'q.")).strip("'"))


def _refused_by_either_parse(doc: dict, words, key: str) -> None:
    """``doc`` (its digest made anew) is refused by a full parse with all of ``words`` in the
    message, and by a lazy one when entry ``key`` is first used (after a prefetch of every entry:
    the vectorised pass leaves it to the per-entry parse, which words the error)."""
    body = with_digest(json.dumps({k: v for k, v in doc.items() if k != "digest"}).encode())
    with pytest.raises(FormatError) as info:
        parse_metadata(body)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    lazy = parse_metadata(body, lazy=True)
    lazy.prefetch(list(doc["tensors"]))
    with pytest.raises(FormatError, match=re.escape(key)):
        lazy.tensors[key]


# ------------------------------------------------------------------ derived tensors
def test_derived_entries_parse_back_by_either_parse_with_their_source_and_no_pieces():
    from .hand_metadata import derived_meta

    data = derived_meta().to_json()
    doc = json.loads(data)
    assert doc["format_version"] == 2
    assert doc["tensors"]["o.p.w_0"] == {
        "dtype": "float32", "shape": [20, 40], "count": 0, "offsets": [], "shapes": [], "file": [],
        "byte_offset": [], "checksums": [], "encoding": "derived", "source": "m.p",
    }
    full = parse_metadata(data)
    lazy = parse_metadata(data, lazy=True)
    lazy.prefetch(["m.p", "o.q", "o.p.w_0"])  # the derived entry is left to the per-entry parse
    for meta in (full, lazy):
        entry = meta.tensors["o.p.w_0"]
        assert (entry.encoding, entry.source, entry.derived, entry.pieces.count) == ("derived", "m.p", True, 0)
        assert entry.piece_nbytes().tolist() == [] and entry.nbytes == 20 * 40 * 4
        assert meta.tensors["m.p"].source is None and not meta.tensors["m.p"].derived


def _as_derived(doc: dict, key: str, source: str, shape=None) -> None:
    """Turn entry ``key`` of ``doc`` into a float32 tensor derived from ``source``."""
    t = doc["tensors"][key]
    t.update(dtype="float32", count=0, offsets=[], shapes=[], file=[], byte_offset=[], checksums=[])
    t.update(encoding="derived", source=source)
    if shape is not None:
        t["shape"] = shape


def _piece(doc: dict) -> None:
    """Give the derived entry one stored piece as well (a derived key that is also stored)."""
    doc["tensors"]["o.p.w_0"].update(
        count=1, offsets=[0, 0], shapes=[20, 40], file=[0], byte_offset=[0], checksums=["0" * 16] * 50
    )


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d["tensors"]["o.p.w_0"].update(source="m.nope"), ["'o.p.w_0'", "'m.nope'", "not a tensor"]),
        (lambda d: d["tensors"]["o.p.w_0"].update(shape=[40, 20]), ["'o.p.w_0'", "(40, 20)", "[20, 40]"]),
        (lambda d: d["tensors"]["o.p.w_0"].update(source="o.p.w_0"), ["'o.p.w_0'", "derived itself"]),
        (lambda d: _as_derived(d, "o.q", "o.p.w_0", [20, 40]), ["'o.q'", "'o.p.w_0'", "derived itself"]),  # a chain
        (  # a cycle: each derived from the other
            lambda d: (_as_derived(d, "o.q", "o.p.w_0", [20, 40]), d["tensors"]["o.p.w_0"].update(source="o.q")),
            ["derived itself"],
        ),
        (_piece, ["'o.p.w_0'", "stored too", "1 pieces"]),
        (lambda d: d["tensors"]["o.p.w_0"].pop("source"), ["'o.p.w_0'", "source must be a tensor key"]),
        (lambda d: d["tensors"]["o.p.w_0"].update(source=["m.p"]), ["'o.p.w_0'", "source must be a tensor key"]),
        (lambda d: d["tensors"]["o.p.w_0"].update(dtype="bfloat16"), ["'o.p.w_0'", "cannot hold dtype bfloat16"]),
        (lambda d: d["tensors"]["o.p.w_0"].update(source="o.q"), ["'o.p.w_0'", "'o.q'", "float32"]),
        (lambda d: d["tensors"]["o.q"].update(source="m.p"), ["'o.q'", "not derived"]),
        (lambda d: d.update(format_version=1), ["'o.p.w_0'", "format_version 1"]),
    ],
)
def test_hostile_derived_entries_are_refused_naming_the_key_by_either_parse(edit, words):
    from .hand_metadata import derived_meta

    doc = doc_of(derived_meta())
    edit(doc)
    _refused_by_either_parse(doc, words, next((w for w in words if w.startswith("'")), "'o.p.w_0'").strip("'"))
