"""Benchmark paddle_dcp against paddle's built-in checkpoint and torch.distributed.checkpoint.

Builds the workload of issue 5 (scripts/bench_workload.py) at ``--size`` logical bytes and
``--ranks`` ranks and measures three phases for every library, each in its own launch (fresh processes):

- save: the state dict laid out mostly Shard(0) (some Replicate) on a 1-D mesh of all ranks;
- load: into the same layout;
- reshard: into another layout (every 2-D Shard(0) becomes Shard(1)).

for "ours" (paddle_dcp) and "paddle" (paddle.distributed.save_state_dict / load_state_dict)
under ``python -m paddle.distributed.launch``, and "torch" (torch.distributed.checkpoint with
DTensors on a gloo mesh of CPU ranks, when torch is installed) under torchrun. The libraries
are interleaved (their order rotates from repeat to repeat) and every phase is repeated
``--repeat`` times; the table shows the best repeat (and the median).

Three more phases measure options of paddle_dcp alone, against its own plain save and load:

- save-async: save_state_dict(async_save=True); the time the caller is blocked (until the call
  returns) and the time until the handle's wait() returns, against the full save's time, and
  the peak RSS growth (the host copies: about the rank's share); the first save of a process
  and a later one (the same process's next save) are reported separately, and torch DCP's
  async_save (when torch runs) is timed the same way, for comparison;
- save-durable: save_state_dict(durable=True), which fsyncs data files, metadata and
  directory: its GB/s against the default save (the cost of fsync), and against torch DCP's
  default save, which fsyncs every data file (sync_files=True): the like-for-like comparison;
- load-noverify: load_state_dict(verify=False): against the verified load (the cost of the
  checksums). The machine's xxh3_64 speed is measured in the same run.

GB/s = logical bytes of the state dict (each tensor's global size, once) / the slowest rank's
time, 1 GB = 10**9 bytes. Each rank times its own call after a barrier. Memory = the peak
growth of a rank's resident set during its call (Linux's VmHWM, reset before the call), the
largest over ranks and repeats, also as a fraction of the rank's share of the checkpoint
(logical bytes / ranks). After the timed region every loaded value is compared with a numpy
oracle; a run that loads one wrong value counts as failed and scores nothing. A save is
checked by the loads of the same repeat, which read what it wrote; a save-async or
save-durable checkpoint is loaded back and checked by its own worker, untimed.

The same run measures the machine's page cache: the logical bytes written as k files of
size/k from k threads with os.write of 64 MiB buffers (into fresh memory, "cold", and into
memory just freed, "warm"; and with O_DIRECT, past the page cache), then read back with
readinto, for k = 1 and each rank count; the best of the repeats is shown as the limit a
library could reach. Each rank waits ``--settle`` seconds before its timed call, so memory a
VM with free page reporting hands back to its host is in the same state for every library,
and the files of a checkpoint are read before each load (by the bench, and again by the ranks
after that wait, just before the timed call), so every load reads from the page cache; each
load reports the fraction of the checkpoint's pages cached when its call started
(docs/performance.md explains all three).

Quick smoke run (every code path, about a minute):
    .venv/bin/python scripts/bench.py --size 16M --repeat 1 --ranks 2
The measurement of issue 5 (1 GiB, 2 ranks, and the reshard on 4 ranks):
    .venv/bin/python scripts/bench.py --size 1G --ranks 2 --repeat 3 \\
        --phases save,save-async,save-durable,load,load-noverify,reshard,reshard@4 --json-out bench.json
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_threads import in_threads  # noqa: E402
import bench_s3  # noqa: E402  (--storage s3: the server, the checkpoints on it, its own speed)
import bench_workload as workload  # noqa: E402
import bench_worker  # noqa: E402  (its file reading: the ranks do the same before a timed load)

WORKER = os.path.join(HERE, "bench_worker.py")
LIBS = ("ours", "paddle", "torch")
PHASES = ("save", "save-async", "save-durable", "load", "load-noverify", "reshard")
# paddle_dcp's own options, measured against its plain save and load (no peer has them)
OURS_ONLY = ("save-async", "save-durable", "load-noverify")
# ...except that torch DCP's async_save runs in the save-async phase too, for comparison
ASYNC_PEERS = ("torch",)
SAVES = ("save", "save-async", "save-durable")
LIB_TITLE = {
    "ours": "paddle_dcp",
    "paddle": "paddle built-in",
    "torch": "torch DCP",
}
# issue 5, point 2: ours / peer at least this, per phase and peer
TARGETS = {
    "save": {"paddle": 3.0, "torch": 3.0},
    "load": {"torch": 2.0},
    "reshard": {"paddle": 4.0, "torch": 2.5},
}
GB = 1e9
TORCH_NO_FSYNC = False  # --torch-no-fsync
IO_BUFFER = 64 * workload.MiB


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ machine
def machine_info(workdir: str) -> dict:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": mem,
        "disk": _disk(workdir),
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": version("numpy"),
        "paddlepaddle": version("paddlepaddle") or version("paddlepaddle-gpu"),
        "torch": version("torch"),
        "paddle_dcp": version("paddle_dcp") or version("paddle-dcp"),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "paddle_dcp_commit": _git("rev-parse", "--short", "HEAD"),
        "paddle_dcp_uncommitted": _git("status", "--porcelain", "--", "paddle_dcp"),
    }


def _git(*args) -> str | None:
    try:
        out = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _disk(path: str) -> dict:
    """The filesystem holding ``path``: device, type, size (from /proc/mounts, longest match)."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, dev, fstype)
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    rotational = None
    dev = os.path.basename(best[1])
    for name in (dev, dev.rstrip("0123456789")):
        try:
            with open(f"/sys/block/{name}/queue/rotational") as f:
                rotational = f.read().strip() == "1"
                break
        except OSError:
            continue
    return {"mount": best[0], "device": best[1], "fstype": best[2], "size_bytes": usage.total,
            "free_bytes": usage.free, "rotational": rotational}


