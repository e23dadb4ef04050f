"""The suites io and s3: paddle_dcp against paddle's built-in checkpoint and torch.distributed.checkpoint.

Builds the workload of issue 5 (bench/workload.py) at ``--size`` logical bytes and
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

The suite s3 runs the same workload, phases save, load and reshard, and checks with the
checkpoints on a local S3 server (bench/s3.py), its own PUT and GET speed as the limit.

Quick smoke run (every code path, about a minute):
    .venv/bin/python scripts/bench io --size 16M --repeat 1 --ranks 2
The measurement of issue 5 (1 GiB, 2 ranks, and the reshard on 4 ranks):
    .venv/bin/python scripts/bench io --size 1G --ranks 2 --repeat 3 \\
        --phases save,save-async,save-durable,load,load-noverify,reshard,reshard@4 --json-out bench.json
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from bench import launch, s3, workload
from bench.io_config import ASYNC_PEERS, LIB_TITLE, LIBS, OURS_ONLY, PHASES, SAVES, WORKER, parse_phases, parse_ranks
from bench.io_report import format_report, summarize
from bench.io_worker import read_files
from bench.machine import checksum_speed, machine_info, page_cache_speed
from bench.report import emit, log
from bench.units import GB, GiB, MiB, human, parse_size


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
    server_cpu: float | None = None  # suite s3: the server's CPU seconds during rank 0's timed call
    results: list = field(default_factory=list)  # per rank, the result it wrote (None: none)

    @property
    def slowest(self) -> float:
        return max(self.seconds) if self.seconds else float("nan")


def launch_phase(lib: str, phase: str, ranks: int, size: int, ckpt: str, run_dir: str, timeout: float,
                 repeat: int, settle: float, worker: str = WORKER, torch_no_fsync: bool = False) -> Run:
    """One launch of ``worker`` (io_worker.py, or another worker taking the same arguments:
    LIB PHASE SIZE CHECKPOINT RESULT_DIR) on ``ranks`` ranks; its ranks' results."""
    result_dir = os.path.join(run_dir, "result")
    argv = launch.launcher(worker, [lib, phase, str(size), ckpt, result_dir], ranks, os.path.join(run_dir, "log"),
                           torch=lib == "torch")
    extra = {"PADDLE_DCP_BENCH_SETTLE": str(settle)}
    if torch_no_fsync:
        extra["PADDLE_DCP_BENCH_TORCH_NO_FSYNC"] = "1"
    job = launch.run([launch.Command(argv, run_dir, os.path.join(run_dir, "launcher.log"))], launch.job_env(**extra),
                     timeout, result_dir, ranks, [run_dir])
    run = Run(lib, phase, ranks, repeat, ok=job.ok, error=job.error, wall=job.wall, results=job.results)
    done = [res for res in job.results if res and "seconds" in res]
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
def rotated(items: list, k: int) -> list:
    k %= max(len(items), 1)
    return items[k:] + items[:k]


def run_line(run: Run, logical: int) -> str:
    """A launch as the progress log shows it."""
    if not run.ok:
        return f"FAILED: {run.error}"
    gbps = logical / run.slowest / GB
    mib = max(run.rss_growth) / MiB
    checked = ", every value checked" if run.phase != "save" else ""
    if run.phase == "save-async":
        return (f"blocked {max(run.blocked):.3f} s, {gbps:6.3f} GB/s until wait() ({run.slowest:.3f} s), "
                f"peak RSS growth {max(run.rss_growth_at_return) / MiB:.0f} MiB/rank at return, "
                f"{mib:.0f} until wait(){checked}")
    cached = f", {100 * min(run.cached):.1f}% of its pages cached at the start" if run.cached else ""
    return f"{gbps:6.3f} GB/s ({run.slowest:.3f} s), peak RSS growth {mib:.0f} MiB/rank{checked}{cached}"


