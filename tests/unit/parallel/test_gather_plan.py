"""paddle_dcp.parallel.gather_plan: a gathered save's plan from every rank's summary (pure): the
safetensors header it writes, who sends which region in which group, and every byte of the data
section assembled once. Oracles: the safetensors layout (8-byte length, JSON, tensors back to
back) and the boxes each rank holds, written out here."""
import json
import struct

import pytest

from paddle_dcp.core import save_plan
from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import FormatError, MismatchError
from paddle_dcp.parallel.gather_plan import plan_gather

SKELETON = {"d": [["w", {"t": 0}], ["b", {"t": 0}], ["step", {"v": 3}]]}


def summaries(world: int = 2):
    """w: float32 (4, 3) cut in row blocks over ``world`` ranks; b: int64 (2,) on every rank."""
    rows = 4 // world
    return [
        save_plan.SaveSummary.from_pieces(r, SKELETON, [
            save_plan.LocalPiece("w", "float32", (4, 3), Box((r * rows, 0), (rows, 3))),
            save_plan.LocalPiece("b", "int64", (2,), Box.whole((2,))),
        ])
        for r in range(world)
    ]  # fmt: skip


def header_of(blob: bytes) -> dict:
    (n,) = struct.unpack("<Q", blob[:8])
    assert len(blob) == 8 + n and (8 + n) % 8 == 0
    return json.loads(blob[8:])


def test_the_header_lays_the_tensors_back_to_back_in_the_state_dicts_order():
    plan = plan_gather(summaries(), (0, 1), 0, "params", 1 << 20)
    doc = header_of(plan.header)
    assert doc["w"] == {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]}
    assert doc["b"] == {"dtype": "I64", "shape": [2], "data_offsets": [48, 64]}
    assert json.loads(doc["__metadata__"]["structure"]) == SKELETON
    assert plan.data_bytes == 64 and [t.key for t in plan.tensors] == ["w", "b"]


def test_the_gathering_rank_copies_its_own_pieces_and_receives_the_others():
    plan = plan_gather(summaries(), (0, 1), 0, "params", 1 << 20)
    (group,) = plan.groups
    assert (group.start, group.stop) == (0, 64)
    assert sorted((r.key, r.box) for r in group.own) == [("b", Box((0,), (2,))), ("w", Box((0, 0), (2, 3)))]
    assert list(group.messages) == [1]  # b is held by the gathering rank: never sent
    assert json.loads(plan.assignment(1)) == [[[["w", [2, 0], [2, 3]]]]]
    assert json.loads(plan.assignment(0)) == [[]]


@pytest.mark.parametrize("root", [0, 1, 3])
@pytest.mark.parametrize("limit", [16, 40, 1 << 20])
def test_every_byte_of_the_data_is_assembled_once_in_groups_within_the_limit(root, limit):
    plan = plan_gather(summaries(4), (0, 1, 2, 3), root, "params", limit)
    assert [g.start for g in plan.groups] == [0] + [g.stop for g in plan.groups[:-1]]
    assert plan.groups[-1].stop == plan.data_bytes == 64
    got = {"w": [], "b": []}
    for g in plan.groups:
        assert g.nbytes <= max(limit, 8) and root not in g.messages
        regions = list(g.own) + [r for msgs in g.messages.values() for m in msgs for r in m]
        assert sum(r.nbytes for r in regions) == g.nbytes
        for r in regions:
            got[r.key] += [tuple(i + o for i, o in zip(idx, r.box.offsets)) for idx in _indices(r.box.shape)]
    assert sorted(got["w"]) == sorted(_indices((4, 3))) and sorted(got["b"]) == [(0,), (1,)]


def _indices(shape):
    return [(i,) if len(shape) == 1 else (i, j) for i in range(shape[0]) for j in range(shape[-1] if len(shape) > 1 else 1)]


def test_ranks_that_disagree_or_a_reserved_key_are_refused():
    other = save_plan.SaveSummary.from_pieces(1, SKELETON, [
        save_plan.LocalPiece("w", "float64", (4, 3), Box((2, 0), (2, 3))),
        save_plan.LocalPiece("b", "int64", (2,), Box.whole((2,))),
    ])  # fmt: skip
    with pytest.raises(MismatchError, match="w"):
        plan_gather([summaries()[0], other], (0, 1), 0, "params", 1 << 20)
    reserved = {"d": [["__metadata__", {"t": 0}]]}
    one = save_plan.SaveSummary.from_pieces(0, reserved, [
        save_plan.LocalPiece("__metadata__", "float32", (2,), Box.whole((2,))),
    ])  # fmt: skip
    with pytest.raises(FormatError, match="reserved by safetensors"):
        plan_gather([one], (0,), 0, "params", 1 << 20)


def test_a_piece_the_gathering_rank_lacks_is_sent_by_the_holder_that_sent_least_so_far():
    """Both row blocks of w are held by ranks 1 and 2 (a save plan's distinct pieces): the first
    goes to rank 1 (a tie: the lower rank), the second to rank 2; b, held by the gathering rank,
    is never sent."""
    def of(r):
        w = [save_plan.LocalPiece("w", "float32", (4, 3), Box((0, 0), (2, 3))),
             save_plan.LocalPiece("w", "float32", (4, 3), Box((2, 0), (2, 3)))] if r else \
            [save_plan.LocalPiece("w", "float32", (4, 3), None)]
        return save_plan.SaveSummary.from_pieces(r, {"d": [["w", {"t": 0}], ["b", {"t": 0}]]},
                                                 w + [save_plan.LocalPiece("b", "int64", (2,), Box.whole((2,)))])
    plan = plan_gather([of(0), of(1), of(2)], (0, 1, 2), 0, "params", 1 << 20)
    assert json.loads(plan.assignment(1)) == [[[["w", [0, 0], [2, 3]]]]]
    assert json.loads(plan.assignment(2)) == [[[["w", [2, 0], [2, 3]]]]]
    assert json.loads(plan.assignment(0)) == [[]]
