"""load_state_dict(aoa_config=...) on 2 ranks: numpy oracle and paddle's built-in load of the
same values with the same config (scripts/aoa.py)."""
import pytest

from launcher import assert_passed, run_launch, script

CASES = ["save_ours", "save_paddle", "load_ours", "ours_equal_paddles", "rename_sharded"]


@pytest.mark.device
def test_aoa_load_matches_oracle_and_paddle(tmp_path):
    logs = run_launch(script("aoa.py"), 2, tmp_path, args=[tmp_path / "work"])
    assert_passed(logs, CASES, 2)
