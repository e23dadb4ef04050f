"""One rank's load work (parallel/loadwork.py): keys matched once, work planned for any set of
the state dict's tensors without opening a file, the plain values restored by the work that
says so, and a finished work freed at once (its host buffers with it), in one process over the
in-memory storage."""
from __future__ import annotations

import gc
import logging
import weakref

import numpy as np
import pytest

from paddle_dcp.core import nested
from paddle_dcp.core.keys import MissingKeys
from paddle_dcp.errors import MismatchError
from paddle_dcp.parallel import protocol
from paddle_dcp.parallel.comm import SoloComm
from paddle_dcp.parallel.loadwork import LoadPlan, LocalLoadWork, match_load, plan_load, plan_work
from paddle_dcp.parallel.placements import describe, is_tensor
from paddle_dcp.parallel.ranks import LocalSaveRank
from paddle_dcp.io import storage as dcp_storage

from unit.io.memory_storage import MemoryStorage

SAVED = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64), "lr": 0.5}


@pytest.fixture
def store():
    store = MemoryStorage("mem", {})
    state = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in SAVED.items()}
    protocol.run(SoloComm(), protocol.save(LocalSaveRank(SoloComm(), state, store, None, {})))
    return store


def target(extra: dict | None = None) -> tuple[dict, nested.Flat, list]:
    state = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.int64), "lr": 0.0, **(extra or {})}
    flat = nested.flatten(state, is_tensor)
    return state, flat, [describe(k, v, 0, flat_ok=True) for k, v in flat.tensors.items()]


def opened(plan: LoadPlan, store) -> LocalLoadWork:
    """The work that carries out ``plan``, its files opened (the load's first step after planning)."""
    work = LocalLoadWork(plan, store)
    work.open_local()
    return work


