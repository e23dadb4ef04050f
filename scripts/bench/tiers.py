"""The suite tiers: CheckpointManager's node-local tier (issue 29, point 6): restores from each tier
and the save with replication, against today's saves, in one run on this machine.

Two "nodes" on one machine: every job is two ``python -m paddle.distributed.launch --nnodes 2
--rank {0,1} --master 127.0.0.1:PORT`` launches, each in its own working directory (``nodeA``,
``nodeB``), so the relative local directory is each node's own; the global tier is a directory
both see, or a bucket on a local S3 server (tests/s3server.py: SeaweedFS ``weed mini``). The
state: ``--size`` bytes of float32 in 64 MiB tensors, Shard(0) over the ranks
(tiers_worker.py). Each repeat, in fresh directories:

- save-local: steps 1 and 2 saved with a local tier (``replicas=1``, async, no global step
  due): each save's blocked time (the ``save()`` call) and total (until ``wait()`` returned);
  then, untimed, step 2 saved by the managers of the global-tier restores (``replicas=0``,
  every step to the global tier too: a directory, and ``s3://``);
- restore, local: a restarted job restores step 2, nothing deleted (every byte from the own node);
- restore, peer: nodeB's local directory deleted first (its ranks' bytes come from nodeA's copies);
- restore, global (disk) and global (S3): ``replicas=0``, nodeB's local directory deleted, so
  no node holds nodeB's files and the restore takes them from the global tier (since 2b3ecef
  the library copies the lost files back into their node and restores the rest locally:
  tier "local", nodeB's bytes "global"); then the same with both nodes' local directories
  deleted (``-all``: every byte from the global tier, tier "global");
- save-async / save-sync: steps 1 and 2 by a manager without a local tier (today's async save,
  and the plain save) to a global directory on disk.

The order of save-local (with its restores), save-async and save-sync rotates from repeat to
repeat. Every rank times its own call after a settle wait and a barrier (process start-up,
manager construction and the checks are outside); a job's time is its slowest rank's. Every
restore must give step 2 from the tier meant (``last_restore.tier``), each rank's bytes by
source (``last_restore.bytes``) must show the source meant, and every tensor's xxh3_64 must
equal the one its save recorded, or the run fails. Beside each time, from the ranks' own INFO
lines: the library's load step inside a restore (the rest is the tier's check of its files)
and, for a save, the seconds until its data file was written (the rest of an async local-tier
save's total is the copy to the other node). The machine's limits are measured in the
same run: memcpy, xxh3_64, a loopback TCP stream, the page cache, and the S3 server's own PUT
and GET. Figures: best (the least seconds) and median over ``--repeat``.

Run (1 GiB, 2 nodes x 1 rank, 3 repeats; 8 to 11 minutes here)::

    .venv/bin/python scripts/bench tiers --size 1G --repeat 3 --json-out tiers.json

Smoke run (every path, about 3 minutes): ``--size 64M --repeat 1``.
Prints the table, the ratios and the targets (PASS/MISS), then one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import time

from bench import launch, s3
from bench.machine import (checksum_speed, describe, machine_info, memcpy_speed, page_cache_speed,
                           tcp_loopback_speed)
from bench.report import emit, log
from bench.units import GB, MiB, parse_size

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiers_worker.py")
NODES = ("nodeA", "nodeB")

# the restores and saves measured: name -> what the table calls it
RESTORES = {
    "local": "restore, own local tier",
    "peer": "restore, other node's copies",
    "global-disk": "restore, global tier on disk",
    "global-s3": "restore, global tier on S3",
    "global-disk-all": "restore, global tier on disk, both nodes' local directories deleted",
    "global-s3-all": "restore, global tier on S3, both nodes' local directories deleted",
    "survivor": "restore, other node lost, resumed on the node left (another rank count)",
}
SAVES = {
    "local-async": "save, local tier + copy (async)",
    "async": "save, global only (async, today)",
    "sync": "save, global only (plain)",
}
WHICH = ("first", "later")  # a process's first save (step 1) and its next one (step 2)
# issue 29, point 6: (name, numerator, denominator, bound, "min" | "max", what it says)
TARGETS = (
    ("peer restore >= 3x faster than S3", "restore.global-s3", "restore.peer", 3.0, "min",
     "restore from S3 / restore from the other node's copies"),
    ("peer restore within 2x of local", "restore.peer", "restore.local", 2.0, "max",
     "restore from the other node's copies / restore from the own local tier"),
    ("resume on the node left within 1.5x of local", "restore.survivor", "restore.local", 1.5, "max",
     "restore on the node left, another rank count / restore from the own local tier, same layout"),
    ("resume on the node left >= 3x faster than S3", "restore.global-s3", "restore.survivor", 3.0, "min",
     "restore from S3 / restore on the node left, another rank count"),
    ("local-tier async save blocks <= today's async (later save)", "save.local-async.later.blocked",
     "save.async.later.blocked", 1.0, "max", "blocked: local tier + copy / global only"),
    ("local-tier async save blocks <= today's async (first save)", "save.local-async.first.blocked",
     "save.async.first.blocked", 1.0, "max", "blocked: local tier + copy / global only"),
)
# more ratios from the same run, for the doc: (name, numerator, denominator)
RATIOS = (
    ("S3 / peer restore", "restore.global-s3", "restore.peer"),
    ("disk global / peer restore", "restore.global-disk", "restore.peer"),
    ("peer / local restore", "restore.peer", "restore.local"),
    ("node left / local restore", "restore.survivor", "restore.local"),
    ("S3 / node left restore", "restore.global-s3", "restore.survivor"),
    ("S3 / local restore", "restore.global-s3", "restore.local"),
    ("S3, no local copy left / peer restore", "restore.global-s3-all", "restore.peer"),
    ("disk global, no local copy left / peer restore", "restore.global-disk-all", "restore.peer"),
    ("local-tier async / today's async, blocked (later)", "save.local-async.later.blocked", "save.async.later.blocked"),
    ("local-tier async / today's async, blocked (first)", "save.local-async.first.blocked", "save.async.first.blocked"),
    ("local-tier async / today's async, total (later)", "save.local-async.later.total", "save.async.later.total"),
    ("local-tier async blocked / plain save (later)", "save.local-async.later.blocked", "save.sync.later.total"),
    ("local-tier async total / plain save (later)", "save.local-async.later.total", "save.sync.later.total"),
)


# ------------------------------------------------------------------------------ pure helpers
def best_median(values: list) -> dict:
    """Seconds of the repeats: the best (least) and the median."""
    return {"best": min(values), "median": statistics.median(values), "samples": list(values)}


def ratio(summary: dict, num: str, den: str) -> dict | None:
    """``num`` / ``den``, best by best and median by median; None when either is missing."""
    a, b = summary.get(num), summary.get(den)
    if not a or not b or not b["best"] or not b["median"]:
        return None
    return {"best": a["best"] / b["best"], "median": a["median"] / b["median"]}


def check_targets(summary: dict) -> list:
    """Every target of TARGETS against the summary: the ratio (best and median) and whether
    it holds (on the best figures; ``median_ok`` says whether the medians agree)."""
    out = []
    for name, num, den, bound, kind, what in TARGETS:
        r = ratio(summary, num, den)
        holds = (lambda x: x >= bound) if kind == "min" else (lambda x: x <= bound)
        out.append({"target": name, "what": what, "bound": bound, "kind": kind, "ratio": r,
                    "ok": None if r is None else holds(r["best"]),
                    "median_ok": None if r is None else holds(r["median"])})
    return out


def source_check(kind: str, reports: list, share: int) -> str:
    """'' when the ranks' ``last_restore`` reports show the source meant, else why not.

    ``reports``: per rank, (its node, {"tier", "bytes": {"local", "peer", "global"}}), the
    local directory of NODES[1] deleted before the restore (but for ``kind`` "local");
    ``share``: one rank's bytes. local: every rank's bytes from its own node; peer: the
    wiped node's from the other node, the rest from their own, none from the global tier;
    global-*: the wiped node's from the global tier, none from the other node (the intact
    node's from the global tier too, or from its own node when the library repairs the lost
    files alone: tier "local" with global bytes); global-*-all (both nodes' local directories
    deleted): every byte of every rank from the global tier, tier "global"; survivor (a job of
    NODES[0] alone, ``share`` the whole state): tier "local", no byte from the global tier."""
    if kind == "survivor":  # one node's ranks, every byte from that node (its files and the copies)
        nodes = sorted({node for node, _ in reports})
        total = sum(sum(b["bytes"].values()) for _, b in reports)
        ok = (nodes == [NODES[0]] and all(b["tier"] == "local" and not b["bytes"].get("global") for _, b in reports)
              and total == share)
        return "" if ok else (f"{[(n, b) for n, b in reports]}: expected {NODES[0]}'s ranks alone to restore all "
                              f"{share} bytes from their node")
    if kind.endswith("-all"):
        tiers = sorted({b["tier"] for _, b in reports})
        ok = tiers == ["global"] and all(b["bytes"].get("global") == share and not b["bytes"].get("peer")
                                         and not b["bytes"].get("local") for _, b in reports)
        return "" if ok else f"{[b for _, b in reports]}: expected every rank's {share} from the global tier"
    wiped = [b["bytes"] for node, b in reports if node == NODES[1]]
    kept = [b["bytes"] for node, b in reports if node != NODES[1]]
    tiers = sorted({b["tier"] for _, b in reports})
    if not wiped or not kept:
        return f"ranks on nodes {sorted({node for node, _ in reports})}, expected both {NODES}"
    if kind in ("local", "peer") and tiers != ["local"]:
        return f"tier {tiers}, expected local"
    if kind == "local":
        ok = all(b.get("local") == share and not b.get("peer") and not b.get("global") for b in wiped + kept)
        return "" if ok else f"bytes {[b for _, b in reports]}: expected all {share} of each rank from its own node"
    if kind == "peer":
        ok = (all(b.get("peer") == share and not b.get("global") for b in wiped)
              and all(b.get("local") == share and not b.get("global") for b in kept))
        return "" if ok else (f"bytes {[b for _, b in reports]}: expected {NODES[1]}'s ranks' {share} each from "
                              f"the other node, {NODES[0]}'s from their own")
    if not set(tiers) <= {"global", "local"}:
        return f"tier {tiers}, expected global (or local with the lost files from the global tier)"
    ok = (all(b.get("global") == share and not b.get("peer") for b in wiped)
          and all((b.get("global") == share or b.get("local") == share) and not b.get("peer") for b in kept))
    return "" if ok else f"bytes {[b for _, b in reports]}: expected {NODES[1]}'s ranks' {share} each from the global tier"


def summarize(runs: dict) -> dict:
    """Per measure (restore.KIND, save.KIND.WHICH.blocked|total): best and median seconds over
    the repeats, each repeat's figure its slowest rank's."""
    out = {}
    for kind, reps in runs.get("restore", {}).items():
        if reps:
            out[f"restore.{kind}"] = best_median([max(r["seconds"] for r in rep) for rep in reps])
            loads = [[r.get("load_seconds") for r in rep] for rep in reps]
            if all(x is not None for rep in loads for x in rep):
                out[f"restore.{kind}.load"] = best_median([max(rep) for rep in loads])
    for kind, reps in runs.get("save", {}).items():
        for i, which in enumerate(WHICH):
            for what in ("blocked", "total", "written"):
                vals = [max(r["saves"][i].get(what) or 0 for r in rep) for rep in reps
                        if rep and all(r["saves"][i].get(what) is not None for r in rep)]
                if vals:
                    out[f"save.{kind}.{which}.{what}"] = best_median(vals)
    return out


def format_table(summary: dict, nbytes: int) -> list:
    """The lines of the table: every measure's best and median seconds, and GB/s at the best."""
    lines = ["| measure | best s | median s | GB/s (best) | of which the load step (a save: its data file written), "
             "best (median) s |",
             "|---|---|---|---|---|"]
    for kind, title in RESTORES.items():
        s = summary.get(f"restore.{kind}")
        if s:
            load = summary.get(f"restore.{kind}.load")
            part = f"{load['best']:.2f} ({load['median']:.2f})" if load else "-"
            lines.append(f"| {title} | {s['best']:.2f} | {s['median']:.2f} | {nbytes / s['best'] / GB:.2f} | {part} |")
    for kind, title in SAVES.items():
        for which in WHICH:
            for what in ("blocked", "total"):
                s = summary.get(f"save.{kind}.{which}.{what}")
                if s:
                    w = summary.get(f"save.{kind}.{which}.written") if what == "total" else None
                    part = f"{w['best']:.2f} ({w['median']:.2f})" if w else ""
                    lines.append(f"| {title}, {which}, {what} | {s['best']:.2f} | {s['median']:.2f} | "
                                 f"{nbytes / s['best'] / GB:.2f} | {part}{' ' if part else ''}|")
    return lines