# ------------------------------------------------------------------------------ page cache
def _write_file(path: str, nbytes: int, buf: memoryview, direct: bool = False) -> None:
    """Write ``nbytes`` from ``buf`` (repeated) to ``path``; ``direct``: with O_DIRECT (the page
    cache bypassed), ``buf`` page-aligned and sizes multiples of 4096."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, buf[: min(left, len(buf))])
    finally:
        os.close(fd)


def _read_file(path: str, buf: memoryview) -> int:
    got = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return got
            got += n


def page_cache_speed(directory: str, nbytes: int, threads: int, settle: float) -> dict:
    """Write ``nbytes`` as ``threads`` fresh files from as many threads, then read them back.

    "cold": the files are written ``settle`` seconds after the previous ones were deleted, as
    a fresh process writing a new checkpoint meets the page cache (in a VM with free page
    reporting the freed memory has gone back to the host by then). "warm": written again at
    once into the memory just freed by deleting them. Reads land in buffers touched before.
    """
    import numpy as np

    os.makedirs(directory, exist_ok=True)
    per_file = nbytes // threads // 4096 * 4096  # O_DIRECT wants whole pages
    total = per_file * threads
    paths = [os.path.join(directory, f"pagecache.{i}") for i in range(threads)]

    def remove():
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)

    pattern = np.random.default_rng(0).integers(0, 256, min(IO_BUFFER, max(per_file, 1)), dtype=np.uint8)
    wbuf = memoryview(pattern)
    rbufs = [memoryview(np.ones(min(IO_BUFFER, max(per_file, 1)), dtype=np.uint8)) for _ in paths]
    out = {"threads": threads, "bytes": total}
    remove()
    os.sync()  # no dirty pages of earlier steps are written back during the measurement
    time.sleep(settle)
    out["write_cold_gbps"] = total / in_threads(_write_file, [(p, per_file, wbuf) for p in paths]) / GB
    read1 = in_threads(_read_file, list(zip(paths, rbufs)))
    remove()
    out["write_warm_gbps"] = total / in_threads(_write_file, [(p, per_file, wbuf) for p in paths]) / GB
    read2 = in_threads(_read_file, list(zip(paths, rbufs)))
    out["read_gbps"] = total / min(read1, read2) / GB
    remove()
    os.sync()
    out["write_direct_gbps"] = None
    if hasattr(os, "O_DIRECT") and per_file % 4096 == 0:
        import mmap

        aligned = mmap.mmap(-1, len(wbuf))  # anonymous maps are page-aligned
        aligned[:] = wbuf
        try:
            seconds = in_threads(_write_file, [(p, per_file, memoryview(aligned), True) for p in paths])
            out["write_direct_gbps"] = total / seconds / GB
        except OSError as exc:  # a filesystem without O_DIRECT (tmpfs)
            log(f"O_DIRECT writes not measured: {exc}")
        finally:
            remove()
            aligned.close()
    return out


CHECKSUM_BUFFER = 256 * workload.MiB


def _library_block_bytes() -> int:
    """paddle_dcp's checksum block (metadata.DEFAULT_BLOCK_BYTES), read from its source: importing
    the package would import paddle into this driver process."""
    import re

    try:
        with open(os.path.join(REPO, "paddle_dcp", "core", "metadata.py")) as f:
            m = re.search(r"^DEFAULT_BLOCK_BYTES\s*=\s*(\d+)(?:\s*<<\s*(\d+))?\s*$", f.read(), re.M)
        if m:
            return int(m.group(1)) << int(m.group(2) or 0)
    except OSError:
        pass
    return 4 * workload.MiB


def checksum_speed(nbytes: int = CHECKSUM_BUFFER, rounds: int = 5) -> dict:
    """xxh3_64 (the python-xxhash the library uses) over a ``nbytes`` buffer already in memory,
    from one thread: once as one call, once in the library's checksum blocks (metadata
    DEFAULT_BLOCK_BYTES, each with its own seed). Best of ``rounds``, GB/s."""
    import numpy as np
    import xxhash

    block = _library_block_bytes()
    buf = np.arange(nbytes // 8, dtype=np.uint64).view(np.uint8)  # touched: no first-touch cost timed
    view = memoryview(buf)
    whole, blocks = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(view)
        whole.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k, i in enumerate(range(0, nbytes, block)):
            xxhash.xxh3_64_intdigest(view[i : i + block], seed=k)
        blocks.append(time.perf_counter() - t0)
    return {"bytes": nbytes, "block_bytes": block, "xxhash": importlib.metadata.version("xxhash"),
            "whole_gbps": nbytes / min(whole) / GB, "blocks_gbps": nbytes / min(blocks) / GB}


# ------------------------------------------------------------------------------ launches
@dataclass
class Run:
    """One launch of one phase of one library."""

    lib: str
    phase: str
    ranks: int
    repeat: int
    ok: bool = False
    error: str = ""
    seconds: list = field(default_factory=list)      # per rank, the timed call
    rss_growth: list = field(default_factory=list)   # per rank, bytes
    checked_bytes: list = field(default_factory=list)
    wall: float = 0.0                                # the whole launch, seconds
    patched: bool = False
    rss_method: str = ""
    blocked: list = field(default_factory=list)           # save-async: per rank, until the call returned
    rss_growth_at_return: list = field(default_factory=list)  # save-async: per rank, bytes
    later: dict = field(default_factory=dict)  # save-async: the same process's next saves, per rank
    cached: list = field(default_factory=list)  # loads: per rank, fraction of the checkpoint's pages cached at the start
    cpu: list = field(default_factory=list)  # per rank, CPU seconds (user + system) of the timed call
    server_cpu: float | None = None  # --storage s3: the server's CPU seconds during rank 0's timed call

    @property
    def slowest(self) -> float:
        return max(self.seconds) if self.seconds else float("nan")


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _logs_tail(run_dir: str, lines: int = 12) -> str:
    """The last lines of every log of a launch, for a failure report."""
    parts = []
    for root, _, files in os.walk(run_dir):
        for name in sorted(files):
            if not name.endswith(".json"):
                parts.append(f"--- {os.path.join(root, name)}\n{_tail(os.path.join(root, name), lines)}")
    return "\n".join(parts)


def _first_error(run_dir: str) -> str:
    """The last exception line in the logs of a failed launch."""
    found = ""
    for root, _, files in os.walk(run_dir):
        for name in sorted(files):
            if name.endswith(".json"):
                continue
            text = _tail(os.path.join(root, name), 60)
            for line in text.splitlines():
                s = line.strip()
                if s and ("Error" in s or "Exception" in s) and not s.startswith("File "):
                    found = s
    return found[:500]


def launch(lib: str, phase: str, ranks: int, size: int, ckpt: str, run_dir: str, timeout: float,
           repeat: int, settle: float) -> Run:
    result_dir = os.path.join(run_dir, "result")
    os.makedirs(result_dir, exist_ok=True)
    args = [WORKER, lib, phase, str(size), ckpt, result_dir]
    if lib == "torch":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *args]
    else:
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(ranks),
               "--log_dir", os.path.join(run_dir, "log"), *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE, REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores, N ranks: no library gets a thread pool
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PADDLE_DCP_BENCH_SETTLE"] = str(settle)
    if TORCH_NO_FSYNC:
        env["PADDLE_DCP_BENCH_TORCH_NO_FSYNC"] = "1"
    run = Run(lib, phase, ranks, repeat)
    launcher_log = os.path.join(run_dir, "launcher.log")
    t0 = time.perf_counter()
    with open(launcher_log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except BaseException as exc:  # a timeout, or ^C: stop the group this launch started, by its id
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            code = None
    run.wall = time.perf_counter() - t0
    results = []
    for r in range(ranks):
        try:
            with open(os.path.join(result_dir, f"rank{r}.json")) as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            results.append(None)
    errors = [res["error"] for res in results if res and res.get("error")]
    if code is None:
        run.error = f"timed out after {timeout:.0f} s (process group killed)"
    elif errors:
        run.error = errors[0]
    elif code != 0 or any(res is None or not res.get("ok") for res in results):
        run.error = f"launcher exit code {code}: {_first_error(run_dir) or 'see ' + run_dir}"
    else:
        run.ok = True
    done = [res for res in results if res and "seconds" in res]
    if len(done) == ranks:
        run.seconds = [res["seconds"] for res in done]
        run.rss_growth = [res["rss_growth"] for res in done]
        run.checked_bytes = [res.get("checked_bytes", 0) for res in done]
        run.patched = any(res.get("patched_gpu_staging") for res in done)
        run.rss_method = done[0].get("rss_method", "")
        run.cached = [res["cached_before"] for res in done if res.get("cached_before") is not None]
        run.cpu = [res.get("cpu_seconds") for res in done]
        run.server_cpu = done[0].get("server_cpu_seconds")
        if phase == "save-async":
            run.blocked = [res["blocked_seconds"] for res in done]
            run.rss_growth_at_return = [res["rss_growth_at_return"] for res in done]
            for key in done[0]:
                if key.startswith(("next_async_", "next_full_")):
                    run.later[key] = [res[key] for res in done]
    elif run.ok:
        run.ok, run.error = False, "a rank reported no time"
    return run


# ------------------------------------------------------------------------------ schedule
def parse_phases(text: str, ranks: list) -> list:
    """'save,load,reshard@4' -> [(ranks, phase)], in run order: every plain phase at each of
    ``ranks``, a phase@R at R only."""
    wanted = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, _, at = item.partition("@")
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; choose from {', '.join(PHASES)} (optionally @RANKS)")
        for r in ([int(at)] if at else ranks):
            if (r, name) not in wanted:
                wanted.append((r, name))
    return sorted(wanted, key=lambda rp: (rp[0], PHASES.index(rp[1])))


def parse_ranks(text: str) -> list:
    out = sorted({int(x) for x in text.split(",") if x.strip()})
    if not out or out[0] < 1:
        raise ValueError(f"--ranks {text!r}: give rank counts >= 1, e.g. 2 or 2,4")
    return out


def rotated(items: list, k: int) -> list:
    k %= max(len(items), 1)
    return items[k:] + items[:k]


def describe(run: Run, logical: int) -> str:
    if not run.ok:
        return f"FAILED: {run.error}"
    gbps = logical / run.slowest / GB
    mib = max(run.rss_growth) / workload.MiB
    checked = ", every value checked" if run.phase != "save" else ""
    if run.phase == "save-async":
        return (f"blocked {max(run.blocked):.3f} s, {gbps:6.3f} GB/s until wait() ({run.slowest:.3f} s), "
                f"peak RSS growth {max(run.rss_growth_at_return) / workload.MiB:.0f} MiB/rank at return, "
                f"{mib:.0f} until wait(){checked}")
    cached = f", {100 * min(run.cached):.1f}% of its pages cached at the start" if run.cached else ""
    return f"{gbps:6.3f} GB/s ({run.slowest:.3f} s), peak RSS growth {mib:.0f} MiB/rank{checked}{cached}"


def run_benchmark(args) -> dict:
    size = workload.parse_size(args.size)
    specs = workload.build(size)
    logical = workload.total_bytes(specs)
    ranks_list = parse_ranks(args.ranks)
    plan = parse_phases(args.phases, ranks_list)
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    for lib in libs:
        if lib not in LIBS:
            raise ValueError(f"unknown library {lib!r}; choose from {', '.join(LIBS)}")
    notes = []
    if "ours" not in libs:
        plan = [(r, p) for r, p in plan if p not in OURS_ONLY]
        if not plan:
            raise ValueError(f"phases {', '.join(OURS_ONLY)} measure paddle_dcp only: add ours to --libs")
    if args.storage == "s3":
        dropped = [lib for lib in libs if lib not in bench_s3.LIBS]
        libs = [lib for lib in libs if lib in bench_s3.LIBS]
        skipped = sorted({p for _, p in plan if p not in bench_s3.PHASES})
        plan = [(r, p) for r, p in plan if p in bench_s3.PHASES]
        if not plan or not libs:
            raise ValueError(f"--storage s3 measures {', '.join(bench_s3.PHASES)} of {', '.join(bench_s3.LIBS)}")
        if dropped:
            notes.append(f"--storage s3: {', '.join(LIB_TITLE[x] for x in dropped)} not measured (local paths only)")
        if skipped:
            notes.append(f"--storage s3: phases {', '.join(skipped)} not measured (options of the local disk)")
    if "torch" in libs and importlib.util.find_spec("torch") is None:
        libs.remove("torch")
        notes.append("torch is not installed in this Python: torch DCP skipped (pip install torch==2.13.0)")
        log(notes[-1])
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        root = tempfile.mkdtemp(prefix="paddle_dcp_bench.", dir=args.workdir)
    else:
        root = tempfile.mkdtemp(prefix="paddle_dcp_bench.")
    load_start = _wait_idle(args.wait_idle)
    info = machine_info(root)
    log(f"workdir {root}; {workload.human(logical)} logical in {len(specs)} tensors; "
        f"phases (ranks, phase) {plan}; libs {libs}; repeat {args.repeat}; "
        f"load average at start {load_start[0]:.2f}")
    if load_start[0] > 1.0:
        notes.append(f"the machine was busy at the start: load average {load_start[0]:.2f} (1 min)")
        log("warning: " + notes[-1])
    store = bench_s3.S3Store.start(root) if args.storage == "s3" else None
    thread_counts = [] if store else sorted({1} | {r for r, _ in plan})
    server: list = []
    page_cache = {k: [] for k in thread_counts}
    checksum: list = []
    runs: list[Run] = []
    ready: dict = {}
    timeout = args.timeout or (180 + 120 * size / workload.GiB * max(r for r, _ in plan))
    started = time.perf_counter()
    try:
        for rep in range(args.repeat):
            for k in thread_counts:
                pc = page_cache_speed(os.path.join(root, "pagecache"), logical, k, args.settle)
                page_cache[k].append(pc)
                log(f"[{rep + 1}/{args.repeat}] page cache, {k} thread(s): write {pc['write_cold_gbps']:.2f} GB/s "
                    f"cold, {pc['write_warm_gbps']:.2f} GB/s warm, {pc['write_direct_gbps'] or 0:.2f} GB/s "
                    f"O_DIRECT; read {pc['read_gbps']:.2f} GB/s")
            if store:
                server.append(bench_s3.server_speed(store, logical))
                log(f"[{rep + 1}/{args.repeat}] S3 server, 1 / {bench_s3.STREAMS} streams: PUT "
                    f"{' / '.join(f'{v:.2f}' for v in server[-1]['put_gbps'].values())} GB/s, GET "
                    f"{' / '.join(f'{v:.2f}' for v in server[-1]['get_gbps'].values())} GB/s (s3fs "
                    f"{' / '.join(f'{v:.2f}' for v in server[-1]['get_gbps_s3fs'].values())}, lean "
                    f"{' / '.join(f'{v:.2f}' for v in server[-1]['get_gbps_lean'].values())})")
            checksum.append(checksum_speed())
            log(f"[{rep + 1}/{args.repeat}] xxh3_64: {checksum[-1]['whole_gbps']:.1f} GB/s in one call, "
                f"{checksum[-1]['blocks_gbps']:.1f} GB/s in {workload.human(checksum[-1]['block_bytes'])} blocks")
            order = rotated(libs, rep)
            for ranks, phase in plan:
                for lib in order:
                    if phase in OURS_ONLY and lib != "ours" and not (phase == "save-async" and lib in ASYNC_PEERS):
                        continue
                    # save-async and save-durable write a checkpoint of their own (checked by the
                    # worker itself, then deleted); the loads read the plain save's
                    own = phase in ("save-async", "save-durable")
                    name = f"{lib}_{ranks}" + (f"_{phase}" if own else "")
                    ckpt = store.path(name) if store else os.path.join(root, "ckpt", name)
                    run_dir = os.path.join(root, "runs", f"r{rep}_{ranks}_{phase}_{lib}")
                    if phase in SAVES:
                        _remove(store, ckpt)
                    elif not ready.get((lib, ranks)):
                        if (ranks, "save") in plan or (lib, ranks) in ready:
                            run = Run(lib, phase, ranks, rep, error="no checkpoint: the save before it failed")
                            runs.append(run)
                            log(f"[{rep + 1}/{args.repeat}] {ranks} ranks {phase:13s} {lib:6s}: skipped, {run.error}")
                            continue
                        # this phase set has no save: write the checkpoint once, untimed
                        prep = launch(lib, "save", ranks, size, ckpt, run_dir + "_prep", timeout, rep, 0)
                        os.sync()
                        ready[(lib, ranks)] = prep.ok
                        log(f"[{rep + 1}/{args.repeat}] {ranks} ranks prepare {lib:6s}: "
                            f"{'ok' if prep.ok else 'FAILED: ' + prep.error}")
                        if not prep.ok:
                            runs.append(Run(lib, phase, ranks, rep, error=f"no checkpoint: {prep.error}"))
                            continue
                    if phase not in SAVES and not store:
                        bench_worker.read_files(ckpt)
                    run = launch(lib, phase, ranks, size, ckpt, run_dir, timeout, rep, args.settle)
                    if store and phase in SAVES and run.ok and not store.holds(ckpt):
                        run.ok, run.error = False, f"the save wrote nothing to the server under {ckpt}"
                    runs.append(run)
                    if phase == "save":
                        ready[(lib, ranks)] = run.ok
                    if phase in SAVES:
                        os.sync()  # its dirty pages are not written back during the next phase
                    if own and not args.keep:
                        _remove(store, ckpt)
                    log(f"[{rep + 1}/{args.repeat}] {ranks} ranks {phase:13s} {lib:6s}: "
                        f"{describe(run, logical)} (launch {run.wall:.1f} s)")
                    if not run.ok:
                        log(_logs_tail(run_dir))
                    if run.ok and not args.keep:
                        shutil.rmtree(run_dir, ignore_errors=True)
            if not args.keep:  # the next repeat saves afresh
                for lib in libs:
                    for ranks in {r for r, p in plan if p == "save"}:
                        _remove(store, store.path(f"{lib}_{ranks}") if store else os.path.join(root, "ckpt", f"{lib}_{ranks}"))
                        ready.pop((lib, ranks), None)
    finally:
        if store:
            store.close()
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    load_end = os.getloadavg()
    res = summarize(args, info, specs, logical, plan, libs, runs, page_cache, checksum, notes, load_start,
                    load_end, time.perf_counter() - started, bench_s3.best_server_speed(server))
    if store:
        res["machine"]["storage"] = store.info()
    return res


def _remove(store, ckpt: str) -> None:
    """Delete a checkpoint: a directory, or the objects under an s3:// prefix."""
    if store:
        store.remove(ckpt)
    else:
        shutil.rmtree(ckpt, ignore_errors=True)


