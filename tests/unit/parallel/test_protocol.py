"""The save and load protocols (parallel/protocol.py) through their real generators, with fake
ranks implementing SaveRankProtocol / LoadRankProtocol / LoadWork: on a world of threads with
real comms (tests/unit/parallel/fakes.py) and on the in-process SimWorld, which must agree."""
from __future__ import annotations

from dataclasses import dataclass, field as dataclass_field

import numpy as np
import pytest

from paddle_dcp.core import save_plan
from paddle_dcp.core.boxes import Box
from paddle_dcp.core.dtypes import itemsize
from paddle_dcp.core.metadata import Metadata
from paddle_dcp.parallel import protocol, requests, servers
from paddle_dcp.parallel.simworld import SimWorld
from paddle_dcp.errors import CollectiveError, FormatError, StorageError
from paddle_dcp.io import storage

from .fakes import ThreadWorld

SIZE = 3
ROWS = 2  # rows of "w" per rank


def pieces_of(rank: int) -> list[save_plan.LocalPiece]:
    """Rank r holds rows [2r, 2r+2) of w (6x4 float32) and all of b (4 int64, replicated)."""
    return [
        save_plan.LocalPiece("b", "int64", (4,), Box((0,), (4,))),
        save_plan.LocalPiece("w", "float32", (SIZE * ROWS, 4), Box((ROWS * rank, 0), (ROWS, 4))),
    ]


class FakeSaveRank:
    """A SaveRankProtocol that writes nothing: it records what it is asked to write."""

    block_bytes = 1 << 20
    created_by = "test"
    replicas = False
    staged = False
    layout = None
    compress = None

    def __init__(self, rank: int, cache: dict, fail_step: str | None = None, reductions: tuple = ()):
        self.rank, self.ranks, self.coordinator, self.cache = rank, tuple(range(SIZE)), 0, cache
        self.fail_step = fail_step
        self.reductions = reductions  # its Partial tensors' (requests.Reduction)
        self.pieces = pieces_of(rank)
        self.written: list[save_plan.LocalPiece] = []
        self.published: list[Metadata] = []
        self.steps: list[str] = []

    def _step(self, name: str) -> None:
        self.steps.append(name)
        if name == self.fail_step:
            raise StorageError(f"rank {self.rank}: disk full")

    def prepare(self):
        self._step("prepare")
        return "prepared", self.reductions

    def describe(self, prepared):
        assert prepared == "prepared"
        self._step("describe")
        return protocol.Described({"d": [["b", {"t": 0}], ["w", {"t": 0}]]}, tuple(self.pieces), "held")

    def choose_id(self):
        self._step("choose id")
        return 7, "listing"

    def prepare_id(self, uid, listing):
        assert listing == ("listing" if self.rank == self.coordinator else None)
        self._step("prepare id")
        return -1, f"listing of {self.rank}"

    def claim_id(self, uid, generation, listing):
        assert self.rank == self.coordinator and listing == f"listing of {self.rank}"
        self._step("claim id")
        return uid, generation

    def stage(self, described, leaves):
        self._step("stage")
        return protocol.Described(described.skeleton, described.pieces, "staged")

    def reserve(self, described, leaves):
        self._step("reserve")

    def write(self, described, uid, generation, leaves):
        assert described.sources == ("staged" if "stage" in self.steps else "held")
        self._step("write")
        self.written = [self.pieces[i] for i in leaves.tolist()]
        nbytes = np.array([p.box.volume * itemsize(p.dtype) for p in self.written], dtype=np.int64)
        _, size = save_plan.layout_offsets(nbytes)
        count = int(sum(1 for n in nbytes.tolist() if n)) if len(nbytes) else 0
        return size, list(range(1, count + 1))

    def values(self, prepared):
        assert prepared == "prepared"
        return {}

    def publish(self, meta, generation):
        self._step("publish")
        self.published.append(meta)

    def tidy(self, uid, generation, listing):
        assert listing == f"listing of {self.rank}"  # prepare id's, carried by the protocol
        self._step("tidy")


def save_on_threads(ranks: dict[int, FakeSaveRank]) -> dict:
    return ThreadWorld(SIZE).run(lambda comm: protocol.run(comm, protocol.save(ranks[comm.rank])))


