"""The suite many: a state dict of many small tensors (issue 36, point 4): real 2-rank jobs saving
and loading 10k to 100k tensors, the time per tensor at each size.

For every count of ``--tensors`` (the workload of many_worker.build_specs: tensors of 1
to 4 KiB as an expert's optimizer states are, 8 in 10 Shard(0) or Shard(1) over a 1-D mesh of
the ranks, the rest replicated), each phase runs in its own launch of ``python -m
paddle.distributed.launch`` (gloo, CPU; the suite io's launch of a phase):

- save: the state dict in its save layout;
- load: into the same layout;
- reshard: into another layout (every Shard(0) becomes Shard(1) and back, a replicated matrix
  in 10 becomes Shard(0)).

Each rank times its own call after a settle wait and a barrier (building the state dict and
checking it are outside); a phase's time is its slowest rank's, and per tensor it is that time
divided by the number of tensors (in microseconds); beside it, the CPU time (user + system, all
threads) of the rank that used most, which other work on a shared machine disturbs less, and
the seconds Python's garbage collector took inside the call. The summary gives, per phase and
library, the ratio of the time per tensor at the largest count to that at the smallest (and of
the CPU time): about 1 when the cost is linear in the number of tensors. After every load each rank compares every value it
loaded with the numpy oracle of bench/workload.py; a wrong value fails the run.
``--libs ours,paddle`` also runs paddle.distributed's built-in save_state_dict/load_state_dict,
up to ``--paddle-max`` tensors (it is slower by far). ``--profile DIR`` runs every call under
cProfile (slower: its times are the profiled ones) and keeps each rank's statistics in DIR.

    .venv/bin/python scripts/bench many --tensors 10k,30k,100k --json-out many.json

Smoke run (every path, about a minute): ``--tensors 1k,2k --libs ours,paddle``.
Prints the table and the ratios, then one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import os
import pstats
import shutil
import tempfile

from bench import launch, many_worker, units
from bench.io import launch_phase
from bench.io_config import LIB_TITLE
from bench.machine import machine_info
from bench.report import emit, log

WORKER = os.path.abspath(many_worker.__file__)
PHASES = many_worker.PHASES
RANKS = 2  # the default of --ranks


def parse_counts(text: str) -> list[int]:
    """'10k,30k,100k' -> [10000, 30000, 100000] (k = 1000), sorted, each at least 1."""
    return units.parse_counts(text, "tensor count")


def per_tensor_us(seconds: float, n: int) -> float:
    return seconds / n * 1e6


def summarize(runs: list[dict], counts: list[int]) -> dict:
    """The best (least seconds) run of each (lib, phase, tensors) over its repeats, its time per
    tensor and its garbage collector's seconds (the most of any rank), and per (lib, phase) the
    ratio of the time per tensor at the largest count measured to that at the smallest (None
    with fewer than two counts)."""
    best: dict = {}
    for r in runs:
        key = (r["lib"], r["phase"], r["tensors"])
        if r["ok"] and (key not in best or r["seconds"] < best[key]["seconds"]):
            best[key] = r
    table = [
        {"lib": lib, "phase": phase, "tensors": n, "seconds": r["seconds"],
         "us_per_tensor": per_tensor_us(r["seconds"], n),
         "cpu_us_per_tensor": per_tensor_us(max((x or 0.0) for x in r.get("cpu_seconds") or [0.0]), n),
         "gc_seconds": max((x or 0.0) for x in r.get("gc_seconds") or [0.0])}
        for (lib, phase, n), r in sorted(best.items(), key=lambda kv: (kv[0][0], PHASES.index(kv[0][1]), kv[0][2]))
    ]
    ratios = {}
    for lib, phase in sorted({(e["lib"], e["phase"]) for e in table}):
        rows = [e for e in table if (e["lib"], e["phase"]) == (lib, phase)]
        lo, hi = rows[0], rows[-1]
        ratios[f"{lib}.{phase}"] = (
            {"from": lo["tensors"], "to": hi["tensors"], "ratio": hi["us_per_tensor"] / lo["us_per_tensor"],
             "cpu_ratio": hi["cpu_us_per_tensor"] / max(lo["cpu_us_per_tensor"], 1e-9)}
            if len(rows) > 1 else None
        )
    return {"table": table, "ratios": ratios, "counts": counts}


def format_report(res: dict) -> str:
    lines = [f"Many small tensors, {res['args']['ranks']} ranks ({res['machine']['cores']} cores): time of the slowest rank's call",
             "", "| library | phase | tensors | seconds | µs per tensor | CPU µs per tensor | of it, garbage collector (s) |",
             "|---|---|---|---|---|---|---|"]
    for e in res["summary"]["table"]:
        lines.append(f"| {LIB_TITLE[e['lib']]} | {e['phase']} | {e['tensors']:,} | {e['seconds']:.2f} | "
                     f"{e['us_per_tensor']:.0f} | {e['cpu_us_per_tensor']:.0f} | {e['gc_seconds']:.2f} |")
    lines.append("")
    for name, r in res["summary"]["ratios"].items():
        if r is not None:
            lines.append(f"{name}: time per tensor at {r['to']:,} / at {r['from']:,} = {r['ratio']:.2f} "
                         f"(CPU time: {r['cpu_ratio']:.2f})")
    for run in res["runs"]:
        if not run["ok"]:
            lines.append(f"FAILED {run['lib']} {run['phase']} {run['tensors']:,}: {run['error']}")
    lines.extend(format_steps(res["runs"]))
    lines.extend(res["notes"])
    return "\n".join(lines)


def format_steps(runs: list[dict]) -> list[str]:
    """With --steps: per phase, each step's seconds (the most of any rank) and share of the
    call at every tensor count (the best repeat's run)."""
    best: dict = {}
    for r in runs:
        key = (r["lib"], r["phase"], r["tensors"])
        if r["ok"] and any(r.get("steps") or []) and (key not in best or r["seconds"] < best[key]["seconds"]):
            best[key] = r
    lines = []
    for lib, phase in sorted({k[:2] for k in best}, key=lambda lp: (lp[0], PHASES.index(lp[1]))):
        counts = sorted(k[2] for k in best if k[:2] == (lib, phase))
        names = []
        for n in counts:
            for per_rank in best[(lib, phase, n)]["steps"]:
                names += [x for x in (per_rank or {}) if x not in names]
        lines += ["", f"Steps of {phase} ({lib}): seconds (share of the call), the most of any rank", "",
                  "| step | " + " | ".join(f"{n:,}" for n in counts) + " |", "|---|" + "---|" * len(counts)]
        for name in names:
            cells = []
            for n in counts:
                run = best[(lib, phase, n)]
                sec = max(((x or {}).get(name) or {}).get("seconds", 0.0) for x in run["steps"])
                cells.append(f"{sec:.2f} ({100 * sec / run['seconds']:.0f}%)")
            lines.append(f"| {name.split(':')[1]} | " + " | ".join(cells) + " |")
    return lines


def top_of_profile(paths: list[str], limit: int = 25) -> str:
    """The functions taking the most time of their own in the profiles ``paths`` (merged)."""
    import io

    out = io.StringIO()
    stats = pstats.Stats(*paths, stream=out)
    stats.sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def run_benchmark(args: argparse.Namespace) -> dict:
    counts = parse_counts(args.tensors)
    paddle_max = parse_counts(args.paddle_max)[0]
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    for lib in libs:
        if lib not in ("ours", "paddle"):
            raise ValueError(f"unknown library {lib!r}; choose from ours, paddle")
    for phase in phases:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; choose from {', '.join(PHASES)}")
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="paddle_dcp_many.", dir=args.workdir or None)
    notes = []
    if "paddle" in libs and any(n > paddle_max for n in counts):
        notes.append(f"paddle built-in measured up to {paddle_max:,} tensors only (--paddle-max)")
    if args.steps:
        os.environ["PADDLE_DCP_BENCH_STEPS"] = "1"
        notes.append("steps timed by wrappers (many_worker.STEPS): a microsecond a call on top")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["PADDLE_DCP_BENCH_PROFILE"] = "1"
        notes.append(f"every call ran under cProfile (times are profiled ones); statistics in {args.profile}")
    info = machine_info(root)
    log(f"workdir {root}; tensors {counts}; phases {phases}; libs {libs}; repeat {args.repeat}")
    runs: list[dict] = []
    try:
        for rep in range(args.repeat):
            for n in counts:
                for lib in libs:
                    if lib == "paddle" and n > paddle_max:
                        continue
                    ckpt = os.path.join(root, "ckpt", f"{lib}_{n}")
                    saved = False
                    for phase in ("save",) + tuple(p for p in phases if p != "save"):
                        if phase != "save" and not saved:
                            runs.append({"lib": lib, "phase": phase, "tensors": n, "repeat": rep, "ok": False,
                                         "error": "no checkpoint: the save failed", "seconds": None})
                            continue
                        run = _launch(args, root, rep, n, lib, phase, ckpt, timed=phase in phases)
                        saved = saved or (phase == "save" and run["ok"])
                        if phase in phases:
                            runs.append(run)
                    if not args.keep:
                        shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return {"machine": info, "args": vars(args), "runs": runs, "summary": summarize(runs, counts), "notes": notes}