def format_targets(summary: dict) -> list:
    lines = []
    for name, num, den in RATIOS:
        r = ratio(summary, num, den)
        if r:
            lines.append(f"ratio {name}: {r['best']:.2f}x best, {r['median']:.2f}x median")
    for t in check_targets(summary):
        if t["ratio"] is None:
            lines.append(f"NOT MEASURED {t['target']}")
            continue
        sign = ">=" if t["kind"] == "min" else "<="
        verdict = "PASS" if t["ok"] else "MISS"
        agree = "" if t["ok"] == t["median_ok"] else f" (median: {'PASS' if t['median_ok'] else 'MISS'})"
        lines.append(f"{verdict} {t['target']}: {t['what']} = {t['ratio']['best']:.2f}x best, "
                     f"{t['ratio']['median']:.2f}x median (target {sign} {t['bound']:g}x){agree}")
    return lines


# ------------------------------------------------------------------------------ machine limits
def machine_limits(workdir: str, share: int, store: s3.S3Store | None) -> dict:
    """The speeds that bound a restore of one rank's ``share``: memcpy, xxh3_64, loopback TCP,
    the page cache, and (with a ``store``) the S3 server's."""
    out = {"share_bytes": share}
    log("machine limits: memcpy, xxh3_64, loopback TCP, page cache" + (", S3 server" if store else ""))
    out["memcpy_gbps"] = memcpy_speed(share)
    out["xxh3"] = checksum_speed(rounds=3)
    out["tcp_loopback_gbps"] = tcp_loopback_speed(share)
    out["page_cache"] = page_cache_speed(os.path.join(workdir, "pagecache"), share, 1, 1.0)
    shutil.rmtree(os.path.join(workdir, "pagecache"), ignore_errors=True)
    if store is not None:
        out["s3_server"] = s3.server_speed(store, share)
    return out