def test_save_writes_every_piece_once_and_all_ranks_agree():
    ranks = {r: FakeSaveRank(r, {}) for r in range(SIZE)}
    results = save_on_threads(ranks)
    assert all(isinstance(v, protocol.SaveResult) for v in results.values()), results
    assert {v.unique_id for v in results.values()} == {7}
    written = [(p.key, p.box) for r in ranks.values() for p in r.written]
    expected = [("b", Box((0,), (4,)))] + [("w", Box((ROWS * r, 0), (ROWS, 4))) for r in range(SIZE)]
    assert sorted(written, key=repr) == sorted(expected, key=repr)  # the replicated b: once
    assert [len(r.published) for r in ranks.values()] == [1, 0, 0]  # the coordinator alone
    meta = ranks[0].published[0]
    assert meta.unique_id == 7
    assert {k: meta.tensors[k].shape for k in meta.tensors} == {"b": (4,), "w": (6, 4)}


def test_the_simulated_world_runs_the_same_save():
    threads = {r: FakeSaveRank(r, {}) for r in range(SIZE)}
    save_on_threads(threads)
    simulated = {r: FakeSaveRank(r, {}) for r in range(SIZE)}
    SimWorld(tuple(range(SIZE)), 0).run({r: protocol.save(simulated[r]) for r in range(SIZE)})
    assert simulated[0].published[0].to_json() == threads[0].published[0].to_json()
    assert [s.steps for s in simulated.values()] == [t.steps for t in threads.values()]


def test_a_second_save_of_the_same_layout_reuses_the_plan_on_every_rank():
    caches = {r: {} for r in range(SIZE)}
    save_on_threads({r: FakeSaveRank(r, caches[r]) for r in range(SIZE)})
    results = save_on_threads({r: FakeSaveRank(r, caches[r]) for r in range(SIZE)})
    assert [results[r].plan_reused for r in range(SIZE)] == [True] * SIZE


def partials_of(rank: int) -> tuple:
    """Rank r's reductions, in the order every member lists them: a (float32) summed and b
    (int64) averaged among all ranks, c averaged among ranks 0 and 1, d multiplied among 1 and 2."""
    every = tuple(range(SIZE))
    out = [requests.Reduction(every, np.array([rank + 1, 2 * rank + 2], np.float32), "sum"),
           requests.Reduction(every, np.array([rank + 1], np.int64), "avg")]
    if rank in (0, 1):
        out.append(requests.Reduction((0, 1), np.array([rank + 0.5], np.float32), "avg"))
    if rank in (1, 2):
        out.append(requests.Reduction((1, 2), np.array([rank + 2], np.int64), "prod"))
    return tuple(out)


EXPECTED = {0: [[6, 12], [2], [1.0]], 1: [[6, 12], [2], [1.0], [12]], 2: [[6, 12], [2], [12]]}


@pytest.mark.parametrize("world", ["threads", "simulated"])
def test_the_protocol_runs_each_rank_s_reductions_among_their_members_before_describe(world):
    """The Partial reduction is the protocol's step (ReduceAmong), not a collective inside a
    rank's local step: sum, avg (// for integers), prod, each among its own members."""
    ranks = {r: FakeSaveRank(r, {}, reductions=partials_of(r)) for r in range(SIZE)}
    if world == "threads":
        save_on_threads(ranks)
    else:
        SimWorld(tuple(range(SIZE)), 0).run({r: protocol.save(ranks[r]) for r in range(SIZE)})
    for r, rank in ranks.items():
        got = [red.array.tolist() for red in rank.reductions]
        assert got == EXPECTED[r], (r, got)
        assert [red.array.dtype for red in rank.reductions] == [red.array.dtype for red in partials_of(r)]
        assert rank.steps[:2] == ["prepare", "describe"]


@pytest.mark.parametrize("step", ["prepare", "describe", "write", "publish"])
def test_a_step_failing_on_one_rank_raises_the_same_error_on_every_rank(step):
    failing = 0 if step == "publish" else 1
    ranks = {r: FakeSaveRank(r, {}, step if r == failing else None) for r in range(SIZE)}
    results = save_on_threads(ranks)
    errors = list(results.values())
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert {(e.step, tuple(e.failures.items())) for e in errors} == {
        (step if step != "publish" else "commit", ((failing, f"StorageError: rank {failing}: disk full"),))
    }
    # nobody went on past the failed step: no rank tidies, the metadata is not published
    assert all("tidy" not in r.steps for r in ranks.values())
    if step != "publish":
        assert ranks[0].published == []