@dataclass
class Session:
    """One bench run: what it runs, where, and the runs so far."""

    args: argparse.Namespace
    size: int
    logical: int
    plan: list
    libs: list
    root: str
    store: object  # s3.S3Store for the suite s3, else None
    timeout: float
    runs: list = field(default_factory=list)
    ready: dict = field(default_factory=dict)  # (lib, ranks) -> its plain save's checkpoint is there

    def checkpoint(self, name: str) -> str:
        return self.store.path(name) if self.store else os.path.join(self.root, "ckpt", name)

    def log(self, rep: int, msg: str) -> None:
        log(f"[{rep + 1}/{self.args.repeat}] {msg}")


def _choose(args) -> tuple[list, list, list]:
    """(plan, libs, notes) from the arguments: which (ranks, phase) of which libraries run,
    and why some asked for do not; ValueError for a choice that runs nothing."""
    plan = parse_phases(args.phases, parse_ranks(args.ranks))
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
        dropped = [lib for lib in libs if lib not in s3.LIBS]
        libs = [lib for lib in libs if lib in s3.LIBS]
        skipped = sorted({p for _, p in plan if p not in s3.PHASES})
        plan = [(r, p) for r, p in plan if p in s3.PHASES]
        if not plan or not libs:
            raise ValueError(f"the suite s3 measures {', '.join(s3.PHASES)} of {', '.join(s3.LIBS)}")
        if dropped:
            notes.append(f"on S3: {', '.join(LIB_TITLE[x] for x in dropped)} not measured (local paths only)")
        if skipped:
            notes.append(f"on S3: phases {', '.join(skipped)} not measured (options of the local disk)")
    if "torch" in libs and importlib.util.find_spec("torch") is None:
        libs.remove("torch")
        notes.append("torch is not installed in this Python: torch DCP skipped (pip install torch==2.13.0)")
        log(notes[-1])
    return plan, libs, notes


def _measure_limits(s: Session, rep: int, page_cache: dict, server: list, checksum: list) -> None:
    """One repeat's measurements of the machine's limits: the page cache (local disk) or the S3
    server's own speed, and the checksum's."""
    for k in page_cache:
        pc = page_cache_speed(os.path.join(s.root, "pagecache"), s.logical, k, s.args.settle)
        page_cache[k].append(pc)
        s.log(rep, f"page cache, {k} thread(s): write {pc['write_cold_gbps']:.2f} GB/s cold, "
                   f"{pc['write_warm_gbps']:.2f} GB/s warm, {pc['write_direct_gbps'] or 0:.2f} GB/s O_DIRECT; "
                   f"read {pc['read_gbps']:.2f} GB/s")
    if s.store:
        server.append(s3.server_speed(s.store, s.logical))
        speeds = {k: " / ".join(f"{v:.2f}" for v in server[-1][k].values())
                  for k in ("put_gbps", "get_gbps", "get_gbps_s3fs", "get_gbps_lean")}
        s.log(rep, f"S3 server, 1 / {s3.STREAMS} streams: PUT {speeds['put_gbps']} GB/s, GET "
                   f"{speeds['get_gbps']} GB/s (s3fs {speeds['get_gbps_s3fs']}, lean {speeds['get_gbps_lean']})")
    checksum.append(checksum_speed())
    s.log(rep, f"xxh3_64: {checksum[-1]['whole_gbps']:.1f} GB/s in one call, "
               f"{checksum[-1]['blocks_gbps']:.1f} GB/s in {human(checksum[-1]['block_bytes'])} blocks")