# ------------------------------------------------------------------------------ launches
class LaunchError(RuntimeError):
    """A job failed: a rank's error, a launcher's exit code or the timeout, and the logs' tails."""


def two_nodes(work: str, name: str, phase: str, opts: dict, nproc: int, timeout: float,
              nodes: tuple = NODES) -> list:
    """One job of ``nodes`` (two by default) running the worker's ``phase``; the ranks'
    results, rank order. Raises LaunchError (with the tails of the logs) when a rank fails or
    the job outlives ``timeout`` seconds (then the launchers and their workers are killed, by
    their ids)."""
    results = os.path.join(work, "results", name)
    shutil.rmtree(results, ignore_errors=True)
    opts = dict(opts, results=results)
    master = f"127.0.0.1:{launch.free_port()}"
    commands, logs = [], []
    for node_rank, node in enumerate(nodes):
        cwd = os.path.join(work, node)
        os.makedirs(cwd, exist_ok=True)
        log_dir = os.path.join(cwd, f"log-{name}")
        shutil.rmtree(log_dir, ignore_errors=True)
        argv = launch.launcher(WORKER, [phase, json.dumps(opts)], nproc, log_dir, nnodes=len(nodes),
                               node_rank=node_rank, master=master)
        commands.append(launch.Command(argv, cwd, os.path.join(cwd, f"launcher-{name}.out")))
        logs.append(log_dir)
    job = launch.run(commands, launch.job_env(), timeout, results, len(nodes) * nproc, logs)
    if not job.ok:
        raise LaunchError(f"{name}: {job.error}\n{job.tail(25)}")
    return job.results