def composed_on_threads(ranks: dict, fail: tuple[str, int] | None = None) -> tuple[dict, dict]:
    """Each rank's save with two steps composed after it ("copy", which builds the metadata on
    the coordinator, and "record"), each recording (name, the result's id, whether it has the
    metadata); ``fail``: (step, rank) raising."""
    seen: dict[int, list] = {r: [] for r in ranks}

    def one(comm):
        def step(name):
            def body(result):
                built = result.built() if name == "copy" and comm.rank == 0 else result.metadata  # the first step builds it
                seen[comm.rank].append((name, result.unique_id, built is not None))
                if fail == (name, comm.rank):
                    raise StorageError(f"{name} failed")
            return lambda result: protocol.local(name, lambda: body(result))
        return protocol.run(comm, protocol.save(ranks[comm.rank], (step("copy"), step("record"))))

    return ThreadWorld(SIZE).run(one), seen


def test_the_steps_composed_after_a_save_run_in_order_with_its_result_instead_of_publishing():
    ranks = {r: FakeSaveRank(r, {}) for r in range(SIZE)}
    results, seen = composed_on_threads(ranks)
    assert all(isinstance(v, protocol.SaveResult) and v.unique_id == 7 for v in results.values()), results
    for r in range(SIZE):  # the metadata, built by the coordinator alone, kept for the steps after
        assert seen[r] == [("copy", 7, r == 0), ("record", 7, r == 0)]
        assert "publish" not in ranks[r].steps and "tidy" not in ranks[r].steps  # not composed
    assert results[0].metadata.unique_id == 7 and ranks[0].published == []


def test_a_composed_step_failing_on_one_rank_raises_on_every_rank_and_no_later_step_runs():
    ranks = {r: FakeSaveRank(r, {}) for r in range(SIZE)}
    results, seen = composed_on_threads(ranks, fail=("copy", 2))
    assert all(isinstance(e, CollectiveError) and e.step == "copy" for e in results.values()), results
    assert all(steps == [("copy", 7, r == 0)] for r, steps in seen.items())


# ---------------------------------------------------------------------------- load
@dataclass(frozen=True)
class FakePlan:
    unreadable: tuple = ()
    remote: dict = dataclass_field(default_factory=dict)
    share_key: tuple = (12345, True)


class FakeWork:
    """A LoadWork recording the order of its steps."""

    def __init__(self, log: list, unreadable: tuple = ()):
        self.log, self.plan = log, FakePlan(unreadable)

    def serve_from(self, answer):
        remote: dict = {}
        for name in self.plan.unreadable:
            server = answer.servers.get(servers.file_key(name))
            if server is None:
                raise StorageError(f"no rank can read {name}")
            remote.setdefault(server, []).append(name)
        if remote:
            self.log.append(("servers", remote))
        self.plan = FakePlan(self.plan.unreadable, remote)

    def open_local(self):
        self.log.append("open")

    def verify_local(self, share):
        self.log.append("verify" if share is None else ("verify", *share))

    def verify_remote(self, comm, clients):
        self.log.append(("verify remote", list(clients)))

    def read_local(self):
        self.log.append("read")

    def exchange(self, comm, clients):
        self.log.append(("exchange", list(clients)))

    def finish(self):
        self.log.append("finish")


class FakeLoadRank:
    unique_id = None
    path = "<test>"
    shares_targets = False
    lists_for_all = False
    near: frozenset = frozenset()

    def __init__(self, rank: int, meta: Metadata, listing: storage.Listing, unreadable: tuple = ()):
        self.rank, self.ranks, self.coordinator = rank, tuple(range(SIZE)), 0
        self.meta, self.listing, self.unreadable = meta, listing, unreadable
        self.log: list = []
        self.asked: list = []

    def inspect(self):
        return f"view of {self.rank}", self.listing

    def read_metadata(self, view, uid):
        assert view == f"view of {self.rank}"
        self.asked.append(uid)
        return self.meta

    def metadata_from_helpers(self, view, readers, meta):
        raise AssertionError("every rank reads the metadata")

    def plan(self, view, meta, uid, listing, every_target):
        assert meta is self.meta and view == f"view of {self.rank}"
        return FakeWork(self.log, self.unreadable)

    def wanted(self, view):
        return {}

    def in_parts(self, data):
        return None  # these tests' metadata is small: read whole

    def metadata_start(self, blob, source):
        return protocol.start_of(blob, source)

    def targets(self, view):
        return b""

    def all_targets(self, blobs):
        return None


def saved_metadata() -> Metadata:
    ranks = {r: FakeSaveRank(r, {}) for r in range(SIZE)}
    SimWorld(tuple(range(SIZE)), 0).run({r: protocol.save(ranks[r]) for r in range(SIZE)})
    return ranks[0].published[0]


def listing_of(meta: Metadata, without: int | None = None) -> storage.Listing:
    writers = [storage.parse_data_name(f.name) for f in meta.files]
    held = frozenset((r, g) for r, _, g in writers if r != without)
    return storage.Listing(frozenset({meta.unique_id}), {meta.unique_id: held})


