"""The node-local tier (paddle_dcp/tiers.py) in one process, a node of one rank: intervals of
both tiers, the local tier's retention, a step due for both tiers staged once (the global
files are the local ones), and a restore that passes over a damaged copy to the next source
that verifies, never an older step than it must. Two nodes, copies and node loss:
tests/multirank/test_tiers.py."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from paddle_dcp import ArgumentError, CheckpointManager, FormatError
from paddle_dcp.core.job_layout import JobLayout
from paddle_dcp.tiers import RestoreReport


def state(step: int) -> dict:
    return {"w": np.arange(4096, dtype=np.float32).reshape(64, 64) + step, "b": np.arange(7, dtype=np.int64) * step, "step": step}


def target() -> dict:
    return {"w": np.zeros((64, 64), np.float32), "b": np.zeros(7, np.int64), "step": -1}


def restore(m: CheckpointManager, step=None) -> int:
    got = target()
    s = m.restore(got, step)
    want = state(s)
    assert np.array_equal(got["w"], want["w"]) and np.array_equal(got["b"], want["b"]) and got["step"] == s
    return s


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))


def steps_in(path) -> list[int]:
    return sorted(int(n.split(".")[0]) for n in os.listdir(path) if n.endswith(".metadata"))


@pytest.fixture
def saved(tmp_path):
    """Steps 1..5: the local tier every step (the newest 2 kept), the global every 2."""
    local, glob = tmp_path / "local", tmp_path / "global"
    m = CheckpointManager(glob, save_interval_steps=2, local_directory=str(local), local_max_to_keep=2, replicas=0)
    assert [s for s in range(1, 6) if m.save(s, state(s))] == [1, 2, 3, 4, 5]
    return m, str(local), str(glob)


def test_each_tier_keeps_its_steps_and_a_step_due_for_both_is_the_same_files(saved):
    m, local, glob = saved
    assert steps_in(local) == [4, 5] and steps_in(glob) == [2, 4] and m.all_steps() == [2, 4]
    for name in ("4.metadata", "0_4.distcp"):  # staged once: the global tier's files are the local step's
        with open(os.path.join(local, name), "rb") as a, open(os.path.join(glob, name), "rb") as b:
            assert a.read() == b.read()
    assert m.latest_step() == 5
    m.close()


def test_restore_takes_the_newest_step_from_the_local_tier(saved):
    m, _, _ = saved
    assert restore(m) == 5
    r = m.last_restore
    assert isinstance(r, RestoreReport) and (r.step, r.tier, r.refused) == (5, "local", ())
    assert r.bytes["local"] > 0 and r.bytes["peer"] == 0 and r.bytes["global"] == 0
    m.close()


def test_a_restore_from_the_local_tier_logs_its_load_and_keeps_its_traffic_like_any_load(saved, caplog):
    import logging

    import paddle_dcp

    m, local, _ = saved
    paddle_dcp.process_state().traffic.pop("load", None)
    with caplog.at_level(logging.INFO, logger="paddle_dcp"):
        assert restore(m) == 5
    loaded = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("loaded checkpoint")]
    assert len(loaded) == 1 and loaded[0].startswith(f"loaded checkpoint 5 from {local}: {m.last_restore.bytes['local']} bytes")
    assert "load" in paddle_dcp.process_state().traffic
    m.close()


def test_a_file_no_node_holds_intact_comes_from_the_global_tier_of_the_same_step(saved):
    """The file's writer copies it back from the global tier (the same step, the same
    metadata), checked; every other byte still comes from the local tier."""
    m, local, glob = saved
    flip(os.path.join(local, "0_4.distcp"))
    assert restore(m, 4) == 4
    r = m.last_restore
    size = os.path.getsize(os.path.join(glob, "0_4.distcp"))
    assert (r.tier, r.refused, r.bytes["global"]) == ("local", (), size) and r.bytes["local"] > 0
    with open(os.path.join(local, "0_4.distcp"), "rb") as a, open(os.path.join(glob, "0_4.distcp"), "rb") as b:
        assert a.read() == b.read()  # repaired
    m.close()


def test_when_no_source_of_a_step_verifies_the_next_older_restorable_step_is_restored(saved):
    m, local, glob = saved
    flip(os.path.join(local, "0_5.distcp"))  # step 5: local only
    assert restore(m) == 4  # from the local tier: its copy is intact
    assert m.last_restore.tier == "local" and [(s, t) for t, s, _ in m.last_restore.refused] == [(5, "local")]
    flip(os.path.join(local, "0_4.distcp"))
    flip(os.path.join(glob, "0_4.distcp"))
    assert restore(m) == 2  # 5 and 4 have no intact copy anywhere; 3 was deleted locally
    assert [(t, s) for t, s, _ in m.last_restore.refused] == [("local", 5), ("local", 4), ("global", 4)]
    m.close()


def test_a_step_asked_for_that_nothing_verifies_is_an_error_naming_every_source(saved):
    m, local, glob = saved
    flip(os.path.join(local, "0_4.distcp"))
    flip(os.path.join(glob, "0_4.distcp"))
    with pytest.raises(FormatError, match="local step 4: .*; global step 4: "):
        m.restore(target(), 4)
    m.close()


def test_copies_with_no_other_node_are_a_warning_and_a_replicas_no_job_can_meet_an_error(tmp_path, caplog):
    """One node cannot hold copies on another: the manager opens, warns once, and its steps
    save and restore without copies. A negative replicas is refused before anything is written."""
    with caplog.at_level(logging.WARNING, logger="paddle_dcp"):
        with CheckpointManager(tmp_path / "g", local_directory=str(tmp_path / "l"), replicas=1) as m:
            assert m.save(1, state(1))
            assert restore(m) == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "replicas=1 asks for a copy of each file on another node, but this job has 1 node" in warned[0], warned
    assert "files saved now have no copy on another node (0 copies)" in warned[0], warned
    for bad in (-1, 0.5):
        with pytest.raises(ArgumentError, match=f"replicas must be a non-negative int, got {bad!r}"):
            CheckpointManager(tmp_path / "g2", local_directory=str(tmp_path / "l2"), replicas=bad)
    assert not (tmp_path / "l2").exists()
    with pytest.raises(ArgumentError, match="local_interval_steps"):
        CheckpointManager(tmp_path / "g", local_directory=str(tmp_path / "l"), local_interval_steps=0)
    with pytest.raises(ArgumentError, match="URL"):
        CheckpointManager(tmp_path / "g", local_directory="s3://bucket/x", replicas=0)


def test_async_saves_write_both_tiers_in_the_background(tmp_path):
    local, glob = tmp_path / "local", tmp_path / "global"
    with CheckpointManager(glob, save_interval_steps=2, async_save=True, local_directory=str(local),
                           local_max_to_keep=2, replicas=0) as m:
        for s in range(1, 5):
            values = state(s)
            assert m.save(s, values)
            values["w"][...] = -1  # the caller moves on: the staged copy is what is written
        m.wait()
        assert steps_in(local) == [3, 4] and steps_in(glob) == [2, 4] and m.all_steps() == [2, 4]
        assert restore(m) == 4 and m.last_restore.tier == "local"
        assert restore(m, 2) == 2 and m.last_restore.tier == "global"


def test_a_global_tier_on_object_storage_holds_the_local_step_s_files_and_serves_a_lost_one(tmp_path):
    import uuid

    url = f"memory://bucket/{uuid.uuid4().hex}"
    local = tmp_path / "local"
    with CheckpointManager(url, save_interval_steps=2, async_save=True, local_directory=str(local), replicas=0) as m:
        for s in range(1, 5):
            m.save(s, state(s))
        m.wait()
        assert sorted(n for n in m.store.sizes() if not n.startswith("paddle_dcp_manager")) == [
            "0_2.distcp", "0_4.distcp", "2.metadata", "4.metadata"]
        os.remove(os.path.join(local, "0_4.distcp"))  # lost on the node: the global tier's copy serves
        assert restore(m) == 4
        assert m.last_restore.tier == "local" and m.last_restore.bytes["global"] == m.store.size("0_4.distcp")


def test_the_latest_step_is_the_newest_one_whose_files_are_all_present(saved):
    m, local, glob = saved
    assert m.latest_step() == 5
    os.remove(os.path.join(local, "0_5.distcp"))  # step 5: local only, now incomplete
    assert m.latest_step() == 4
    m.close()


def test_a_step_in_no_tier_is_named_with_the_steps_there_are(saved):
    m, _, _ = saved
    with pytest.raises(FormatError, match=r"step 9 is in no tier of .*: it holds \[2, 4, 5\]"):
        m.restore(target(), 9)
    m.close()


# ---------------------------------------------------------------------- two nodes, as threads
def two_nodes(tmp_path) -> dict[int, str]:
    """Two ranks, each its own node: each node holds its rank's original, a copy of the other's
    data file and the metadata (a local step as the tier leaves it)."""
    import shutil

    from unit.helpers import random_array, save_checkpoint

    rng = np.random.default_rng(7)
    arrays = {"w": random_array(rng, "float32", (8, 16)), "b": random_array(rng, "int64", (6,))}
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    save_checkpoint(str(a), arrays, {"w": "float32", "b": "int64"}, (2,), {"w": (0,), "b": (0,)}, block_bytes=64, unique_id=3)
    shutil.copytree(a, b)
    return {0: str(a), 1: str(b)}


def check_on_threads(dirs: dict[int, str], monkeypatch) -> tuple[dict, dict, dict]:
    """Every rank's LocalTier._check of step 3, the files each node hashed, and its calls of
    check_files (the names of each)."""
    from paddle_dcp.io import file_check
    from paddle_dcp.parallel import protocol
    from paddle_dcp.tiers import LocalTier

    from unit.parallel.fakes import ThreadWorld

    hashed: dict[str, list] = {}
    calls: dict[str, list] = {}
    real = file_check.check_files

    def spy(store, meta, names=None, *args, **kwargs):
        hashed.setdefault(store.path, []).extend(names or [])
        calls.setdefault(store.path, []).append(sorted(names or []))
        return real(store, meta, names, *args, **kwargs)

    monkeypatch.setattr(file_check, "check_files", spy)

    def rank(comm):
        tier = LocalTier(dirs[comm.rank], comm, 1, 2)
        tier.nodes = ((0,), (1,))
        return protocol.run(comm, tier._check(3))

    return ThreadWorld(2).run(rank), hashed, calls


def test_whole_nodes_check_only_their_originals_and_read_no_copy(tmp_path, monkeypatch):
    dirs = two_nodes(tmp_path)
    results, hashed, calls = check_on_threads(dirs, monkeypatch)
    assert hashed == {dirs[0]: ["0_3.distcp"], dirs[1]: ["1_3.distcp"]}  # half the bytes: no copy hashed
    assert results[0][:3] == ("", frozenset({"1_3.distcp"}), ())  # the unchecked copy is not read
    assert results[1][:3] == ("", frozenset({"0_3.distcp"}), ())


def test_a_damaged_original_makes_its_copies_checked_and_read(tmp_path, monkeypatch):
    dirs = two_nodes(tmp_path)
    flip(os.path.join(dirs[1], "1_3.distcp"))
    results, hashed, calls = check_on_threads(dirs, monkeypatch)
    assert hashed == {dirs[0]: ["0_3.distcp", "1_3.distcp"], dirs[1]: ["1_3.distcp"]}
    assert results[0][:3] == ("", frozenset(), ())  # node A reads its checked copy of rank 1's file
    assert results[1][:3] == ("", frozenset({"1_3.distcp", "0_3.distcp"}), ())
    flip(os.path.join(dirs[0], "1_3.distcp"))  # the copy too: nothing left of rank 1's file
    results, _, _ = check_on_threads(dirs, monkeypatch)
    assert all(r[0].startswith("no intact copy of the data files of ranks [[1, 1]]") and r[2] == (1,) for r in results.values())


def test_a_lost_original_has_its_copies_checked_in_the_same_pass_as_the_originals(tmp_path, monkeypatch):
    """Node B lost rank 1's file (the node was replaced): every node says what it holds
    before hashing, so node A checks its original and its copy of rank 1's file in one pass,
    not one after the other."""
    dirs = two_nodes(tmp_path)
    os.remove(os.path.join(dirs[1], "1_3.distcp"))
    results, hashed, calls = check_on_threads(dirs, monkeypatch)
    assert calls[dirs[0]] == [["0_3.distcp", "1_3.distcp"]]
    assert hashed[dirs[1]] == []
    assert results[0][:3] == ("", frozenset(), ())
    assert results[1][:3] == ("", frozenset({"0_3.distcp"}), ())  # its unchecked copy unread


def test_markers_of_earlier_jobs_are_removed_when_the_tier_opens(tmp_path):
    """Each job marks its ranks with a token of its own; the markers an earlier job left (here
    of a rank this job does not have) are gone once the tier is open, this job's stay."""
    local = tmp_path / "local"
    local.mkdir()
    (local / "paddle_dcp_node.7").write_bytes(b"0123456789abcdef")
    (local / "paddle_dcp_node.0").write_bytes(b"an earlier token")
    CheckpointManager(tmp_path / "global", local_directory=str(local), replicas=0)
    markers = sorted(n for n in os.listdir(local) if n.startswith("paddle_dcp_node."))
    assert markers == ["paddle_dcp_node.0"]
    assert (local / "paddle_dcp_node.0").read_bytes() != b"an earlier token"


