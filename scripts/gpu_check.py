"""One command that checks paddle_dcp on this machine's GPUs: ``python scripts/gpu_check.py``.

Needs ``paddlepaddle-gpu`` (3.3.1, from Paddle's own package index, see README.md) and at least
one visible GPU. It launches what it needs itself: for 1 GPU one worker process, for 2 GPUs
``python -m paddle.distributed.launch`` with 2 ranks (NCCL). Each case builds its tensors from
positions, derives from the placements with numpy what every rank must hold, and compares
exactly; it prints one line per case and number of GPUs::

    PASS <case> gpus=<n> time=<seconds>s peak_gpu=<MiB>MiB peak_pinned=<MiB>MiB
    FAIL <case> gpus=<n> time=<seconds>s peak_gpu=<MiB>MiB peak_pinned=<MiB>MiB rank <r>: <reason>

Cases: ``save_load`` (dist tensors sharded over a ProcessMesh with Shard / Replicate, loaded
into another layout), ``async_in_a_row`` (three ``async_save=True`` saves of changing values,
each loaded back), ``offload_into_model`` (a paddle.nn model's state dict loaded into a fresh
model with ``offload=True`` and ``offload=False``: its own parameters hold the values, on their
own place), ``nodelocal`` (2 GPUs only: every rank saves into a directory of its own, then a
load into another layout moves bytes between ranks) and ``manager`` (a CheckpointManager with
retention, then a restore of the latest step).

Options: ``--gpus 1,2`` (default both; with one visible GPU the 2-GPU run is skipped with a
``SKIP`` line), ``--keep DIR`` (checkpoints and logs go to DIR and stay; otherwise a temporary
directory, removed when every case passed), ``--timeout SECONDS`` (per launch; its process
group, and the workers it started, are killed after it), ``--cases a,b`` (a subset),
``--size-mib MIB`` (the large int32 tensor of save_load, async_in_a_row and nodelocal; default
16).

Exit code: 0 every case passed, 1 a case failed, 2 no GPU (or a usage error).

Peak memory, per case and rank (the largest rank is printed), since a reset at the case's start:

- ``peak_gpu``: ``paddle.device.cuda.max_memory_allocated()``, reset with
  ``paddle.device.cuda.reset_max_memory_allocated()``.
- ``peak_pinned``: paddle 3.3.1 has no counter of pinned memory alone.
  ``paddle.device.cuda.max_pinned_memory_allocated()`` is used when paddle has it (newer
  versions); else ``paddle.base.core.host_memory_stat_peak_value("Allocated", 0)`` (reset with
  ``host_memory_stat_reset_peak_value``): paddle's allocator counts pinned host memory
  (``CUDAPinnedPlace``) and its ordinary CPU tensors there together, so on 3.3.1 the number is
  an upper bound of the pinned memory (it includes, e.g., the pageable host buffers a load
  assembles its pieces in).

Without a GPU, ``PADDLE_DCP_GPU_CHECK_ALLOW_CPU=1`` runs the same cases on the CPU (``gpus=N``
then counts CPU processes, gloo instead of NCCL; peak memory is printed as ``n/a``): that is
how the test suite runs this script. ``PADDLE_DCP_GPU_CHECK_CORRUPT=<case>`` flips one expected
value of that case, so that its comparison must fail (a test of the FAIL path).

Every paddle call goes through a ``paddle.``-qualified name looked up at call time, so a test
harness that patches paddle's device and memory calls sees its patches used.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from bench.launch import kill_started  # scripts/ is this script's directory: the one way a launch is ended

if TYPE_CHECKING:  # elsewhere paddle is imported, and its calls looked up, where they are used
    import paddle

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
ALLOW_CPU_ENV = "PADDLE_DCP_GPU_CHECK_ALLOW_CPU"
CORRUPT_ENV = "PADDLE_DCP_GPU_CHECK_CORRUPT"
CASES = ("save_load", "async_in_a_row", "offload_into_model", "nodelocal", "manager")
TWO_RANKS_ONLY = frozenset({"nodelocal"})
INSTALL = ("python -m pip install paddlepaddle-gpu==3.3.1 "
           "-i https://www.paddlepaddle.org.cn/packages/stable/cu126/")
MIB = float(1 << 20)
TAIL_LINES = 40
BIG_COLS = 1024  # the large tensor of a case: int32, (rows, BIG_COLS), --size-mib MiB


# =============================================================================== the oracle
def global_array(shape: tuple, dtype: str = "float32", offset: int = 0) -> np.ndarray:
    """The whole tensor, its values from positions (exact in every dtype used here)."""
    return (np.arange(math.prod(shape), dtype=np.int64).reshape(shape) + offset).astype(dtype)


def local_box(shape: tuple, ranks: list, placement: tuple, rank: int) -> tuple | None:
    """The slice of the global tensor ``rank`` holds on the 1-D mesh ``ranks`` under
    ``placement`` (``("S", dim)`` or ``("R",)``); None when the rank is not in the mesh.
    Shard(d) cuts dim d in chunks of ceil(n / k), in mesh order, as paddle does."""
    if rank not in ranks:
        return None
    box = [slice(0, n) for n in shape]
    if placement[0] == "S":
        dim, pos = placement[1], ranks.index(rank)
        step = -(-shape[dim] // len(ranks))
        lo = min(pos * step, shape[dim])
        box[dim] = slice(lo, min(lo + step, shape[dim]))
    return tuple(box)


class Oracle:
    """Exact comparisons; flips one expected value of the case named by CORRUPT_ENV."""

    def __init__(self, corrupt: str | None) -> None:
        self.corrupt, self.flipped = corrupt, False
        self.case: str | None = None

    def start(self, case: str) -> None:
        self.case, self.flipped = case, False

    def expect(self, what: str, got: np.ndarray, want: np.ndarray) -> None:
        want = np.array(want, copy=True)
        if self.corrupt == self.case and not self.flipped and want.size:
            want.flat[0] = want.flat[0] + 1  # PADDLE_DCP_GPU_CHECK_CORRUPT: must be caught
            self.flipped = True
        if got.dtype != want.dtype or got.shape != want.shape:
            raise AssertionError(f"{what}: got {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        if bad.size:
            i = int(bad[0])
            raise AssertionError(f"{what}: {bad.size} of {want.size} values differ, first at flat index {i}: "
                                 f"got {got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r}")

    def value(self, what: str, got: object, want: object) -> None:
        if got != want:
            raise AssertionError(f"{what}: got {got!r}, expected {want!r}")


# =============================================================================== worker side
class Worker:
    """One rank of the check: its rank, the world, where it works, how it reports."""

    def __init__(self, device: str, root: Path, oracle: Oracle, size_mib: float) -> None:
        import paddle.distributed as dist

        self.device, self.root, self.oracle = device, root, oracle
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ranks = list(range(self.world))
        rows = max(2 * self.world, int(size_mib * MIB) // (4 * BIG_COLS))
        self.big = (rows - rows % (2 * self.world), BIG_COLS)  # int32: --size-mib MiB
        self.results = root / f"results.rank{self.rank}.jsonl"

    def tensor(self, gl: np.ndarray, ranks: list, placement: tuple) -> "paddle.Tensor":
        """A dist tensor holding ``gl`` on the 1-D mesh ``ranks`` (paddle slices it)."""
        import paddle
        import paddle.distributed as dist

        mesh = dist.ProcessMesh(list(ranks), dim_names=["x"])
        spec = dist.Shard(placement[1]) if placement[0] == "S" else dist.Replicate()
        return dist.shard_tensor(paddle.to_tensor(gl), mesh, [spec])

    def check(self, what: str, tensor: "paddle.Tensor", gl: np.ndarray, ranks: list, placement: tuple) -> None:
        """This rank's local value of ``tensor`` equals its slice of ``gl``."""
        box = local_box(gl.shape, ranks, placement, self.rank)
        if box is None:
            return
        local = tensor._local_value() if tensor.is_dist() else tensor
        self.oracle.expect(f"{what} (rank {self.rank}, {placement})", local.numpy(), gl[box])

    def barrier(self) -> None:
        import paddle.distributed as dist

        if self.world > 1:
            dist.barrier()


