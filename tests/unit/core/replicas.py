"""Builders for ShardedWeight and save_replicas cases: a rank holding one key as several boxes
(a flattened range), the plan and metadata of copies held by every rank, and the numpy markers
counting how often each element is written. Shared by the save plan, parse and load plan
tests."""
import numpy as np

from paddle_dcp.core import save_plan
from paddle_dcp.parallel import wire
from paddle_dcp.core.boxes import Box, flat_range_boxes
from paddle_dcp.core.metadata import blocks_of


SHAPE = (4, 5)


def flat_pieces(key, start, stop, shape=SHAPE, dtype="float32"):
    return [save_plan.LocalPiece(key, dtype, shape, b) for b in flat_range_boxes(shape, start, stop)] or [
        save_plan.LocalPiece(key, dtype, shape, None)
    ]


def summary_of(rank, per_key):
    """per_key: key -> list of LocalPiece (one key may have several)."""
    skeleton = {"d": [[k, {"t": 0}] for k in per_key] + [["step", {"v": 1}]]}
    return save_plan.SaveSummary.from_pieces(rank, skeleton, [p for ps in per_key.values() for p in ps])


def plan_of(summaries, replicas=False, wired=True):
    if wired:
        cache: dict = {}
        summaries = [wire.decode_summary(wire.encode_summary(s), s.rank, cache) for s in summaries]
    return save_plan.plan_save(summaries, replicas)


def meta_of(plan, block_bytes=64):
    sums = {}
    for r, rows in plan.writes.items():
        mine = np.flatnonzero(plan.piece_writer == r)
        n = int(blocks_of(plan.piece_nbytes[mine], block_bytes).sum())
        sums[r] = np.arange(n, dtype=np.uint64) + 1000 * r
    return save_plan.build_metadata(plan, sums, plan.skeleton, 0, 2, block_bytes)


def covered(plan, key):
    """How often every element of ``key`` is written, as a numpy marker array."""
    k = plan.keys.index(key)
    nd = len(plan.shapes[k])
    marks = np.zeros(plan.shapes[k], dtype=np.int64)
    for i in np.flatnonzero(plan.piece_key == k):
        box = Box(tuple(plan.piece_offsets[i, :nd].tolist()), tuple(plan.piece_shapes[i, :nd].tolist()))
        marks[box.slices()] += 1
    return marks


def replicated(world=2):
    whole = [save_plan.LocalPiece("w", "float32", SHAPE, Box.whole(SHAPE))]
    halves = [flat_pieces("h", 0, 10), flat_pieces("h", 10, 20)]
    return [summary_of(r, {"w": whole, "h": halves[r % 2]}) for r in range(world)]
