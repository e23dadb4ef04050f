"""async_save=True (issue 5): staged copies, background failures surface, saves queue."""
import pytest

from launcher import assert_passed, run_launch, script


@pytest.mark.device
def test_async_save_on_2_ranks(tmp_path):
    logs = run_launch(script("async_save.py"), 2, tmp_path, args=[tmp_path / "work"], timeout=200)
    assert_passed(logs, ["changed_after_return", "writer_fails_in_background", "next_save_waits", "load_while_saving"], 2)