def case_save_load(w: Worker) -> None:
    """Shard(0) / Replicate / Shard(1) saved, loaded into other placements on the reversed mesh."""
    import paddle_dcp

    back = w.ranks[::-1]
    arrays = {"w": global_array((8, 6)), "b": global_array((6,), offset=1000),
              "i": global_array((4, 4), "int64", offset=2000), "big": global_array(w.big, "int32", 3000)}
    saved = {"w": ("S", 0), "b": ("R",), "i": ("S", 1), "big": ("S", 0)}
    loaded = {"w": ("S", 1), "b": ("S", 0), "i": ("R",), "big": ("S", 1)}
    state = {k: w.tensor(a, w.ranks, saved[k]) for k, a in arrays.items()}
    state["step"] = 7
    paddle_dcp.save_state_dict(state, str(w.root / "save_load"))
    target = {k: w.tensor(np.zeros_like(a), back, loaded[k]) for k, a in arrays.items()}
    target["step"] = 0
    paddle_dcp.load_state_dict(target, str(w.root / "save_load"))
    for key, gl in arrays.items():
        w.check(key, target[key], gl, back, loaded[key])
    w.oracle.value("step", target["step"], 7)


def case_async_in_a_row(w: Worker) -> None:
    """Three async saves in a row, the tensor changing right after each call; each checkpoint
    holds the values at its call, loaded into Shard(1) on the reversed mesh."""
    import paddle
    import paddle_dcp

    path, gl, back = str(w.root / "async"), global_array(w.big, "int32"), w.ranks[::-1]
    tensor = w.tensor(gl, w.ranks, ("S", 0))
    handles = []
    for k in (1, 2, 3):
        tensor.add_(paddle.full(list(w.big), 100, dtype="int32"))  # now gl + 100 * k
        handles.append(paddle_dcp.save_state_dict({"w": tensor, "step": k}, path, async_save=True))
    tensor.add_(paddle.full(list(w.big), 100, dtype="int32"))  # while the last one may be writing
    ids = [h.wait() for h in handles]
    paddle_dcp.wait_async_save()
    w.oracle.value("checkpoint ids", ids, [0, 1, 2])
    for k, uid in zip((1, 2, 3), ids):
        target = {"w": w.tensor(np.zeros_like(gl), back, ("S", 1)), "step": 0}
        paddle_dcp.load_state_dict(target, path, unique_id=uid)
        w.check(f"checkpoint {uid}: w", target["w"], gl + 100 * k, back, ("S", 1))
        w.oracle.value(f"checkpoint {uid}: step", target["step"], k)