LOADED_RE = re.compile(r"loaded checkpoint \d+ from \S+: \d+ bytes by this rank in ([0-9.]+) s")


def load_seconds(work: str, name: str, nproc: int, nodes: tuple = NODES) -> list:
    """Per rank, the seconds the library's load step took inside its restore (its INFO line
    "loaded checkpoint ... in X s"; None when absent): the rest of a restore is the tier's
    check of its files and the agreement on the step."""
    out = []
    for node in nodes:
        for local_rank in range(nproc):
            found = None
            path = os.path.join(work, node, f"log-{name}", f"workerlog.{local_rank}")
            try:
                with open(path, errors="replace") as f:
                    for m in LOADED_RE.finditer(f.read()):
                        found = float(m.group(1))
            except OSError:
                pass
            out.append(found)
    return out


SAVED_RE = re.compile(r"saved checkpoint (\d+) to \S+: \d+ bytes written by this rank in ([0-9.]+) s")


def written_seconds(work: str, name: str, nproc: int) -> list:
    """Per rank, {step: seconds from the save call's start until its data file was written}
    (the library's INFO line "saved checkpoint N to DIR: ... in X s", the first for each step:
    the launch's untimed saves come after)."""
    out = []
    for node in NODES:
        for local_rank in range(nproc):
            found: dict = {}
            try:
                with open(os.path.join(work, node, f"log-{name}", f"workerlog.{local_rank}"), errors="replace") as f:
                    for m in SAVED_RE.finditer(f.read()):
                        found.setdefault(int(m.group(1)), float(m.group(2)))
            except OSError:
                pass
            out.append(found)
    return out