def _wait_idle(limit: float) -> tuple:
    """Wait up to ``limit`` seconds for the 1-minute load average to drop to 1.0 or below."""
    deadline = time.monotonic() + limit
    load = os.getloadavg()
    while load[0] > 1.0 and time.monotonic() < deadline:
        log(f"load average {load[0]:.2f} > 1.0: waiting (up to {deadline - time.monotonic():.0f} s more)")
        time.sleep(min(15.0, max(deadline - time.monotonic(), 0.1)))
        load = os.getloadavg()
    return load


# ------------------------------------------------------------------------------ results
def _cpu_use(run: Run) -> dict | None:
    """CPU seconds of a run's timed calls (all ranks; the S3 server's, if any) against what the
    machine's cores offer in the slowest call."""
    if not run.cpu or None in run.cpu:
        return None
    ranks = sum(run.cpu)
    used = ranks + (run.server_cpu or 0.0)
    available = (os.cpu_count() or 1) * run.slowest
    return {"ranks_seconds": ranks, "server_seconds": run.server_cpu, "available_seconds": available,
            "busy_fraction": used / available if available else None}


def summarize(args, info, specs, logical, plan, libs, runs, page_cache, checksum, notes, load_start, load_end,
              seconds, server=None):
    targets = bench_s3.TARGETS if args.storage == "s3" else TARGETS
    phases = []
    for ranks, phase in plan:
        share = logical / ranks
        entry = {"ranks": ranks, "phase": phase, "logical_bytes": logical, "share_bytes": share, "libs": {}}
        entry_libs = ["ours"] if phase in OURS_ONLY else libs
        if phase == "save-async":
            entry_libs = ["ours"] + [lib for lib in libs if lib in ASYNC_PEERS]
        for lib in entry_libs:
            mine = [r for r in runs if r.lib == lib and r.phase == phase and r.ranks == ranks]
            good = [r for r in mine if r.ok]
            rates = [logical / r.slowest / GB for r in good]
            stat = {
                "runs": [
                    {"repeat": r.repeat, "ok": r.ok, "error": r.error, "seconds_per_rank": r.seconds,
                     "rss_growth_per_rank": r.rss_growth, "checked_bytes_per_rank": r.checked_bytes,
                     "gbps": logical / r.slowest / GB if r.ok else None, "launch_seconds": r.wall,
                     "cached_fraction_per_rank": r.cached, "cpu_seconds_per_rank": r.cpu,
                     "server_cpu_seconds": r.server_cpu,
                     **({"blocked_seconds_per_rank": r.blocked, "rss_growth_at_return_per_rank": r.rss_growth_at_return,
                         **{k + "_per_rank": v for k, v in r.later.items()}}
                        if phase == "save-async" else {})}
                    for r in mine
                ],
                "ok_runs": len(good),
                "gpu_staging_patched": any(r.patched for r in mine),
                "rss_method": next((r.rss_method for r in mine if r.rss_method), ""),
                "cached_fraction_min": min((min(r.cached) for r in good if r.cached), default=None),
            }
            if good:
                best = max(good, key=lambda r: logical / r.slowest)
                growth = max(max(r.rss_growth) for r in good)
                stat.update(
                    best_gbps=max(rates), median_gbps=statistics.median(rates), best_seconds=best.slowest,
                    rss_growth_max_bytes=growth, rss_growth_fraction_of_share=growth / share,
                    best_cpu=_cpu_use(best),
                )
            entry["libs"][lib] = stat
        ours = entry["libs"].get("ours", {}).get("best_gbps")
        ours_median = entry["libs"].get("ours", {}).get("median_gbps")
        entry["ratio_ours_over"] = {}
        entry["ratio_ours_over_median"] = {}
        entry["targets"] = {}
        for lib in entry_libs:
            peer = entry["libs"][lib].get("best_gbps")
            peer_median = entry["libs"][lib].get("median_gbps")
            if lib != "ours":
                entry["ratio_ours_over"][lib] = ours / peer if ours and peer else None
                entry["ratio_ours_over_median"][lib] = ours_median / peer_median if ours_median and peer_median else None
            if lib in targets.get(phase, {}):
                ratio = entry["ratio_ours_over"].get(lib)
                entry["targets"][lib] = {"at_least": targets[phase][lib],
                                         "met": None if ratio is None else ratio >= targets[phase][lib]}
        if server and phase in ("save", "load", "reshard"):
            limit = bench_s3.limit_targets(entry, server)
            if limit:
                entry["targets"]["server"] = limit
        if server and phase in bench_s3.PHASES:
            entry["targets"]["memory"] = bench_s3.memory_target(entry)
        elif "ours" in entry["libs"] and "rss_growth_max_bytes" in entry["libs"]["ours"] and phase != "save-async":
            limit = 0.1 * share + 64 * workload.MiB
            entry["targets"]["memory"] = {"limit_bytes": limit,
                                          "met": entry["libs"]["ours"]["rss_growth_max_bytes"] <= limit}
        phases.append(entry)
    _compare_variants(phases)
    pc = {}
    for k, samples in page_cache.items():
        pc[str(k)] = {
            "threads": k,
            "write_cold_gbps": max(s["write_cold_gbps"] for s in samples) if samples else None,
            "write_warm_gbps": max(s["write_warm_gbps"] for s in samples) if samples else None,
            "read_gbps": max(s["read_gbps"] for s in samples) if samples else None,
            "write_direct_gbps": max((s["write_direct_gbps"] for s in samples if s["write_direct_gbps"]),
                                     default=None),
            "samples": samples,
        }
    return {
        "machine": info,
        "config": {"size_bytes": logical, "size_arg": args.size, "tensors": len(specs),
                   "ranks": sorted({r for r, _ in plan}), "phases": [f"{p}@{r}" for r, p in plan],
                   "libs": libs, "repeat": args.repeat, "statistic": "best of the repeats (median also given)",
                   "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"), "settle_seconds": args.settle,
                   "torch_sync_files": not args.torch_no_fsync and args.storage != "s3", "storage": args.storage},
        "workload": _workload_summary(specs, logical),
        "page_cache": pc,
        "server": server or {},
        "checksum": {
            "what": "xxh3_64 over a buffer in memory, one thread, GB/s: one call over the buffer, and in the "
                    "library's checksum blocks; best of the repeats",
            "whole_gbps": max((c["whole_gbps"] for c in checksum), default=None),
            "blocks_gbps": max((c["blocks_gbps"] for c in checksum), default=None),
            "samples": checksum,
        },
        "phases": phases,
        "load_average": {"start": list(load_start), "end": list(load_end)},
        "notes": notes,
        "seconds": seconds,
    }


