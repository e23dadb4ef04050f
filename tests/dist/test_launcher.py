"""The guard every other test here relies on: a launch that does not finish is killed, the
launcher and the workers it started, and the test fails with the workers' logs."""
import time

import psutil
import pytest

from launcher import run_launch, script


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