def wipe(work: str, node: str, local: str) -> None:
    shutil.rmtree(os.path.join(work, node, local), ignore_errors=True)


# ------------------------------------------------------------------------------ one repeat
def tiers_block(work: str, args: argparse.Namespace, common: dict, s3_url: str | None, runs: dict, checks: list) -> None:
    """save-local, then the four restores, each a fresh job."""
    extra = [["global-disk", os.path.join(work, "global-disk"), "local0"]]
    if s3_url:
        extra.append(["global-s3", s3_url, "local0s3"])
    log("  save-local (local tier + copies, async; then the global tiers' step 2, untimed)")
    res = two_nodes(work, "save-local", "save-local", dict(common, directory=os.path.join(work, "global-none"),
                    local="local", replicas=1, extra=extra), args.nproc_per_node, args.timeout)
    _add_written(res, work, "save-local", args.nproc_per_node)
    runs["save"]["local-async"].append(res)
    restores = [("local", os.path.join(work, "global-none"), "local", 1, None),
                ("peer", os.path.join(work, "global-none"), "local", 1, "local"),
                ("global-disk", os.path.join(work, "global-disk"), "local0", 0, "local0")]
    if s3_url:
        restores.append(("global-s3", s3_url, "local0s3", 0, "local0s3"))
    if s3_url:
        restores.append(("global-s3-all", s3_url, "local0s3", 0, "local0s3"))
    restores.insert(3, ("global-disk-all", os.path.join(work, "global-disk"), "local0", 0, "local0"))
    restores.insert(2, ("survivor", os.path.join(work, "global-none"), "local", 1, "local"))
    for kind, directory, local, replicas, doomed in restores:
        if kind == "survivor":
            survivor_restore(work, args, common, runs, checks)
            continue
        wiped = NODES if kind.endswith("-all") else NODES[1:]
        for node in wiped if doomed else ():
            wipe(work, node, doomed)
        log(f"  restore from {kind}" + (f" ({', '.join(n + '/' + doomed for n in wiped)} deleted)" if doomed else ""))
        tiers = ["global"] if kind.endswith("-all") else ["global", "local"] if kind.startswith("global") else ["local"]
        res = two_nodes(work, f"restore-{kind}", "restore", dict(common, directory=directory, local=local,
                        replicas=replicas, step=2, tiers=tiers), args.nproc_per_node, args.timeout)
        why = source_check(kind, [(os.path.basename(r["cwd"]), r["report"]) for r in res], res[0]["share_bytes"])
        if why:
            raise LaunchError(f"restore from {kind}: not the source meant: {why}")
        checks.append({"kind": kind, "reports": [dict(r["report"], node=os.path.basename(r["cwd"])) for r in res],
                       "checked_bytes": sum(r["checked_bytes"] for r in res)})
        for r, seconds in zip(res, load_seconds(work, f"restore-{kind}", args.nproc_per_node)):
            r["load_seconds"] = seconds
        runs["restore"][kind].append(res)