def _has_checkpoint(s: Session, rep: int, ranks: int, phase: str, lib: str, ckpt: str, run_dir: str) -> bool:
    """Before a load: is ``lib``'s plain save there? A phase set without a save writes it once,
    untimed; a failed save makes its loads fail ("no checkpoint") without a launch."""
    if s.ready.get((lib, ranks)):
        return True
    if (ranks, "save") in s.plan or (lib, ranks) in s.ready:
        run = Run(lib, phase, ranks, rep, error="no checkpoint: the save before it failed")
        s.runs.append(run)
        s.log(rep, f"{ranks} ranks {phase:13s} {lib:6s}: skipped, {run.error}")
        return False
    prep = launch_phase(lib, "save", ranks, s.size, ckpt, run_dir + "_prep", s.timeout, rep, 0,
                        torch_no_fsync=s.args.torch_no_fsync)
    os.sync()
    s.ready[(lib, ranks)] = prep.ok
    s.log(rep, f"{ranks} ranks prepare {lib:6s}: {'ok' if prep.ok else 'FAILED: ' + prep.error}")
    if not prep.ok:
        s.runs.append(Run(lib, phase, ranks, rep, error=f"no checkpoint: {prep.error}"))
    return prep.ok


def _run_one(s: Session, rep: int, ranks: int, phase: str, lib: str) -> None:
    """One launch of one phase of one library, recorded in ``s.runs``."""
    # save-async and save-durable write a checkpoint of their own (checked by the worker
    # itself, then deleted); the loads read the plain save's
    own = phase in ("save-async", "save-durable")
    ckpt = s.checkpoint(f"{lib}_{ranks}" + (f"_{phase}" if own else ""))
    run_dir = os.path.join(s.root, "runs", f"r{rep}_{ranks}_{phase}_{lib}")
    if phase in SAVES:
        _remove(s.store, ckpt)
    elif not _has_checkpoint(s, rep, ranks, phase, lib, ckpt, run_dir):
        return
    if phase not in SAVES and not s.store:
        read_files(ckpt)
    run = launch_phase(lib, phase, ranks, s.size, ckpt, run_dir, s.timeout, rep, s.args.settle,
                       torch_no_fsync=s.args.torch_no_fsync)
    if s.store and phase in SAVES and run.ok and not s.store.holds(ckpt):
        run.ok, run.error = False, f"the save wrote nothing to the server under {ckpt}"
    s.runs.append(run)
    if phase == "save":
        s.ready[(lib, ranks)] = run.ok
    if phase in SAVES:
        os.sync()  # its dirty pages are not written back during the next phase
    if own and not s.args.keep:
        _remove(s.store, ckpt)
    s.log(rep, f"{ranks} ranks {phase:13s} {lib:6s}: {run_line(run, s.logical)} (launch {run.wall:.1f} s)")
    if not run.ok:
        log(launch.logs_tail([run_dir]))
    if run.ok and not s.args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_benchmark(args: argparse.Namespace) -> dict:
    """Every repeat of every (ranks, phase) of every library, with the machine's limits; the results."""
    size = parse_size(args.size)
    specs = workload.build(size)
    logical = workload.total_bytes(specs)
    plan, libs, notes = _choose(args)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="paddle_dcp_bench.", dir=args.workdir or None)
    load_start = _wait_idle(args.wait_idle)
    info = machine_info(root)
    log(f"workdir {root}; {human(logical)} logical in {len(specs)} tensors; "
        f"phases (ranks, phase) {plan}; libs {libs}; repeat {args.repeat}; "
        f"load average at start {load_start[0]:.2f}")
    if load_start[0] > 1.0:
        notes.append(f"the machine was busy at the start: load average {load_start[0]:.2f} (1 min)")
        log("warning: " + notes[-1])
    store = s3.S3Store.start(root) if args.storage == "s3" else None
    timeout = args.timeout or (180 + 120 * size / GiB * max(r for r, _ in plan))
    s = Session(args, size, logical, plan, libs, root, store, timeout)
    page_cache: dict = {k: [] for k in ([] if store else sorted({1} | {r for r, _ in plan}))}
    server: list = []
    checksum: list = []
    started = time.perf_counter()
    try:
        for rep in range(args.repeat):
            _measure_limits(s, rep, page_cache, server, checksum)
            for ranks, phase in plan:
                for lib in rotated(libs, rep):
                    if phase not in OURS_ONLY or lib == "ours" or (phase == "save-async" and lib in ASYNC_PEERS):
                        _run_one(s, rep, ranks, phase, lib)
            if not args.keep:  # the next repeat saves afresh
                for lib in libs:
                    for ranks in {r for r, p in plan if p == "save"}:
                        _remove(store, s.checkpoint(f"{lib}_{ranks}"))
                        s.ready.pop((lib, ranks), None)
    finally:
        if store:
            store.close()
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    res = summarize(args, info, specs, logical, plan, libs, s.runs, page_cache, checksum, notes, load_start,
                    os.getloadavg(), time.perf_counter() - started, s3.best_server_speed(server))
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


