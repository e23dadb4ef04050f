"""Reading version 3 metadata: a part read holds every piece of the whole file that overlaps the
boxes asked for, exactly as the whole file has it, in three rounds of reads; damage anywhere is
a FormatError before anything is taken from it; numbers the file claims are checked before they
size an allocation; the work grows with what is read."""
from __future__ import annotations

import sys
import tracemalloc

import metadoc
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from paddle_dcp.core import metafile
from paddle_dcp.core.boxes import Box
from paddle_dcp.core.metadata_parse import parse_metadata
from paddle_dcp.errors import FormatError

from .hand_metadata import hand_meta
from .metadata_cases import calls_of, columns_meta, entry_of, metadatas, pieces


def _fetch(data: bytes, log: list | None = None):
    def fetch(ranges):
        if log is not None:
            log.append(list(ranges))
        return [data[a:b] for a, b in ranges]

    return fetch


def _overlaps(offsets, shape, box: Box) -> bool:
    return all(max(o, b) < min(o + s, b + n) for o, s, b, n in zip(offsets, shape, box.offsets, box.shape)) or not box.ndim


@settings(max_examples=120, deadline=None)
@given(metadatas(), st.data())
def test_a_part_holds_every_piece_that_overlaps_its_boxes_as_the_whole_file_has_it(meta, data):
    raw = metafile.encode(meta)
    whole = metafile.decode(raw)
    keys = sorted(meta.tensors)
    chosen = data.draw(st.lists(st.sampled_from(keys), unique=True))
    wanted = {}
    for key in chosen:
        shape = meta.tensors[key].shape
        lo = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
        box = Box(lo, tuple(data.draw(st.integers(1, n - o)) for o, n in zip(lo, shape)))
        wanted[key] = data.draw(st.sampled_from([[box], [], [box, box]]))
    wanted["not.a.key"] = []
    log: list = []
    part = metafile.read_part(_fetch(raw, log), len(raw), wanted)
    assert part.subset and part.files == meta.files
    sources = {meta.tensors[k].source for k in chosen if meta.tensors[k].source}
    assert set(part.tensors) == set(chosen) | sources
    for key in part.tensors:
        got, full = entry_of(part, key), entry_of(whole, key)
        assert got[:4] == full[:4]
        assert set(got[4]) <= set(full[4])  # nothing that is not in the file
        boxes = wanted.get(key, []) + [b for k in chosen if meta.tensors[k].source == key for b in wanted[k]]
        need = {p for p in full[4] if any(_overlaps(p[0], p[1], b) for b in boxes)}
        assert need <= set(got[4])
    assert len(log) == 2 + 3  # the head, the files and index, then the three rounds


def test_part_rounds_are_three_whatever_is_asked():
    raw = metafile.encode(hand_meta(rows=10))
    start = metafile.read_start(_fetch(raw), len(raw))
    for wanted in ({}, {"m.w": [Box((0, 0), (2, 3))]}, {"missing": []}):
        rounds = metafile.part_rounds(start, wanted)
        asked = [next(rounds)]
        with pytest.raises(StopIteration):
            while True:
                asked.append(rounds.send([raw[a:b] for a, b in asked[-1]]))
        assert len(asked) == 3


def test_the_outline_and_holders_of_a_part_are_the_checkpoints():
    meta = hand_meta(rows=4)
    raw = metafile.encode(meta)
    part = metafile.read_part(_fetch(raw), len(raw), {"m.b": [Box((0,), (5,))]})
    assert part.structure == {"d": [["step", {"v": 3}], ["lr", meta.structure["d"][2][1]]]}
    assert part.holders == frozenset()
    assert part.values() == meta.values()


@pytest.mark.parametrize("where", ["head", "files", "structure", "index", "parts", "records", "sums"])
def test_a_byte_changed_anywhere_is_a_format_error_naming_the_file(where):
    meta = hand_meta(rows=40)
    raw = bytearray(metafile.encode(meta))
    head = metafile.read_head(_fetch(bytes(raw)), len(raw), "x")
    if where == "head":
        at = raw.index(b'"world_size"') + 14
    elif where in ("files", "structure", "index"):
        at = head.section(where)[0] + 3
    else:
        at = head.area(where)[0] + 5
    raw[at] ^= 0x01
    with pytest.raises(FormatError, match="ck/0.metadata") as info:
        parse_metadata(bytes(raw), source="ck/0.metadata")
    assert "digest" in str(info.value) or "malformed" in str(info.value) or "JSON" in str(info.value)


def test_a_damaged_group_fails_the_part_read_that_takes_it_and_no_other():
    meta = hand_meta(rows=100)  # m.w: 100 pieces, four groups
    raw = bytearray(metafile.encode(meta))
    head = metafile.read_head(_fetch(bytes(raw)), len(raw), "x")
    rec = head.area("records")[0]
    raw[rec + 3 * head.record_width] ^= 0xFF  # a record of m.w's first group
    data = bytes(raw)
    with pytest.raises(FormatError, match=r"'m\.w'.*group 0.*digest"):
        metafile.read_part(_fetch(data), len(data), {"m.w": [Box((0, 0), (1, 3))]})
    part = metafile.read_part(_fetch(data), len(data), {"m.w": [Box((99, 0), (1, 3))]})
    assert len(pieces(part.tensors["m.w"])) == 4  # its group: pieces 96..99


def _claiming(raw: bytes, name: str, factor: int) -> bytes:
    """``raw`` with section ``name`` claiming ``factor`` times its real raw length (the head's
    digest made again: a file crafted, not damaged)."""
    from paddle_dcp.core.metadata import with_digest
    import json

    end = raw.index(b"\n")
    doc = json.loads(raw[:end])
    doc.pop("digest")
    doc["sections"][name][2] *= factor
    return with_digest(json.dumps(doc, separators=(",", ":")).encode()) + raw[end:]