def test_load_reads_the_latest_checkpoint_and_runs_the_steps_in_order():
    meta = saved_metadata()
    ranks = {r: FakeLoadRank(r, meta, listing_of(meta)) for r in range(SIZE)}
    results = ThreadWorld(SIZE).run(lambda comm: protocol.run(comm, protocol.load(ranks[comm.rank])))
    assert {results[r][0] for r in range(SIZE)} == {7}
    for r, rank in ranks.items():
        assert rank.asked == [7]
        # same tensors on every rank of a shared file system: they share the checks
        assert rank.log == ["open", ("verify", r, SIZE), "read", "finish"]


def test_load_routes_clients_to_their_servers():
    meta = saved_metadata()
    # rank 2 does not see rank 1's file, ranks 0 and 1 do: the coordinator names rank 0 (2 % 2)
    # its server; rank 0 learns its client, rank 2 its server's work is remote
    name = next(f.name for f in meta.files if storage.parse_data_name(f.name)[0] == 1)
    ranks = {r: FakeLoadRank(r, meta, listing_of(meta, 1 if r == 2 else None), (name,) if r == 2 else ())
             for r in range(SIZE)}
    ThreadWorld(SIZE).run(lambda comm: protocol.run(comm, protocol.load(ranks[comm.rank])))
    assert ranks[0].log == ["open", "verify", ("verify remote", [2]), ("exchange", [2]), "finish"]
    assert ranks[1].log == ["open", "verify", ("verify remote", []), ("exchange", []), "finish"]
    assert ranks[2].log[0] == ("servers", {0: [name]})


def test_a_file_no_other_rank_sees_fails_the_load_on_every_rank_naming_it():
    meta = saved_metadata()
    name = next(f.name for f in meta.files if storage.parse_data_name(f.name)[0] == 1)
    ranks = {r: FakeLoadRank(r, meta, listing_of(meta, 1), (name,) if r == 2 else ()) for r in range(SIZE)}
    results = ThreadWorld(SIZE).run(lambda comm: protocol.run(comm, protocol.load(ranks[comm.rank])))
    assert {type(e) for e in results.values()} == {CollectiveError}
    assert {e.step for e in results.values()} == {"verify"}
    assert all(name in str(e) and sorted(e.failures) == [2] for e in results.values())


def test_load_of_an_empty_directory_fails_the_same_on_every_rank():
    meta = saved_metadata()
    empty = storage.Listing(frozenset(), {})
    ranks = {r: FakeLoadRank(r, meta, empty) for r in range(SIZE)}
    results = ThreadWorld(SIZE).run(lambda comm: protocol.run(comm, protocol.load(ranks[comm.rank])))
    assert {type(e) for e in results.values()} == {CollectiveError}
    assert {e.step for e in results.values()} == {"read metadata"}
    assert all("no complete checkpoint" in m for e in results.values() for m in e.failures.values())
    assert all(len(e.failures) == SIZE for e in results.values())


class ObjectStoreLoadRank(FakeLoadRank):
    """A rank of a load from object storage (``lists_for_all``): only the coordinator lists, and
    its ``metadata_bytes`` is the only read of the metadata; the others parse what it sent."""

    lists_for_all = True

    def __init__(self, rank: int, meta: Metadata, missing: bool = False):
        seen = listing_of(meta) if rank == 0 else storage.Listing(frozenset(), {})
        super().__init__(rank, meta, seen)
        self.missing = missing
        self.parsed: list[bytes] = []

    def read_metadata(self, view, uid):
        raise AssertionError("a rank of a load from object storage never reads the metadata itself")

    def metadata_bytes(self, view, uid):
        self.asked.append(uid)
        if self.missing:
            raise StorageError(f"checkpoint {uid} has no metadata object s3://b/{uid}.metadata", "s3://b")
        return self.meta.to_json()

    def parse_metadata(self, uid, data):
        self.parsed.append(data)
        parsed = storage.metadata_from_bytes(data, uid, "<from the coordinator>")
        assert parsed.to_json() == self.meta.to_json()
        return self.meta  # FakeLoadRank.plan checks it is this object


