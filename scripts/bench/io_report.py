"""The results of a run of the suite io: each phase's best and median runs, ratios
against the peers, targets, the options compared with our plain calls, and the report."""
from __future__ import annotations

import argparse
import os
import statistics

from bench import s3
from bench.io_config import ASYNC_PEERS, LIB_TITLE, OURS_ONLY, TARGETS
from bench.io_variants import compare_variants, format_variant
from bench.machine import describe
from bench.units import GB, MiB, human


def _cpu_use(run) -> dict | None:
    """CPU seconds of a run's timed calls (all ranks; the S3 server's, if any) against what the
    machine's cores offer in the slowest call."""
    if not run.cpu or None in run.cpu:
        return None
    ranks = sum(run.cpu)
    used = ranks + (run.server_cpu or 0.0)
    available = (os.cpu_count() or 1) * run.slowest
    return {"ranks_seconds": ranks, "server_seconds": run.server_cpu, "available_seconds": available,
            "busy_fraction": used / available if available else None}


def _lib_stat(mine: list, phase: str, logical: int, share: float) -> dict:
    """One library's runs of one phase: every run, and the best and median of the good ones."""
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
    return stat


def _set_targets(entry: dict, entry_libs: list, targets: dict, server: dict | None) -> None:
    """Ratios of ours over each peer, and every target of the phase, met or not."""
    phase, share = entry["phase"], entry["share_bytes"]
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
        limit = s3.limit_targets(entry, server)
        if limit:
            entry["targets"]["server"] = limit
    if server and phase in s3.PHASES:
        entry["targets"]["memory"] = s3.memory_target(entry)
    elif "ours" in entry["libs"] and "rss_growth_max_bytes" in entry["libs"]["ours"] and phase != "save-async":
        limit = 0.1 * share + 64 * MiB
        entry["targets"]["memory"] = {"limit_bytes": limit,
                                      "met": entry["libs"]["ours"]["rss_growth_max_bytes"] <= limit}


def summarize(args: argparse.Namespace, info: dict, specs: list, logical: int, plan: list, libs: list, runs: list,
              page_cache: dict, checksum: list, notes: list, load_start: tuple, load_end: tuple, seconds: float,
              server: dict | None = None) -> dict:
    """A run's results: per (ranks, phase) every library's runs, best and median, ratios and
    targets; the machine, the configuration, the page cache's and the checksum's speeds."""
    targets = s3.TARGETS if args.storage == "s3" else TARGETS
    phases = []
    for ranks, phase in plan:
        share = logical / ranks
        entry = {"ranks": ranks, "phase": phase, "logical_bytes": logical, "share_bytes": share, "libs": {}}
        entry_libs = ["ours"] if phase in OURS_ONLY else libs
        if phase == "save-async":
            entry_libs = ["ours"] + [lib for lib in libs if lib in ASYNC_PEERS]
        for lib in entry_libs:
            mine = [r for r in runs if r.lib == lib and r.phase == phase and r.ranks == ranks]
            entry["libs"][lib] = _lib_stat(mine, phase, logical, share)
        _set_targets(entry, entry_libs, targets, server)
        phases.append(entry)
    compare_variants(phases, torch_fsyncs=not args.torch_no_fsync)
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
    out = _report_header(res)
    for entry in res["phases"]:
        if entry["phase"] in OURS_ONLY:
            out.extend(format_variant(entry))
            continue
        out.extend(_phase_table(entry))
        if res["config"].get("storage") == "s3":
            out.extend(s3.report_lines(entry, res.get("server") or {}))
        else:
            out.extend(_local_limits(entry, res))
    out.extend(_report_footer(res))
    return "\n".join(out)


def _report_header(res: dict) -> list:
    """The machine, the commit, the workload and the checksum's speed."""
    w = res["workload"]
    out = [describe(res["machine"])]
    out.append(
        f"workload: {human(res['config']['size_bytes'])} logical in {w['tensors']} tensors "
        f"(largest {human(w['big_tensor_bytes'])}, {w['tiny_tensors']} tiny), "
        f"{100 * w['bfloat16_fraction']:.0f}% bfloat16, {100 * w['replicated_fraction']:.0f}% replicated; "
        f"best of {res['config']['repeat']} repeat(s), median in brackets; 1 GB = 1e9 bytes; "
        f"load average {res['load_average']['start'][0]:.2f} at the start"
    )
    ck = res.get("checksum") or {}
    if ck.get("whole_gbps"):
        sample = ck["samples"][0]
        out.append(f"checksums: xxh3_64 (xxhash {sample['xxhash']}), one thread, {human(sample['bytes'])} in memory: "
                   f"{ck['whole_gbps']:.1f} GB/s in one call, {ck['blocks_gbps']:.1f} GB/s in the library's "
                   f"{human(sample['block_bytes'])} blocks")
    return out


def _phase_table(entry: dict) -> list:
    """One phase's table: every library's best and median, ratios, targets, memory."""
    ranks, phase = entry["ranks"], entry["phase"]
    out = []
    title = {"save": "save", "load": "load, same layout", "reshard": "load into another layout (Shard(0) -> Shard(1))"}[phase]
    out.append("")
    out.append(f"== {title}: {ranks} ranks, share per rank {human(entry['share_bytes'])}")
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
            f"{stat['rss_growth_max_bytes'] / MiB:12.0f} {100 * stat['rss_growth_fraction_of_share']:7.1f}%  "
            f"{ok}" + (f"; failed: {fails[0][:120]}" if fails else "")
        )
    return out


def _local_limits(entry: dict, res: dict) -> list:
    """Under a phase on the local disk: how torch saved, the memory limit, the page cache."""
    ranks, phase = entry["ranks"], entry["phase"]
    pc = res["page_cache"]
    out = []
    if phase == "save" and "torch" in entry["libs"] and "best_gbps" in entry["libs"]["torch"]:
        fsync = not res["config"].get("torch_sync_files", True)
        out.append("ours/torch above: paddle_dcp's default save (no fsync) against torch DCP's default save "
                   + ("(sync_files=False here: --torch-no-fsync)" if fsync else
                      "(sync_files=True: fsyncs every data file); like for like, both fsyncing: "
                      "paddle_dcp durable=True against it, in \"save, durable=True\" below"))
    mem = entry["targets"].get("memory")
    if mem:
        out.append(f"ours' memory limit (10% of share + 64 MiB): {mem['limit_bytes'] / MiB:.0f} MiB/rank"
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
    return out


def _report_footer(res: dict) -> list:
    """Notes on the peers' setup, the run's notes, its duration."""
    out = []
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
    return out
