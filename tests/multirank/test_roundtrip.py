"""Save and load back into the same layout, on 2 ranks (1-D mesh) and 4 ranks (2-D mesh)."""
import pytest

from launcher import assert_passed, run_launch, script

CASES = [
    "fixture_layout",
    "save_first",
    "load_same_layout",
    "pieces",
    "save_second_gets_id_1",
    "load_latest_is_id_1",
    "load_unique_id_0",
    "explicit_id_and_coordinator_1",
]

def test_roundtrip_2ranks(tmp_path):
    logs = run_launch(script("roundtrip.py"), 2, tmp_path, args=[tmp_path / "work", "1d"])
    assert_passed(logs, CASES, 2)


@pytest.mark.device
def test_roundtrip_4ranks_2d_mesh(tmp_path):
    logs = run_launch(script("roundtrip.py"), 4, tmp_path, args=[tmp_path / "work", "2d"])
    assert_passed(logs, CASES, 4)


def test_roundtrip_4ranks_coshard(tmp_path):
    """Two mesh dims sharding one tensor dim, e.g. [Shard(0), Shard(0)] with 9 rows."""
    logs = run_launch(script("roundtrip.py"), 4, tmp_path, args=[tmp_path / "work", "coshard"])
    assert_passed(logs, CASES, 4)