def _model() -> "paddle.nn.Layer":
    """A small model: Linear(8, 16), ReLU, Linear(16, 4)."""
    import paddle

    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))


def case_offload_into_model(w: Worker) -> None:
    """A model's state dict, saved; a fresh model loaded with offload=True, then offload=False:
    its own parameters hold the values afterwards, each still on its own place."""
    import paddle_dcp

    path, model = str(w.root / "offload"), _model()
    want = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        want[name] = global_array(tuple(p.shape), offset=1000 * i)
        p.set_value(want[name])
    paddle_dcp.save_state_dict(model.state_dict(), path)
    for offload in (True, False):
        fresh = _model()
        for p in fresh.parameters():
            p.set_value(np.zeros(p.shape, dtype="float32"))
        places = {name: str(p.place) for name, p in fresh.named_parameters()}
        paddle_dcp.load_state_dict(fresh.state_dict(), path, offload=offload)
        for name, p in fresh.named_parameters():
            w.oracle.value(f"offload={offload}: place of {name}", str(p.place), places[name])
            w.oracle.expect(f"offload={offload}: parameter {name} (rank {w.rank})", p.numpy(), want[name])


def case_nodelocal(w: Worker) -> None:
    """Every rank saves into a working directory of its own (node-local disks: the same
    relative path "ck", no rank sees another's files), then loads into Shard(1) on the
    reversed mesh: each rank needs rows only the other ranks' files hold."""
    import paddle_dcp

    mine, back = w.root / "nodelocal" / f"rank{w.rank}", w.ranks[::-1]
    mine.mkdir(parents=True, exist_ok=True)
    gl, bias = global_array(w.big, "int32"), global_array((6,), offset=1000)
    before = os.getcwd()
    os.chdir(mine)
    try:
        state = {"w": w.tensor(gl, w.ranks, ("S", 0)), "b": w.tensor(bias, w.ranks, ("R",)), "step": 3}
        paddle_dcp.save_state_dict(state, "ck")
        w.barrier()
        files = sorted(os.listdir("ck"))
        data = [f for f in files if f.endswith(".distcp")]
        w.oracle.value(f"rank {w.rank}'s data files", [f.split("_")[0] for f in data], [str(w.rank)])
        w.oracle.value(f"metadata on rank {w.rank}", "0.metadata" in files, w.rank == 0)
        target = {"w": w.tensor(np.zeros_like(gl), back, ("S", 1)),
                  "b": w.tensor(np.zeros_like(bias), back, ("S", 0)), "step": 0}
        paddle_dcp.load_state_dict(target, "ck")
        w.check("w", target["w"], gl, back, ("S", 1))
        w.check("b", target["b"], bias, back, ("S", 0))
        w.oracle.value("step", target["step"], 3)
    finally:
        os.chdir(before)


