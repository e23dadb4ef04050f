"""Launches of ranks, the one way the benchmarks start them: a job of ``python -m
paddle.distributed.launch`` (or torchrun) launchers, one per node, each in a session of its
own; the JSON result every rank writes (:func:`write_result`); the logs' tails on failure.

A job that outlives its timeout, or whose driver is interrupted, is stopped by the ids of the
processes it started: each launcher's process group, and the workers below it (paddle's
launcher starts each in a session of its own)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from bench import REPO, SCRIPTS


@dataclass(frozen=True)
class Command:
    """One launcher of a job: its arguments, where it runs, where its output goes."""

    argv: list
    cwd: str
    output: str  # the launcher's stdout and stderr


@dataclass
class Job:
    """What a job left: each rank's result (None where a rank wrote none) and the launchers'."""

    results: list
    codes: list  # the launchers' exit codes, None for one stopped
    why: str  # why the job was stopped ("timed out after ..."), or ""
    wall: float  # seconds from the first start to the last exit
    log_dirs: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def error(self) -> str:
        """'' when every launcher exited 0 and every rank reported ok; else the first reason."""
        if self.why.startswith("timed out"):
            return self.why
        errors = [r["error"] for r in self.results if r and r.get("error")]
        if errors:
            return errors[0]
        if self.why or any(self.codes) or any(r is None or not r.get("ok") for r in self.results):
            return (f"{self.why or 'launcher exit codes ' + str(self.codes)}: "
                    f"{first_error(self.log_dirs) or 'see ' + ', '.join(self.log_dirs)}")
        return ""

    def tail(self, lines: int = 12) -> str:
        """The last lines of every log of the job."""
        return logs_tail(self.log_dirs, lines)


def job_env(**extra: str) -> dict:
    """This process's environment for a job's ranks: the benchmarks and the repository first on
    PYTHONPATH, one OpenMP thread (few cores, several ranks: no library gets a thread pool),
    unbuffered output; then ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SCRIPTS, REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def launcher(worker: str, args: list, nproc: int, log_dir: str, *, torch: bool = False, nnodes: int = 1,
             node_rank: int = 0, master: str | None = None) -> list:
    """The command of one node's launcher: torchrun (``torch``) or paddle's, ``nproc`` ranks of
    ``worker args``; several nodes meet at ``master`` (host:port)."""
    if torch:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                worker, *args]
    nodes = ["--nnodes", str(nnodes), "--rank", str(node_rank), "--master", master] if nnodes > 1 else []
    return [sys.executable, "-m", "paddle.distributed.launch", *nodes, "--nproc_per_node", str(nproc),
            "--log_dir", log_dir, worker, *args]


def run(commands: list, env: dict, timeout: float, result_dir: str, ranks: int, log_dirs: list) -> Job:
    """Start every launcher of ``commands``, wait for all (stopping the rest when one fails,
    or all after ``timeout`` seconds), then read the ``ranks`` results from ``result_dir``."""
    os.makedirs(result_dir, exist_ok=True)
    procs: list = []
    why = ""
    t0 = time.perf_counter()
    try:
        for c in commands:
            with open(c.output, "w") as out:
                procs.append(subprocess.Popen(c.argv, cwd=c.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                why = f"a launcher exited with {[p.poll() for p in procs]}"
                break
            if time.monotonic() > deadline:
                why = f"timed out after {timeout:.0f} s (process groups killed)"
                break
            time.sleep(0.05)
    except BaseException:  # ^C: stop what this job started, then stop
        for p in procs:
            kill_started(p)
        raise
    for p in procs:
        if p.poll() is None:
            kill_started(p)
        p.wait()
    wall = time.perf_counter() - t0
    codes = [None if why.startswith("timed out") else p.returncode for p in procs]
    return Job(read_results(result_dir, ranks), codes, why, wall, list(log_dirs))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_started(proc: subprocess.Popen) -> None:
    """Kill a launch the caller started in a session of its own, by its group id, and the
    processes below it (paddle's launcher puts each worker in a session of its own: those are
    killed by their own group ids). Nothing else is touched. Shared with scripts/gpu_check.py."""
    below = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a job's master)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ results
def write_result(result_dir: str, rank: int, result: dict) -> None:
    """A rank's end: its ``result`` as ``RESULT_DIR/rank{rank}.json`` (what :func:`run` reads)."""
    os.makedirs(result_dir, exist_ok=True)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def read_results(result_dir: str, ranks: int) -> list:
    """Every rank's result in ``result_dir``, rank order (None for a rank without one)."""
    out = []
    for r in range(ranks):
        try:
            with open(os.path.join(result_dir, f"rank{r}.json")) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            out.append(None)
    return out


# ------------------------------------------------------------------------------ logs
def _tail(path: str, lines: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _logs(directories: list) -> list:
    """Every log under ``directories`` (the results' JSON files are not logs), sorted."""
    return [os.path.join(root, name) for d in directories for root, _, names in os.walk(d)
            for name in sorted(names) if not name.endswith(".json")]


def logs_tail(directories: list, lines: int = 12) -> str:
    """The last lines of every log under ``directories``, for a failure report."""
    return "\n".join(f"--- {path}\n{_tail(path, lines)}" for path in _logs(directories))


def first_error(directories: list) -> str:
    """The last exception line in the logs under ``directories``."""
    found = ""
    for path in _logs(directories):
        for line in _tail(path, 60).splitlines():
            s = line.strip()
            if s and ("Error" in s or "Exception" in s) and not s.startswith("File "):
                found = s
    return found[:500]
