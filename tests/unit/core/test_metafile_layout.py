"""The pieces of a version 3 file, checked one by one: bounded decompression, packed integers,
the head's fields, stored sizes as the format defines them."""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from paddle_dcp.core import metafile
from paddle_dcp.core.metadata import stored_nbytes, with_digest
from paddle_dcp.core.metafile_layout import (
    DTYPE_CODE, ENCODING_CODE, RATIO, Reader, has_head_line, inflate, is_packed, parse_head, shuffled, stored_bytes,
    worth_parts,
)
from paddle_dcp.errors import FormatError

from .hand_metadata import hand_meta


def test_inflate_takes_exactly_the_length_claimed_and_refuses_an_impossible_claim_before_decompressing():
    raw = bytes(range(256)) * 100
    packed = zlib.compress(raw)
    assert inflate(packed, len(raw), "p") == raw
    with pytest.raises(FormatError, match="cannot come from"):
        inflate(packed, RATIO * len(packed) + 65, "p")
    with pytest.raises(FormatError, match="longer than"):
        inflate(packed, len(raw) - 1, "p")
    with pytest.raises(FormatError, match="holds"):
        inflate(packed, len(raw) + 1, "p")
    with pytest.raises(FormatError, match="decompress"):
        inflate(b"not zlib", 10, "p")


def test_shuffled_integers_read_back_and_a_short_buffer_is_refused():
    values = np.array([0, 1, -5, 2**62, 123456789], dtype=np.int64)
    r = Reader(shuffled(values) + b"\x07", "p")
    assert r.ints(5).tolist() == values.tolist()
    with pytest.raises(FormatError, match="truncated"):
        r.ints(1)
    with pytest.raises(FormatError, match="left over"):
        r.done()
    with pytest.raises(FormatError, match="more than its bytes"):
        Reader(np.array([10**6], "<u8").tobytes(), "p").count()


def _head_doc() -> tuple[dict, int]:
    """The head of a file as a dict, and the length of the file's body."""
    raw = metafile.encode(hand_meta(rows=5))
    end = raw.index(b"\n")
    doc = json.loads(raw[:end])
    doc.pop("digest")
    return doc, len(raw) - end - 1


def _line(doc: dict) -> bytes:
    return with_digest(json.dumps(doc, separators=(",", ":")).encode())


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.update(format_version=4), ["version 3"]),
        (lambda d: d.update(world_size=0), ["world_size"]),
        (lambda d: d["counts"].update(pieces=-1), ["counts.pieces"]),
        (lambda d: d["widths"].update(file=9), ["widths.file"]),
        (lambda d: d["sections"]["index"].__setitem__(1, 10**9), ["index.length"]),
        (lambda d: d["areas"]["sums"].__setitem__(1, 8), ["sums area"]),
        (lambda d: d["sections"]["files"].__setitem__(3, "XYZ"), ["digest must be"]),
        (lambda d: d.update(outline={"d": [["a", {"x": 0}]]}), ["has no value"]),
        (lambda d: d.update(holders=[["a", 1.5]]), ["holders"]),
        (lambda d: d.update(replicas="yes"), ["replicas"]),
        (lambda d: d.pop("checksum"), ["checksum"]),
    ],
)
def test_a_head_with_a_bad_field_is_refused_naming_it(edit, words):
    doc, body = _head_doc()
    edit(doc)
    line = _line(doc)
    with pytest.raises(FormatError) as info:
        parse_head(line, len(line) + 1 + body, "ck/1.metadata")
    for w in ["ck/1.metadata"] + words:
        assert w in str(info.value), (w, str(info.value))


def test_a_head_whose_digest_does_not_match_is_refused_at_once():
    doc, body = _head_doc()
    line = _line(doc).replace(b'"world_size":4', b'"world_size":3')
    with pytest.raises(FormatError, match="head does not match its digest"):
        parse_head(line, len(line) + 1 + body, "x")


def test_version_three_is_told_from_json_by_its_head_line_and_large_files_are_read_in_parts():
    raw = metafile.encode(hand_meta(rows=5))
    assert is_packed(raw) and has_head_line(raw)
    assert not is_packed(b'{"format":"paddle_dcp","format_version":1}') and not has_head_line(b'{"format":"paddle_dcp"}')
    assert has_head_line(b'{"format":"paddle_dcp","format_version":4,"x":1}\nrest') and not is_packed(b'{"format":"paddle_dcp","format_version":4}\n')
    assert worth_parts(metafile.PARTS_FROM) and not worth_parts(metafile.PARTS_FROM - 1)


@pytest.mark.parametrize("dtype, encoding", [("float32", None), ("bfloat16", "int8"), ("float16", "int4"),
                                             ("float32", "derived"), ("complex128", None), ("bool", None)])
def test_stored_sizes_are_the_formats(dtype, encoding):
    extents = np.array([[3, 5, 0], [1000, 3, 0], [7, 0, 0]], dtype=np.int64)
    ndim = np.array([2, 2, 1])
    got = stored_bytes(np.full(3, DTYPE_CODE[dtype]), np.full(3, ENCODING_CODE[encoding]), extents, ndim)
    want = [stored_nbytes(int(np.prod(e[:n])), dtype, encoding) for e, n in zip(extents, ndim)]
    assert got.tolist() == want