def test_temporary_files_of_a_crashed_marker_or_record_write_are_removed_when_the_tier_opens(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    left = ["paddle_dcp_node.3.tmp.0a1b2c3d", "paddle_dcp_tier.json.tmp.deadbeef"]
    for name in left + ["paddle_dcp_tier.json.tmp.notours"]:
        (local / name).write_bytes(b"half")
    CheckpointManager(tmp_path / "global", local_directory=str(local), replicas=0)
    assert sorted(n for n in os.listdir(local) if ".tmp." in n) == ["paddle_dcp_tier.json.tmp.notours"]


def test_a_step_due_in_both_tiers_reads_its_local_metadata_once_for_the_upload(tmp_path, monkeypatch):
    from paddle_dcp.io import local as local_io

    reads = []
    real = local_io.LocalStorage.read_file

    def counted(self, name, limit=None):
        if name == "2.metadata" and os.path.realpath(self.path) == os.path.realpath(tmp_path / "local"):
            reads.append(name)
        return real(self, name, limit)

    monkeypatch.setattr(local_io.LocalStorage, "read_file", counted)
    m = CheckpointManager(tmp_path / "global", save_interval_steps=2, local_directory=str(tmp_path / "local"), replicas=0)
    assert m.save(2, state(2))
    assert steps_in(tmp_path / "global") == [2] and len(reads) == 1, reads  # parsed and committed from one read
    m.close()


def test_last_restore_names_the_layout_saved_on_and_the_one_restored_into(saved, caplog):
    """Issue 39, point 3, in one process: a local step and a global one report the layout
    they were saved on (1 rank, no dist tensor, one node), recorded at save, and this job's;
    a step without its node's record (as an older paddle_dcp saved it, or the record
    unreadable) reports the metadata's number of ranks alone, and restores all the same."""
    m, local, _ = saved
    one = JobLayout(1, (), ((0,),))
    assert restore(m) == 5
    r = m.last_restore
    assert (r.tier, r.saved_on, r.restored_into, r.from_lost_nodes) == ("local", one, one, ())
    assert restore(m, 2) == 2  # step 2, on the global tier alone: its layout from the manifest
    r = m.last_restore
    assert (r.tier, r.saved_on, r.restored_into, r.from_lost_nodes) == ("global", one, one, ())
    m.close()

    record = os.path.join(local, "paddle_dcp_tier.json")
    with open(record, "w") as f:
        f.write("{not json")
    m = CheckpointManager(os.path.dirname(local) + "/global", save_interval_steps=2, local_directory=local, replicas=0)
    with caplog.at_level(logging.WARNING, logger="paddle_dcp"):
        assert restore(m) == 5
    assert m.last_restore.saved_on == JobLayout(1) and m.last_restore.restored_into == one
    assert any("record of steps is unreadable" in rec.getMessage() for rec in caplog.records), caplog.text
    os.remove(record)
    assert restore(m) == 5 and m.last_restore.saved_on == JobLayout(1)
    m.close()