def test_a_load_from_object_storage_reads_the_metadata_once_and_broadcasts_it():
    meta = saved_metadata()
    raw = meta.to_json()
    ranks = {r: ObjectStoreLoadRank(r, meta) for r in range(SIZE)}
    results = ThreadWorld(SIZE).run(lambda comm: protocol.run(comm, protocol.load(ranks[comm.rank])))
    assert {results[r][0] for r in range(SIZE)} == {7}
    assert [rank.asked for rank in ranks.values()] == [[7], [], []]
    assert all(rank.parsed == [raw] for rank in ranks.values())
    assert all(rank.log == ["open", ("verify", r, SIZE), "read", "finish"] for r, rank in ranks.items())

    # the simulation runs the same steps; the metadata crosses the comm once per other rank
    sim_ranks = {r: ObjectStoreLoadRank(r, meta) for r in range(SIZE)}
    world = SimWorld(tuple(range(SIZE)), 0)
    world.run({r: protocol.load(sim_ranks[r]) for r in range(SIZE)})
    assert [rank.asked for rank in sim_ranks.values()] == [[7], [], []]
    assert world.traffic[0].sent >= (SIZE - 1) * len(raw)
    assert all(len(raw) <= world.traffic[r].received < len(raw) + 1024 for r in (1, 2))


def test_a_missing_metadata_object_fails_the_load_on_every_rank_naming_it():
    meta = saved_metadata()
    ranks = {r: ObjectStoreLoadRank(r, meta, missing=True) for r in range(SIZE)}
    results = ThreadWorld(SIZE).run(lambda comm: protocol.run(comm, protocol.load(ranks[comm.rank])))
    assert {type(e) for e in results.values()} == {CollectiveError}
    assert {e.step for e in results.values()} == {"read metadata"}
    assert all(sorted(e.failures) == [0] for e in results.values())
    assert all("s3://b/7.metadata" in str(e) for e in results.values())
    assert not any(rank.parsed or rank.log for rank in ranks.values())


class StagedRank(FakeSaveRank):
    """An async save's rank: staging memory for its pieces or not (``room``)."""

    staged = True

    def __init__(self, rank: int, cache: dict, room: bool, fail_step: str | None = None):
        super().__init__(rank, cache, fail_step)
        self.room = room

    def can_stage(self, described, leaves):
        return self.room


def staged_on_threads(ranks: dict) -> dict:
    """Each rank's steps until its Detach, and its result after finishing the save."""

    def one(comm):
        run = protocol.save(ranks[comm.rank])
        protocol.run(comm, run, until_detach=True)
        before = list(ranks[comm.rank].steps)
        try:
            return before, protocol.run(comm, run)
        except CollectiveError as exc:
            return before, exc

    return ThreadWorld(SIZE).run(one)


@pytest.mark.parametrize("rooms, detached_after", [((True, True, True), "stage"), ((True, False, True), "write")])
def test_an_async_save_detaches_after_staging_or_while_a_rank_has_no_room_after_writing(rooms, detached_after):
    ranks = {r: StagedRank(r, {}, rooms[r]) for r in range(SIZE)}
    results = staged_on_threads(ranks)
    for r, (before, result) in results.items():
        assert before[-1] == detached_after, before
        assert ("stage" in ranks[r].steps) == (detached_after == "stage")
        # a save that wrote without staging makes the staging memory for the next one, last
        assert (ranks[r].steps[-1] == "reserve") == (detached_after == "write") == ("reserve" in ranks[r].steps)
        assert isinstance(result, protocol.SaveResult) and result.unique_id == 7
    assert [len(r.published) for r in ranks.values()] == [1, 0, 0]


def test_a_failed_staging_is_agreed_on_after_the_detach_and_nothing_is_written():
    ranks = {r: StagedRank(r, {}, True, fail_step="stage" if r == 2 else None) for r in range(SIZE)}
    results = staged_on_threads(ranks)
    for r, (before, result) in results.items():
        assert before[-1] == "stage"  # every caller returned; the failure comes with wait()
        assert isinstance(result, CollectiveError) and sorted(result.failures) == [2], result
    assert not any(r.written or r.published for r in ranks.values())


def test_the_coordinator_serves_only_ranges_inside_the_metadata_file():
    """A rank's request for its part of the metadata: pairs of (start, stop), each inside the
    file; anything else is a FormatError naming the range, before any byte is sliced."""
    assert protocol._spans([0, 4, 4, 4, 7, 10], 10) == [[0, 4], [4, 4], [7, 10]]
    assert protocol._spans([], 10) == []
    for numbers, named in (([3, 11], "3..11"), ([-1, 2], "-1..2"), ([0, 1, 5, 4], "5..4")):
        with pytest.raises(FormatError, match=named):
            protocol._spans(numbers, 10)
    with pytest.raises(FormatError, match="without its end"):
        protocol._spans([0, 1, 2], 10)
