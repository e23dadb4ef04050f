"""paddle_dcp.core.metadata: the frozen dataclasses and the JSON they write (packed and plain
columns as docs/format.md defines them), the digest, alignment and checksum blocks, and the
names a checkpoint may hold. Oracles: the format's definitions written out here."""
import json

import numpy as np
import pytest
import xxhash

from paddle_dcp.core import metadata
from paddle_dcp.core.boxes import Box
from paddle_dcp.core.metadata import FORMAT_VERSION, aligned
from paddle_dcp.errors import FormatError

from .hand_metadata import BLOCK, doc_of, hand_meta, unpack


def test_long_columns_are_packed_as_the_format_says_and_short_ones_are_plain():
    meta = hand_meta(100)
    doc = doc_of(meta)
    w, b = doc["tensors"]["m.w"], doc["tensors"]["m.b"]
    for col in ("offsets", "shapes", "file", "byte_offset", "checksums"):
        assert isinstance(w[col], str) and w[col].startswith("z:"), col
        assert isinstance(b[col], list), col
    p = meta.tensors["m.w"].pieces
    assert (unpack(w["offsets"], "<i8") == p.offsets.reshape(-1)).all()
    assert (unpack(w["byte_offset"], "<i8") == p.byte_offsets).all()
    assert (unpack(w["checksums"], "<u8") == p.checksums).all()
    assert b["checksums"] == [f"{int(x):016x}" for x in meta.tensors["m.b"].pieces.checksums]
    assert b["offsets"] == [0, 3] and b["shapes"] == [3, 2]
    assert doc["format"] == "paddle_dcp" and doc["format_version"] == FORMAT_VERSION
    assert doc["checksum"] == {"algorithm": "xxh3_64", "block_bytes": BLOCK}


def test_sixty_four_entries_stay_plain_and_sixty_five_are_packed():
    assert isinstance(doc_of(hand_meta(64))["tensors"]["m.w"]["file"], list)
    assert isinstance(doc_of(hand_meta(65))["tensors"]["m.w"]["file"], str)