def _launch(args, root: str, rep: int, n: int, lib: str, phase: str, ckpt: str, timed: bool = True) -> dict:
    """One launch of one phase at ``n`` tensors (``timed``: a phase asked for, else a save the
    loads need); its record (the slowest rank's seconds, and per rank the seconds, CPU seconds,
    the garbage collector's seconds and collections, and with --steps the steps' seconds)."""
    run_dir = os.path.join(root, "runs", f"r{rep}_{n}_{phase}_{lib}")
    run = launch_phase(lib, phase, args.ranks, n, ckpt, run_dir, args.timeout or 120 + n / 100, rep, args.settle,
                       worker=WORKER)
    if phase == "save":
        os.sync()  # its dirty pages are not written back during the loads
    out = {"lib": lib, "phase": phase, "tensors": n, "repeat": rep, "ok": run.ok, "error": run.error,
           "seconds": run.slowest if run.ok else None, "per_rank": run.seconds, "launch_seconds": run.wall,
           "cpu_seconds": run.cpu}
    results = run.results
    for field in ("gc_seconds", "gc_collections", "steps"):
        out[field] = [(r or {}).get(field) for r in results]
    if run.ok:
        gc_s = max((x or 0.0) for x in out["gc_seconds"])
        what = f"{run.slowest:.2f} s, {per_tensor_us(run.slowest, n):.0f} us/tensor, garbage collector {gc_s:.2f} s"
    else:
        what = f"FAILED: {run.error}"
    untimed = "" if timed else " (untimed, for the loads)"
    log(f"[{rep + 1}/{args.repeat}] {n:>7,} tensors {phase:8s} {lib:6s}: {what}{untimed} (launch {run.wall:.1f} s)")
    if not run.ok:
        log(launch.logs_tail([run_dir]))
    _keep_profiles(args.profile, run_dir, f"{lib}_{n}_{phase}_r{rep}", args.ranks)
    if run.ok and not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def _keep_profiles(profile_dir: str | None, run_dir: str, name: str, ranks: int = RANKS) -> None:
    """Copy a launch's cProfile statistics into ``profile_dir``, with rank 0's top functions
    as text beside them."""
    if not profile_dir:
        return
    result = os.path.join(run_dir, "result")
    kept = []
    for r in range(ranks):
        src = os.path.join(result, f"rank{r}.prof")
        if os.path.exists(src):
            kept.append(os.path.join(profile_dir, f"{name}_rank{r}.prof"))
            shutil.copy(src, kept[-1])
    if kept:
        with open(os.path.join(profile_dir, f"{name}_rank0.txt"), "w") as f:
            f.write(top_of_profile(kept[:1], 40))


