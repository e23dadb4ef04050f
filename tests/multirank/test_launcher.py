"""The guard every other test here relies on: a launch that does not finish is killed, the
launcher and the workers it started, and the test fails with the workers' logs. The same for
the two launches of a two-node job and for one process run without the launcher."""
import time

import psutil
import pytest

from launcher import run_launch, run_single, run_two_nodes, script


def test_timeout_kills_the_launch_and_its_workers(tmp_path):
    hang = script("hang.py")
    with pytest.raises(pytest.fail.Exception) as failure:
        run_launch(hang, 2, tmp_path, timeout=20)
    message = str(failure.value)
    assert "did not finish in 20 s" in message and "was killed" in message, message
    assert "HANGING rank=0" in message and "HANGING rank=1" in message, message  # logs attached
    deadline = time.monotonic() + 10
    while True:
        left = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if hang in (p.info["cmdline"] or []):
                    left.append(p)
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes of the killed launch still running: {left}"


def _left_running(path: str, deadline_s: float = 10) -> list:
    """Processes whose command line holds ``path``, waiting up to ``deadline_s`` for them to go."""
    deadline = time.monotonic() + deadline_s
    while True:
        left = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if path in (p.info["cmdline"] or []):
                    left.append(p)
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_two_node_timeout_kills_both_launches_and_their_workers(tmp_path):
    hang = script("hang.py")
    with pytest.raises(pytest.fail.Exception) as failure:
        run_two_nodes(hang, 2, tmp_path, timeout=60)
    message = str(failure.value)
    assert "did not finish in 60 s" in message and "were killed" in message, message
    for r in range(4):  # both nodes' logs attached
        assert f"HANGING rank={r}" in message, message
    left = _left_running(hang)
    assert not left, f"processes of the killed launches still running: {left}"


def test_single_process_timeout_kills_it(tmp_path):
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\nprint('SLEEPING', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(pytest.fail.Exception) as failure:
        run_single(str(sleeper), tmp_path, timeout=5)
    message = str(failure.value)
    assert "did not finish in 5 s" in message and "SLEEPING" in message, message
    assert not _left_running(str(sleeper)), "the killed process is still running"