def case_manager(w: Worker) -> None:
    """A CheckpointManager (async saves, keep 2) saves steps 1-4; a new one restores the latest
    into another layout."""
    import paddle
    import paddle_dcp

    path, gl, back = w.root / "manager", global_array((8, 6)), w.ranks[::-1]
    tensor = w.tensor(gl, w.ranks, ("S", 0))
    with paddle_dcp.CheckpointManager(str(path), max_to_keep=2, async_save=True) as manager:
        for step in (1, 2, 3, 4):
            tensor.add_(paddle.full([8, 6], 10.0, dtype="float32"))  # gl + 10 * step
            manager.save(step, {"w": tensor, "step": step})
        manager.wait()
        w.oracle.value("kept steps", manager.all_steps(), [3, 4])
    w.barrier()
    left = sorted(f for f in os.listdir(path) if f.split(".")[0].split("_")[-1] in ("1", "2"))
    w.oracle.value("files of the deleted steps", left, [])
    target = {"w": w.tensor(np.zeros_like(gl), back, ("S", 1)), "step": 0}
    with paddle_dcp.CheckpointManager(str(path), max_to_keep=2) as manager:
        restored = manager.restore(target)
    w.oracle.value("restored step", restored, 4)
    w.oracle.value("step", target["step"], 4)
    w.check("w", target["w"], gl + 40, back, ("S", 1))


CASE_FUNCS: dict[str, Callable[[Worker], None]] = {
    "save_load": case_save_load, "async_in_a_row": case_async_in_a_row,
    "offload_into_model": case_offload_into_model, "nodelocal": case_nodelocal, "manager": case_manager,
}


# ------------------------------------------------------------------------------ peak memory
def reset_peaks(device: str) -> None:
    """Reset paddle's peak counters of GPU and pinned (host) memory; nothing on the CPU."""
    if device != "gpu":
        return
    import paddle

    cuda = paddle.device.cuda
    resets = [cuda.reset_max_memory_allocated]
    if hasattr(cuda, "max_pinned_memory_allocated"):
        resets.append(getattr(cuda, "reset_max_pinned_memory_allocated", lambda: None))
    elif hasattr(paddle.base.core, "host_memory_stat_reset_peak_value"):
        resets.append(lambda: paddle.base.core.host_memory_stat_reset_peak_value("Allocated", 0))
    for reset in resets:
        try:
            reset()
        except Exception:  # noqa: BLE001 - a counter paddle cannot reset: the peak covers more
            pass


def read_peaks(device: str) -> tuple[float | None, float | None]:
    """(peak GPU MiB, peak pinned MiB) since :func:`reset_peaks`; None where unknown."""
    if device != "gpu":
        return None, None
    import paddle

    def pinned() -> int:
        if hasattr(paddle.device.cuda, "max_pinned_memory_allocated"):
            return paddle.device.cuda.max_pinned_memory_allocated()
        return paddle.base.core.host_memory_stat_peak_value("Allocated", 0)

    out: list[float | None] = []
    for read in (paddle.device.cuda.max_memory_allocated, pinned):
        try:
            out.append(float(read()) / MIB)
        except Exception:  # noqa: BLE001 - no such counter in this build
            out.append(None)
    return out[0], out[1]


def run_case(w: Worker, name: str) -> None:
    """Run one case on this rank and append its result to this rank's results file."""
    import paddle_dcp

    w.oracle.start(name)
    reset_peaks(w.device)
    started = time.perf_counter()
    ok, reason = True, ""
    try:
        CASE_FUNCS[name](w)
    except Exception as exc:  # noqa: BLE001 - reported as FAIL, the next case still runs
        ok, reason = False, f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        traceback.print_exc()
        try:
            paddle_dcp.wait_async_save()  # its error is this case's, not the next one's
        except Exception:  # noqa: BLE001
            pass
    seconds = time.perf_counter() - started
    gpu, pinned = read_peaks(w.device)
    record = {"case": name, "ok": ok, "time": seconds, "gpu": gpu, "pinned": pinned, "reason": reason}
    with open(w.results, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"rank {w.rank}: {'PASS' if ok else 'FAIL'} {name} in {seconds:.2f}s {reason}", flush=True)