def _ratio(a, b):
    return a / b if a and b else None


def _compare_variants(phases: list) -> None:
    """Add to each entry of an ours-only phase its comparison with the plain phase it varies.

    save-async: the time training is blocked (the call's return) against the full save's time;
    save-durable: its speed against the default save's, and, like for like, against torch DCP's
    default save (which fsyncs every data file); load-noverify: against the verified load.
    Times are the slowest rank's; "best" compares best with best, "median" median with median.
    """
    by = {(e["phase"], e["ranks"]): e for e in phases}
    for e in phases:
        ours = e["libs"].get("ours", {})
        if e["phase"] not in OURS_ONLY or "best_gbps" not in ours:
            continue
        good = [r for r in ours["runs"] if r["ok"]]
        base_phase = "load" if e["phase"] == "load-noverify" else "save"
        base = by.get((base_phase, e["ranks"]), {}).get("libs", {})
        plain = base.get("ours", {})
        plain_runs = [r for r in plain.get("runs", []) if r["ok"]]
        plain_best = min((max(r["seconds_per_rank"]) for r in plain_runs), default=None)
        plain_median = statistics.median([max(r["seconds_per_rank"]) for r in plain_runs]) if plain_runs else None
        if e["phase"] == "save-async":
            def slowest(key, runs=good):  # the slowest rank of each good run
                return [max(r[key]) for r in runs if key in r]

            def best_median(values):
                return (min(values), statistics.median(values)) if values else (None, None)

            blocked, total = slowest("blocked_seconds_per_rank"), slowest("seconds_per_rank")
            nb, nt = slowest("next_async_blocked_seconds_per_rank"), slowest("next_async_seconds_per_rank")
            nf = slowest("next_full_seconds_per_rank")
            e["async"] = {
                "what": "first: the first save of a fresh process (as the save phase), which also creates the "
                        "background save's process group; next: a second async save in the same process, against "
                        "a plain save after it in that process (as a training loop's later saves); blocked = until "
                        "the call returned, until_wait = until wait() returned; slowest rank, best and median of "
                        "the repeats",
                "first_blocked_best_s": best_median(blocked)[0], "first_blocked_median_s": best_median(blocked)[1],
                "first_until_wait_best_s": best_median(total)[0], "first_until_wait_median_s": best_median(total)[1],
                "full_save_best_s": plain_best, "full_save_median_s": plain_median,
                "full_save_rss_growth_max_bytes": plain.get("rss_growth_max_bytes"),
                "first_blocked_over_full_save_best": _ratio(best_median(blocked)[0], plain_best),
                "first_blocked_over_full_save_median": _ratio(best_median(blocked)[1], plain_median),
                "next_blocked_best_s": best_median(nb)[0], "next_blocked_median_s": best_median(nb)[1],
                "next_until_wait_best_s": best_median(nt)[0], "next_until_wait_median_s": best_median(nt)[1],
                "next_full_save_best_s": best_median(nf)[0], "next_full_save_median_s": best_median(nf)[1],
                "next_blocked_over_next_full_save_best": _ratio(best_median(nb)[0], best_median(nf)[0]),
                "next_blocked_over_next_full_save_median": _ratio(best_median(nb)[1], best_median(nf)[1]),
                "first_rss_growth_at_return_max_bytes": max(max(r["rss_growth_at_return_per_rank"]) for r in good),
                "first_rss_growth_until_wait_max_bytes": ours["rss_growth_max_bytes"],
                "next_rss_growth_at_return_max_bytes": max((max(r["next_async_rss_growth_at_return_per_rank"])
                                                            for r in good if "next_async_rss_growth_at_return_per_rank" in r),
                                                           default=None),
                "next_rss_growth_until_wait_max_bytes": max((max(r["next_async_rss_growth_per_rank"]) for r in good
                                                             if "next_async_rss_growth_per_rank" in r), default=None),
                "next_full_save_rss_growth_max_bytes": max((max(r["next_full_rss_growth_per_rank"]) for r in good
                                                            if "next_full_rss_growth_per_rank" in r), default=None),
                "expected_rss_growth_bytes": e["share_bytes"],
            }
            for peer in ASYNC_PEERS:  # the peer's first and next async saves, blocked
                peer_good = [r for r in e["libs"].get(peer, {}).get("runs", []) if r["ok"]]
                if peer_good:
                    pb = best_median(slowest("blocked_seconds_per_rank", peer_good))
                    pn = best_median(slowest("next_async_blocked_seconds_per_rank", peer_good))
                    e["async"][peer] = {"first_blocked_best_s": pb[0], "first_blocked_median_s": pb[1],
                                        "next_blocked_best_s": pn[0], "next_blocked_median_s": pn[1],
                                        "ours_next_blocked_over_peer_next_best": _ratio(best_median(nb)[0], pn[0]),
                                        "ours_next_blocked_over_peer_next_median": _ratio(best_median(nb)[1], pn[1])}
        elif e["phase"] == "save-durable":
            e["durable"] = {
                "default_save_best_gbps": plain.get("best_gbps"), "default_save_median_gbps": plain.get("median_gbps"),
                "durable_over_default_gbps_best": _ratio(ours["best_gbps"], plain.get("best_gbps")),
                "durable_over_default_gbps_median": _ratio(ours["median_gbps"], plain.get("median_gbps")),
                "extra_seconds_best": ours["best_seconds"] - plain_best if plain_best else None,
                "extra_seconds_median": (statistics.median([max(r["seconds_per_rank"]) for r in good]) - plain_median
                                         if plain_median else None),
            }
            # like for like: both fsync (torch DCP's default sync_files=True) / not: ours without fsync
            e["like_for_like"] = {}
            for peer in ("torch", "paddle"):
                p = base.get(peer, {})
                if "best_gbps" not in p:
                    continue
                e["like_for_like"][peer] = {
                    "peer_fsyncs": peer == "torch" and not TORCH_NO_FSYNC,
                    "ours_durable_over_peer_default_best": _ratio(ours["best_gbps"], p["best_gbps"]),
                    "ours_durable_over_peer_default_median": _ratio(ours["median_gbps"], p["median_gbps"]),
                    "ours_default_over_peer_default_best": _ratio(plain.get("best_gbps"), p["best_gbps"]),
                    "ours_default_over_peer_default_median": _ratio(plain.get("median_gbps"), p["median_gbps"]),
                }
        else:  # load-noverify
            noverify = [max(r["seconds_per_rank"]) for r in good]
            e["verify"] = {
                "verified_load_best_gbps": plain.get("best_gbps"), "verified_load_median_gbps": plain.get("median_gbps"),
                "noverify_over_verified_gbps_best": _ratio(ours["best_gbps"], plain.get("best_gbps")),
                "noverify_over_verified_gbps_median": _ratio(ours["median_gbps"], plain.get("median_gbps")),
                "verify_extra_seconds_best": plain_best - min(noverify) if plain_best else None,
                "verify_extra_seconds_median": plain_median - statistics.median(noverify) if plain_median else None,
            }