def test_aligned_is_the_next_multiple_for_ints_and_arrays():
    assert [aligned(n) for n in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert aligned(5, 1) == 5
    assert aligned(np.array([0, 1, 64, 65])).tolist() == [0, 64, 64, 128]


def test_blocks_of_counts_whole_and_partial_blocks_and_one_for_an_empty_piece():
    assert metadata.blocks_of(np.array([0, 1, 64, 65, 128, 1000]), 64).tolist() == [1, 1, 1, 2, 2, 16]
    assert int(metadata.blocks_of(7, 64)) == 1


def test_a_piece_of_an_entry_knows_its_box_bytes_and_checksum_blocks():
    entry = hand_meta(3).tensors["m.b"]  # 5 int64 in pieces of 3 and 2 elements
    first, second = entry.piece(0), entry.piece(1)
    assert (first.box, first.nbytes, first.file, first.byte_offset) == (Box((0,), (3,)), 24, 1, 0)
    assert (second.box, second.nbytes, second.byte_offset) == (Box((3,), (2,)), 16, 64)
    assert (first.first_block, first.nblocks, second.first_block, second.nblocks) == (0, 1, 1, 1)
    assert entry.piece_nbytes().tolist() == [24, 16] and entry.block_starts().tolist() == [0, 1, 2]
    assert entry.nbytes == 40 and entry.itemsize == 8
    with pytest.raises(ValueError):
        entry.piece_nbytes()[0] = 1  # shared by every caller: read-only


def test_metadata_nbytes_and_values_come_from_its_tensors_and_structure():
    meta = hand_meta(10)
    assert meta.nbytes == 10 * 3 * 4 + 5 * 8 + 8
    values = meta.values()
    assert values["step"] == 3 and values["lr.0"] == 0.5 and values["lr.4"] == "adam"
    assert values["lr.2"] == float("-inf") and values["lr.3"] is None


def test_the_digest_is_the_xxh3_of_the_document_without_it():
    data = hand_meta(2).to_json()
    doc = json.loads(data)
    body = json.dumps({k: v for k, v in doc.items() if k != "digest"}, separators=(",", ":")).encode()
    assert doc["digest"] == xxhash.xxh3_64_hexdigest(body)
    assert metadata.digest_matches(data, doc) is True
    assert metadata.digest_matches(data + b"\n", doc) is True  # trailing white space is not the object's


def test_an_edited_or_missing_digest_is_told_apart():
    data = hand_meta(2).to_json()
    edited = data.replace(b'"world_size":4', b'"world_size":5')
    assert metadata.digest_matches(edited, json.loads(edited)) is False
    moved = data[:-2] + b'X"}'  # the digest itself damaged
    assert metadata.digest_matches(moved, json.loads(moved)) is False
    plain = json.dumps({"a": 1}).encode()
    assert metadata.digest_matches(plain, json.loads(plain)) is None
    assert metadata.digest_matches(b"[]", []) is None


def test_check_digest_refuses_only_a_digest_that_does_not_match():
    meta = hand_meta(2)
    meta.check_digest()  # built in memory: no verdict
    for matches in (None, True):
        metadata.Metadata(**{**meta.__dict__, "digest": metadata.DigestVerdict(matches, "ck/7.metadata")}).check_digest()
    bad = metadata.Metadata(**{**meta.__dict__, "digest": metadata.DigestVerdict(False, "ck/7.metadata")})
    with pytest.raises(FormatError, match="ck/7.metadata: the metadata's digest does not match"):
        bad.check_digest()


def test_replicas_and_subset_are_written_only_when_set():
    meta = hand_meta(2)
    assert "replicas" not in doc_of(meta) and "subset" not in doc_of(meta)
    both = metadata.Metadata(**{**meta.__dict__, "replicas": True, "subset": True})
    assert doc_of(both)["replicas"] is True and doc_of(both)["subset"] is True


@pytest.mark.parametrize("name", ["0_7.distcp", "model-00001-of-00002.safetensors", "a.b_c-d"])
def test_plain_file_names_are_accepted(name):
    assert metadata.check_file_name(name) == name
    assert metadata.check_member_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", "x\x00y", None, 3])
def test_names_that_leave_the_directory_or_are_not_names_are_refused_by_both_checks(name):
    for check in (metadata.check_file_name, metadata.check_member_name):
        with pytest.raises(FormatError, match="not a plain file name"):
            check(name, "data file")


def test_a_member_name_may_be_any_name_of_the_file_system_but_a_metadata_name_is_plainer():
    for name in ("my model (v2).safetensors", "é.bin", "..hidden"):
        assert metadata.check_member_name(name) == name
        with pytest.raises(FormatError):
            metadata.check_file_name(name)
    with pytest.raises(FormatError):
        metadata.check_member_name("x" * 256)


def test_an_encoding_is_written_only_for_tensors_that_have_one_and_then_as_version_2():
    from .hand_metadata import encoded_meta

    plain = doc_of(hand_meta(2))
    assert plain["format_version"] == FORMAT_VERSION == 1
    assert not any("encoding" in t for t in plain["tensors"].values())
    doc = doc_of(encoded_meta())
    assert doc["format_version"] == 2
    assert {k: t.get("encoding") for k, t in doc["tensors"].items()} == {"q.a": "int8", "q.b": "int4", "q.p": None}


def test_an_encoded_entry_s_pieces_take_their_whole_blocks_and_its_logical_bytes_stay_its_elements():
    from .hand_metadata import encoded_meta

    meta = encoded_meta()
    a, b, p = (meta.tensors[k] for k in ("q.a", "q.b", "q.p"))
    assert a.piece_nbytes().tolist() == [2 * 264, 2 * 264] and a.nbytes == 20 * 40 * 4
    assert b.piece_nbytes().tolist() == [2 * 136] and b.nbytes == 600
    assert p.piece_nbytes().tolist() == [40]
    piece = a.piece(1)
    assert piece.nbytes == 528 and piece.first_block == -(-528 // BLOCK)
    assert metadata.stored_nbytes(257, "float16", "int4") == 2 * 136
    assert metadata.stored_nbytes(np.array([1, 256, 512, 513]), "float32", "int8").tolist() == [264, 264, 528, 792]
    assert metadata.stored_nbytes(7, "float16", None) == 14
