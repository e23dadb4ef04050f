"""paddle_dcp under the fake GPU (tests/fakegpu.py), whatever mode the suite runs in: loads into
device tensors, async saves in a row, offload into a model, Partial targets, the groups of an
NCCL job, and the host memory a save holds. Each case failed before paddle_dcp followed
paddle's GPU rules (issue 26)."""
from launcher import assert_passed, run_launch, script

CASES = [
    "fake_is_on",
    "load_device_targets",
    "async_in_a_row",
    "offload_into_model",
    "partial_target",
    "groups_of_an_nccl_job",
    "save_holds_one_host_copy",
]


def test_gpu_rules_2ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("PADDLE_DCP_FAKE_GPU", "1")
    monkeypatch.setenv("PADDLE_DCP_PINNED_STAGING_MB", "0.001")  # 1048 bytes: several runs per tensor
    logs = run_launch(script("gpu_rules.py"), 2, tmp_path, args=[tmp_path / "work"])
    assert_passed(logs, CASES, 2)


def test_groups_stay_bounded_on_4_ranks(tmp_path, monkeypatch):
    """save_gathered on 4 ranks: the gathering rank talks to 3 peers, and holds no group for any."""
    monkeypatch.setenv("PADDLE_DCP_FAKE_GPU", "1")
    monkeypatch.setenv("PADDLE_DCP_PINNED_STAGING_MB", "0.001")
    logs = run_launch(script("gpu_rules.py"), 4, tmp_path, args=[tmp_path / "work", "groups_of_an_nccl_job"])
    assert_passed(logs, ["groups_of_an_nccl_job"], 4)
