"""The suite scale: planning and metadata at thousands of ranks, measured on one machine.

For every rank of a job from ../shared/scale/workload.py (the per-rank layouts of a large
model on a [pp, dp, tp] mesh), this runs paddle_dcp's real save and load protocols in one
process (paddle_dcp.tools.simulate): the same generators a real rank runs, with the collectives
replaced by an in-process world that hands each rank what the real collective would and counts
its bytes with the real comm's cost functions. Nothing but planning runs: no tensors, no data
files; the metadata is built, serialized and parsed for real.

    python scripts/bench scale --model llama-70b --ranks 1024,8192 [--tp 8 --pp 8] [--json-out F]

Figures per rank count (seconds, bytes, MiB):
  coord_save_s               everything the coordinator does in a save, serialization included
  coord_save_peak_mib        peak resident memory growth of the process during the save
  coord_save_kernel_s        of coord_save_s, the kernel's time (page faults: on this virtual
                             machine, memory touched for the first time costs ~4 s per GiB)
  rank_save_{recv,send}_bytes_max   the largest planning traffic of any other rank in a save
  metadata_bytes             the metadata file's size
  metadata_parse_s           parsing the metadata as a load does (entries validated on use)
  metadata_validate_s        parsing and validating every entry (what `verify` does)
  load_plan_rank_s           one rank planning its reads (parse of its entries included)
  load_plan_reshard_rank_s   one rank planning a load into tp/2 with dp doubled
  coord_load_s               everything the coordinator does in a load (parse included)
  rank_load_recv_bytes_max   the largest traffic any other rank receives in a load
  coord_load_s3_s            the coordinator's load on object storage (it reads the metadata
                             and broadcasts it)
  rank_load_s3_recv_bytes_max  what any other rank receives then (the metadata, and the rest)
  cached_save_plan_s         the coordinator's work in a second save of the same layout
  rank_metadata_read_bytes_max  the most bytes of the metadata file any rank reads on a shared
                             file system (the coordinator and two other ranks, measured)
  rank_metadata_read_s3_bytes_max  the most any rank but the coordinator receives in a load
                             on object storage (its part of the metadata, and the rest)
  gc_in_timed_s              of the coordinator's timed steps above (simulated saves and loads),
                             the time Python's garbage collector took (see settle())
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

from bench import REPO
from bench.report import emit, log
from paddle_dcp.core import metafile
from paddle_dcp.core.metadata_parse import parse_metadata
from paddle_dcp.tools.simulate import RankLayout, plan_rank, simulate_load, simulate_save, targets_of, wanted_of

for candidate in (os.path.join(os.path.dirname(REPO), "shared", "scale"), os.path.join(REPO, "shared", "scale")):
    if os.path.exists(os.path.join(candidate, "workload.py")):
        sys.path.insert(0, candidate)
        break
try:
    from workload import Job  # noqa: E402  (../shared/scale/workload.py: the jobs' per-rank layouts)
except ImportError:  # pragma: no cover
    raise SystemExit("cannot find ../shared/scale/workload.py next to this repository")


def layouts_of(job: Job) -> dict[int, RankLayout]:
    return {r: RankLayout.flat(job.pieces(r)) for r in range(job.ranks)}


def read_as_rank(meta_json: bytes, layout: RankLayout):
    """The metadata as a load rank of ``layout`` reads it on a shared file system: a large
    version 3 file in parts, any other whole."""
    if metafile.is_packed(meta_json) and metafile.worth_parts(len(meta_json)):
        view = memoryview(meta_json)
        return metafile.read_part(lambda ranges: [view[a:b] for a, b in ranges], len(meta_json), wanted_of(layout))
    return parse_metadata(meta_json, lazy=True)


def settle() -> None:
    """Move every object alive now out of the garbage collector's sight (gc.freeze). The
    simulation holds millions of objects (every rank's layout, plans, caches) that live until
    the end; a full collection traverses them all (2.4 s at 8192 ranks on this machine) and
    lands in whichever timed step allocates when it is due: the coordinator's load once showed
    2.2 s instead of 0.2 s that way. The collector's time left inside the timed steps is
    reported apart (``gc_in_timed_s``)."""
    gc.freeze()


def measure(model: str, ranks: int, tp: int, pp: int, s3: bool = True) -> dict:
    t0 = time.perf_counter()
    job = Job(model, ranks, tp, pp)
    layouts = layouts_of(job)
    log(f"[{ranks}] layouts of {ranks} ranks built in {time.perf_counter() - t0:.1f} s")
    gc.collect()
    settle()
    cache: dict = {}
    save = simulate_save(layouts, values={"step": 1000, "lr": 3e-4}, cache=cache)
    settle()
    meta_json = save.metadata_json
    unique = sum(save.metadata.tensors[k].pieces.count for k in save.metadata.tensors)
    others = [save.traffic[r] for r in range(1, ranks)] or [save.traffic[0]]
    log(f"[{ranks}] save simulated: coordinator {save.coordinator_seconds:.2f} s, {unique} pieces")

    t0 = time.perf_counter()
    parse_metadata(meta_json, lazy=True)
    parse_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    parse_metadata(meta_json)
    validate_s = time.perf_counter() - t0

    # one rank of the middle pipeline stage reads its part of the metadata and plans its reads
    rank = ranks // 2
    t0 = time.perf_counter()
    ops = plan_rank(read_as_rank(meta_json, layouts[rank]), targets_of(layouts[rank]))
    plan_s = time.perf_counter() - t0
    reshard_job = Job(model, ranks, max(1, tp // 2), pp)
    target = RankLayout.flat(reshard_job.pieces(rank))
    t0 = time.perf_counter()
    reshard_ops = plan_rank(read_as_rank(meta_json, target), targets_of(target))
    reshard_s = time.perf_counter() - t0
    log(f"[{ranks}] rank {rank} plans {len(ops)} reads in {plan_s:.3f} s, {len(reshard_ops)} resharded in {reshard_s:.3f} s")

    settle()
    load = simulate_load(layouts, meta_json, plan_ranks=(rank, ranks - 1))
    log(f"[{ranks}] load simulated: coordinator {load.coordinator_seconds:.2f} s")
    settle()
    s3_load = simulate_load(layouts, meta_json, object_storage=True) if s3 else None
    if s3_load is not None:
        log(f"[{ranks}] load from object storage simulated: coordinator {s3_load.coordinator_seconds:.2f} s")
    else:
        log(f"[{ranks}] load from object storage not simulated (--s3-max-ranks)")
    settle()
    cached = simulate_save(layouts, values={"step": 2000, "lr": 3e-4}, cache=cache, unique_id=1)
    gc_timed = sum(x.coordinator_gc_seconds for x in (save, load, s3_load, cached) if x is not None)
    assert cached.plan_reused, "the second save of the same layout should reuse the plan"
    load_others = [load.traffic[r] for r in range(1, ranks)] or [load.traffic[0]]
    s3_others = ([s3_load.traffic[r] for r in range(1, ranks)] or [s3_load.traffic[0]]) if s3_load else []
    return {
        "ranks": ranks,
        "unique_pieces": unique,
        "coord_save_s": round(save.coordinator_seconds, 3),
        "coord_save_peak_mib": round(save.peak_rss_growth_mib, 1),
        "coord_save_kernel_s": round(save.coordinator_kernel_seconds, 3),
        "rank_save_recv_bytes_max": max(t.received for t in others),
        "rank_save_send_bytes_max": max(t.sent for t in others),
        "metadata_bytes": len(meta_json),
        "metadata_bytes_per_piece": round(len(meta_json) / max(unique, 1), 2),
        "metadata_parse_s": round(parse_s, 3),
        "metadata_validate_s": round(validate_s, 3),
        "load_plan_rank_s": round(plan_s, 3),
        "load_plan_reshard_rank_s": round(reshard_s, 3),
        "coord_load_s": round(load.coordinator_seconds, 3),
        "rank_load_recv_bytes_max": max(t.received for t in load_others),
        "coord_load_s3_s": round(s3_load.coordinator_seconds, 3) if s3_load else None,
        "rank_load_s3_recv_bytes_max": max((t.received for t in s3_others), default=None),
        "cached_save_plan_s": round(cached.coordinator_seconds, 3),
        "rank_metadata_read_bytes_max": max(load.metadata_read.values()),
        "rank_metadata_read_s3_bytes_max": max((t.received for t in s3_others), default=None),
        "gc_in_timed_s": round(gc_timed, 3),
    }


COLUMNS = [
    ("ranks", "ranks"), ("unique_pieces", "pieces"), ("coord_save_s", "coord save s"),
    ("coord_save_peak_mib", "peak MiB"), ("coord_save_kernel_s", "of it kernel s"), ("rank_save_recv_bytes_max", "rank recv B"),
    ("rank_save_send_bytes_max", "rank send B"), ("metadata_bytes_per_piece", "md B/piece"),
    ("metadata_parse_s", "parse s"), ("metadata_validate_s", "validate s"), ("load_plan_rank_s", "plan s"),
    ("load_plan_reshard_rank_s", "reshard plan s"), ("coord_load_s", "coord load s"),
    ("rank_load_recv_bytes_max", "load recv B"), ("coord_load_s3_s", "s3 coord load s"),
    ("rank_load_s3_recv_bytes_max", "s3 load recv B"), ("cached_save_plan_s", "cached save s"),
    ("gc_in_timed_s", "gc in timed s"), ("rank_metadata_read_bytes_max", "metadata_read B"),
    ("rank_metadata_read_s3_bytes_max", "s3 metadata_read B"),
]


def main(argv: list | None = None, prog: str = "bench scale") -> int:
    """The suite scale: the table of figures per rank count on stdout."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-70b")
    ap.add_argument("--ranks", default="1024,8192", help="comma-separated rank counts")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--json-out")
    ap.add_argument("--s3-max-ranks", type=int, default=None,
                    help="simulate the object storage load only up to this many ranks (every rank reads its part for real: about 0.1 s per rank); the figures above are then empty")
    args = ap.parse_args(argv)
    limit = args.s3_max_ranks
    results = [measure(args.model, int(r), args.tp, args.pp, s3=limit is None or int(r) <= limit)
               for r in args.ranks.split(",")]
    lines = [f"{args.model}, tp {args.tp}, pp {args.pp}, {os.cpu_count()} cores", " | ".join(t for _, t in COLUMNS)]
    lines += [" | ".join("-" if row[key] is None else str(row[key]) for key, _ in COLUMNS) for row in results]
    emit({"model": args.model, "tp": args.tp, "pp": args.pp, "results": results}, "\n".join(lines), args.json_out)
    return 0

