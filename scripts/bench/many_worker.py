"""One rank of one launch of the suite many (bench/many.py): a state dict of many small
tensors saved or loaded, timed inside the rank, every loaded value checked.

Started by bench/many.py on every rank, under ``python -m paddle.distributed.launch``, with the
arguments the suite io's launch passes (bench/io.py)::

    many_worker.py LIB PHASE TENSORS CHECKPOINT_DIR RESULT_DIR

LIB is "ours" (paddle_dcp) or "paddle" (paddle.distributed's built-in); PHASE is "save" (the
workload in its save layout), "load" (into the same layout) or "reshard" (into the reshard
layout); TENSORS the number of tensors (:func:`build_specs`). The rank builds its state dict,
waits ``PADDLE_DCP_BENCH_SETTLE`` seconds and a barrier, then times its own call
(io_worker's timed call, the garbage collector's share of it measured); after the timed region every loaded value is compared with the
numpy oracle of bench/workload.py. With ``PADDLE_DCP_BENCH_PROFILE=1`` the call runs
under cProfile and its statistics go to ``RESULT_DIR/rank{r}.prof`` (the time is then the
profiled one); with ``PADDLE_DCP_BENCH_STEPS=1`` the steps of STEPS are timed (wrappers, a
microsecond a call) and their seconds and calls reported. The rank writes ``RESULT_DIR/rank{r}.json``; on failure also its error, and it
exits 1.
"""
from __future__ import annotations

import gc
import os
import sys
import time
import traceback

if __package__ in (None, ""):  # run by path: this directory is the package ``bench``
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import io_worker  # noqa: E402  (the library wrapper, the state's build, the timed call, the check)
from bench.workload import TensorSpec  # noqa: E402

PHASES = ("save", "load", "reshard")

# One cycle of ten tensors: what an expert's optimizer states look like at the sizes a
# many-tensor job makes of them (a few KiB each): (suffix, shape, dtype, layout, reshard).
CYCLE = (
    ("w1.moment1", (16, 64), "float32", "S0", "S1"),
    ("w1.moment2", (16, 64), "float32", "S0", "S1"),
    ("w2.moment1", (64, 16), "float32", "S0", "S1"),
    ("w2.moment2", (64, 16), "float32", "S0", "S1"),
    ("w3.moment1", (32, 32), "float32", "S1", "S0"),
    ("w3.moment2", (32, 32), "float32", "S1", "S0"),
    ("w1.weight", (16, 64), "bfloat16", "S0", "S1"),
    ("w2.weight", (64, 16), "bfloat16", "S1", "S0"),
    ("gate.bias", (256,), "float32", "R", "R"),
    ("norm.weight", (32, 64), "bfloat16", "R", "S0"),
)
EXPERTS = 64  # tensors of one "layer" are named layers.{i // (10 * EXPERTS)}.experts.{e}...


def build_specs(n: int) -> list[TensorSpec]:
    """``n`` tensors, the cycle of CYCLE repeated: 8 in 10 sharded over the 1-D mesh (Shard(0)
    or Shard(1), the other dim on reshard), 1 in 10 replicated everywhere, 1 in 10 replicated on
    save and Shard(0) on reshard; 1 to 4 KiB each (about 3.3 KiB on average)."""
    specs = []
    for i in range(n):
        suffix, shape, dtype, layout, reshard = CYCLE[i % len(CYCLE)]
        group = i // len(CYCLE)
        name = f"layers.{group // EXPERTS}.experts.{group % EXPERTS}.{suffix}"
        specs.append(TensorSpec(name, shape, dtype, layout, reshard, i))
    return specs


class GcTime:
    """Python's garbage collections during a ``with`` block: their seconds, and their count
    per generation (a collection lands in whatever code allocates when it is due)."""

    def __enter__(self):
        self.seconds, self.collections, self._start = 0.0, [0, 0, 0], 0.0
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)
        return False


