"""One rank of one launch of the suite tiers (bench/tiers.py): a CheckpointManager's save or
restore, timed inside the rank, the restored values checked.

Started by bench/tiers.py on every rank of a two-"node" job (two launches, each in its own
working directory, so the relative local directories are each node's own)::

    tiers_worker.py PHASE OPTIONS_JSON

PHASE:
  save-local   a manager with a local tier (``replicas`` copies, async) and no global step due:
               steps 1 and 2 timed; then, untimed, step 2 saved again by the managers the
               global-tier restores read (``replicas=0``, every step also to the global tier:
               a directory on disk, and an ``s3://`` URL when given)
  save-async   today's async save: a manager without a local tier, ``async_save=True``
  save-sync    the plain save: a manager without a local tier, ``async_save=False``
  restore      a manager opened on ``directory`` / ``local`` / ``replicas``; its restore of the
               newest step timed, which must be step 2 from a tier expected; every tensor's
               xxh3_64 compared with the oracle's (piece) for this job's own layout

The state: ``size`` bytes of float32, tensors of TENSOR_BYTES (64 MiB) global, Shard(0) on a 1-D
mesh of all ranks (shapes cut for ``layout_ranks``, the saving job's rank count); tensor i at
step s is a ramp over its global rows offset by (i, s), so a restore of another step or of
other rows has other digests, and a job resumed on another rank count has an oracle too. Each rank waits ``settle``
seconds after building its state (see io_worker.SETTLE: a VM returns memory freed seconds
ago to its host), passes a barrier, then times its own call with time.perf_counter. A save's
"blocked" time is the ``save()`` call, its "total" until ``wait()`` returned. The rank writes
``RESULT_DIR/rank{r}.json``; on failure also its error, and it exits 1.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

if __package__ in (None, ""):  # run by path: this directory is the package ``bench``
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench.launch import write_result  # noqa: E402
from bench.units import MiB  # noqa: E402

TENSOR_BYTES = 64 * MiB
COLS = 1024  # float32 elements per row
SENTINEL = -7.0  # what restore targets hold before the call


def layout(size: int, ranks: int) -> list[tuple[str, tuple[int, int]]]:
    """(key, global shape) of every tensor: ``size`` bytes of float32 in tensors of at most
    TENSOR_BYTES, rows a multiple of ``ranks`` (the last tensor takes what is left)."""
    row_bytes = 4 * COLS * ranks  # one row per rank
    rows_total = max(1, size // row_bytes)
    per_tensor = max(1, TENSOR_BYTES // row_bytes)
    out, done, i = [], 0, 0
    while done < rows_total:
        n = min(per_tensor, rows_total - done)
        out.append((f"model.layer{i:03d}.weight", (n * ranks, COLS)))
        done, i = done + n, i + 1
    return out


def piece(index: int, first_row: int, step: int, rows: int) -> np.ndarray:
    """Rows ``first_row`` .. ``first_row + rows`` of tensor ``index`` at ``step`` (``rows`` x
    COLS float32): a ramp over the tensor's global rows, so any layout's pieces have an oracle."""
    ramp = np.arange(first_row * COLS, (first_row + rows) * COLS, dtype=np.float64).reshape(rows, COLS)
    ramp = (ramp * 1e-3).astype(np.float32)
    ramp += np.float32(index * 10 + step * 0.25)
    return ramp


def digest(values: np.ndarray) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(memoryview(np.ascontiguousarray(values)).cast("B"))


class Rank:
    def __init__(self, size: int, layout_ranks: int | None = None):
        """``layout_ranks``: the rank count the tensors' shapes are cut for (the saving job's,
        a multiple of this job's: a job resumed on fewer ranks restores the same shapes)."""
        import paddle
        import paddle.distributed as dist

        self.paddle, self.dist = paddle, dist
        dist.init_parallel_env()
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        self.mesh = dist.ProcessMesh(list(range(self.ranks)), dim_names=["x"])
        self.layout = layout(size, layout_ranks or self.ranks)

    def state(self, step: int | None) -> dict:
        """The state of ``step`` (None: restore targets holding SENTINEL, memory touched)."""
        sd = {}
        for i, (key, shape) in enumerate(self.layout):
            rows = shape[0] // self.ranks
            local = (np.full((rows, COLS), SENTINEL, np.float32) if step is None
                     else piece(i, self.rank * rows, step, rows))
            sd[key] = self.paddle.Tensor(self.paddle.to_tensor(local), dims=list(shape), process_mesh=self.mesh,
                                         placements=[self.dist.Shard(0)])
        return sd

    def digests(self, sd: dict) -> dict:
        return {key: digest(sd[key]._local_value().numpy()) for key, _ in self.layout}

    def share(self) -> int:
        return sum(shape[0] // self.ranks * COLS * 4 for _, shape in self.layout)

    def barrier(self) -> None:
        if self.ranks > 1:  # a job of one rank has no global group to wait on
            self.dist.barrier()


def settle(seconds: float, rank: Rank) -> None:
    time.sleep(seconds)
    rank.barrier()


def timed_saves(rank: Rank, manager, opts: dict, out: dict) -> None:
    """Steps 1 and 2 saved by ``manager``, each after the settle wait and a barrier; their
    blocked and total seconds."""
    for step in (1, 2):
        sd = rank.state(step)
        settle(opts["settle"], rank)
        t0 = time.perf_counter()
        assert manager.save(step, sd)
        t1 = time.perf_counter()
        manager.wait()
        t2 = time.perf_counter()
        out.setdefault("saves", []).append({"step": step, "blocked": t1 - t0, "total": t2 - t0})
        del sd


def run(phase: str, opts: dict, out: dict) -> None:
    import paddle_dcp

    rank = Rank(opts["size"], opts.get("layout_ranks"))
    out.update(rank=rank.rank, ranks=rank.ranks, share_bytes=rank.share(), cwd=os.getcwd())
    if phase == "save-local":
        with paddle_dcp.CheckpointManager(opts["directory"], save_interval_steps=10**9, async_save=True,
                                          local_directory=opts["local"], replicas=opts["replicas"]) as m:
            timed_saves(rank, m, opts, out)
        out["extra_saves"] = {}
        for name, directory, local in opts.get("extra", []):  # untimed for the tables: the global-tier restores' step
            sd = rank.state(2)
            with paddle_dcp.CheckpointManager(directory, save_interval_steps=1, local_directory=local,
                                              replicas=0) as m:
                rank.barrier()
                t0 = time.perf_counter()
                m.save(2, sd)
                m.wait()
                out["extra_saves"][name] = time.perf_counter() - t0
            del sd
    elif phase in ("save-async", "save-sync"):
        with paddle_dcp.CheckpointManager(opts["directory"], async_save=phase == "save-async") as m:
            timed_saves(rank, m, opts, out)
    elif phase == "restore":
        local = opts.get("local")
        kwargs = {} if local is None else {"local_directory": local, "replicas": opts["replicas"]}
        with paddle_dcp.CheckpointManager(opts["directory"], **kwargs) as m:
            sd = rank.state(None)
            settle(opts["settle"], rank)
            t0 = time.perf_counter()
            step = m.restore(sd)
            out["seconds"] = time.perf_counter() - t0
            report = m.last_restore
            out["report"] = {"step": report.step, "tier": report.tier, "bytes": dict(report.bytes),
                             "refused": [list(r) for r in report.refused]}
            if step != opts["step"] or report.tier not in opts["tiers"]:
                raise RuntimeError(f"restored step {step} from the {report.tier} tier; expected step "
                                   f"{opts['step']} from the {' or '.join(opts['tiers'])} tier ({out['report']})")
            expected = rank.digests(rank.state(step))  # the oracle of this job's own layout
            got = rank.digests(sd)
            wrong = sorted(k for k in expected if got.get(k) != expected[k])
            if wrong or set(got) != set(expected):
                raise RuntimeError(f"restored values differ from the saved ones in {len(wrong)} tensors: {wrong[:3]}")
            out["checked_bytes"] = rank.share()
    else:
        raise ValueError(f"unknown phase {phase!r}")
    rank.barrier()


def main() -> None:
    phase, opts = sys.argv[1], json.loads(sys.argv[2])
    out: dict = {"phase": phase, "ok": False}
    rank_id = int(os.environ.get("PADDLE_TRAINER_ID", os.environ.get("PADDLE_GLOBAL_RANK", "0")))
    code = 0
    try:
        run(phase, opts, out)
        out["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then exit 1
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        code = 1
    write_result(opts["results"], out.get("rank", rank_id), out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # paddle's interpreter teardown skipped (tests/multirank/scripts/common.py)


if __name__ == "__main__":
    main()
