"""paddle_dcp.core.metadata: the frozen dataclasses and the JSON they write (packed and plain
columns as docs/format.md defines them), the digest, alignment and checksum blocks, and the
names a checkpoint may hold. Oracles: the format's definitions written out here."""


from paddle_dcp.core.metadata import FORMAT_VERSION

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