def test_a_length_the_file_claims_is_refused_before_it_sizes_an_allocation():
    raw = metafile.encode(hand_meta(rows=40))
    with pytest.raises(FormatError, match=r"structure\.raw must be an integer in \[0, "):
        parse_metadata(_claiming(raw, "structure", 10**6))
    tracemalloc.start()
    try:
        with pytest.raises(FormatError):
            parse_metadata(_claiming(raw, "index", 2))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(raw) + (1 << 20)


def _hostile(edit) -> bytes:
    doc = metadoc.read(metafile.encode(hand_meta(rows=8)))
    edit(doc)
    return metadoc.write(doc)


HOSTILE = {
    "a piece past its file": (lambda d: d["tensors"]["m.b"]["byte_offset"].__setitem__(1, 10**9), ["m.b", "past the end"]),
    "a file index past the list": (lambda d: d["tensors"]["m.b"]["file"].__setitem__(0, 5), ["file index"]),
    "boxes that overlap": (lambda d: d["tensors"]["m.b"]["offsets"].__setitem__(1, 2), ["m.b", "overlap"]),
    "a box outside the tensor": (lambda d: d["tensors"]["m.b"]["shapes"].__setitem__(1, 9), ["m.b", "outside"]),
    "a gap": (lambda d: d["tensors"]["m.b"]["shapes"].__setitem__(1, 1), ["m.b"]),
    "a derived tensor with pieces": (lambda d: d["tensors"]["m.b"].update(encoding="derived", source="m.w"), ["m.b", "derived"]),
    "a source on a stored tensor": (lambda d: d["tensors"]["m.b"].update(source="m.w"), ["m.b", "source"]),
    "an encoding on integers": (lambda d: d["tensors"]["m.b"].update(encoding="int8"), ["m.b", "int64"]),
    "a shape with too many elements": (lambda d: d["tensors"]["m.s"].update(shape=[2**40, 2**30]), ["m.s"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_entries_are_format_errors_naming_the_key(case):
    edit, needles = HOSTILE[case]
    data = _hostile(edit)
    with pytest.raises(FormatError) as info:
        parse_metadata(data, source="ck/7.metadata")
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_the_independent_writers_files_read_in_parts_too():
    meta = hand_meta(rows=70)
    raw = metadoc.write(metadoc.read(metafile.encode(meta)))  # every layout stored with its boxes
    part = metafile.read_part(_fetch(raw), len(raw), {"m.w": [Box((65, 0), (2, 3))], "m.s": [Box((), ())]})
    assert entry_of(part, "m.s") == entry_of(meta, "m.s")
    assert set(pieces(part.tensors["m.w"])) == set(pieces(meta.tensors["m.w"]))  # a layout read whole


def test_the_work_of_a_whole_read_grows_with_the_tensors_not_faster():
    def calls(n):
        raw = metafile.encode(columns_meta(n))
        return calls_of(lambda: metafile.decode(raw))

    assert calls(20_000) <= 10.5 * calls(2_000)


def test_a_part_read_of_a_few_tensors_costs_the_same_whatever_the_checkpoints_size():
    def calls(n):
        raw = metafile.encode(columns_meta(n))
        wanted = {f"model.layers.{i}.w": [Box((1, 0), (2, 8))] for i in range(0, 100, 7)}
        return calls_of(lambda: metafile.read_part(_fetch(raw), len(raw), wanted))

    small, large = calls(2_000), calls(20_000)
    assert large <= 1.2 * small


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_byte_changed_is_refused_by_a_whole_read_and_by_every_part_read_that_reads_it(data):
    meta = hand_meta(rows=70)
    raw = bytearray(metafile.encode(meta))
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    bad = bytes(raw)
    if bad[at : at + 1] == b"\n" or b"\n" not in bad:  # the head line ends elsewhere: a file of another shape
        return
    with pytest.raises(FormatError):
        parse_metadata(bad)
    log: list = []
    wanted = {"m.w": [Box((data.draw(st.integers(0, 69)), 0), (1, 3))], "m.b": [Box((0,), (5,))]}
    try:
        part = metafile.read_part(_fetch(bad, log), len(bad), wanted)
    except FormatError:
        return
    read = [r for rounds in log[1:] for r in rounds]  # the first read takes the head and what follows it
    assert not any(a <= at < b for a, b in read)  # it read around the damage, never through it
    whole = metafile.decode(metafile.encode(meta))
    for key in part.tensors:
        assert set(entry_of(part, key)[4]) <= set(entry_of(whole, key)[4])


@pytest.mark.parametrize("field, value, message", [
    ("file", 5, "file index outside the file list"),
    ("offset", -1, "past the end of its file"),
])
def test_a_part_read_refuses_a_piece_outside_the_files_as_the_whole_read_does(field, value, message):
    """Found by the fuzz (tests/integration/test_fuzz_v3.py): a record naming a file the list
    does not have (or a byte range past its file's end), under valid digests, was taken by a
    part read, and the load failed later with an IndexError."""
    import metafields

    raw = metafile.encode(hand_meta(rows=5))
    f = metafields.split(raw)
    wf, w = f.head["widths"]["file"], f.record_width
    rec = bytearray(f.records)  # record 0: m.b's first piece (keys in order)
    if field == "file":
        rec[0:wf] = value.to_bytes(wf, "little")
    else:
        rec[wf:w] = b"\xff" * (w - wf)
    f.records = bytes(rec)
    bad = metafields.join(f, raw)
    with pytest.raises(FormatError, match=message):
        metafile.decode(bad)
    with pytest.raises(FormatError, match=message):
        metafile.read_part(_fetch(bad), len(bad), {"m.b": [Box((0,), (5,))]})