def _workload_summary(specs, logical) -> dict:
    def share(pred):
        return sum(s.nbytes for s in specs if pred(s)) / logical

    return {
        "tensors": len(specs),
        "big_tensor_bytes": max(s.nbytes for s in specs),
        "bfloat16_fraction": share(lambda s: s.dtype == "bfloat16"),
        "replicated_fraction": share(lambda s: s.layout == "R"),
        "tiny_tensors": sum(1 for s in specs if s.nbytes < 4096),
    }


def format_report(res: dict) -> str:
    out = []
    m = res["machine"]
    w = res["workload"]
    out.append(
        f"machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / workload.GiB:.1f} GiB RAM, "
        f"disk {m['disk']['device']} ({m['disk']['fstype']}); python {m['python']}, paddle {m['paddlepaddle']}, "
        f"torch {m['torch'] or '-'}; {m['date']}"
    )
    dirty = m.get("paddle_dcp_uncommitted")
    out.append(f"paddle_dcp: commit {m.get('paddle_dcp_commit') or '?'}"
               + (f", with uncommitted changes: {' '.join(dirty.split())}" if dirty else ""))
    out.append(
        f"workload: {workload.human(res['config']['size_bytes'])} logical in {w['tensors']} tensors "
        f"(largest {workload.human(w['big_tensor_bytes'])}, {w['tiny_tensors']} tiny), "
        f"{100 * w['bfloat16_fraction']:.0f}% bfloat16, {100 * w['replicated_fraction']:.0f}% replicated; "
        f"best of {res['config']['repeat']} repeat(s), median in brackets; 1 GB = 1e9 bytes; "
        f"load average {res['load_average']['start'][0]:.2f} at the start"
    )
    ck = res.get("checksum") or {}
    if ck.get("whole_gbps"):
        sample = ck["samples"][0]
        out.append(f"checksums: xxh3_64 (xxhash {sample['xxhash']}), one thread, {workload.human(sample['bytes'])} in memory: "
                   f"{ck['whole_gbps']:.1f} GB/s in one call, {ck['blocks_gbps']:.1f} GB/s in the library's "
                   f"{workload.human(sample['block_bytes'])} blocks")
    pc = res["page_cache"]
    for entry in res["phases"]:
        ranks, phase = entry["ranks"], entry["phase"]
        if phase in OURS_ONLY:
            out.extend(_format_variant(entry))
            continue
        title = {"save": "save", "load": "load, same layout", "reshard": "load into another layout (Shard(0) -> Shard(1))"}[phase]
        out.append("")
        out.append(f"== {title}: {ranks} ranks, share per rank {workload.human(entry['share_bytes'])}")
        header = (f"{'library':16s} {'GB/s best':>9s} {'(median)':>9s} {'s slowest':>9s} {'ours/this':>9s} {'(median)':>9s} "
                  f"{'target':>9s} {'RSS MiB/rank':>12s} {'% share':>8s}  runs")
        out.append(header)
        out.append("-" * len(header))
        for lib, stat in entry["libs"].items():
            name = LIB_TITLE[lib] + ("*" if stat.get("gpu_staging_patched") and phase != "save" else "")
            ok = f"{stat['ok_runs']}/{len(stat['runs'])} ok"
            if "best_gbps" not in stat:
                err = next((r["error"] for r in stat["runs"] if r["error"]), "no run")
                out.append(f"{name:16s} {'n/a':>9s} {'':>9s} {'':>9s} {'':>9s} {'':>9s} {'':>9s} {'':>12s} {'':>8s}  "
                           f"{ok}: {err[:160]}")
                continue
            ratio = entry["ratio_ours_over"].get(lib)
            ratio_median = entry["ratio_ours_over_median"].get(lib)
            target = entry["targets"].get(lib)
            tgt = ""
            if target:
                tgt = f">={target['at_least']:g}x" + ("" if target["met"] is None else (" ok" if target["met"] else " no"))
            fails = [r["error"] for r in stat["runs"] if not r["ok"]]
            out.append(
                f"{name:16s} {stat['best_gbps']:9.3f} {'(' + format(stat['median_gbps'], '.3f') + ')':>9s} "
                f"{stat['best_seconds']:9.3f} {'' if ratio is None else format(ratio, '.2f') + 'x':>9s} "
                f"{'' if ratio_median is None else '(' + format(ratio_median, '.2f') + 'x)':>9s} {tgt:>9s} "
                f"{stat['rss_growth_max_bytes'] / workload.MiB:12.0f} {100 * stat['rss_growth_fraction_of_share']:7.1f}%  "
                f"{ok}" + (f"; failed: {fails[0][:120]}" if fails else "")
            )
        if res["config"].get("storage") == "s3":
            out.extend(bench_s3.report_lines(entry, res.get("server") or {}))
            continue
        if phase == "save" and "torch" in entry["libs"] and "best_gbps" in entry["libs"]["torch"]:
            fsync = not res["config"].get("torch_sync_files", True)
            out.append("ours/torch above: paddle_dcp's default save (no fsync) against torch DCP's default save "
                       + ("(sync_files=False here: --torch-no-fsync)" if fsync else
                          "(sync_files=True: fsyncs every data file); like for like, both fsyncing: "
                          "paddle_dcp durable=True against it, in \"save, durable=True\" below"))
        mem = entry["targets"].get("memory")
        if mem:
            out.append(f"ours' memory limit (10% of share + 64 MiB): {mem['limit_bytes'] / workload.MiB:.0f} MiB/rank"
                       f" -> {'ok' if mem['met'] else 'over'}")
        counts = ["1"] + ([str(ranks)] if ranks != 1 else [])
        if phase == "save":
            cold = " / ".join(f"{pc[k]['write_cold_gbps']:.2f}" for k in counts)
            warm = " / ".join(f"{pc[k]['write_warm_gbps']:.2f}" for k in counts)
            out.append(f"page cache write GB/s from {' / '.join(counts)} thread(s): {cold} into fresh memory"
                       f" (cold), {warm} into memory just freed (warm)")
            if all(pc[k]["write_direct_gbps"] for k in counts):
                direct = " / ".join(f"{pc[k]['write_direct_gbps']:.2f}" for k in counts)
                out.append(f"disk write with O_DIRECT (no page cache) GB/s from {' / '.join(counts)} thread(s): {direct}")
        else:
            read = " / ".join(f"{pc[k]['read_gbps']:.2f}" for k in counts)
            out.append(f"page cache read GB/s from {' / '.join(counts)} thread(s): {read}")
            cached = [(LIB_TITLE[lib], stat["cached_fraction_min"]) for lib, stat in entry["libs"].items()
                      if stat.get("cached_fraction_min") is not None]
            if cached:
                out.append("checkpoint pages in the page cache when the timed call started, lowest of the runs: "
                           + ", ".join(f"{title} {100 * f:.1f}%" for title, f in cached))
    if any(s.get("gpu_staging_patched") for e in res["phases"] for s in e["libs"].values()):
        out.append("")
        out.append("* paddle built-in with its GPU staging patched out (Tensor.cuda returns the tensor itself,"
                   " in its worker only): unpatched, its load fails on a CPU build whenever a chunk must move"
                   " between ranks (\"No available device found.\").")
    if res["config"].get("storage") == "s3":
        out.append(f"object storage: a local S3 server ({res['machine'].get('storage', {}).get('server', '?')}), "
                   "AWS_* variables pointing at it; torch DCP through FsspecWriter(sync_files=False) / FsspecReader "
                   "(s3fs), paddle_dcp through s3:// paths")
    elif "torch" in res["config"]["libs"] and any(e["phase"] == "save" for e in res["phases"]):
        out.append("torch DCP " + ("saves with sync_files=False (--torch-no-fsync)." if not res["config"].get("torch_sync_files", True)
                                   else "saves with its default sync_files=True: its time includes an fsync of every "
                                        "data file (paddle_dcp's and paddle's defaults do not fsync)."))
    for note in res["notes"]:
        out.append(f"note: {note}")
    out.append(f"({res['seconds']:.0f} s in all; load average {res['load_average']['end'][0]:.2f} at the end)")
    return "\n".join(out)


