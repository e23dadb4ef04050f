"""Run a script under ``python -m paddle.distributed.launch`` from a test.

The launcher runs in its own session (a new process group), so on a timeout exactly that
group is killed by its id, then the workers it started (each in a session of its own), and
nothing else. On failure the tail of every worker log is attached to the test failure.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port, free_ports

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
REPO = HERE.parent.parent
if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))
from bench.launch import kill_started  # noqa: E402 - scripts/ first on the path

PASS_RE = re.compile(r"^PASS (\S+) rank=(\d+)$", re.M)
TAIL_LINES = 60


def script(name: str) -> str:
    """Path of a script under tests/multirank/scripts."""
    return str(SCRIPTS / name)


def _worker_logs(log_dir: Path) -> list[Path]:
    def index(p: Path) -> int:
        suffix = p.name.rsplit(".", 1)[-1]
        return int(suffix) if suffix.isdigit() else 1 << 30

    return sorted(log_dir.glob("workerlog.*"), key=index)


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _report(log_dir: Path, launcher_output: str) -> str:
    parts = [f"--- launcher output (tail) ---\n{_tail(launcher_output)}"]
    logs = _worker_logs(log_dir)
    if not logs:
        parts.append(f"(no worker logs in {log_dir})")
    for log in logs:
        text = log.read_text(errors="replace")
        parts.append(f"--- {log.name} (tail) ---\n{_tail(text)}")
    return "\n".join(parts)


def _kill(proc: subprocess.Popen) -> None:
    """Kill the launcher this module started (in its own session), and the workers it started
    (paddle's launcher puts each in a session of its own), by their ids: the one way a launch
    is ended, shared with the benchmarks (``scripts/bench/launch.kill_started``)."""
    kill_started(proc)


class Launch:
    """A finished launch: the launcher's exit code, worker logs (rank order) and a report of
    the tails of every log, for failure messages."""

    def __init__(self, returncode: int, logs: str, report: str):
        self.returncode, self.logs, self.report = returncode, logs, report


def _env() -> dict:
    """The environment of every process a test starts (launches, single processes, two
    nodes): the scripts and the repository importable, and tests/worker_site first."""
    env = dict(os.environ)
    # every process started finds tests/worker_site/sitecustomize.py: the fake GPU when asked
    # (scripts/test.sh --fake-gpu), and a launched rank's wait for rank 0's store
    site = [str(REPO / "tests" / "worker_site")]
    env["PYTHONPATH"] = os.pathsep.join(
        site + [str(SCRIPTS), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a rank that crashes leaves its threads' stacks in its log
    return env


def launch(script: str, nproc: int, tmp_path, args=(), timeout: float = 180) -> Launch:
    """Start ``script`` on ``nproc`` ranks and wait for it, whatever its exit code.

    When it does not finish in ``timeout`` seconds its process group, and only that, is killed
    and the test fails (with the tail of every worker log).
    """
    tmp_path = Path(tmp_path)
    log_dir = tmp_path / "log"
    n = 0
    while log_dir.exists():  # several launches in one test keep their own logs
        n += 1
        log_dir = tmp_path / f"log{n}"
    cmd = [
        sys.executable, "-m", "paddle.distributed.launch",
        "--nproc_per_node", str(nproc), "--log_dir", str(log_dir),
        script, *[str(a) for a in args],
    ]
    env = _env()
    proc = subprocess.Popen(
        cmd, cwd=str(tmp_path), env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        output, _ = proc.communicate()
        pytest.fail(
            f"{Path(script).name} on {nproc} ranks did not finish in {timeout} s; its process group "
            f"{proc.pid} was killed\n{_report(log_dir, output)}",
            pytrace=False,
        )
    logs = "\n".join(log.read_text(errors="replace") for log in _worker_logs(log_dir))
    return Launch(proc.returncode, logs, _report(log_dir, output))


def run_launch(script: str, nproc: int, tmp_path, args=(), timeout: float = 180) -> str:
    """Start ``script`` on ``nproc`` ranks and wait for it.

    Returns the worker logs, concatenated in rank order. Fails the test (with the tail of
    every worker log) when the launcher exits non-zero or does not finish in ``timeout``
    seconds; in the latter case its process group, and only that, is killed first.
    """
    result = launch(script, nproc, tmp_path, args, timeout)
    if result.returncode != 0:
        pytest.fail(
            f"{Path(script).name} on {nproc} ranks failed (launcher exit code {result.returncode})\n"
            f"{result.report}",
            pytrace=False,
        )
    return result.logs


def passed(logs: str) -> dict[str, set[int]]:
    """Case name -> ranks that printed ``PASS <case> rank=<r>``."""
    out: dict[str, set[int]] = {}
    for name, rank in PASS_RE.findall(logs):
        out.setdefault(name, set()).add(int(rank))
    return out


def assert_passed(logs: str, cases, nproc: int) -> None:
    """Every case in ``cases`` passed on every rank, and no other case ran."""
    got = passed(logs)
    want = {name: set(range(nproc)) for name in cases}
    missing = {n: sorted(want[n] - got.get(n, set())) for n in want if want[n] - got.get(n, set())}
    extra = sorted(set(got) - set(want))
    count = len(PASS_RE.findall(logs))
    assert not missing and not extra and count == len(cases) * nproc, (
        f"PASS lines: expected {len(cases)} cases x {nproc} ranks = {len(cases) * nproc}, got {count}; "
        f"missing (case: ranks) {missing}; unexpected cases {extra}\n{_tail(logs, 80)}"
    )


class KnownBug(Exception):
    """Raised by a test marked ``xfail(strict=True, raises=KnownBug)`` when the run failed
    with the signature of a known library bug (and only then: any other failure fails)."""


def expect_known_bug(result: Launch, signature, cases, nproc: int) -> None:
    """Raise KnownBug when ``result`` failed with ``signature`` (a string, or a tuple of
    alternatives) in its logs; fail the test for any other failure; when it succeeded, check
    its PASS lines (the bug is fixed: the strict xfail then reports XPASS)."""
    signatures = (signature,) if isinstance(signature, str) else tuple(signature)
    if result.returncode != 0:
        found = [s for s in signatures if s in result.logs]
        if found:
            raise KnownBug(f"known bug ({found[0]!r}) still present\n{result.report}")
        pytest.fail(f"failed, but not with the known bug {signatures!r}\n{result.report}", pytrace=False)
    assert_passed(result.logs, cases, nproc)


# ------------------------------------------------------------------------------ two nodes
NODES = ("nodeA", "nodeB")


def run_two_nodes(script: str, nproc_per_node: int, tmp_path, args=(), timeout: float = 180) -> str:
    """Run ``script`` as one job of two "nodes" on this machine: two launches started at
    once, ``--nnodes 2 --master 127.0.0.1:PORT`` (a free port), each in its own working
    directory ``tmp_path/nodeA`` and ``tmp_path/nodeB`` (so a relative checkpoint path is a
    directory of that node alone) with its own ``log`` directory there.

    Which launch gets node rank 0 (global ranks 0 .. nproc_per_node - 1) is decided by the
    order in which they register with the master, not by their names.

    Returns the worker logs of both nodes, concatenated. Fails the test (with the tail of every
    worker log of both nodes) when a launcher exits non-zero (the other one, if still running,
    is killed at once) or both do not finish within ``timeout`` seconds; launchers are killed
    with the workers they started, and nothing else, by their ids (see :func:`_kill`).
    """
    tmp_path = Path(tmp_path)
    port = free_port()
    env = _env()
    procs, outs, log_dirs = [], [], []
    try:
        for name in NODES:
            node = tmp_path / name
            node.mkdir(parents=True, exist_ok=True)
            log_dir = node / "log"
            out = open(node / "launcher.out", "w")  # a file: a full pipe cannot block a launcher
            cmd = [
                sys.executable, "-m", "paddle.distributed.launch",
                "--nnodes", "2", "--nproc_per_node", str(nproc_per_node),
                "--master", f"127.0.0.1:{port}", "--log_dir", str(log_dir),
                script, *[str(a) for a in args],
            ]
            procs.append(subprocess.Popen(cmd, cwd=str(node), env=env, start_new_session=True,
                                          stdout=out, stderr=subprocess.STDOUT))
            outs.append(out)
            log_dirs.append(log_dir)
        deadline = time.monotonic() + timeout
        timed_out = failed_early = False
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                failed_early = True  # the other node's ranks may wait for it until gloo's timeout
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
        if timed_out or failed_early:
            for proc in procs:
                if proc.poll() is None:
                    _kill(proc)
            for proc in procs:
                proc.wait()
    except BaseException:
        for proc in procs:
            _kill(proc)
        raise
    finally:
        for out in outs:
            out.close()

    def report() -> str:
        parts = []
        for name, log_dir in zip(NODES, log_dirs):
            text = (tmp_path / name / "launcher.out").read_text(errors="replace")
            parts.append(f"=== {name} ===\n{_report(log_dir, text)}")
        return "\n".join(parts)

    what = f"{Path(script).name} on 2 nodes x {nproc_per_node} ranks"
    if timed_out:
        pids = ", ".join(str(p.pid) for p in procs)
        pytest.fail(f"{what} did not finish in {timeout} s; the launchers ({pids}) and their workers "
                    f"were killed\n{report()}", pytrace=False)
    codes = [p.returncode for p in procs]
    if any(codes):
        pytest.fail(f"{what} failed (launcher exit codes {codes})\n{report()}", pytrace=False)
    return "\n".join(log.read_text(errors="replace") for d in log_dirs for log in _worker_logs(d))


# ------------------------------------------------------------------------------ one process
def run_single(script: str, tmp_path, args=(), timeout: float = 120) -> str:
    """Run ``script`` in one plain process (``sys.executable script``, no launcher), as an
    evaluation job would. Returns its output. Fails the test (with the output's tail) when it
    exits non-zero or does not finish in ``timeout`` seconds; then its process group, started
    here and holding only it, is killed by its id first."""
    tmp_path = Path(tmp_path)
    cmd = [sys.executable, script, *[str(a) for a in args]]
    proc = subprocess.Popen(
        cmd, cwd=str(tmp_path), env=_env(), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        output, _ = proc.communicate()
        pytest.fail(f"{Path(script).name} (one process) did not finish in {timeout} s; its process group "
                    f"{proc.pid} was killed\n{_tail(output)}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"{Path(script).name} (one process) failed (exit code {proc.returncode})\n"
                    f"{_tail(output)}", pytrace=False)
    return output


# ------------------------------------------------------------------------------ ranks without a launcher
class Job:
    """Ranks of one job started by :func:`spawn` as plain processes, without paddle's launcher
    (which stops every rank seconds after one fails, hiding how the others end). Each rank is
    a child of this process in a session of its own; :meth:`kill` and :meth:`kill_all` signal
    these processes alone, by their ids."""

    def __init__(self, procs, log_paths, started: float):
        self.procs, self.log_paths, self.started = procs, log_paths, started
        self.exited_at: dict[int, float] = {}

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def poll(self) -> dict[int, int | None]:
        """rank -> exit code (None: running); records when each rank was first seen gone."""
        out = {}
        for r, p in enumerate(self.procs):
            code = p.poll()
            if code is not None and r not in self.exited_at:
                self.exited_at[r] = time.monotonic()
            out[r] = code
        return out

    def kill(self, rank: int) -> None:
        """SIGKILL one rank (the process this module started for it)."""
        proc = self.procs[rank]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        for r in range(len(self.procs)):
            self.kill(r)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def wait(self, ranks, deadline: float) -> bool:
        """Wait until every rank of ``ranks`` has exited or time.monotonic() passes
        ``deadline``; True when they all exited."""
        while True:
            codes = self.poll()
            if all(codes[r] is not None for r in ranks):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def log(self, rank: int) -> str:
        return Path(self.log_paths[rank]).read_text(errors="replace") if Path(self.log_paths[rank]).exists() else ""

    def report(self) -> str:
        return "\n".join(f"--- rank {r} (exit {p.poll()}) ---\n{_tail(self.log(r))}" for r, p in enumerate(self.procs))


def spawn(script: str, nproc: int, log_dir, args=(), env=None) -> Job:
    """Start ``script`` as ``nproc`` ranks of one job (gloo on 127.0.0.1, rank 0 hosting the
    store), each a plain ``python script args`` process with the environment paddle's
    launcher would give it, its output in ``log_dir/rank{r}.log``. Returns at once."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(nproc + 1)
    endpoints = [f"127.0.0.1:{p}" for p in ports[1:]]
    procs, logs = [], []
    for r in range(nproc):
        e = _env()
        e.update(env or {})
        e.update({
            "PADDLE_MASTER": f"127.0.0.1:{ports[0]}", "PADDLE_GLOBAL_SIZE": str(nproc),
            "PADDLE_LOCAL_SIZE": str(nproc), "PADDLE_GLOBAL_RANK": str(r), "PADDLE_LOCAL_RANK": str(r),
            "PADDLE_NNODES": "1", "PADDLE_CURRENT_ENDPOINT": endpoints[r], "PADDLE_TRAINER_ID": str(r),
            "PADDLE_TRAINERS_NUM": str(nproc), "PADDLE_RANK_IN_NODE": str(r),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints), "PADDLE_DISTRI_BACKEND": "gloo",
        })  # fmt: skip
        path = log_dir / f"rank{r}.log"
        with open(path, "w") as out:
            procs.append(subprocess.Popen([sys.executable, script, *[str(a) for a in args]], cwd=str(log_dir),
                                          env=e, start_new_session=True, stdout=out, stderr=subprocess.STDOUT))
        logs.append(path)
    return Job(procs, logs, time.monotonic())