# What --steps times inside paddle_dcp's calls (inclusive: a step's time holds the steps it
# calls): the rank's own steps, and the coordinator's planning, metadata and nesting work;
# json's loads and dumps wherever they are called (the metadata's parse and serialization).
STEPS = (
    "paddle_dcp.parallel.ranks:LocalSaveRank.prepare",
    "paddle_dcp.core.nested:flatten",
    "paddle_dcp.parallel.ranks:LocalSaveRank.describe",
    "paddle_dcp.parallel.placements:held_of",
    "paddle_dcp.parallel.wire:encode_summary",
    "paddle_dcp.parallel.protocol:plan_from_summaries",
    "paddle_dcp.parallel.wire:decode_summary",
    "paddle_dcp.core.save_plan:plan_save",
    "paddle_dcp.parallel.ranks:LocalSaveRank.prepare_id",
    "paddle_dcp.parallel.ranks:LocalSaveRank.write",
    "paddle_dcp.parallel.protocol:metadata_from_reports",
    "paddle_dcp.core.nested:fill_values",
    "paddle_dcp.core.save_plan:build_metadata",
    "paddle_dcp.core.nested:merge",
    "paddle_dcp.parallel.ranks:LocalSaveRank.publish",
    "paddle_dcp.core.metadata:Metadata.to_json",
    "json:dumps",
    "paddle_dcp.parallel.ranks:LocalSaveRank.tidy",
    "paddle_dcp.parallel.ranks:LocalLoadRank.inspect",
    "paddle_dcp.parallel.ranks:LocalLoadRank.read_metadata",
    "paddle_dcp.core.metadata_parse:parse_metadata",
    "json:loads",
    "paddle_dcp.parallel.ranks:LocalLoadRank.plan",
    "paddle_dcp.parallel.loadwork:match_load",
    "paddle_dcp.core.keys:reconcile",
    "paddle_dcp.core.nested:node_paths",
    "paddle_dcp.core.nested:plain_subtrees",
    "paddle_dcp.core.metadata:Metadata.prefetch",
    "paddle_dcp.parallel.loadwork:plan_work",
    "paddle_dcp.core.load_plan:plan_reads",
    "paddle_dcp.parallel.loadwork:LocalLoadWork.open_local",
    "paddle_dcp.parallel.loadwork:LocalLoadWork.verify_local",
    "paddle_dcp.parallel.loadwork:LocalLoadWork.read_local",
    "paddle_dcp.parallel.loadwork:LocalLoadWork.finish",
)


class StepTimes:
    """Seconds and calls of the functions ``STEPS`` names, timed by wrappers put in their place
    (in their class, or in every paddle_dcp module that holds the function)."""

    def __init__(self, names=STEPS):
        import importlib

        self.times = {name: [0.0, 0] for name in names}
        for name in names:
            module_name, _, attr = name.partition(":")
            owner = importlib.import_module(module_name)
            *outer, last = attr.split(".")
            for part in outer:
                owner = getattr(owner, part)
            original = getattr(owner, last)
            timed = self._wrap(original, self.times[name])
            setattr(owner, last, timed)  # a method in its class, a function in its module
            if outer:
                continue
            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("paddle_dcp"):
                    for key, value in list(vars(module).items()):
                        if value is original:
                            setattr(module, key, timed)

    @staticmethod
    def _wrap(fn, cell):
        import functools

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cell[0] += time.perf_counter() - t0
                cell[1] += 1

        return timed

    def report(self) -> dict:
        return {name: {"seconds": s, "calls": c} for name, (s, c) in self.times.items() if c}


def run(lib_name: str, phase: str, n: int, ckpt: str, result_dir: str) -> int:
    started = time.perf_counter()
    lib = io_worker.PaddleLib(lib_name)
    result = {"lib": lib_name, "phase": phase, "tensors": n, "rank": lib.rank, "ranks": lib.ranks, "ok": False,
              "patched_gpu_staging": lib.patched}
    status = 0
    try:
        specs = build_specs(n)
        layout_of = (lambda s: s.reshard) if phase == "reshard" else (lambda s: s.layout)
        sd = io_worker.build_state(lib, specs, layout_of, fill=phase != "save")
        result["build_seconds"] = time.perf_counter() - started
        io_worker.settle(lib)
        if phase != "save":
            io_worker.read_files(ckpt, lib.rank, lib.ranks)
            lib.barrier()
        profile = os.environ.get("PADDLE_DCP_BENCH_PROFILE") == "1"
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        steps = StepTimes() if os.environ.get("PADDLE_DCP_BENCH_STEPS") == "1" and lib_name == "ours" else None
        with GcTime() as collector:
            io_worker.timed_call(lib, phase, sd, ckpt, result)
        result.update(gc_seconds=collector.seconds, gc_collections=collector.collections)
        if steps is not None:
            result["steps"] = steps.report()
        if profile:
            prof.disable()
            prof.dump_stats(os.path.join(result_dir, f"rank{lib.rank}.prof"))
        if phase != "save":
            t1 = time.perf_counter()
            result["checked_bytes"] = io_worker.check_all(lib, sd, specs, layout_of)
            result["check_seconds"] = time.perf_counter() - t1
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - report, then stop this rank
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
        status = 1
    return io_worker.finish(lib, result, result_dir, status, "many_worker")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 5 or argv[0] not in ("ours", "paddle") or argv[1] not in PHASES:
        print(__doc__, file=sys.stderr)
        return 2
    return run(argv[0], argv[1], int(argv[2]), argv[3], argv[4])


if __name__ == "__main__":
    sys.exit(main())
