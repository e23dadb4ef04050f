"""core/json_text.parse_json: every way outside JSON text can be malformed is a FormatError
naming its source, for each parser that reads one (metadata, safetensors header, HF index,
manifest, a peer's message)."""
from __future__ import annotations

import json
import struct

import pytest

from paddle_dcp.core.json_text import parse_json
from paddle_dcp.errors import FormatError

DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE_NUMBER = b'{"a": ' + b"9" * 10_000 + b"}"
NOT_UTF8 = b'{"a": "\xff\xfe"}'


def test_valid_text_and_bytes_parse_to_the_same_value():
    doc = {"k": [1, 2.5, None, "\u00e9"], "n": {"x": True}}
    text = json.dumps(doc)
    assert parse_json(text, "s") == parse_json(text.encode(), "s") == parse_json(memoryview(text.encode()), "s") == doc


@pytest.mark.parametrize("data, cause", [(DEEP, "RecursionError"), (HUGE_NUMBER, "ValueError"), (NOT_UTF8, "UnicodeDecodeError"),
                                         (b"{", "JSONDecodeError"), (b"", "JSONDecodeError")])
def test_each_malformation_is_a_format_error_naming_the_source(data, cause):
    with pytest.raises(FormatError, match=f"^f.json: the thing is not valid JSON \\({cause}") as info:
        parse_json(data, "f.json", "the thing")
    assert len(str(info.value)) < 400  # the parser's message is cut, not the text echoed


def test_a_hook_that_refuses_is_prefixed_with_the_source():
    def hook(pairs):
        raise FormatError("names 'a' twice")

    with pytest.raises(FormatError, match="^f: names 'a' twice$"):
        parse_json(b'{"a": 1, "a": 2}', "f", hook=hook)


@pytest.mark.parametrize("data", [DEEP, HUGE_NUMBER, NOT_UTF8])
def test_every_reader_of_outside_json_says_format_error(data):
    """The safetensors header, a Hugging Face index, the manager's manifest and the metadata:
    a crafted text is a FormatError, never a RecursionError or a bare ValueError."""
    from paddle_dcp.core.metadata_parse import parse_metadata
    from paddle_dcp.core.retention import Manifest
    from paddle_dcp.format import hf_dir, safetensors

    blob = struct.pack("<Q", len(data)) + data
    readers = [
        lambda: safetensors.parse_header(data, len(blob), "m.safetensors"),
        lambda: hf_dir.parse_index(data, "model.safetensors.index.json"),
        lambda: Manifest.from_json(data, "manifest.json"),
        lambda: parse_metadata(data, source="0.metadata"),
    ]
    for read in readers:
        with pytest.raises(FormatError):
            read()
