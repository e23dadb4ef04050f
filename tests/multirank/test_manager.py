"""CheckpointManager (issue 18): retention policies on 2 ranks, restore after crashes, node-local disks."""
import json
import time

import pytest

from launcher import assert_passed, run_launch, script, spawn

CASES = ["interval_and_max_to_keep", "keep_every_n_steps", "best_fn_max_and_min", "two_managers", "node_local"]


@pytest.mark.device
def test_manager_on_2_ranks(tmp_path):
    logs = run_launch(script("manager.py"), 2, tmp_path, args=[tmp_path / "work", "cases"], timeout=240)
    assert_passed(logs, CASES, 2)


def test_manager_on_object_storage_2_ranks(tmp_path, s3_env):
    """The launched ranks inherit s3_env's AWS_* variables."""
    import uuid

    logs = run_launch(script("manager.py"), 2, tmp_path, args=[s3_env.url(uuid.uuid4().hex), "s3"], timeout=240)
    assert_passed(logs, ["object_storage"], 2)


@pytest.mark.parametrize("scenario", ["async_keep1", "async_keep2", "retention"])
def test_restore_after_a_rank_dies(tmp_path, scenario):
    """A rank dies (os._exit) mid-way through an async save (max_to_keep 1 and 2), or the
    coordinator during retention; a new job restores the newest complete step, exactly, and
    the crash's leftovers are cleaned up when its manager opens the directory."""
    work = tmp_path / "work"
    job = spawn(script("manager.py"), 2, tmp_path / "crashlog", args=[work, "crash", scenario])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(code is None for code in job.poll().values()):
            time.sleep(0.2)
        codes = job.poll()
    finally:
        job.kill_all()
    victim = 0 if scenario == "retention" else 1
    assert codes[victim] == 17 and codes[1 - victim] == 0, f"exit codes {codes}\n{job.report()}"
    with open(work / "ck" / "paddle_dcp_manager.json") as f:
        states = {e["step"]: e["state"] for e in json.load(f)["steps"]}
    if scenario == "retention":
        assert states[1] == "deleting" and not (work / "ck" / "1.metadata").exists(), states
        assert (work / "ck" / "1_1.distcp").exists()
    else:
        assert states[3] == "writing", states
    logs = run_launch(script("manager.py"), 2, tmp_path, args=[work, "resume", scenario], timeout=150)
    assert_passed(logs, [f"resume_{scenario}"], 2)


def test_exit_with_an_async_save_in_flight_finishes_it(tmp_path):
    work = tmp_path / "work"
    logs = run_launch(script("manager.py"), 2, tmp_path, args=[work, "exit"], timeout=120)
    assert_passed(logs, ["returned"], 2)
    import paddle_dcp

    assert paddle_dcp.read_metadata(str(work / "ck")).unique_id == 5
    with open(work / "ck" / "paddle_dcp_manager.json") as f:
        assert [(e["step"], e["state"]) for e in json.load(f)["steps"]] == [(5, "complete")]
    assert sorted(p.name for p in (work / "ck").iterdir() if not p.name.startswith("paddle_dcp_manager")) == [
        "0_5.distcp", "1_5.distcp", "5.0.claim", "5.metadata"]
