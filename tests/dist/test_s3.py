"""Checkpoints on a real S3 server (SeaweedFS on 127.0.0.1, one per session: tests/s3server.py):
round trip and reshard on 2 and 4 ranks, numbering and generations, ranged GETs counted on the
wire, and a rank killed mid-save. The launched ranks inherit the AWS_* variables of ``s3_env``."""
import uuid

from launcher import assert_passed, launch, run_launch, run_single, script

CASES_2 = ["save_s0", "s0_into_s1", "s0_into_replicate", "s0_into_numpy", "numbering", "ranged_gets"]
CASES_4 = ["save_2d", "2d_into_1d_s1", "2d_into_replicate"]


def test_s3_round_trip_and_reshard_2ranks(tmp_path, s3_env):
    logs = run_launch(script("s3.py"), 2, tmp_path, args=[s3_env.url(uuid.uuid4().hex), "2"], timeout=300)
    assert_passed(logs, CASES_2, 2)


def test_s3_reshard_4ranks(tmp_path, s3_env):
    logs = run_launch(script("s3.py"), 4, tmp_path, args=[s3_env.url(uuid.uuid4().hex), "4"], timeout=300)
    assert_passed(logs, CASES_4, 4)


def test_s3_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, s3_env):
    url = s3_env.url(uuid.uuid4().hex)
    result = launch(script("s3.py"), 2, tmp_path, args=[url, "crash"], timeout=300)
    assert result.returncode != 0, result.report
    assert "PASS save_first rank=0" in result.logs and "PASS save_first rank=1" in result.logs, result.report
    assert "DIED after part " in result.logs, result.report  # a part of rank 1's file was uploaded
    assert "CollectiveError" in result.logs, result.report  # rank 0 raised instead of waiting
    assert "PASS crash" not in result.logs, result.report
    out = run_single(script("s3.py"), tmp_path, args=[url, "check"], timeout=180)
    assert "PASS check rank=0" in out, out
