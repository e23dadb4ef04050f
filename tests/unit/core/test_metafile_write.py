"""Writing version 3 metadata: whatever a checkpoint holds comes back from the file exactly, as
this package reads it and as an independent reader written from docs/format.md reads it; the
saves of one plan share what does not change; the work grows with the tensors, not faster."""
from __future__ import annotations

import sys

import metadoc
import numpy as np
import pytest
from hypothesis import given, settings

from paddle_dcp.core import metafile, metafile_write, nested
from paddle_dcp.core.metadata import ColumnTensors, FileEntry, Metadata
from paddle_dcp.core.metafile_layout import RATIO, deflate

from .metadata_cases import calls_of, columns_meta, entry_of, metadatas


@settings(max_examples=150, deadline=None)
@given(metadatas())
def test_every_tensor_piece_value_and_file_comes_back_exactly(meta):
    data = metafile.encode(meta)
    back = metafile.decode(data)
    assert set(back.tensors) == set(meta.tensors)
    for key in meta.tensors:
        assert entry_of(back, key) == entry_of(meta, key)
    assert back.files == meta.files and back.structure == meta.structure
    assert (back.unique_id, back.world_size, back.block_bytes, back.created_by, back.replicas) == (
        meta.unique_id, meta.world_size, meta.block_bytes, meta.created_by, meta.replicas)
    # an independent reader of the format sees the same
    doc = metadoc.read(data)
    assert doc["structure"] == meta.structure
    assert [(f["name"], f["bytes"]) for f in doc["files"]] == [(f.name, f.nbytes) for f in meta.files]
    for key, entry in meta.tensors.items():
        t, nd = doc["tensors"][key], len(entry.shape)
        got = sorted(
            (tuple(t["offsets"][i * nd : (i + 1) * nd]), tuple(t["shapes"][i * nd : (i + 1) * nd]), t["file"][i],
             t["byte_offset"][i])
            for i in range(t["count"]))
        assert got == [p[:4] for p in entry_of(meta, key)[4]]
        assert (t["dtype"], tuple(t["shape"]), t.get("encoding"), t.get("source")) == entry_of(meta, key)[:4]


def test_a_file_the_independent_writer_makes_reads_back_the_same():
    from .metadata_cases import metadatas as _  # noqa: F401 - the same cases, one fixed here
    from .hand_metadata import hand_meta

    meta = hand_meta(rows=40)
    back = metafile.decode(metadoc.write(metadoc.read(metafile.encode(meta))))
    assert all(entry_of(back, k) == entry_of(meta, k) for k in meta.tensors)
    assert back.structure == meta.structure


def test_the_saves_of_one_plan_share_what_does_not_change_and_each_reads_back_its_own():
    first = columns_meta(50, seed=1, step=1)
    data1 = metafile.encode(first)
    shared = first.tensors.columns.static["parts"]
    second_cols = first.tensors.columns
    from dataclasses import replace

    rng = np.random.default_rng(2)
    cols2 = replace(second_cols, checksums=rng.integers(0, 2**64, len(second_cols.checksums), dtype=np.uint64))
    second = replace(first, unique_id=4, tensors=ColumnTensors(cols2, 64),
                     structure=nested.fill_values(nested.restrict(first.structure, set(first.tensors)),
                                                  {})[0] | {"d": first.structure["d"][:1] + [["step", {"v": 2}]]})
    data2 = metafile.encode(second)
    assert second.tensors.columns.static["parts"] is shared  # not made again
    b1, b2 = metafile.decode(data1), metafile.decode(data2)
    assert b1.values() == {"step": 1} and b2.values() == {"step": 2}
    assert b2.unique_id == 4
    for key in first.tensors:
        assert entry_of(b1, key) == entry_of(first, key)
        assert entry_of(b2, key) == entry_of(second, key)


@pytest.mark.parametrize(
    "structure, outline, holders",
    [
        ({"d": [["m", {"d": [["w", {"t": 0}]]}], ["step", {"v": 1}]]}, {"d": [["step", {"v": 1}]]}, []),
        ({"d": [["opt", {"d": [["m", {"t": 0}], ["lr", {"v": 0.1}]]}]]}, {"d": [["opt", {"d": [["lr", {"v": 0.1}]]}]]},
         [["opt"]]),
        ({"d": [["l", {"l": [{"t": 0}, {"d": [["w", {"t": 0}]]}, {"v": 2}]}]]},
         {"d": [["l", {"l": [{"t": 0}, {"d": []}, {"v": 2}]}]]}, [["l"], ["l", 1]]),
        ({"d": [["m", {"d": [["w", {"t": 0}]]}]]}, {"d": []}, []),
    ],
)
def test_the_outline_keeps_the_plain_values_and_names_the_containers_that_hold_tensors(structure, outline, holders):
    assert metafile.outline_of(structure) == (outline, holders)


def test_a_part_that_compresses_too_well_is_stored_so_a_reader_keeps_its_bound():
    raw = bytes(1 << 20)  # zeros: zlib would give more than RATIO bytes out of each
    packed = deflate(raw)
    assert len(raw) <= RATIO * len(packed)


def test_the_work_of_a_write_grows_with_the_tensors_not_faster():
    """Function calls of a first save's write and of a later one's, at 2,000 and 20,000
    tensors: ten times the tensors, at most ten times the calls (a step whose work grew with
    tensors x parts or pieces x pieces would show as a hundred times)."""
    def first(n):
        meta = columns_meta(n)
        return calls_of(lambda: metafile.encode(meta))

    def later(n):
        meta = columns_meta(n)
        metafile.encode(meta)
        return calls_of(lambda: metafile.encode(meta))

    assert first(20_000) <= 10.5 * first(2_000)
    assert later(20_000) <= 10.5 * later(2_000)
    assert later(20_000) < first(20_000) / 3  # a later save does not encode what it shares again


def test_columns_are_taken_as_they_are_when_the_metadata_has_them():
    meta = columns_meta(3)
    assert metafile_write.columns_of(meta) is meta.tensors.columns
