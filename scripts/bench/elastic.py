"""The suite scale-elastic: the node-local tier's restore after a lost node, at thousands of
simulated ranks (issue 39, point 5).

A job of ../shared/scale/workload.py on nodes of ``tp`` ranks (one node: the tp group of one
pipeline stage and data-parallel replica) saves a step to the local tier with ``replicas``
copies (paddle_dcp.tools.simulate: the real save protocol; the copies where the tier's own
placement puts them), then loses one node's directory and restores it with the real check and
load code (paddle_dcp.tools.simulate_tier), in three cases:

  same       the baseline: the same job on the same nodes, nothing lost
  survivors  one data-parallel replica fewer (dp - 1), on the nodes left less pp - 1 that idle
             (their files unseen; chosen so that every file keeps a copy on a node that runs)
  new-node   the same job, the lost node replaced by a new, empty one

    python scripts/bench scale-elastic --model llama-70b --ranks 1024 [--lost-node 1] [--repeat 2] [--json-out F]

Figures per case (seconds, bytes):
  coord_s                   everything the coordinator does in the resume's planning: the
                            tier's open (nodes from the markers, steps on the nodes, the steps
                            to restore), the survey, the record's broadcast, the check's
                            agreements (no hashing), the load's metadata read, planning, routing
  coord_open_s / coord_check_s / coord_load_s   of it, the open, the check and the load
  rank_recv_bytes_max       the most planning bytes any rank but the coordinator receives
                            (collectives and agreements), and rank_send_bytes_max it sends
  coord_recv_bytes          what the coordinator receives
  p2p_recv_bytes_max        planning bytes received point to point (metadata from a helper, by
                            the ranks of a node that has no metadata)
  collectives               collectives per rank
  remote_servers_max        the most ranks any rank takes bytes from
  top_recv                  the collectives that cost a rank most, (step, bytes)
Goal (issue 39): coord_s <= 1, rank_recv_bytes_max <= 4096.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

from bench.report import emit, log
from bench.scale import Job, layouts_of, settle
from paddle_dcp.core.job_layout import JobLayout, Mesh
from paddle_dcp.core.naming import parse_data_name
from paddle_dcp.tools.simulate import simulate_save
from paddle_dcp.tools.simulate_tier import saved_nodes, simulate_tier_restore

CASES = ("same", "survivors", "new-node")
GOAL_S, GOAL_BYTES = 1.0, 4096


def nodes_of_job(ranks: int, per_node: int) -> tuple[tuple[int, ...], ...]:
    """Ranks 0..ranks-1, ``per_node`` consecutive ranks a node."""
    return tuple(tuple(range(i, i + per_node)) for i in range(0, ranks, per_node))


def replica_nodes(node: int, pp: int, dp: int) -> tuple[int, ...]:
    """The nodes of ``node``'s data-parallel replica, one per pipeline stage, on a [pp, dp, tp]
    mesh whose nodes are its tp groups (node = pp_i * dp + dp_i)."""
    return tuple(s * dp + node % dp for s in range(pp))


def resume(case: str, held: list[set], lost: int, pp: int, dp: int) -> tuple[int, list[int | None]]:
    """(the resumed job's dp, which saved node's directory each of its nodes has: an index into
    the saved nodes, whose node i holds the data files of the writers ``held[i]``; None for a
    new, empty node). The survivors run on all nodes but the lost one and as many more idle
    ones as a replica has nodes less one: the idle nodes those of the lost node's replica
    first, then the lowest, each only when every file still has a copy on a node that runs."""
    nodes = len(held)
    if case == "same":
        return dp, list(range(nodes))
    if case == "new-node":
        return dp, [None if i == lost else i for i in range(nodes)]
    if case != "survivors":
        raise ValueError(f"unknown case {case!r}: one of {CASES}")
    need = set().union(*held)
    idle = {lost}
    for i in sorted(set(range(nodes)) - idle, key=lambda i: (i not in replica_nodes(lost, pp, dp), i)):
        if len(idle) == pp:
            break
        if set().union(*(held[j] for j in range(nodes) if j not in idle | {i})) == need:
            idle.add(i)
    if len(idle) < pp:
        raise ValueError(f"no {pp - 1} nodes besides node {lost} can idle with every file on the others")
    return dp - 1, [i for i in range(nodes) if i not in idle]


def recorded(job: Job, nodes) -> list[JobLayout]:
    """The layout each node's first rank records: the job's nodes, and the mesh of its
    pipeline stage's tensors ([dp, tp], the stage's ranks)."""
    stage = job.dp * job.tp
    return [JobLayout(job.ranks, (Mesh((job.dp, job.tp), tuple(range(n[0] // stage * stage, (n[0] // stage + 1) * stage)),
                                       ("dp", "tp")),), tuple(nodes)) for n in nodes]


def row(case: str, sim, ranks: int, coordinator: int = 0) -> dict:
    """One case's figures from its simulation."""
    others = [r for r in sim.traffic if r != coordinator] or [coordinator]
    top = sorted(sim.log, key=lambda x: -x[1])[:4]
    return {
        "case": case,
        "ranks": ranks,
        "coord_s": round(sim.coordinator_seconds, 3),
        "coord_open_s": round(sim.open_seconds, 3),
        "coord_check_s": round(sim.check_seconds, 3),
        "coord_load_s": round(sim.load_seconds, 3),
        "rank_recv_bytes_max": max(sim.traffic[r].received for r in others),
        "rank_send_bytes_max": max(sim.traffic[r].sent for r in others),
        "coord_recv_bytes": sim.traffic[coordinator].received,
        "p2p_recv_bytes_max": max((t.received for t in sim.p2p.values()), default=0),
        "collectives": max(t.collectives for t in sim.traffic.values()),
        "remote_servers_max": max(sim.remote_servers.values()),
        "files_from_lost_node": len(sim.gone),
        "top_recv": [[name, n] for name, n, _ in top],
        "goal_met": sim.coordinator_seconds <= GOAL_S and max(sim.traffic[r].received for r in others) <= GOAL_BYTES,
    }