def survivor_restore(work: str, args: argparse.Namespace, common: dict, runs: dict, checks: list) -> None:
    """The job restarted with the same arguments on NODES[0] alone, NODES[1]'s local directory
    lost, on one node's worth of ranks (half the saving job's): step 2 from the files and the
    copies NODES[0] holds, resharded to the new rank count."""
    wipe(work, NODES[1], "local")
    log(f"  restore on {NODES[0]} alone ({NODES[1]}/local deleted), {args.nproc_per_node} rank(s) "
        f"instead of {2 * args.nproc_per_node}")
    nodes = NODES[:1]
    res = two_nodes(work, "restore-survivor", "restore", dict(common, directory=os.path.join(work, "global-none"),
                    local="local", replicas=1, step=2, tiers=["local"]), args.nproc_per_node, args.timeout, nodes)
    share = sum(r["share_bytes"] for r in res)
    why = source_check("survivor", [(os.path.basename(r["cwd"]), r["report"]) for r in res], share)
    if why:
        raise LaunchError(f"restore on the node left: not the source meant: {why}")
    checks.append({"kind": "survivor", "reports": [dict(r["report"], node=os.path.basename(r["cwd"])) for r in res],
                   "checked_bytes": sum(r["checked_bytes"] for r in res)})
    for r, seconds in zip(res, load_seconds(work, "restore-survivor", args.nproc_per_node, nodes)):
        r["load_seconds"] = seconds
    runs["restore"]["survivor"].append(res)


def _add_written(res: list, work: str, name: str, nproc: int) -> None:
    for r, steps in zip(res, written_seconds(work, name, nproc)):
        for save in r["saves"]:
            save["written"] = steps.get(save["step"])


def one_repeat(rep: int, base: str, args: argparse.Namespace, store: s3.S3Store | None, runs: dict, checks: list) -> None:
    work = os.path.join(base, f"rep{rep}")
    os.makedirs(work, exist_ok=True)
    common = {"size": args.size, "settle": args.settle, "layout_ranks": 2 * args.nproc_per_node}
    s3_url = store.path(f"tiers-rep{rep}") if store else None
    blocks = ["tiers", "async", "sync"]
    blocks = blocks[rep % 3:] + blocks[: rep % 3]
    log(f"repeat {rep + 1}/{args.repeat}: {', '.join(blocks)}")
    try:
        for block in blocks:
            if block == "tiers":
                tiers_block(work, args, common, s3_url, runs, checks)
            else:
                log(f"  save-{block} (no local tier)")
                res = two_nodes(work, f"save-{block}", f"save-{block}",
                                dict(common, directory=os.path.join(work, f"global-{block}")),
                                args.nproc_per_node, args.timeout)
                _add_written(res, work, f"save-{block}", args.nproc_per_node)
                runs["save"][block].append(res)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if store and s3_url:
                store.remove(s3_url)