def worker_main(args: argparse.Namespace) -> int:
    """A rank of the check (under paddle.distributed.launch when there are several)."""
    if (REPO / "paddle_dcp").is_dir():
        sys.path.insert(0, str(REPO))  # the checkout this script belongs to
    import paddle
    import paddle.distributed as dist

    if args.device == "cpu":
        paddle.set_device("cpu")
    if int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) > 1:
        dist.init_parallel_env()
    w = Worker(args.device, Path(args.out), Oracle(os.environ.get(CORRUPT_ENV)), args.size_mib)
    print(f"rank {w.rank} of {w.world}: paddle {paddle.__version__}, device {args.device}, "
          f"place {paddle.get_device()}", flush=True)
    for name in args.cases.split(","):
        run_case(w, name)
    w.barrier()
    return 0


# =============================================================================== driver side
def gpu_count() -> int:
    """The number of GPUs paddle sees (0 without a CUDA build)."""
    import paddle

    if not paddle.is_compiled_with_cuda():
        return 0
    return int(paddle.device.cuda.device_count())


def no_gpu_message() -> str:
    """What a user without a GPU (or without paddle's GPU build) reads."""
    return (
        "gpu_check: no GPU: this check needs paddlepaddle-gpu and at least one visible NVIDIA GPU "
        "(paddle.is_compiled_with_cuda() is False or paddle.device.cuda.device_count() is 0).\n"
        "Install paddle's GPU build from Paddle's own package index (not PyPI), in place of "
        "paddlepaddle:\n"
        "    python -m pip uninstall -y paddlepaddle\n"
        f"    {INSTALL}\n"
        "(cu126 is CUDA 12.6; choose the index of your CUDA version, see README.md), then run "
        "this script again.\n"
        f"To run the same cases on the CPU instead: {ALLOW_CPU_ENV}=1 python {sys.argv[0]}"
    )


def launch_flags(n: int, device: str) -> list[str]:
    """How paddle's launcher is told to start ``n`` ranks: ``--devices 0,1`` when it will
    see those GPU ids (its own detection: a CUDA build, CUDA_VISIBLE_DEVICES), else
    ``--nproc_per_node n`` (CPU ranks, or visible devices named otherwise)."""
    import paddle

    core = paddle.base.core
    if device == "gpu" and core.is_compiled_with_cuda():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None or visible == "all":
            count = getattr(core, "get_cuda_device_count", lambda: 0)  # what the launcher calls
            labels = [str(i) for i in range(count())]
        else:
            labels = [s.strip() for s in visible.split(",")]
        wanted = [str(i) for i in range(n)]
        if all(want in labels for want in wanted):
            return ["--devices", ",".join(wanted)]
    return ["--nproc_per_node", str(n)]


def launch_env(device: str) -> dict:
    """The environment of the processes this script starts."""
    import paddle

    env = dict(os.environ)
    if not paddle.base.core.is_compiled_with_cuda():
        env.pop("CUDA_VISIBLE_DEVICES", None)  # a CPU build's launcher would take it for GPUs
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def command(n: int, device: str, cases: list[str], out: Path, size_mib: float) -> list[str]:
    worker = [str(HERE), "--worker", "--device", device, "--out", str(out), "--cases", ",".join(cases),
              "--size-mib", f"{size_mib:g}"]
    if n == 1:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "paddle.distributed.launch", *launch_flags(n, device),
            "--log_dir", str(out / "log"), *worker]


