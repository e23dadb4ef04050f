"""The suite layouts: a tensor saved in pieces that no grid describes (issue 38, point 2): the
time to verify its checkpoint, to read and check its metadata, and to load it, per piece count.

For every count of ``--pieces`` this writes, in a temporary directory, a real checkpoint of one
float32 tensor ``bricks`` laid out as staggered bricks (:func:`staggered`: a (rows, 2 * cols)
matrix, every row cut into pieces of width 2, the odd rows shifted by one element, so no two
neighbouring rows share a cut). A save from placements only makes grids, so the checkpoint is
written with the library's own parts (:func:`write_checkpoint`): its data files by
``io.datafile``'s writer (the block checksums, each piece with its own seed), its metadata by
``core.metafile.encode`` and committed by ``io.storage.commit_metadata``, as a save's
coordinator does. The values are the float32 arange of the global shape.

Then, in this process, each timed apart (best and median of ``--repeat``, wall and CPU time,
and the seconds Python's garbage collector took inside the best call):

- verify: ``paddle_dcp.tools.verify.verify_checkpoint``, what ``python -m paddle_dcp verify DIR``
  runs (in-process: the import and the command line's parsing are outside the time); any
  problem fails the run;
- metadata: ``paddle_dcp.read_metadata(DIR)`` and ``Metadata.validate()``: the file read,
  parsed and every entry checked, its pieces' tiling included (core.boxes.check_tiling);
- load: ``paddle_dcp.load_state_dict({"bricks": target}, DIR)`` into a numpy array (one
  process, no launcher), every value then compared with the numpy oracle: a wrong one fails
  the run.

``--layout guillotine`` writes instead a 3-dim cube cut at random (:func:`guillotine`), a layout
no split of its dims into leading and trailing ones decides: the tiling check counts corners.

The summary gives, per measure, the ratio of the time per piece at the largest count to that at
the smallest (and of the CPU time): about 1 when the cost is linear in the number of pieces.
A call over ``--timeout`` seconds is stopped (SIGALRM) and reported as "over N s"; that
measure is not run at larger counts. ``--library PATH`` measures the paddle_dcp of another
checkout (e.g. an older commit's worktree) with this suite.

    .venv/bin/python scripts/bench layouts --pieces 1k,4k,16k,64k --json-out layouts.json

Smoke run (seconds): ``--pieces 1k,4k --repeat 1``. Prints the table and the ratios, then one
JSON line on stdout.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from bench import REPO
from bench.machine import describe, machine_info
from bench.report import emit, log
from bench.units import human, parse_counts

KEY = "bricks"
DTYPE = "float32"
MEASURES = ("verify", "metadata", "load")
VERIFY_HOW = "in-process: paddle_dcp.tools.verify.verify_checkpoint (the import and argument parsing not timed)"


def staggered(rows: int, cols: int) -> tuple[tuple[int, int], np.ndarray, np.ndarray]:
    """A (rows, 2 * cols) matrix tiled like bricks: every row cut into pieces of width 2, the
    odd rows shifted by one element (a half brick at each end, so cols + 1 pieces); the global
    shape, and the pieces' offsets and shapes ((p, 2) int64, in elements, row by row)."""
    width = 2 * cols
    offsets, shapes = [], []
    for r in range(rows):
        if r % 2 == 0:
            cuts = np.arange(0, width + 1, 2)
        else:
            cuts = np.concatenate([[0], np.arange(1, width, 2), [width]])
        n = len(cuts) - 1
        offsets.append(np.column_stack([np.full(n, r), cuts[:-1]]))
        shapes.append(np.column_stack([np.ones(n, np.int64), np.diff(cuts)]))
    return (rows, width), np.concatenate(offsets).astype(np.int64), np.concatenate(shapes).astype(np.int64)


