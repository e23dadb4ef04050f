"""Our shard rule equals paddle's: for many (shape, mesh, placements), the box
paddle_dcp.placements.describe computes, paddle's own local value (shape and values) and the
test's independent oracle all agree."""
import pytest

from known_bugs import COSHARD_BUG, COSHARD_REASON
from launcher import KnownBug, assert_passed, expect_known_bug, launch, run_launch, script


def test_local_shape_matches_paddle_2ranks(tmp_path):
    logs = run_launch(script("layout.py"), 2, tmp_path, args=[tmp_path / "work", "2"])
    assert_passed(logs, ["paddle_matches_oracle", "describe_matches_paddle"], 2)


def test_local_shape_matches_paddle_4ranks(tmp_path):
    logs = run_launch(script("layout.py"), 4, tmp_path, args=[tmp_path / "work", "4"])
    assert_passed(logs, ["paddle_matches_oracle", "describe_matches_paddle", "paddle_matches_oracle_coshard"], 4)


@pytest.mark.xfail(strict=True, raises=KnownBug, reason=COSHARD_REASON)
def test_local_shape_matches_paddle_coshard(tmp_path):
    result = launch(script("layout.py"), 4, tmp_path, args=[tmp_path / "work", "coshard"])
    expect_known_bug(result, COSHARD_BUG, ["describe_matches_paddle_coshard"], 4)
