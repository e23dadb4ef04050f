"""Our shard rule equals paddle's: for many (shape, mesh, placements), the box
paddle_dcp.parallel.placements.describe computes, paddle's own local value (shape and values) and the
test's independent oracle all agree."""
from launcher import assert_passed, run_launch, script


def test_local_shape_matches_paddle_2ranks(tmp_path):
    logs = run_launch(script("layout.py"), 2, tmp_path, args=[tmp_path / "work", "2"])
    assert_passed(logs, ["paddle_matches_oracle", "describe_matches_paddle"], 2)


def test_local_shape_matches_paddle_4ranks(tmp_path):
    logs = run_launch(script("layout.py"), 4, tmp_path, args=[tmp_path / "work", "4"])
    assert_passed(logs, ["paddle_matches_oracle", "describe_matches_paddle", "paddle_matches_oracle_coshard"], 4)


def test_local_shape_matches_paddle_coshard(tmp_path):
    """Co-sharded placements come back from paddle as bare Placement objects; describe reads
    their dim and order from their repr."""
    logs = run_launch(script("layout.py"), 4, tmp_path, args=[tmp_path / "work", "coshard"])
    assert_passed(logs, ["describe_matches_paddle_coshard"], 4)