def bricks_for(pieces: int, rows: int) -> tuple[int, int]:
    """(rows, cols) of the staggered layout of the fewest pieces, at least ``pieces``, in
    ``rows`` rows (rows * cols + rows // 2 pieces: 16k in 2 rows is 16,001)."""
    rows = max(1, min(rows, pieces))
    return rows, max(1, -(-(pieces - rows // 2) // rows))


def guillotine(pieces: int, seed: int = 0, side: int | None = None) -> tuple[tuple[int, int, int], np.ndarray, np.ndarray]:
    """A cube (of ``side`` elements a side; default about 8 elements a piece) cut into
    ``pieces`` boxes: each cut halves a random box (of two elements or more in the dim) at a
    random place in a random dim. Its intervals
    nest and overlap in every dim, so no choice of leading dims splits it into disjoint
    trailing boxes (core.boxes.first_overlap_nd is undecided): what a crafted 3-dim file can
    hold. The global shape, the pieces' offsets and shapes."""
    rng = np.random.default_rng(seed)
    side = side or max(2, round((8 * pieces) ** (1 / 3)))
    lo, hi = [[0, 0, 0]], [[side] * 3]
    while len(lo) < pieces:
        i, d = int(rng.integers(len(lo))), int(rng.integers(3))
        if hi[i][d] - lo[i][d] < 2:
            continue
        at = int(rng.integers(lo[i][d] + 1, hi[i][d]))
        lo.append(list(lo[i]))
        hi.append(list(hi[i]))
        hi[i][d] = lo[-1][d] = at
    offsets = np.array(lo, np.int64)
    return (side,) * 3, offsets, np.array(hi, np.int64) - offsets


LAYOUTS = ("staggered", "guillotine")


def layout_for(kind: str, pieces: int, rows: int) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """The layout ``kind`` of (at least) ``pieces`` pieces: its shape, offsets and shapes."""
    if kind == "guillotine":
        return guillotine(pieces)
    return staggered(*bricks_for(pieces, rows))


def oracle(shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's values: the float32 arange of its global shape (exact up to 2**24 elements)."""
    return np.arange(math.prod(shape), dtype=np.float32).reshape(shape)


@dataclass(frozen=True)
class Built:
    """A checkpoint :func:`write_checkpoint` wrote."""

    path: str
    unique_id: int
    shape: tuple[int, ...]  # the tensor's, in elements
    pieces: int
    files: int
    data_bytes: int  # of all data files
    metadata_bytes: int  # of the metadata file


def write_checkpoint(path: str, layout: tuple, files: int = 1, unique_id: int = 0,
                     block_bytes: int | None = None) -> Built:
    """Write into ``path`` a checkpoint of the one tensor ``bricks`` (:func:`oracle`'s values)
    in ``layout`` (shape, offsets, shapes: :func:`layout_for`): its pieces in ``files`` data
    files (consecutive runs of pieces, as ranks hold them), written by the library's data file
    writer, then its metadata, encoded and committed as a save's coordinator does."""
    from paddle_dcp.core import checksums, metafile
    from paddle_dcp.core.metadata import DEFAULT_BLOCK_BYTES, FileEntry, Metadata, PieceTable, TensorEntry
    from paddle_dcp.core.naming import data_file_name
    from paddle_dcp.io import datafile, open_storage, storage

    block_bytes = block_bytes or DEFAULT_BLOCK_BYTES
    shape, offsets, shapes = layout
    p = len(offsets)
    files = max(1, min(files, p))
    values = oracle(shape)
    owner = np.arange(p, dtype=np.int64) * files // p  # each file a run of consecutive pieces
    byte_offsets = np.zeros(p, np.int64)
    sums: list[int] = []
    entries = []
    os.makedirs(path, exist_ok=True)
    store = open_storage(path)
    for f in range(files):
        name = data_file_name(f, unique_id)
        writer = datafile.data_writer(store, name, block_bytes)
        for i in np.flatnonzero(owner == f).tolist():
            at, extent = tuple(offsets[i].tolist()), tuple(shapes[i].tolist())
            region = values[tuple(slice(a, a + n) for a, n in zip(at, extent))]
            piece = np.ascontiguousarray(region).reshape(-1).view(np.uint8)
            seed = checksums.piece_seed(KEY, DTYPE, at, extent)
            sums += writer.write(memoryview(piece), keep=piece, seed=seed)
            byte_offsets[i] = writer.offset - piece.nbytes  # the writer aligned its start
        entries.append(FileEntry(name, writer.commit()))
    table = PieceTable(offsets=offsets, shapes=shapes, files=owner, byte_offsets=byte_offsets,
                       checksums=np.array(sums, dtype=np.uint64))
    meta = Metadata(
        unique_id=unique_id, world_size=files, files=tuple(entries),
        tensors={KEY: TensorEntry(KEY, DTYPE, shape, table, block_bytes)},
        structure={"d": [[KEY, {"t": 0}]]}, block_bytes=block_bytes, created_by="scripts/bench layouts",
    )
    data = metafile.encode(meta)
    storage.commit_metadata(store, unique_id, data)
    return Built(path, unique_id, shape, p, files, sum(e.nbytes for e in entries), len(data))


# ---------------------------------------------------------------------------- the measures
def run_verify(built: Built) -> None:
    from paddle_dcp.tools.verify import verify_checkpoint

    problems, counts = verify_checkpoint(built.path, built.unique_id)
    if problems or counts["pieces"] != built.pieces:
        raise RuntimeError(f"verify: {counts}; problems: {problems[:3]}")


def run_metadata(built: Built) -> None:
    import paddle_dcp

    meta = paddle_dcp.read_metadata(built.path, built.unique_id).validate()
    if meta.tensors[KEY].pieces.count != built.pieces:
        raise RuntimeError(f"metadata lists {meta.tensors[KEY].pieces.count} pieces, not {built.pieces}")


def run_load(built: Built, target: np.ndarray) -> None:
    import paddle_dcp

    paddle_dcp.load_state_dict({KEY: target}, built.path, unique_id=built.unique_id)


def check_loaded(target: np.ndarray, shape: tuple[int, ...]) -> None:
    """Every loaded value equals the oracle's (the target was NaN before the load)."""
    expected = oracle(shape)
    if not np.array_equal(target, expected):
        wrong = np.argwhere(target != expected)
        raise RuntimeError(f"load: {len(wrong)} wrong values, the first at {tuple(wrong[0].tolist())}: "
                           f"{target[tuple(wrong[0])]} instead of {expected[tuple(wrong[0])]}")


class Overtime(BaseException):
    """A timed call ran past --timeout (a BaseException: no ``except Exception`` of the
    library takes it for its own error)."""


def timed(call, timeout: float) -> tuple[float, float, float]:
    """(wall, CPU, garbage collector) seconds of ``call()``: time.perf_counter, time.process_time
    (every thread of this process), and the collections inside the call (gc.callbacks); raises
    Overtime after ``timeout`` seconds (0: none)."""

    def expire(signum, frame):
        raise Overtime()

    collecting = [0.0, 0.0]  # seconds so far, start of the collection under way

    def count(phase, info):
        if phase == "start":
            collecting[1] = time.perf_counter()
        else:
            collecting[0] += time.perf_counter() - collecting[1]

    gc.collect()
    old = signal.signal(signal.SIGALRM, expire) if timeout else None
    gc.callbacks.append(count)
    try:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        w0, c0 = time.perf_counter(), time.process_time()
        call()
        wall = time.perf_counter() - w0
        if timeout and wall > timeout:  # the alarm came in a gc callback, which swallows what it raises
            raise Overtime()
        return wall, time.process_time() - c0, collecting[0]
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        gc.callbacks.remove(count)


def measure_one(measure: str, built: Built, timeout: float) -> dict:
    """One timed call of ``measure`` on ``built``, its result checked; its record."""
    target = np.full(built.shape, np.nan, dtype=np.float32) if measure == "load" else None
    call = {"verify": lambda: run_verify(built), "metadata": lambda: run_metadata(built),
            "load": lambda: run_load(built, target)}[measure]
    out = {"measure": measure, "pieces": built.pieces, "ok": False, "over": False, "error": None,
           "seconds": None, "cpu_seconds": None, "gc_seconds": None}
    try:
        out["seconds"], out["cpu_seconds"], out["gc_seconds"] = timed(call, timeout)
        if target is not None:
            check_loaded(target, built.shape)
        out["ok"] = True
    except Overtime:
        out["over"], out["error"] = True, f"over {timeout:g} s"
    except Exception as exc:  # a failed measure is reported, the others still run
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# ---------------------------------------------------------------------------- the run
def summarize(runs: list[dict]) -> dict:
    """Per (measure, pieces): best and median wall and CPU seconds of its good runs (or
    "over"), the garbage collector's seconds inside the best run, and per measure the ratio of the best time per piece at the largest count
    measured to that at the smallest (None with fewer than two)."""
    table = []
    for measure in MEASURES:
        for n in sorted({r["pieces"] for r in runs if r["measure"] == measure}):
            mine = [r for r in runs if (r["measure"], r["pieces"]) == (measure, n)]
            good = [r for r in mine if r["ok"]]
            over = next((r["error"] for r in mine if r["over"]), None)
            row = {"measure": measure, "pieces": n, "runs": len(good), "over": over}
            if good:
                wall, cpu = [r["seconds"] for r in good], [r["cpu_seconds"] for r in good]
                best = min(good, key=lambda r: r["seconds"])
                row.update(best=min(wall), median=statistics.median(wall), cpu_best=min(cpu), cpu_median=statistics.median(cpu),
                           us_per_piece=min(wall) / n * 1e6, cpu_us_per_piece=min(cpu) / n * 1e6,
                           gc_seconds=best.get("gc_seconds") or 0.0)
            table.append(row)
    ratios = {}
    for measure in MEASURES:
        rows = [e for e in table if e["measure"] == measure and "best" in e]
        lo, hi = (rows[0], rows[-1]) if rows else (None, None)
        ratios[measure] = (
            {"from": lo["pieces"], "to": hi["pieces"], "ratio": hi["us_per_piece"] / lo["us_per_piece"],
             "cpu_ratio": hi["cpu_us_per_piece"] / max(lo["cpu_us_per_piece"], 1e-9)}
            if len(rows) > 1 else None
        )
    return {"table": table, "ratios": ratios}


def format_report(res: dict) -> str:
    lib = res["library"]
    lines = [f"A {res['args']['layout']} (non-grid) layout of one float32 tensor: {', '.join(MEASURES)}; "
             f"best and median of {res['args']['repeat']}, wall and CPU seconds",
             f"library: paddle_dcp from {lib['path']} (commit {res['machine'].get('paddle_dcp_commit') or '?'})",
             describe(res["machine"]), "",
             "| measure | pieces | shape | best (s) | median (s) | CPU best (s) | CPU median (s) | µs per piece "
             "| CPU µs per piece | of best, garbage collector (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    shapes = {b["pieces"]: b["shape"] for b in res["built"]}
    for e in res["summary"]["table"]:
        shape = "x".join(map(str, shapes.get(e["pieces"], ())))
        if "best" in e:
            lines.append(f"| {e['measure']} | {e['pieces']:,} | {shape} | {e['best']:.4f} | {e['median']:.4f} | "
                         f"{e['cpu_best']:.4f} | {e['cpu_median']:.4f} | {e['us_per_piece']:.2f} | {e['cpu_us_per_piece']:.2f} | {e['gc_seconds']:.3f} |")
        else:
            lines.append(f"| {e['measure']} | {e['pieces']:,} | {shape} | {e['over'] or 'failed'} | | | | | | |")
    lines.append("")
    for name, r in res["summary"]["ratios"].items():
        if r is not None:
            lines.append(f"{name}: time per piece at {r['to']:,} / at {r['from']:,} pieces = {r['ratio']:.2f} "
                         f"(CPU time: {r['cpu_ratio']:.2f})")
    for run in res["runs"]:
        if not run["ok"] and not run["over"]:
            lines.append(f"FAILED {run['measure']} at {run['pieces']:,} pieces: {run['error']}")
    lines.extend(res["notes"])
    return "\n".join(lines)


def run_benchmark(args: argparse.Namespace, library: str) -> dict:
    counts = parse_counts(args.pieces, "piece count", "1k,4k,16k,64k")
    measures = [x.strip() for x in args.measures.split(",") if x.strip()]
    for m in measures:
        if m not in MEASURES:
            raise ValueError(f"unknown measure {m!r}; choose from {', '.join(MEASURES)}")
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="paddle_dcp_layouts.", dir=args.workdir or None)
    info = machine_info(root, library)
    notes = [f"verify measured {VERIFY_HOW}",
             "each measure ran once untimed first, on 65 pieces (the imports it does on first use, paddle's by the load)",
             "the data files were just written: their reads come from the page cache"]
    log(f"workdir {root}; layout {args.layout}; pieces {counts}; rows {args.rows}; files {args.files}; "
        f"repeat {args.repeat}; library {library}")
    runs: list[dict] = []
    built_all: list[dict] = []
    stopped: dict[str, int] = {}  # measure -> the count it went over --timeout at
    try:
        warm = write_checkpoint(os.path.join(root, "warmup"), layout_for(args.layout, 64, args.rows), args.files)
        for m in measures:
            run = measure_one(m, warm, args.timeout)
            if not run["ok"]:
                raise RuntimeError(f"{m} of the warm-up checkpoint failed: {run['error']}")
        for n in counts:
            t0 = time.perf_counter()
            built = write_checkpoint(os.path.join(root, f"p{n}"), layout_for(args.layout, n, args.rows), args.files)
            build_s = time.perf_counter() - t0
            built_all.append({"asked": n, "pieces": built.pieces, "shape": built.shape, "files": built.files,
                              "data_bytes": built.data_bytes, "metadata_bytes": built.metadata_bytes, "build_seconds": build_s})
            log(f"{built.pieces:>7,} pieces ({'x'.join(map(str, built.shape))}): written in {build_s:.2f} s, data "
                f"{human(built.data_bytes)} in {built.files} files, metadata {human(built.metadata_bytes)}")
            for rep in range(args.repeat):
                for m in measures:
                    if m in stopped:
                        if rep == 0 and stopped[m] != built.pieces:
                            notes.append(f"{m} not run at {built.pieces:,} pieces: over --timeout at {stopped[m]:,}")
                        continue
                    run = measure_one(m, built, args.timeout)
                    run["repeat"] = rep
                    runs.append(run)
                    if run["ok"]:
                        what = (f"{run['seconds']:.4f} s (CPU {run['cpu_seconds']:.4f} s, "
                                f"garbage collector {run['gc_seconds']:.4f} s)")
                    else:
                        what = run["error"] if run["over"] else f"FAILED: {run['error']}"
                    log(f"[{rep + 1}/{args.repeat}] {built.pieces:>7,} pieces {m:8s}: {what}")
                    if run["over"]:
                        stopped[m] = built.pieces
            if not args.keep:
                shutil.rmtree(built.path, ignore_errors=True)
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return {"machine": info, "args": vars(args), "library": {"path": library, "verify": VERIFY_HOW},
            "built": built_all, "runs": runs, "summary": summarize(runs), "notes": notes}


def use_library(path: str | None) -> str:
    """Import paddle_dcp from the checkout ``path`` (default: this one); the directory it was
    imported from.

    Raises:
        ValueError: it came from elsewhere (imported before, or no paddle_dcp in ``path``).
    """
    want = os.path.realpath(path or REPO)
    if "paddle_dcp" not in sys.modules:
        sys.path.insert(0, want)
    import paddle_dcp

    found = os.path.dirname(os.path.dirname(os.path.realpath(paddle_dcp.__file__)))
    if found != want:
        raise ValueError(f"paddle_dcp was imported from {found}, not {want}")
    return found


def main(argv: list | None = None, prog: str = "bench layouts") -> int:
    """The suite layouts: the table on stdout; 1 when a run failed (a call over --timeout is
    reported, not a failure)."""
    p = argparse.ArgumentParser(prog=prog, description="A non-grid (staggered) layout: verify, metadata and load "
                                "time per piece count.", epilog="Smoke run: scripts/bench layouts --pieces 1k,4k --repeat 1")
    p.add_argument("--pieces", default="1k,4k,16k,64k", help="piece counts, k = 1000 (default 1k,4k,16k,64k)")
    p.add_argument("--layout", default="staggered", choices=LAYOUTS,
                   help="staggered: 2-dim bricks (default); guillotine: a 3-dim cube cut at random, "
                        "which no split of its dims decides")
    p.add_argument("--rows", type=int, default=2,
                   help="rows of the brick layout (default 2: pieces per row grow with the count, as in issue 38)")
    p.add_argument("--files", type=int, default=4, help="data files the pieces are spread over (default 4)")
    p.add_argument("--measures", default=",".join(MEASURES), help=f"subset of {','.join(MEASURES)} (default all)")
    p.add_argument("--repeat", type=int, default=3, help="timed calls of each measure; best and median (default 3)")
    p.add_argument("--timeout", type=float, default=120,
                   help="seconds a call may take before it is stopped and reported as over (default 120; 0: none)")
    p.add_argument("--library", default=None,
                   help="the paddle_dcp checkout to measure (default: this one), e.g. an older commit's worktree")
    p.add_argument("--workdir", default=None, help="where the temporary directory goes (default: /tmp)")
    p.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (the checkpoints)")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.rows < 1 or args.files < 1:
        p.error("--repeat, --rows and --files must be at least 1")
    try:
        library = use_library(args.library)
        res = run_benchmark(args, library)
    except ValueError as exc:
        p.error(str(exc))
    emit(res, format_report(res), args.json_out)
    return 0 if res["runs"] and all(r["ok"] or r["over"] for r in res["runs"]) else 1