def main(argv: list | None = None, prog: str = "bench many") -> int:
    """The suite many: the table on stdout; 1 when a run failed."""
    p = argparse.ArgumentParser(prog=prog, description="Save/load of many small tensors on 2 ranks (--ranks): time per tensor.",
                                epilog="Smoke run: scripts/bench many --tensors 1k,2k --libs ours,paddle")
    p.add_argument("--ranks", type=int, default=RANKS, help=f"ranks of each launch (default {RANKS}; 1: the tensors whole)")
    p.add_argument("--tensors", default="10k,30k,100k", help="tensor counts, k = 1000 (default 10k,30k,100k)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"subset of {','.join(PHASES)} (default all)")
    p.add_argument("--libs", default="ours", help="ours, or ours,paddle (paddle's built-in too; default ours)")
    p.add_argument("--paddle-max", default="10k", help="the most tensors paddle's built-in runs (default 10k)")
    p.add_argument("--repeat", type=int, default=1, help="repeats; the best is reported (default 1)")
    p.add_argument("--settle", type=float, default=0.5, help="seconds each rank waits before its call (default 0.5)")
    p.add_argument("--timeout", type=float, default=0, help="seconds per launch (default 120 + tensors / 100)")
    p.add_argument("--profile", default=None, help="run every call under cProfile, statistics into this directory")
    p.add_argument("--steps", action="store_true",
                   help="time paddle_dcp's steps inside each call (many_worker.STEPS) and show them per rank")
    p.add_argument("--workdir", default=None, help="where the temporary directory goes (default: /tmp)")
    p.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (checkpoints, logs)")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.ranks < 1:
        p.error("--repeat and --ranks must be at least 1")
    try:
        res = run_benchmark(args)
    except ValueError as exc:
        p.error(str(exc))
    emit(res, format_report(res), args.json_out)
    return 0 if res["runs"] and all(r["ok"] for r in res["runs"]) else 1

