"""paddle_dcp's options in a run of the suite io, against its own plain calls:
save-async (the time training is blocked), save-durable (the cost of fsync, and like for like
against torch DCP's fsyncing save) and load-noverify (the cost of the checksums); computed
from the phases' results and reported."""
from __future__ import annotations

import statistics

from bench.io_config import ASYNC_PEERS, LIB_TITLE, OURS_ONLY
from bench.units import MiB, human


def _ratio(a, b):
    return a / b if a and b else None


def compare_variants(phases: list, torch_fsyncs: bool) -> None:
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


def format_variant(entry: dict) -> list:
    """The report of an ours-only phase (save-async, save-durable, load-noverify)."""
    ranks, phase = entry["ranks"], entry["phase"]
    ours = entry["libs"].get("ours", {})
    share = entry["share_bytes"]
    title = {"save-async": "save, async_save=True", "save-durable": "save, durable=True (fsync of data files, "
             "metadata and directory)", "load-noverify": "load, same layout, verify=False (no checksum checks)"}[phase]
    peers = " (torch DCP's async_save below)" if phase == "save-async" and entry.get("async", {}).get("torch") else " only"
    out = ["", f"== {title}: paddle_dcp{peers}, {ranks} ranks, share per rank {human(share)}"]
    ok = f"{ours.get('ok_runs', 0)}/{len(ours.get('runs', []))} ok"
    if "best_gbps" not in ours:
        err = next((r["error"] for r in ours.get("runs", []) if r["error"]), "no run")
        out.append(f"n/a: {ok}: {err[:200]}")
        return out
    if phase == "save-async":
        return _format_async(entry, out, ok)
    mib = MiB
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


def _format_async(entry: dict, out: list, ok: str) -> list:
    """The save-async phase: blocked and until wait(), first in a process and later, with the
    peers' async saves."""
    share = entry["share_bytes"]
    mib = MiB
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
    out.append(f"RSS: the host copies are expected to take ~ the share, {human(share)} per rank; "
               f"the memory limit of the plain save does not apply")
    out.append(f"runs: {ok}; each of the three checkpoints loaded back and every value checked")
    return out