def _parser(prog: str, storage: str) -> argparse.ArgumentParser:
    """The options of the suite io (``storage`` "local") or s3."""
    s3_suite = storage == "s3"
    p = argparse.ArgumentParser(
        prog=prog,
        description=("Save/load speed and memory of paddle_dcp against torch DCP on a local S3 server (weed mini, "
                     "tests/s3server.py: paddle_dcp through s3:// paths, torch DCP through FsspecWriter/FsspecReader), "
                     "with the server's own PUT/GET speed as the limit." if s3_suite else
                     "Save/load speed and memory of paddle_dcp against paddle's built-in and torch DCP."),
        epilog=f"Smoke run: scripts/bench {prog.split()[-1]} --size 16M --repeat 1 --ranks 2",
    )
    libs, phases = (s3.LIBS, s3.PHASES) if s3_suite else (LIBS, PHASES)
    p.add_argument("--size", default="1G", help="logical bytes of the state dict, e.g. 16M, 256M, 1G (default 1G)")
    p.add_argument("--ranks", default="2", help="rank counts, e.g. 2 or 2,4 (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="repeats of every phase; the best is reported (default 3)")
    p.add_argument("--libs", default=",".join(libs), help=f"subset of {','.join(libs)} (default all)")
    p.add_argument("--phases", default=",".join(phases),
                   help=f"subset of {','.join(phases)}; PHASE@R runs it at R ranks only (default: all)"
                        + ("" if s3_suite else ". save-async (async_save=True: time blocked vs until wait()), "
                           "save-durable (durable=True) and load-noverify (verify=False) measure paddle_dcp only"))
    p.add_argument("--workdir", default=None, help="where the temporary directory goes (default: /tmp)")
    p.add_argument("--json-out", default=None, help="also write the numbers to this JSON file")
    p.add_argument("--timeout", type=float, default=0, help="seconds per launch (default: from the size)")
    p.add_argument("--wait-idle", type=float, default=0,
                   help="wait up to this many seconds for the load average to drop to 1.0 first (default 0)")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds between building the state dict and the timed call, and before the cold page-cache "
                        "write, so memory freed earlier has gone back to a VM host with free page reporting "
                        "(default 3 from --size 256M on, 0.5 below)")
    if not s3_suite:
        p.add_argument("--torch-no-fsync", action="store_true",
                       help="save with torch DCP's FileSystemWriter(sync_files=False); its default fsyncs every "
                            "data file, paddle's built-in and paddle_dcp's do not")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (checkpoints, logs)")
    p.set_defaults(storage=storage, torch_no_fsync=False)
    return p


def main(argv: list | None = None, prog: str = "bench io", storage: str = "local") -> int:
    """The suite io (checkpoints on local disk) or, with ``storage`` "s3", the suite s3: the
    report on stdout; 1 when a run failed."""
    p = _parser(prog, storage)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.settle is None:
        try:
            args.settle = 3.0 if parse_size(args.size) >= 256 * MiB else 0.5
        except ValueError as exc:
            p.error(str(exc))
    try:
        res = run_benchmark(args)
    except ValueError as exc:
        p.error(str(exc))
    emit(res, format_report(res), args.json_out)
    bad = [
        (e["phase"], e["ranks"], lib)
        for e in res["phases"] for lib, s in e["libs"].items() if s["ok_runs"] < len(s["runs"])
    ]
    return 1 if bad else 0
