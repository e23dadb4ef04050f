"""CheckpointManager in one process (a world of one): arguments, what it refuses, cleanup of a
crash's leftovers, and the same manager on object storage (fsspec's memory://). The
multi-rank behaviour is in tests/multirank/test_manager.py."""
from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp import ArgumentError, CheckpointManager
from paddle_dcp.core.retention import MANIFEST_NAME


def state(step: int) -> dict:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + step, "step": step}


def restored(m: CheckpointManager, step=None) -> tuple[int, dict]:
    target = {"w": np.zeros((3, 4), np.float32), "step": -1}
    got = m.restore(target, step)
    assert np.array_equal(target["w"], state(got)["w"]) and target["step"] == got
    return got, target


def names(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("paddle_dcp_manager"))


@pytest.mark.parametrize("kwargs", [{"max_to_keep": 0}, {"keep_every_n_steps": -1}, {"save_interval_steps": 0},
                                    {"best_mode": "best"}, {"best_fn": 3}, {"max_to_keep": 1.5}])
def test_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ArgumentError):
        CheckpointManager(tmp_path / "ck", **kwargs)


def test_save_skips_by_interval_refuses_bad_steps_and_a_step_it_holds(tmp_path):
    with CheckpointManager(tmp_path / "ck", save_interval_steps=3) as m:
        assert [s for s in range(7) if m.save(s, state(s))] == [0, 3, 6]
        for bad in (-1, 1.0, "2", None):
            with pytest.raises(ArgumentError):
                m.save(bad, state(0), force=True)
        with pytest.raises(ArgumentError):
            m.save(6, state(6), force=True)
        with pytest.raises(ArgumentError):
            m.save(7, state(7), metrics={"x": object()}, force=True)
        assert m.all_steps() == [0, 3, 6] and restored(m)[0] == 6 and restored(m, 3)[0] == 3
    with pytest.raises(ArgumentError):
        m.save(9, state(9))  # closed


def test_restore_without_a_step_is_a_format_error(tmp_path):
    with CheckpointManager(tmp_path / "ck") as m, pytest.raises(paddle_dcp.FormatError):
        m.restore(state(0))


def test_leftovers_of_a_crash_are_removed_when_a_manager_opens(tmp_path):
    path = tmp_path / "ck"
    with CheckpointManager(path, max_to_keep=2) as m:
        for s in (1, 2, 3):
            m.save(s, state(s))
    # a crash: step 4 written but never committed; step 2 half deleted (no metadata any more)
    paddle_dcp.save_state_dict(state(4), str(path), unique_id=4)
    os.remove(path / "4.metadata")
    os.remove(path / "2.metadata")
    doc = json.loads((path / MANIFEST_NAME).read_text())
    doc["steps"].append({"step": 4, "state": "writing", "metrics": None})
    (path / MANIFEST_NAME).write_text(json.dumps(doc))
    paddle_dcp.save_state_dict(state(9), str(path), unique_id=9)  # not the manager's: kept
    with CheckpointManager(path, max_to_keep=2) as m:
        assert m.all_steps() == [3]
        assert names(path) == ["0_3.distcp", "0_9.distcp", "3.0.claim", "3.metadata", "9.0.claim", "9.metadata"]
        assert restored(m)[0] == 3


def test_object_storage(tmp_path):
    url = f"memory://bucket/{uuid.uuid4().hex}"
    with CheckpointManager(url, max_to_keep=1, keep_every_n_steps=10, async_save=True) as m:
        for s in (5, 10, 15, 20, 25):
            m.save(s, state(s), metrics={"loss": 1 / s})
        m.wait()
        assert m.all_steps() == [10, 20, 25] and m.metrics(25) == {"loss": 0.04}
        assert sorted(m.store.sizes()) == sorted(["0_10.distcp", "0_20.distcp", "0_25.distcp", "10.0.claim", "10.metadata",
                                                  "20.0.claim", "20.metadata", "25.0.claim", "25.metadata", MANIFEST_NAME])
    with CheckpointManager(url) as m:
        assert restored(m)[0] == 25


def test_the_lock_file_is_never_followed_through_a_link_nor_truncated_when_planted(tmp_path):
    """A link named as the manager's lock file (planted in a shared directory) is refused,
    its target untouched; a hard link to another file under that name is locked but never
    truncated; a lock file a manager wrote is rewritten with its holder."""
    from paddle_dcp.manager import LOCK_NAME

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    ck = tmp_path / "ck"
    ck.mkdir()
    os.symlink(victim, ck / LOCK_NAME)
    with pytest.raises(paddle_dcp.StorageError, match="lock file"):
        CheckpointManager(ck)
    assert victim.read_text() == "precious\n"
    os.remove(ck / LOCK_NAME)
    os.link(victim, ck / LOCK_NAME)
    with CheckpointManager(ck) as m:
        m.save(1, state(1), force=True)
    assert victim.read_text() == "precious\n"
    os.remove(ck / LOCK_NAME)
    (ck / LOCK_NAME).write_text("pid 1 on elsewhere\n")  # a lock file a manager left
    with CheckpointManager(ck):
        assert (ck / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} on ")
