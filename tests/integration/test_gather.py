"""save_gathered's plan and the safetensors file it describes, without paddle or processes.

Summaries are built here from the chunking rule (ceil split), the plan is executed by a small
simulation of the ranks written from the plan's contract (each region's bytes copied from its
sender's local piece to its place in its group), and the file checked with safetensors' own
reader and with ours.
"""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from unit.helpers import fast
from paddle_dcp import gather, singlefile
from paddle_dcp.format import safetensors
from paddle_dcp.core import save_plan
from paddle_dcp.core.boxes import Box
from paddle_dcp.parallel import wire
from paddle_dcp.parallel.gather_plan import GatherPlan, _limits, plan_gather
from paddle_dcp.errors import DcpError, FormatError, MismatchError, PlanError

DT = {"float32": np.float32, "int64": np.int64, "bool": np.bool_, "float16": np.float16, "uint8": np.uint8,
      "bfloat16": np.uint16, "float64": np.float64, "int8": np.int8, "int16": np.int16, "int32": np.int32}


def split(extent: int, parts: int, i: int) -> tuple[int, int]:
    step = -(-extent // parts)
    lo = min(i * step, extent)
    return lo, min(step, extent - lo)


def box_of(shape, spec, rank, nranks):
    """The box ``rank`` holds: spec "R" (whole), ("S", d) (dim d split over all ranks), or a
    list of per-rank boxes (None: holds nothing)."""
    if spec == "R":
        return Box.whole(shape)
    if isinstance(spec, list):
        return spec[rank]
    d = spec[1]
    lo, n = split(shape[d], nranks, rank)
    offsets = [0] * len(shape)
    sizes = list(shape)
    offsets[d], sizes[d] = lo, n
    return Box(tuple(offsets), tuple(sizes))


def value(shape, dtype, seed):
    rng = np.random.RandomState(seed)
    if dtype == "bool":
        return rng.rand(*shape) > 0.5
    return (rng.rand(*shape) * 1000).astype(DT[dtype]) if shape else np.asarray(rng.rand() * 100, DT[dtype])


def summary(rank: int, skeleton: dict, rows) -> save_plan.SaveSummary:
    """A rank's summary as a save sends it (encoded and decoded), from rows [key, dtype,
    global shape, offsets or None, shape or None] in the skeleton's tensor order."""
    pieces = [
        save_plan.LocalPiece(k, d, tuple(g), Box(tuple(o), tuple(b)) if o is not None else None)
        for k, d, g, o, b in rows
    ]
    return wire.decode_summary(wire.encode_summary(save_plan.SaveSummary.from_pieces(rank, skeleton, pieces)), rank)


def job(tensors: dict, nranks: int, values: dict | None = None):
    """(summaries, locals) for a job: tensors maps key -> (dtype, shape, spec)."""
    globals_ = {k: value(shape, dtype, i) for i, (k, (dtype, shape, _)) in enumerate(tensors.items())}
    summaries, locals_ = [], []
    for r in range(nranks):
        items = [[k, {"t": 0}] for k in tensors]
        items += [[k, {"v": v}] for k, v in (values or {}).items()]
        rows, mine = [], {}
        for k, (dtype, shape, spec) in tensors.items():
            b = box_of(shape, spec, r, nranks)
            if b is None or b.volume == 0:
                rows.append([k, dtype, list(shape), None, None])
                continue
            rows.append([k, dtype, list(shape), list(b.offsets), list(b.shape)])
            mine[k] = (b, np.ascontiguousarray(globals_[k][b.slices() + (Ellipsis,)]))
        summaries.append(summary(r, {"d": items}, rows))
        locals_.append(mine)
    return summaries, locals_, globals_


def simulate(plan: GatherPlan, locals_, root: int) -> bytes:
    """The file the ranks would write, and a check that every byte of every group is written
    exactly once and only from a piece its sender holds."""
    data = bytearray()
    for g in plan.groups:
        buf = np.zeros(g.nbytes, np.uint8)
        hits = np.zeros(g.nbytes, np.int64)
        sources = [(root, [r]) for r in g.own] + [(s, msg) for s, msgs in g.messages.items() for msg in msgs]
        for sender, regions in sources:
            for reg in regions:
                box, local = locals_[sender][reg.key]
                assert box.contains(reg.box) and reg.chunk.contains(reg.box)
                src = local[reg.box.relative_to(box).slices() + (Ellipsis,)]
                chunk = buf[reg.at : reg.at + reg.chunk.volume * reg.itemsize].view(local.dtype).reshape(reg.chunk.shape)
                dest = chunk[reg.box.relative_to(reg.chunk).slices() + (Ellipsis,)]
                dest[...] = src
                mark = hits[reg.at : reg.at + reg.chunk.volume * reg.itemsize].reshape(
                    reg.chunk.shape + (reg.itemsize,) if reg.chunk.shape else (reg.itemsize,))
                mark[reg.box.relative_to(reg.chunk).slices() + (Ellipsis,)] += 1
        assert (hits == 1).all(), f"group [{g.start}, {g.stop}): bytes written {sorted(set(hits.tolist()))} times"
        assert len(data) == g.start, (len(data), g.start)
        data += buf.tobytes()
    assert len(data) == plan.data_bytes
    return plan.header + bytes(data)


def test_parse_size():
    assert gather.parse_size("3G") == 3 << 30
    assert gather.parse_size("512M") == 512 << 20
    assert gather.parse_size("64k") == 64 << 10
    assert gather.parse_size("2GiB") == gather.parse_size("2GB") == 2 << 30
    assert gather.parse_size("100") == gather.parse_size(100) == 100
    assert gather.parse_size(np.int64(7)) == 7
    for bad in ("3X", "", "G", "-1M", "0", 0, -5, True, 1.5, None, "1.5G"):
        with pytest.raises(DcpError):
            gather.parse_size(bad)


TENSORS = {
    "model.s0": ("float32", (7, 5), ("S", 0)),
    "model.s1": ("bfloat16", (7, 5), ("S", 1)),
    "model.r": ("int64", (3, 4), "R"),
    "model.vec": ("bool", (9,), ("S", 0)),
    "model.big3d": ("float16", (6, 4, 3), ("S", 2)),
    "scalar": ("float64", (), "R"),
    "empty": ("float32", (0, 3), "R"),
}


@pytest.mark.parametrize("nranks,root", [(1, 0), (2, 0), (2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("limit", [1, 7, 40, 1000, 1 << 30])
def test_plan_writes_every_byte_once_within_the_limit(nranks, root, limit, tmp_path):
    summaries, locals_, globals_ = job(TENSORS, nranks, {"step": 5})
    plan = plan_gather(summaries, tuple(range(nranks)), root, "params", limit)
    batch, _, part = _limits(limit)
    for g in plan.groups:
        assert g.nbytes <= max(limit, 8)  # a tensor larger than the limit is cut, down to one element
        assert root not in g.messages  # the gathering rank never sends to itself
        for sender, msgs in g.messages.items():
            for msg in msgs:
                assert sum(r.nbytes for r in msg) <= max(batch, part)
    if limit >= 1 << 30:
        assert len(plan.groups) == 1
    blob = simulate(plan, locals_, root)
    path = tmp_path / "f.safetensors"
    path.write_bytes(blob)
    header = safetensors.read_header(str(path))
    assert set(header.entries) == set(TENSORS)
    assert list(header.entries)[: len(TENSORS) - 1] == [k for k in TENSORS if k != "empty"]
    # numpy has no bfloat16: that tensor is checked from the file's bytes
    target = {k: np.zeros(s, DT[d]) for k, (d, s, _) in TENSORS.items() if d != "bfloat16"}
    singlefile.load_file(target, str(path))
    for k, v in globals_.items():
        if k in target:
            assert target[k].dtype == v.dtype and target[k].shape == v.shape, k
            assert target[k].tobytes() == v.tobytes(), k
        else:
            e = header.entries[k]
            assert e.code == "BF16" and blob[e.begin : e.begin + e.nbytes] == v.tobytes(), k


def test_safetensors_reads_the_file(tmp_path):
    """safetensors' own reader (Rust) accepts the header, padding and layout, values included."""
    import safetensors.numpy

    tensors = {k: v for k, v in TENSORS.items() if v[0] != "bfloat16"}
    summaries, locals_, globals_ = job(tensors, 3)
    plan = plan_gather(summaries, (0, 1, 2), 1, "params", 24)
    blob = simulate(plan, locals_, 1)
    assert (8 + struct.unpack("<Q", blob[:8])[0]) % 8 == 0
    theirs = safetensors.numpy.load(blob)
    assert set(theirs) == set(tensors) - {"empty"}
    for k, v in theirs.items():
        assert v.dtype == globals_[k].dtype and np.array_equal(v, globals_[k]), k
    meta = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])["__metadata__"]
    assert meta["format"] == "paddle_dcp.gathered" and json.loads(meta["empty_tensors"]) == {
        "empty": {"dtype": "F32", "shape": [0, 3]}}


def test_replicated_pieces_travel_once_and_never_to_a_holder():
    tensors = {"r": ("float32", (8, 8), "R"), "s": ("float32", (8, 8), ("S", 0))}
    summaries, _, _ = job(tensors, 4)
    plan = plan_gather(summaries, (0, 1, 2, 3), 2, "params", 1 << 20)
    sent = [(s, reg.key) for g in plan.groups for s, msgs in g.messages.items() for m in msgs for reg in m]
    assert ("r" not in {k for _, k in sent})  # the gathering rank holds it
    assert sorted(s for s, k in sent if k == "s") == [0, 1, 3]
    assert {r.key for g in plan.groups for r in g.own} == {"r", "s"}
    assignment = json.loads(plan.assignment(3))
    assert [[m[0][0] for m in g] for g in assignment] == [["s"]]


def test_a_piece_held_by_others_is_sent_by_the_least_loaded_holder():
    boxes = [None, Box((0, 0), (4, 4)), Box((0, 0), (4, 4)), Box((0, 0), (4, 4))]
    tensors = {f"t{i}": ("float32", (4, 4), boxes) for i in range(3)}
    summaries, _, _ = job(tensors, 4)
    plan = plan_gather(summaries, (0, 1, 2, 3), 0, "params", 1 << 20)
    senders = sorted(s for g in plan.groups for s, msgs in g.messages.items() for _ in msgs)
    assert senders == [1, 2, 3]


def test_params_needs_the_same_keys_on_every_rank_and_opt_takes_the_union():
    a = summary(0, {"d": [["w", {"t": 0}], ["lr", {"v": 1}]]}, [["w", "float32", [2], [0], [2]]])
    b = summary(1, {"d": [["w", {"t": 0}], ["m1", {"t": 0}], ["lr", {"v": 2}], ["x", {"v": 3}]]},
                [["w", "float32", [2], [0], [2]], ["m1", "int64", [3], [0], [3]]])
    with pytest.raises(MismatchError, match="state_type='opt'"):
        plan_gather([a, b], (0, 1), 0, "params", 100)
    plan = plan_gather([a, b], (0, 1), 0, "opt", 100)
    assert [t.key for t in plan.tensors] == ["w", "m1"]
    from paddle_dcp.core import nested

    assert nested.values_of(plan.skeleton) == {"lr": 1, "x": 3}  # the gathering rank's value wins


def test_disagreements_and_refusals():
    def summ(rank, rows):
        return summary(rank, {"d": [[r[0], {"t": 0}] for r in rows]}, rows)

    w = ["w", "float32", [4], [0], [4]]
    with pytest.raises(MismatchError, match="w"):
        plan_gather([summ(0, [w]), summ(1, [["w", "float32", [5], [0], [5]]])], (0, 1), 0, "params", 9)
    with pytest.raises(MismatchError, match="w"):
        plan_gather([summ(0, [w]), summ(1, [["w", "int64", [4], [0], [4]]])], (0, 1), 0, "params", 9)
    with pytest.raises(FormatError, match="complex64"):
        plan_gather([summ(0, [["z", "complex64", [2], [0], [2]]])], (0,), 0, "params", 9)
    with pytest.raises(FormatError, match="__metadata__"):
        plan_gather([summ(0, [["__metadata__", "float32", [2], [0], [2]]])], (0,), 0, "params", 9)
    with pytest.raises(PlanError):  # rows 2..3 held by nobody
        plan_gather([summ(0, [["g", "float32", [4], [0], [2]]])], (0,), 0, "params", 9)
    with pytest.raises(PlanError):  # overlapping pieces
        plan_gather([summ(0, [["o", "float32", [4], [0], [3]]]), summ(1, [["o", "float32", [4], [2], [2]]])],
                           (0, 1), 0, "params", 9)


@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    nranks=st.integers(1, 4),
    dim=st.integers(0, 2),
    limit=st.integers(1, 400),
    root=st.integers(0, 3),
)
@fast(60)
def test_any_split_any_limit_round_trips(shape, nranks, dim, limit, root):
    shape = tuple(shape)
    root %= nranks
    spec = ("S", dim % len(shape))
    tensors = {"a": ("int32", shape, spec), "b": ("float16", shape, "R"), "c": ("int8", shape, spec)}
    summaries, locals_, globals_ = job(tensors, nranks)
    plan = plan_gather(summaries, tuple(range(nranks)), root, "params", limit)
    blob = simulate(plan, locals_, root)
    n = struct.unpack("<Q", blob[:8])[0]
    header = safetensors.parse_header(blob[8 : 8 + n], len(blob), "mem")
    for k, v in globals_.items():
        e = header.entries[k]
        got = np.frombuffer(blob[e.begin : e.begin + e.nbytes], v.dtype).reshape(v.shape)
        assert np.array_equal(got, v), k


def test_gathering_onto_a_directory_is_refused_before_any_byte_moves(tmp_path):
    from paddle_dcp.errors import ArgumentError

    with pytest.raises(ArgumentError, match=r"is a directory: save_gathered writes one file; name it, e\.g\. .*model\.safetensors"):
        gather.save_gathered({"w": np.arange(4, dtype=np.float32)}, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # no temporary file left beside it



def run_transfer(nranks: int, root: int, limit: int, fail_rank: int | None = None, fail_at: int = 1):
    """gather's step 3 on ranks that are threads, with a point to point that blocks until
    taken: every rank sends its share of the plan (rank ``fail_rank``'s packing fails from its
    message number ``fail_at`` on) and the gathering rank writes each group to a recording
    writer. Returns (plan, the groups written, what each rank's transfer returned, the bytes
    each rank sent)."""
    import threading
    from types import SimpleNamespace

    from unit.parallel.fakes import ThreadWorld
    from paddle_dcp.parallel.device import HostBytes

    summaries, locals_, _ = job(TENSORS, nranks)
    plan = plan_gather(summaries, tuple(range(nranks)), root, "params", limit)
    written: list[bytes] = []
    writer = SimpleNamespace(write=lambda data: written.append(bytes(data)))
    real, packed, rank_of = gather._message, {}, {}

    def message(msg, pieces, nbytes):
        me = rank_of[threading.get_ident()]
        packed[me] = packed.get(me, 0) + 1
        if me == fail_rank and packed[me] > fail_at:
            raise OSError("the device copy failed")
        return real(msg, pieces, nbytes)

    def rank(comm):
        me = rank_of[threading.get_ident()] = comm.rank
        held = {k: SimpleNamespace(local=HostBytes(a, a), piece=SimpleNamespace(box=b, dtype=TENSORS[k][0]))
                for k, (b, a) in locals_[me].items()}
        if me == root:
            return gather._receive(comm, plan, held, writer)
        return gather._send_all(comm, root, gather._parse_assignment(plan.assignment(me), held, root), held)

    world = ThreadWorld(nranks)
    gather._message = message
    try:
        results = world.run(rank)
    finally:
        gather._message = real
    sent = {r: sum(n for s, _, n in world.sent if s == r) for r in range(nranks)}
    return plan, written, results, sent


@pytest.mark.parametrize("nranks,root,limit", [(2, 0, 40), (3, 2, 7), (4, 1, 1000)])
def test_the_transfer_writes_the_simulated_file(nranks, root, limit):
    """Step 3 as the ranks run it (messages through parallel/transfer) writes the bytes the
    plan's simulation gives, group by group."""
    summaries, locals_, _ = job(TENSORS, nranks)
    plan, written, results, _ = run_transfer(nranks, root, limit)
    assert all(r is None for r in results.values()), results
    assert plan.header + b"".join(written) == simulate(plan, locals_, root)


def test_a_sender_that_fails_sends_no_more_bytes_and_the_gathering_rank_writes_no_more_groups():
    nranks, root, limit = 3, 0, 7
    plan, whole, _, sent_whole = run_transfer(nranks, root, limit)
    plan, written, results, sent = run_transfer(nranks, root, limit, fail_rank=2, fail_at=1)
    assert isinstance(results[2], OSError) and results[1] is None and results[0] is None  # nobody hangs
    # the groups before the one of rank 2's second message are written as they were; none after
    counts = np.cumsum([len(g.messages.get(2, [])) for g in plan.groups])
    assert written == whole[: int(np.argmax(counts >= 2))]
    first = sum(r.nbytes for r in next(m for g in plan.groups for m in g.messages.get(2, [])))
    assert sent[2] == 16 * int(counts[-1]) + first < sent_whole[2]  # headers only after the failure