def main(argv: list | None = None, prog: str = "bench tiers") -> int:
    """The suite tiers: the table, the ratios and the targets on stdout."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=1 << 30, help="bytes of float32 state over all ranks (1G)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--settle", type=float, default=3.0, help="seconds each rank waits before its timed call")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one job may take before it is killed")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 server and the restore from it")
    p.add_argument("--workdir", default=None, help="where the nodes' directories go (a fresh temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the directories of every repeat")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    base = args.workdir or tempfile.mkdtemp(prefix="bench_tiers_")
    os.makedirs(base, exist_ok=True)
    t_start = time.perf_counter()
    store = None
    runs = {"restore": {k: [] for k in RESTORES}, "save": {k: [] for k in SAVES}}
    checks: list = []
    result: dict = {"config": {"size_bytes": args.size, "nodes": 2, "nproc_per_node": args.nproc_per_node,
                               "repeat": args.repeat, "settle": args.settle, "workdir": base},
                    "machine": machine_info(base), "load_average_start": os.getloadavg()}
    try:
        if not args.no_s3:
            store = s3.S3Store.start(os.path.join(base, "s3"))
            result["s3_server"] = store.info()
        share = args.size // (2 * args.nproc_per_node)
        result["limits"] = machine_limits(base, share, store)
        for rep in range(args.repeat):
            one_repeat(rep, base, args, store, runs, checks)
    finally:
        if store is not None:
            store.close()
        if not args.keep and args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    result["load_average_end"] = os.getloadavg()
    result["seconds"] = time.perf_counter() - t_start
    nbytes = runs["restore"]["local"][0][0]["share_bytes"] * 2 * args.nproc_per_node
    summary = summarize(runs)
    result.update(bytes=nbytes, summary=summary, targets=check_targets(summary), checks=checks,
                  ratios={name: ratio(summary, a, b) for name, a, b in RATIOS},
                  raw={k: {kind: [[{x: r.get(x) for x in ("rank", "cwd", "seconds", "load_seconds", "saves", "report",
                                                           "extra_saves")} for r in rep] for rep in reps]
                           for kind, reps in v.items()} for k, v in runs.items()})
    emit(result, report(result), args.json_out)
    return 0


def report(result: dict) -> str:
    m, cfg, lim = result["machine"], result["config"], result.get("limits", {})
    out = [f"{describe(m)}; load average {result['load_average_start'][0]:.2f} at the start, "
           f"{result['load_average_end'][0]:.2f} at the end; {result['seconds']:.0f} s",
           f"state: {result['bytes'] / MiB:.0f} MiB of float32 over 2 nodes x {cfg['nproc_per_node']} rank(s); "
           f"{cfg['repeat']} repeat(s); every restore checked (step, tier, bytes by source, xxh3_64 of every tensor)"]
    if lim:
        pc = lim["page_cache"]
        out.append(f"limits ({lim['share_bytes'] / MiB:.0f} MiB, one rank's share): memcpy {lim['memcpy_gbps']:.2f} GB/s; "
                   f"xxh3_64 {lim['xxh3']['blocks_gbps']:.2f} GB/s; loopback TCP {lim['tcp_loopback_gbps']:.2f} GB/s; "
                   f"page cache write {pc['write_cold_gbps']:.2f} cold / {pc['write_warm_gbps']:.2f} warm, "
                   f"read {pc['read_gbps']:.2f} GB/s")
        if lim.get("s3_server"):
            out.append(s3.speed_line(lim["s3_server"]))
    out += format_table(result["summary"], result["bytes"])
    out += format_targets(result["summary"])
    return "\n".join(out)