def measure(model: str, ranks: int, tp: int, pp: int, lost: int, replicas: int, repeat: int) -> list[dict]:
    t0 = time.perf_counter()
    job = Job(model, ranks, tp, pp)
    saved = nodes_of_job(ranks, tp)
    save = simulate_save(layouts_of(job), values={"step": 1000}, unique_id=1000)
    dirs = saved_nodes(save.metadata_json, saved, replicas, recorded(job, saved))
    held = [{w for w in map(parse_data_name, d.sizes) if w is not None} for d in dirs]
    held = [{w[0] for w in h} for h in held]
    log(f"[{ranks}] saved and {len(saved)} nodes' directories laid out in {time.perf_counter() - t0:.1f} s")
    out = []
    for case in CASES:
        dp, which = resume(case, held, lost, pp, job.dp)
        resumed = Job(model, pp * dp * tp, tp, pp)
        layouts = layouts_of(resumed)
        for attempt in range(repeat):
            gc.collect()
            settle()
            sim = simulate_tier_restore(save.metadata_json, [None if i is None else dirs[i] for i in which],
                                        nodes_of_job(resumed.ranks, tp), layouts, replicas)
            out.append(dict(row(case, sim, resumed.ranks), run=attempt + 1))
            log(f"[{ranks}] {case} ({resumed.ranks} ranks) run {attempt + 1}: coordinator {sim.coordinator_seconds:.3f} s, "
                f"rank receives <= {out[-1]['rank_recv_bytes_max']} B")
    return out


COLUMNS = [("case", "case"), ("ranks", "ranks"), ("run", "run"), ("coord_s", "coord s"), ("coord_open_s", "open s"),
           ("coord_check_s", "check s"),
           ("coord_load_s", "load s"), ("rank_recv_bytes_max", "rank recv B"), ("rank_send_bytes_max", "rank send B"),
           ("coord_recv_bytes", "coord recv B"), ("p2p_recv_bytes_max", "p2p recv B"), ("collectives", "collectives"),
           ("remote_servers_max", "servers"), ("goal_met", "goal met")]


def main(argv: list | None = None, prog: str = "bench scale-elastic") -> int:
    """The suite scale-elastic: a table of figures per case on stdout."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-70b")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=8, help="also the ranks per node")
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--lost-node", type=int, default=1, help="the node whose directory is lost (not 0: the coordinator's)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    rows = measure(args.model, args.ranks, args.tp, args.pp, args.lost_node, args.replicas, args.repeat)
    lines = [f"{args.model}, tp {args.tp}, pp {args.pp}, node {args.lost_node} lost, replicas {args.replicas}, "
             f"{os.cpu_count()} cores; goal: coord <= {GOAL_S} s, rank recv <= {GOAL_BYTES} B",
             " | ".join(t for _, t in COLUMNS)]
    lines += [" | ".join(str(r[k]) for k, _ in COLUMNS) for r in rows]
    lines += [f"{r['case']} run {r['run']}: top rank recv {r['top_recv']}" for r in rows if r["run"] == 1]
    emit({"model": args.model, "tp": args.tp, "pp": args.pp, "lost_node": args.lost_node, "results": rows},
         "\n".join(lines), args.json_out)
    return 0
