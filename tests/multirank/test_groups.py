"""paddle_dcp's own process groups: many per process (each with its own id), on 4 ranks."""
from launcher import assert_passed, run_launch, script


def test_many_groups_in_one_process(tmp_path):
    logs = run_launch(script("groups.py"), 4, tmp_path, args=[tmp_path / "work"], timeout=120)
    assert_passed(logs, ["pairs_and_groups"], 4)
