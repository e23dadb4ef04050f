"""scripts/gpu_check.py, the one-command check for a machine with GPUs, run on the CPU build
(PADDLE_DCP_GPU_CHECK_ALLOW_CPU=1): every case passes on 1 and 2 processes; a corrupted expected
value (PADDLE_DCP_GPU_CHECK_CORRUPT) is a FAIL line and exit code 1; without a GPU it says what
to install and exits 2; a launch past its timeout is killed, with everything it started.

Under the fake GPU (PADDLE_DCP_FAKE_GPU=1 with tests/worker_site on PYTHONPATH, inherited) the
script sees GPUs and runs the same cases in its GPU mode, printing peak memory.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import REPO, _env, _kill, _tail

GPU_CHECK = REPO / "scripts" / "gpu_check.py"
LINE = re.compile(r"^(PASS|FAIL) (\S+) gpus=(\d) time=\d+\.\d\ds peak_gpu=(\S+) peak_pinned=(\S+)(.*)$", re.M)
FAKE_GPU = os.environ.get("PADDLE_DCP_FAKE_GPU") == "1"
ONE = ["save_load", "async_in_a_row", "offload_into_model", "manager"]
TWO = ["save_load", "async_in_a_row", "offload_into_model", "nodelocal", "manager"]


def run_check(tmp_path: Path, args: list, env: dict | None = None, timeout: float = 100) -> tuple[int, str]:
    """``python scripts/gpu_check.py ARGS`` in its own session; (exit code, output). On a
    timeout its process group and the processes it started, and nothing else, are killed."""
    e = {k: v for k, v in _env().items() if not k.startswith("PADDLE_DCP_GPU_CHECK_")}  # the fake GPU's too
    e.update({"PADDLE_DCP_GPU_CHECK_ALLOW_CPU": "1", "PYTHONUNBUFFERED": "1"})
    e.update(env or {})
    proc = subprocess.Popen([sys.executable, str(GPU_CHECK), *map(str, args)], cwd=str(tmp_path), env=e,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        pytest.fail(f"gpu_check.py {args} did not finish in {timeout} s; killed\n{_tail(out)}", pytrace=False)
    return proc.returncode, out


def lines(out: str) -> list[tuple]:
    """(PASS|FAIL, case, gpus, peak_gpu, peak_pinned, rest) of every result line."""
    return [(m[0], m[1], int(m[2]), m[3], m[4], m[5].strip()) for m in LINE.findall(out)]


@pytest.mark.device
def test_every_case_passes_on_1_and_2_processes(tmp_path):
    code, out = run_check(tmp_path, ["--gpus", "1,2", "--keep", tmp_path / "run", "--timeout", 90])
    got = lines(out)
    assert code == 0, f"exit code {code}\n{_tail(out, 80)}"
    want = [("PASS", c, 1) for c in ONE] + [("PASS", c, 2) for c in TWO]
    assert [g[:3] for g in got] == want, _tail(out, 80)
    if not FAKE_GPU:  # the CPU build: no GPU and no pinned memory to measure
        assert all(g[3] == "n/a" and g[4] == "n/a" for g in got), _tail(out, 80)
    else:  # a GPU as paddle reports it: its counters are read
        assert all(re.fullmatch(r"\d+\.\d\dMiB", g[3]) for g in got), _tail(out, 80)
    assert (tmp_path / "run" / "gpus2" / "nodelocal" / "rank1" / "ck").is_dir()


def test_a_wrong_value_is_a_fail_line_and_exit_code_1(tmp_path):
    """One expected value of nodelocal flipped: that case fails on 2 processes (its message
    names the mismatch, the worker logs' tails follow), the others still pass."""
    code, out = run_check(tmp_path, ["--gpus", "1,2", "--cases", "save_load,nodelocal", "--timeout", 90],
                          env={"PADDLE_DCP_GPU_CHECK_CORRUPT": "nodelocal"})
    got = lines(out)
    assert code == 1, f"exit code {code}\n{_tail(out, 80)}"
    assert [g[:3] for g in got] == [("PASS", "save_load", 1), ("PASS", "save_load", 2),
                                    ("FAIL", "nodelocal", 2)], _tail(out, 80)
    assert "values differ" in got[2][5] and "got" in got[2][5], got[2]
    assert "workerlog.0 (last" in out and "workerlog.1 (last" in out, _tail(out, 80)


@pytest.mark.skipif(FAKE_GPU, reason="the fake GPU makes paddle report GPUs")
def test_without_a_gpu_it_says_what_to_install_and_exits_2(tmp_path):
    code, out = run_check(tmp_path, [], env={"PADDLE_DCP_GPU_CHECK_ALLOW_CPU": "0"}, timeout=60)
    assert code == 2, f"exit code {code}\n{out}"
    assert "needs paddlepaddle-gpu" in out and not lines(out), out
    assert "pip install paddlepaddle-gpu==3.3.1 -i https://www.paddlepaddle.org.cn/packages/stable/" in out, out


def test_a_launch_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    psutil = pytest.importorskip("psutil")
    code, out = run_check(tmp_path, ["--gpus", "2", "--timeout", 1, "--keep", tmp_path / "run"], timeout=60)
    got = lines(out)
    assert code == 1 and got and all(g[0] == "FAIL" and "did not finish in 1s" in g[5] for g in got), out
    deadline, marker = time.monotonic() + 10, str(tmp_path / "run")
    while True:
        left = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            if any(marker in part for part in (p.info["cmdline"] or [])):
                left.append(p.info["pid"])
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"processes of the killed launch still running: {left}"
