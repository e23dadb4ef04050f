"""The results of a bench run (scripts/bench.py): each phase's best and median runs, ratios
against the peers, targets, the options compared with our plain calls, and the report."""
from __future__ import annotations

import os
import statistics

import bench_s3
from bench_config import ASYNC_PEERS, GB, LIB_TITLE, OURS_ONLY, TARGETS, workload


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
        limit = bench_s3.limit_targets(entry, server)
        if limit:
            entry["targets"]["server"] = limit
    if server and phase in bench_s3.PHASES:
        entry["targets"]["memory"] = bench_s3.memory_target(entry)
    elif "ours" in entry["libs"] and "rss_growth_max_bytes" in entry["libs"]["ours"] and phase != "save-async":
        limit = 0.1 * share + 64 * workload.MiB
        entry["targets"]["memory"] = {"limit_bytes": limit,
                                      "met": entry["libs"]["ours"]["rss_growth_max_bytes"] <= limit}


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
            entry["libs"][lib] = _lib_stat(mine, phase, logical, share)
        _set_targets(entry, entry_libs, targets, server)
        phases.append(entry)
    _compare_variants(phases, torch_fsyncs=not args.torch_no_fsync)
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


def _compare_variants(phases: list, torch_fsyncs: bool) -> None:
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
            e["async"] = _async_comparison(e, good, plain, plain_best, plain_median)
        elif e["phase"] == "save-durable":
            _durable_comparison(e, good, plain, plain_best, plain_median, base, torch_fsyncs)
        else:  # load-noverify
            _verify_comparison(e, good, plain, plain_best, plain_median)


def _async_comparison(e: dict, good: list, plain: dict, plain_best, plain_median) -> dict:
    """save-async: the time blocked, first in a process and later, against the full save's time
    (ours and the async peers'), and the memory held."""
    ours = e["libs"]["ours"]

    def slowest(key, runs=good):  # the slowest rank of each good run
        return [max(r[key]) for r in runs if key in r]

    def best_median(values):
        return (min(values), statistics.median(values)) if values else (None, None)

    blocked, total = slowest("blocked_seconds_per_rank"), slowest("seconds_per_rank")
    nb, nt = slowest("next_async_blocked_seconds_per_rank"), slowest("next_async_seconds_per_rank")
    nf = slowest("next_full_seconds_per_rank")
    out = {
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
            out[peer] = {"first_blocked_best_s": pb[0], "first_blocked_median_s": pb[1],
                         "next_blocked_best_s": pn[0], "next_blocked_median_s": pn[1],
                         "ours_next_blocked_over_peer_next_best": _ratio(best_median(nb)[0], pn[0]),
                         "ours_next_blocked_over_peer_next_median": _ratio(best_median(nb)[1], pn[1])}
    return out


def _durable_comparison(e: dict, good: list, plain: dict, plain_best, plain_median, base: dict,
                        torch_fsyncs: bool) -> None:
    """save-durable: its speed against the default save's, and like for like against the peers'."""
    ours = e["libs"]["ours"]
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
            "peer_fsyncs": peer == "torch" and torch_fsyncs,
            "ours_durable_over_peer_default_best": _ratio(ours["best_gbps"], p["best_gbps"]),
            "ours_durable_over_peer_default_median": _ratio(ours["median_gbps"], p["median_gbps"]),
            "ours_default_over_peer_default_best": _ratio(plain.get("best_gbps"), p["best_gbps"]),
            "ours_default_over_peer_default_median": _ratio(plain.get("median_gbps"), p["median_gbps"]),
        }


def _verify_comparison(e: dict, good: list, plain: dict, plain_best, plain_median) -> None:
    """load-noverify: the cost of the checksums, against the verified load."""
    ours = e["libs"]["ours"]
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
    out = _report_header(res)
    for entry in res["phases"]:
        if entry["phase"] in OURS_ONLY:
            out.extend(_format_variant(entry))
            continue
        out.extend(_phase_table(entry))
        if res["config"].get("storage") == "s3":
            out.extend(bench_s3.report_lines(entry, res.get("server") or {}))
        else:
            out.extend(_local_limits(entry, res))
    out.extend(_report_footer(res))
    return "\n".join(out)


def _report_header(res: dict) -> list:
    """The machine, the commit, the workload and the checksum's speed."""
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
    return out


def _phase_table(entry: dict) -> list:
    """One phase's table: every library's best and median, ratios, targets, memory."""
    ranks, phase = entry["ranks"], entry["phase"]
    out = []
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