def run_launch(n: int, device: str, cases: list[str], out: Path, args: argparse.Namespace) -> str:
    """Start the check on ``n`` ranks and wait; returns how the launch ended ('' when it
    exited 0)."""
    cmd, timeout = command(n, device, cases, out, args.size_mib), args.timeout
    print(f"gpu_check: gpus={n}: python {' '.join(cmd[1:])}", flush=True)
    with open(out / "launcher.out", "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(out), env=launch_env(device), start_new_session=True,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_started(proc)
            proc.wait()
            return f"the launch did not finish in {timeout:g}s; its processes were killed"
        except BaseException:
            kill_started(proc)
            proc.wait()
            raise
    return "" if code == 0 else f"the launch exited with code {code}"


def collect(out: Path, n: int, cases: list[str], ended: str) -> dict[str, dict]:
    """Every case's result over the ranks: passed only when every rank passed it."""
    rows: dict[str, list[dict]] = {c: [] for c in cases}
    for path in sorted(out.glob("results.rank*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["case"], []).append(dict(row, rank=path.name.split(".")[1][4:]))
    merged = {}
    for case in cases:
        got = rows[case]
        fails = [r for r in got if not r["ok"]]
        peaks = {k: [r[k] for r in got if r[k] is not None] for k in ("gpu", "pinned")}
        if fails:
            reason = f"rank {fails[0]['rank']}: {fails[0]['reason']}"
        elif len(got) < n:
            reason = f"{n - len(got)} of {n} ranks reported nothing: {ended or 'the job ended first'}"
        else:
            reason = ""
        merged[case] = {"ok": not reason, "reason": reason, "time": max((r["time"] for r in got), default=0.0),
                        "gpu": max(peaks["gpu"], default=None), "pinned": max(peaks["pinned"], default=None)}
    return merged


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}MiB"


def print_tails(out: Path) -> None:
    """The last lines of the launcher's output and of every worker log."""
    logs = [out / "launcher.out"]
    if (out / "log").is_dir():  # paddle's launcher: one workerlog.N per rank
        logs += sorted((out / "log").glob("workerlog.*"))
    for log in logs:
        if log.exists():
            lines = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
            print(f"----- {log} (last {len(lines)} lines) -----")
            print("\n".join(lines))


def check_gpus(n: int, device: str, root: Path, args: argparse.Namespace) -> bool:
    """One launch on ``n`` GPUs (or CPU ranks); prints a line per case; True when all passed."""
    cases = [c for c in args.case_list if n > 1 or c not in TWO_RANKS_ONLY]
    if not cases:
        return True
    out = root / f"gpus{n}"
    out.mkdir(parents=True)
    ended = run_launch(n, device, cases, out, args)
    results = collect(out, n, cases, ended)
    for case in cases:
        r = results[case]
        line = f"gpus={n} time={r['time']:.2f}s peak_gpu={mib(r['gpu'])} peak_pinned={mib(r['pinned'])}"
        print(f"PASS {case} {line}" if r["ok"] else f"FAIL {case} {line} {r['reason']}", flush=True)
    ok = all(r["ok"] for r in results.values()) and not ended
    if ended and all(r["ok"] for r in results.values()):
        print(f"FAIL gpus={n}: every case passed, but {ended}", flush=True)
    if not ok:
        print_tails(out)
    return ok


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="1,2", help="numbers of GPUs to check with: 1, 2 or 1,2 (default)")
    p.add_argument("--keep", metavar="DIR", help="put checkpoints and logs in DIR and keep them")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per launch (default 600)")
    p.add_argument("--cases", default=",".join(CASES), help=f"a subset of {','.join(CASES)}")
    p.add_argument("--size-mib", type=float, default=16.0, metavar="MIB",
                   help="size of the large tensor of save_load, async_in_a_row and nodelocal (default 16)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    try:
        args.gpu_list = sorted({int(g) for g in args.gpus.split(",")})
    except ValueError:
        p.error(f"--gpus takes 1, 2 or 1,2; got {args.gpus!r}")
    if not args.gpu_list or not set(args.gpu_list) <= {1, 2}:
        p.error(f"--gpus takes 1, 2 or 1,2; got {args.gpus!r}")
    args.case_list = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.case_list if c not in CASES]
    if unknown or not args.case_list:
        p.error(f"unknown cases {unknown}; the cases are {', '.join(CASES)}")
    if not args.size_mib > 0:
        p.error(f"--size-mib must be positive, got {args.size_mib:g}")
    if args.keep and Path(args.keep).exists() and any(Path(args.keep).iterdir()):
        p.error(f"--keep {args.keep}: not empty (give a new or empty directory)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker_main(args)
    import paddle

    visible = gpu_count()
    if visible:
        device = "gpu"
        print(f"gpu_check: paddle {paddle.__version__}, {visible} GPU(s) visible", flush=True)
    elif os.environ.get(ALLOW_CPU_ENV) == "1":
        device = "cpu"
        print(f"gpu_check: no GPU; {ALLOW_CPU_ENV}=1: running on the CPU (gpus=N: N CPU processes over "
              f"gloo; peak memory n/a)", flush=True)
    else:
        print(no_gpu_message(), flush=True)
        return 2
    root = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    root.mkdir(parents=True, exist_ok=True)
    ok = True
    for n in args.gpu_list:
        if device == "gpu" and n > visible:
            for case in args.case_list:
                print(f"SKIP {case} gpus={n}: needs {n} GPUs, {visible} visible", flush=True)
            continue
        ok = check_gpus(n, device, root, args) and ok
    if ok and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"gpu_check: checkpoints and logs are in {root}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
