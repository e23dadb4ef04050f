"""Messages between ranks: summaries, assignments, reports (no pickle, exact round trips)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.core import save_plan
from paddle_dcp.parallel import wire
from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import FormatError

from ..core.replicas import flat_pieces, summary_of
from ..helpers import fast


def make_summary(rank, boxes):
    keys = [f"k{i}" for i in range(len(boxes))]
    skeleton = {"d": [[k, {"t": 0}] for k in keys] + [["step", {"v": 3}], ["lr", {"f": "nan"}]]}
    pieces = [save_plan.LocalPiece(k, "float32", (8,) * (b.ndim if b else 2), b) for k, b in zip(keys, boxes)]
    return save_plan.SaveSummary.from_pieces(rank, skeleton, pieces)


def test_summary_round_trip_is_exact():
    s = make_summary(3, [Box((0, 4), (8, 4)), None, Box((), ()), Box((1,), (0,))])
    back = wire.decode_summary(wire.encode_summary(s), 3)
    assert back.rank == 3 and back.skeleton == s.skeleton
    assert back.dtypes == s.dtypes and back.global_shapes == s.global_shapes
    assert back.boxes.dtype == np.int32 and np.array_equal(back.boxes, s.boxes)  # every value fits
    assert [back.piece_box(i) for i in range(4)] == [Box((0, 4), (8, 4)), None, Box((), ()), None]


def test_box_values_past_int32_travel_as_int64_and_widen_the_whole_table():
    big = make_summary(1, [Box((2**31, 0), (2**33, 8))])  # a dimension of 2**34 elements
    small = make_summary(0, [Box((0, 0), (4, 8))])
    assert wire.encode_summary(big)[:4] == b"DCS1" and wire.encode_summary(small)[:4] == b"DCS3"
    both = wire.decode_summaries([0, 1], [wire.encode_summary(small), wire.encode_summary(big)])
    assert [b.boxes.dtype for b in both] == [np.int64, np.int64]
    assert np.array_equal(both[0].boxes, small.boxes) and np.array_equal(both[1].boxes, big.boxes)
    assert both[1].piece_box(0) == Box((2**31, 0), (2**33, 8))


def test_equal_layouts_share_one_parsed_header():
    cache = {}
    a = wire.decode_summary(wire.encode_summary(make_summary(0, [Box((0, 0), (4, 8))])), 0, cache)
    b = wire.decode_summary(wire.encode_summary(make_summary(1, [Box((4, 0), (4, 8))])), 1, cache)
    c = wire.decode_summary(wire.encode_summary(make_summary(2, [Box((0,), (8,))])), 2, cache)
    assert a.header_id == b.header_id != c.header_id
    assert len(cache) == 2 and a.outline is b.outline and a.keys is b.keys


def test_from_pieces_refuses_pieces_out_of_skeleton_order():
    skeleton = {"d": [["a", {"t": 0}], ["b", {"t": 0}]]}
    pieces = [save_plan.LocalPiece(k, "float32", (2,), Box.whole((2,))) for k in ("b", "a")]
    with pytest.raises(save_plan.PlanError):
        save_plan.SaveSummary.from_pieces(0, skeleton, pieces)


@pytest.mark.parametrize("decode", [lambda d: wire.decode_summary(d, 0), wire.decode_assignment,
                                    lambda d: wire.decode_report(d, 0)])  # fmt: skip
def test_messages_with_the_wrong_tag_are_refused(decode):
    with pytest.raises(FormatError):
        decode(b"XXXX" + bytes(40))


@fast(100)
@given(st.integers(0, 300).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, max(0, n - 1)), max_size=n))))
def test_assignment_round_trip(case):
    leaves, writes = case
    got = wire.decode_assignment(wire.encode_assignment(np.array(sorted(writes), dtype=np.int64), leaves))
    assert got.tolist() == sorted(writes)


@fast(100)
@given(st.integers(0, 2**63), st.lists(st.integers(0, 2**64 - 1), max_size=20))
def test_report_round_trip(file_bytes, sums):
    n, got = wire.decode_report(wire.encode_report(file_bytes, np.array(sums, dtype=np.uint64)), 0)
    assert n == file_bytes and got.tolist() == sums


def test_rle_runs():
    assert wire.rle([5, 1, 2, 3, 7, 8, 2]) == [[1, 3], [5, 5], [7, 8]]
    assert wire.rle([]) == []


# ------------------------------------------------------------------ several boxes per key (ShardedWeight)
def test_summary_with_several_rows_for_one_leaf_round_trips_the_wire():
    s = summary_of(1, {"a": flat_pieces("a", 3, 17), "b": [save_plan.LocalPiece("b", "int64", (3,), Box.whole((3,)))]})
    assert len(s.boxes) == 4 and s.row_leaf.tolist() == [0, 0, 0, 1]
    back = wire.decode_summary(wire.encode_summary(s), 1)
    assert back.row_leaf.tolist() == [0, 0, 0, 1] and np.array_equal(back.boxes, s.boxes)
    assert [back.piece_box(i) for i in range(4)] == [Box((0, 3), (1, 2)), Box((1, 0), (2, 5)), Box((3, 0), (1, 2)), Box((0,), (3,))]
    assert back.dtypes == ("float32", "int64")
    one = summary_of(0, {"b": [save_plan.LocalPiece("b", "int64", (3,), Box.whole((3,)))]})
    assert one.row_leaf is None and wire.encode_summary(one)[:4] == b"DCS3"  # a leaf column only when needed


def test_summaries_decoded_together_share_one_table_and_equal_single_decodes():
    summaries = [make_summary(r, [Box((r, 0), (1, 8)), None]) for r in range(3)]
    blobs = [wire.encode_summary(s) for s in summaries]
    together = wire.decode_summaries([0, 1, 2], blobs)
    for s, t in zip(summaries, together):
        assert np.array_equal(t.boxes, s.boxes) and t.rank == s.rank and t.global_shapes == s.global_shapes
    assert all(np.shares_memory(together[0].boxes.base, t.boxes) for t in together)
    assert not together[1].boxes.flags.writeable


def test_summaries_of_different_widths_decode_apart():
    summaries = [make_summary(0, [Box((0, 0), (8, 8))]), make_summary(1, [Box((0,), (8,))])]
    together = wire.decode_summaries([0, 1], [wire.encode_summary(s) for s in summaries])
    assert [t.boxes.shape for t in together] == [(1, 5), (1, 3)]
    assert np.array_equal(together[1].boxes, summaries[1].boxes)


@pytest.mark.parametrize("rows", [2, 1 << 40])
def test_a_summary_claiming_other_rows_than_it_holds_is_refused_before_allocating(rows):
    blob = bytearray(wire.encode_summary(make_summary(0, [Box((0, 0), (8, 8))] * 3)))
    blob[12:20] = rows.to_bytes(8, "little")  # the row count, after the tag and header length
    with pytest.raises(FormatError, match="rank 0: a save summary"):
        wire.decode_summaries([0], [bytes(blob)])


def _header_edited(blob: bytes, index: int, value: int) -> bytes:
    """A summary whose header's integer ``index`` (dtype codes, then ndims, then shapes) is
    ``value``, the header compressed again (what a rank running other code could send)."""
    import struct
    import zlib

    hlen, rows, width = struct.unpack_from("<QQQ", blob, 4)
    raw = bytearray(zlib.decompress(blob[28 : 28 + hlen]))
    (text_len,) = struct.unpack_from("<Q", raw, 0)
    struct.pack_into("<q", raw, 24 + text_len + 8 * index, value)
    packed = zlib.compress(bytes(raw))
    return blob[:4] + struct.pack("<QQQ", len(packed), rows, width) + packed + blob[28 + hlen :]


@pytest.mark.parametrize("index, value", [(1, -1), (1, 65), (2, -8), (2, 2**62 + 1)])
def test_a_summary_with_shapes_out_of_range_is_refused(index, value):
    """ndims (index 1 of a one-tensor summary) in [0, width], shape entries (from index 2) in
    [0, 2**62]: anything else is a FormatError naming the rank, never a value planned with."""
    blob = wire.encode_summary(make_summary(0, [Box((0, 0), (8, 8))]))
    assert wire.decode_summary(_header_edited(blob, index, 2 if index == 1 else 8), 0).global_shapes
    with pytest.raises(FormatError, match="rank 0: a save summary's shapes are out of range"):
        wire.decode_summaries([0], [_header_edited(blob, index, value)])


def test_a_summary_of_scalars_only_has_no_shape_entries_to_check():
    back = wire.decode_summary(wire.encode_summary(make_summary(2, [Box((), ())])), 2)
    assert back.global_shapes == ((),) and back.ndims.tolist() == [0] and back.shapes.shape == (1, 0)


@pytest.mark.parametrize("values", [[], [5], list(range(1024)), [3, -7, 2**40, 0, 0, 12], [8] * 128])
def test_packed_ints_round_trip(values):
    assert wire.unpack_ints(wire.pack_ints(values)) == values


def test_ints_with_a_pattern_pack_into_a_few_bytes():
    assert len(wire.pack_ints(list(range(8192)))) < 200
    assert len(wire.encode_json(wire.pack_nodes([tuple(range(i, i + 8)) for i in range(0, 8192, 8)]))) < 300


@pytest.mark.parametrize("text", ["", "not base64!", "AAAA", wire.pack_names(["a"])])
def test_packings_that_do_not_unpack_are_refused(text):
    with pytest.raises(FormatError):
        wire.unpack_ints(text) if text != "" else wire.unpack_nodes([text, text])


def test_a_layout_and_names_cross_the_wire_whole():
    from paddle_dcp.core.job_layout import JobLayout, Mesh

    layout = JobLayout(1024, (Mesh((16, 8), tuple(range(128, 256)), ("dp", "tp")),),
                       tuple(tuple(range(i, i + 8)) for i in range(0, 1024, 8)))
    doc = wire.encode_layout(layout)
    assert wire.decode_layout(wire.decode_json(wire.encode_json(doc))) == layout and len(wire.encode_json(doc)) < 300
    assert wire.decode_layout(wire.encode_layout(JobLayout(3))) == JobLayout(3)
    names = [f"{r}_1000.distcp" for r in range(8, 72)]
    assert wire.unpack_names(wire.pack_names(names)) == names and len(wire.pack_names(names)) < 200
    assert wire.unpack_names(wire.pack_names([])) == []