def test_planning_opens_no_file_and_the_first_step_after_it_names_a_missing_one(store):
    """The plan is data: made while the data file is gone, it is complete (frozen, every read
    op of both tensors planned), and the file's absence is found when the work opens it,
    named with the tensors it holds."""
    import dataclasses

    from paddle_dcp.errors import DcpError

    meta = dcp_storage.read_metadata(store, 0, lazy=True)
    (data,) = [f.name for f in meta.files]
    del store.blobs[data]
    state, flat, held = target()
    plan = plan_load(state, flat, held, meta, "mem", store)
    assert sorted({seg.piece.key for op in plan.local for seg in op.segments}) == ["a", "b"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.verify = False  # type: ignore[misc]
    work = LocalLoadWork(plan, store)
    with pytest.raises(DcpError, match=rf"{data}.*\['a', 'b'\]"):
        work.open_local()
    np.testing.assert_array_equal(state["a"], np.zeros((2, 3), np.float32))  # untouched


def test_work_for_each_tensor_apart_loads_the_same_as_one_work(store):
    meta = dcp_storage.read_metadata(store, 0, lazy=True)
    state, flat, held = target()
    matched = match_load(flat, meta, "mem", True, MissingKeys())
    for i, h in enumerate(held):  # one tensor a work; the plain values with the last
        work = opened(plan_work(state, flat, [h], meta, matched, "mem", store, False, plain=i == len(held) - 1), store)
        work.read_local()
        work.finish()
        assert state["lr"] == (0.5 if i == len(held) - 1 else 0.0)
    np.testing.assert_array_equal(state["a"], SAVED["a"])
    np.testing.assert_array_equal(state["b"], SAVED["b"])


def test_missing_keys_are_reported_once_by_the_matching(store, caplog):
    meta = dcp_storage.read_metadata(store, 0, lazy=True)
    state, flat, held = target({"c": np.zeros(2)})
    with pytest.raises(MismatchError, match="c"):
        match_load(flat, meta, "mem", True, MissingKeys())
    with caplog.at_level(logging.WARNING):
        matched = match_load(flat, meta, "mem", True, MissingKeys.of(False, None))
        for h in held:
            plan_work(state, flat, [h], meta, matched, "mem", store, False)
    assert sum("not found in checkpoint" in r.getMessage() and "['c']" in r.getMessage() for r in caplog.records) == 1


def test_a_finished_work_is_freed_without_the_garbage_collector(store):
    """No reference cycle keeps a work (and every host buffer of a GPU load) alive until the
    collector runs."""
    meta = dcp_storage.read_metadata(store, 0, lazy=True)
    state, flat, held = target()
    gc.disable()
    try:
        work = opened(plan_load(state, flat, held, meta, "mem", store), store)
        work.read_local()
        work.finish()
        alive = weakref.ref(work)
        del work
        assert alive() is None
    finally:
        gc.enable()


def test_the_copy_from_own_files_runs_while_bytes_cross_between_ranks(store, monkeypatch):
    """exchange(): the rank's own reads go on in a helper thread while fetch_remote serves and
    receives on the caller's thread (the copy here waits until the exchange has started, so
    a copy done first would fail), and a failed copy is raised once the exchange is over."""
    import threading

    from paddle_dcp.errors import StorageError
    from paddle_dcp.parallel import loadwork

    meta = dcp_storage.read_metadata(store, 0, lazy=True)
    state, flat, held = target()
    work = opened(plan_load(state, flat, held, meta, "mem", store), store)
    exchanging, served = threading.Event(), []
    real_ahead = loadwork.reads.read_ahead

    def ahead_after_the_exchange_started(files, ops, *args, **kwargs):
        assert exchanging.wait(5), "the copy did not run while the exchange did"
        return real_ahead(files, ops, *args, **kwargs)

    def fetch(comm, store_, remote, clients, name, run_op):
        exchanging.set()
        served.append(list(clients))

    monkeypatch.setattr(loadwork.reads, "read_ahead", ahead_after_the_exchange_started)
    monkeypatch.setattr(loadwork.exchange, "fetch_remote", fetch)
    work.exchange(SoloComm(), [1])
    work.finish()
    assert served == [[1]]
    np.testing.assert_array_equal(state["a"], SAVED["a"])
    np.testing.assert_array_equal(state["b"], SAVED["b"])

    def broken(files, ops, *args, **kwargs):
        raise StorageError("disk gone")

    state, flat, held = target()
    work = opened(plan_load(state, flat, held, meta, "mem", store), store)
    monkeypatch.setattr(loadwork.reads, "read_ahead", broken)
    served.clear()
    with pytest.raises(StorageError, match="disk gone"):
        work.exchange(SoloComm(), [1])
    assert served == [[1]]  # the pair was served all the same: no peer left waiting


def test_ops_received_on_several_connections_at_once_never_share_a_staging_buffer(store, monkeypatch):
    """run_op is called from one thread per lane (exchange.fetch_remote): a read that is not
    direct lands in a staging buffer first, which must be the thread's own; the copy from the
    rank's own files has its own too."""
    import threading

    from paddle_dcp.parallel import loadwork

    meta = dcp_storage.read_metadata(store, 0, lazy=True)
    state, flat, held = target()
    work = opened(plan_load(state, flat, held, meta, "mem", store), store)
    seen: dict = {}
    both = threading.Barrier(3, timeout=5)

    def record(op, meta, files, arrays, staging, *args, **kwargs):
        seen.setdefault(threading.current_thread().name, []).append(staging)  # kept: ids are not reused

    monkeypatch.setattr(loadwork.reads, "execute_op", record)

    def lane(name):
        def run():
            both.wait()
            work.run_op(work.plan.ops[0], None)
            work.run_op(work.plan.ops[-1], None)
        return threading.Thread(target=run, name=name)

    threads = [lane("lane0"), lane("lane1")]
    for t in threads:
        t.start()
    both.wait()
    work._copy_local()
    for t in threads:
        t.join(5)
    assert len(seen) == 3
    firsts = [used[0] for used in seen.values()]
    assert all(all(s is used[0] for s in used) for used in seen.values())  # one buffer per thread, kept
    assert len({id(s) for s in firsts}) == 3  # all alive here: distinct objects


def test_a_load_that_fails_its_checksums_leaves_no_file_open(tmp_path):
    """Found by the fuzz (tests/integration/test_fuzz_v3.py): every load refused in the verify
    step (a checksum that does not match) left its data files open, until a long run of them
    failed with "Too many open files"."""
    import os

    import metadoc

    import paddle_dcp
    from paddle_dcp.core import metafile
    from unit.helpers import save_checkpoint

    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    saved = save_checkpoint(str(tmp_path), {"w": a}, {"w": "float32"}, (4,), {"w": (0,)}, block_bytes=64)
    doc = metadoc.read(metafile.encode(saved.meta))
    doc["tensors"]["model.w"]["checksums"][0] = "0" * 16
    (tmp_path / "0.metadata").write_bytes(metadoc.write(doc))
    sd = {"model": {"w": np.zeros((8, 8), np.float32)}}

    def open_here():
        """Descriptors of this process open on the checkpoint's files: counting every descriptor
        of the process also counts what other threads of the test session open and close."""
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed between the listing and the readlink
                continue
            if target.startswith(str(tmp_path)):
                found.append(target)
        return found

    for _ in range(10):
        with pytest.raises(paddle_dcp.IntegrityError):
            paddle_dcp.load_state_dict(sd, str(tmp_path))
    assert open_here() == []  # 4 files a load, 40 in all, before the fix
    assert not sd["model"]["w"].any()