def _x(v, paren=False) -> str:
    if v is None:
        return "n/a"
    return f"({v:.2f}x)" if paren else f"{v:.2f}x"


def _s(v, sign=False) -> str:
    return "n/a" if v is None else (f"{v:+.3f} s" if sign else f"{v:.3f} s")


def _base_row(out: list, label: str, best, median) -> None:
    """The row of the plain phase an option is compared with (when it ran)."""
    if best:
        out.append(f"{label:34s} {best:9.3f} {'(' + format(median, '.3f') + ')':>9s}")


def _format_variant(entry: dict) -> list:
    """The report of an ours-only phase (save-async, save-durable, load-noverify)."""
    ranks, phase = entry["ranks"], entry["phase"]
    ours = entry["libs"].get("ours", {})
    share = entry["share_bytes"]
    title = {"save-async": "save, async_save=True", "save-durable": "save, durable=True (fsync of data files, "
             "metadata and directory)", "load-noverify": "load, same layout, verify=False (no checksum checks)"}[phase]
    peers = " (torch DCP's async_save below)" if phase == "save-async" and entry.get("async", {}).get("torch") else " only"
    out = ["", f"== {title}: paddle_dcp{peers}, {ranks} ranks, share per rank {workload.human(share)}"]
    ok = f"{ours.get('ok_runs', 0)}/{len(ours.get('runs', []))} ok"
    if "best_gbps" not in ours:
        err = next((r["error"] for r in ours.get("runs", []) if r["error"]), "no run")
        out.append(f"n/a: {ok}: {err[:200]}")
        return out
    mib = workload.MiB
    if phase == "save-async":
        a = entry["async"]

        def mb(v):
            return "n/a" if v is None else f"{v / mib:.0f} MiB"

        header = (f"{'save (slowest rank; best (median))':44s} {'blocked s':>9s} {'(median)':>9s} {'until wait s':>12s} "
                  f"{'(median)':>9s} {'RSS at return':>13s} {'RSS peak':>9s}")
        out.append(header)
        out.append("-" * len(header))

        def row(label, b, bm, t, tm, r0, r1):
            fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
            out.append(f"{label:44s} {fmt(b):>9s} {'(' + fmt(bm) + ')':>9s} {fmt(t):>12s} {'(' + fmt(tm) + ')':>9s} "
                       f"{mb(r0):>13s} {mb(r1):>9s}")

        row("first in its process: async_save=True", a["first_blocked_best_s"], a["first_blocked_median_s"],
            a["first_until_wait_best_s"], a["first_until_wait_median_s"], a["first_rss_growth_at_return_max_bytes"],
            a["first_rss_growth_until_wait_max_bytes"])
        save = a.get("full_save_rss_growth_max_bytes")
        row("first in its process: full save (save above)", a["full_save_best_s"], a["full_save_median_s"],
            a["full_save_best_s"], a["full_save_median_s"], None, save)
        row("next in the same process: async_save=True", a["next_blocked_best_s"], a["next_blocked_median_s"],
            a["next_until_wait_best_s"], a["next_until_wait_median_s"], a["next_rss_growth_at_return_max_bytes"],
            a["next_rss_growth_until_wait_max_bytes"])
        row("next in the same process: full save", a["next_full_save_best_s"], a["next_full_save_median_s"],
            a["next_full_save_best_s"], a["next_full_save_median_s"], None, a["next_full_save_rss_growth_max_bytes"])
        out.append(f"training blocked: {_s(a['next_blocked_best_s'])} async vs {_s(a['next_full_save_best_s'])} full save "
                   f"({_x(a['next_blocked_over_next_full_save_best'])}; medians "
                   f"{_s(a['next_blocked_median_s'])} vs {_s(a['next_full_save_median_s'])}, "
                   f"{_x(a['next_blocked_over_next_full_save_median'])}), a later save of a process; the first save of "
                   f"a process: {_s(a['first_blocked_best_s'])} vs {_s(a['full_save_best_s'])} "
                   f"({_x(a['first_blocked_over_full_save_best'])}; medians {_x(a['first_blocked_over_full_save_median'])}),"
                   f" (it writes its own file before returning; the staging memory and the background"
                   f" group are made afterwards, by the writer thread)")
        for peer in ASYNC_PEERS:
            p = a.get(peer)
            if p:
                row(f"first in its process: {LIB_TITLE[peer]} async_save", p["first_blocked_best_s"],
                    p["first_blocked_median_s"], None, None, None, None)
                row(f"next in the same process: {LIB_TITLE[peer]} async_save", p["next_blocked_best_s"],
                    p["next_blocked_median_s"], None, None, None, None)
                out.append(f"later async saves, blocked: paddle_dcp / {LIB_TITLE[peer]} "
                           f"{_x(p['ours_next_blocked_over_peer_next_best'])} (medians "
                           f"{_x(p['ours_next_blocked_over_peer_next_median'])})")
        out.append(f"RSS: the host copies are expected to take ~ the share, {workload.human(share)} per rank; "
                   f"the memory limit of the plain save does not apply")
        out.append(f"runs: {ok}; each of the three checkpoints loaded back and every value checked")
        return out
    header = (f"{'variant':34s} {'GB/s best':>9s} {'(median)':>9s} {'s slowest':>9s} {'RSS MiB/rank':>12s} "
              f"{'% share':>8s}  runs")
    out.append(header)
    out.append("-" * len(header))
    label = {"save-durable": "paddle_dcp durable=True", "load-noverify": "paddle_dcp verify=False"}[phase]
    out.append(f"{label:34s} {ours['best_gbps']:9.3f} {'(' + format(ours['median_gbps'], '.3f') + ')':>9s} "
               f"{ours['best_seconds']:9.3f} {ours['rss_growth_max_bytes'] / mib:12.0f} "
               f"{100 * ours['rss_growth_fraction_of_share']:7.1f}%  {ok}"
               + (", saved checkpoint loaded back and every value checked" if phase == "save-durable"
                  else ", every value checked"))
    if phase == "save-durable":
        d = entry["durable"]
        _base_row(out, "paddle_dcp default (save above)", d["default_save_best_gbps"], d["default_save_median_gbps"])
        out.append(f"cost of fsync: durable / default = {_x(d['durable_over_default_gbps_best'])} GB/s "
                   f"{_x(d['durable_over_default_gbps_median'], True)}, "
                   f"{_s(d['extra_seconds_best'], True)} (median {_s(d['extra_seconds_median'], True)})")
        for peer, c in entry.get("like_for_like", {}).items():
            name = LIB_TITLE[peer]
            if c["peer_fsyncs"]:
                out.append(f"like for like, both fsync: paddle_dcp durable=True / {name} default (sync_files=True) = "
                           f"{_x(c['ours_durable_over_peer_default_best'])} "
                           f"{_x(c['ours_durable_over_peer_default_median'], True)}; not like for like: "
                           f"paddle_dcp default (no fsync) / {name} default (fsync) = "
                           f"{_x(c['ours_default_over_peer_default_best'])} "
                           f"{_x(c['ours_default_over_peer_default_median'], True)}")
            else:
                out.append(f"paddle_dcp durable=True / {name} (no fsync) = "
                           f"{_x(c['ours_durable_over_peer_default_best'])} "
                           f"{_x(c['ours_durable_over_peer_default_median'], True)}; "
                           f"paddle_dcp default / {name} = {_x(c['ours_default_over_peer_default_best'])} "
                           f"{_x(c['ours_default_over_peer_default_median'], True)} (neither fsyncs)")
    else:
        v = entry["verify"]
        _base_row(out, "paddle_dcp verify=True (load above)", v["verified_load_best_gbps"], v["verified_load_median_gbps"])
        out.append(f"cost of checksums: verify=False / verify=True = {_x(v['noverify_over_verified_gbps_best'])} GB/s "
                   f"{_x(v['noverify_over_verified_gbps_median'], True)}; verify=True takes "
                   f"{_s(v['verify_extra_seconds_best'], True)} (median {_s(v['verify_extra_seconds_median'], True)})")
    mem = entry["targets"].get("memory")
    if mem:
        out.append(f"ours' memory limit (10% of share + 64 MiB): {mem['limit_bytes'] / mib:.0f} MiB/rank"
                   f" -> {'ok' if mem['met'] else 'over'}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Save/load speed and memory of paddle_dcp against paddle's built-in and torch DCP.",
        epilog="Smoke run: scripts/bench.py --size 16M --repeat 1 --ranks 2",
    )
    p.add_argument("--size", default="1G", help="logical bytes of the state dict, e.g. 16M, 256M, 1G (default 1G)")
    p.add_argument("--ranks", default="2", help="rank counts, e.g. 2 or 2,4 (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="repeats of every phase; the best is reported (default 3)")
    p.add_argument("--libs", default=",".join(LIBS), help="subset of ours,paddle,torch (default all)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"subset of {','.join(PHASES)}; PHASE@R runs it at R ranks only (default: all). "
                        "save-async (async_save=True: time blocked vs until wait()), save-durable (durable=True) "
                        "and load-noverify (verify=False) measure paddle_dcp only")
    p.add_argument("--workdir", default=None, help="where the temporary directory goes (default: /tmp)")
    p.add_argument("--json-out", default=None, help="also write the numbers to this JSON file")
    p.add_argument("--timeout", type=float, default=0, help="seconds per launch (default: from the size)")
    p.add_argument("--wait-idle", type=float, default=0,
                   help="wait up to this many seconds for the load average to drop to 1.0 first (default 0)")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds between building the state dict and the timed call, and before the cold page-cache "
                        "write, so memory freed earlier has gone back to a VM host with free page reporting "
                        "(default 3 from --size 256M on, 0.5 below)")
    p.add_argument("--torch-no-fsync", action="store_true",
                   help="save with torch DCP's FileSystemWriter(sync_files=False); its default fsyncs every "
                        "data file, paddle's built-in and paddle_dcp's do not")
    p.add_argument("--storage", choices=("local", "s3"), default="local",
                   help="where checkpoints go: local disk (default), or s3: a local S3 server (weed mini, "
                        "tests/s3server.py) for paddle_dcp (s3:// paths) and torch DCP (FsspecWriter/FsspecReader), "
                        "with the server's own PUT/GET speed as the limit; phases save, load, reshard")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (checkpoints, logs)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.settle is None:
        try:
            args.settle = 3.0 if workload.parse_size(args.size) >= 256 * workload.MiB else 0.5
        except ValueError as exc:
            p.error(str(exc))
    global TORCH_NO_FSYNC
    TORCH_NO_FSYNC = args.torch_no_fsync
    try:
        res = run_benchmark(args)
    except ValueError as exc:
        p.error(str(exc))
    print(format_report(res))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
        log(f"wrote {args.json_out}")
    bad = [
        (e["phase"], e["ranks"], lib)
        for e in res["phases"] for lib, s in e["libs"].items() if s["ok_runs"] < len(s["runs"])
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
