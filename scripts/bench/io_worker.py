"""One rank of one benchmark phase: build the state dict, time one save or load, check it.

Started by the suites io and s3 (bench/io.py) on every rank, under ``python -m
paddle.distributed.launch`` (libraries "ours" = paddle_dcp and "paddle" = paddle.distributed's
built-in) or under ``torchrun`` ("torch" = torch.distributed.checkpoint with DTensors on a gloo
mesh of CPU ranks)::

    io_worker.py LIB PHASE SIZE_BYTES CHECKPOINT_DIR RESULT_DIR

CHECKPOINT_DIR may be an ``s3://bucket/prefix`` URL (the suite s3): paddle_dcp takes it
as it is, torch DCP through FsspecWriter(sync_files=False) / FsspecReader (s3fs), both
configured by the AWS_* variables; nothing is read into the page cache before a load then.
PHASE is "save" (the workload in its save layout), "load" (into the same layout) or "reshard"
(into the reshard layout: Shard(0) -> Shard(1)); "save-async" for "ours" and "torch"
(save_state_dict(async_save=True) / DCP's async_save: the call's return and the handle's
``wait()`` are timed separately; then, in the same process, a second async save and a plain
save, as a training loop's later saves; torch's go to sub-directories 0, 1, 2), for "ours"
only also "save-durable" (save_state_dict(durable=True): data files, metadata and directory
fsynced) and "load-noverify" (load_state_dict(verify=False): no checksum checks). Each rank
waits at a barrier, then times its own call with time.perf_counter (whatever barriers the
library does inside included) and records its peak resident memory growth during the call.
After the timed region, a load's every value is compared with the numpy oracle
(bench/workload.py); after a save-async or save-durable the rank loads every checkpoint it
wrote back, untimed, into fresh targets and compares those (nothing else reads them). The
rank writes ``RESULT_DIR/rank{r}.json``; on any failure it also prints the traceback and
exits 1.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback

import numpy as np

if __package__ in (None, ""):  # run by path: this directory is the package ``bench``
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import s3, workload  # noqa: E402  (s3: the S3 server's CPU time, when the suite runs one)
from bench.io_config import OURS_ONLY, PHASES, SAVES  # noqa: E402
from bench.launch import write_result  # noqa: E402
from bench.units import MiB  # noqa: E402

SENTINEL = -7.0  # what load targets hold before the load (exact in bfloat16)
# Seconds to wait between building the state dict and the timed call. In a VM with free page
# reporting (Firecracker: page_reporting.page_reporting_order=11) memory freed more than ~2 s
# ago goes back to the host, and touching it again runs at ~0.5-1 GB/s instead of ~8 GB/s; the
# wait puts every library in that same state (what a fresh process meets) instead of a state
# that depends on what the build freed last.
SETTLE = float(os.environ.get("PADDLE_DCP_BENCH_SETTLE", "3"))


# ------------------------------------------------------------------------------ memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakRss:
    """Peak resident memory growth of this process during a ``with`` block, in bytes.

    Linux resets the high-water mark (VmHWM) to the current RSS when "5" is written to
    /proc/self/clear_refs; then VmHWM after the block minus VmRSS before it is the exact peak
    growth, with nothing running beside the library. Without that file, a thread samples RSS
    every 5 ms (it may miss a peak shorter than that).
    """

    def __init__(self):
        self.method = "vmhwm"
        try:
            self._reset()
            _status_kib("VmHWM")
        except OSError:
            self.method = "sampled 5 ms"

    @staticmethod
    def _reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def __enter__(self):
        self.before = _status_kib("VmRSS")
        if self.method == "vmhwm":
            self._reset()
            self.before = _status_kib("VmRSS")
        else:
            self.peak = self.before
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def growth_so_far(self) -> int:
        """The peak growth from ``__enter__`` until now (inside the block)."""
        if self.method == "vmhwm":
            return max(0, _status_kib("VmHWM") - self.before)
        return max(0, max(self.peak, _status_kib("VmRSS")) - self.before)

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _status_kib("VmRSS"))

    def __exit__(self, *exc):
        if self.method == "vmhwm":
            self.peak = _status_kib("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _status_kib("VmRSS"))
        self.growth = max(0, self.peak - self.before)
        return False


# ------------------------------------------------------------------------------ libraries
class PaddleLib:
    """paddle_dcp ("ours") or paddle.distributed's built-in ("paddle"), on a 1-D mesh."""

    def __init__(self, which: str):
        import paddle
        import paddle.distributed as dist

        self.paddle, self.dist, self.which = paddle, dist, which
        dist.init_parallel_env()
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        self.mesh = dist.ProcessMesh(list(range(self.ranks)), dim_names=["x"])
        self.patched = False
        if which == "paddle" and not paddle.is_compiled_with_cuda() and not os.environ.get("PADDLE_DCP_BENCH_UNPATCHED"):
            self.patched = _stage_on_host(paddle)
        if which == "ours":
            import paddle_dcp

            self.save_fn, self.load_fn = paddle_dcp.save_state_dict, paddle_dcp.load_state_dict
        else:
            self.save_fn, self.load_fn = dist.save_state_dict, dist.load_state_dict

    def tensor(self, spec, layout: str, values: np.ndarray):
        """A float32 dist tensor holding ``values`` as this rank's piece, cast to the spec's
        dtype afterwards (paddle's CPU slicing has no bfloat16 kernel)."""
        dist = self.dist
        placement = dist.Replicate() if layout == "R" else dist.Shard(int(layout[1:]))
        local = self.paddle.to_tensor(values)
        t = self.paddle.Tensor(local, dims=list(spec.shape), process_mesh=self.mesh, placements=[placement])
        return t.astype(spec.dtype) if spec.dtype != "float32" else t

    def local(self, t) -> np.ndarray:
        return t._local_value().numpy()  # bfloat16 comes out as its uint16 bits

    def barrier(self):
        if self.ranks > 1:  # a job of one rank has no global group to wait on
            self.dist.barrier()

    def save(self, sd, path, **options):
        return self.save_fn(sd, path, **options)

    def load(self, sd, path, **options):
        self.load_fn(sd, path, **options)

    @staticmethod
    def checkpoint(path: str, uid: int) -> tuple[str, dict]:
        """Where the save-async phase's ``uid``-th checkpoint goes, and the load options that read it."""
        return path, {"unique_id": uid}

    def close(self):
        pass


def _stage_on_host(paddle) -> bool:
    """Make paddle's built-in load work on a CPU build, in this process only.

    flex_checkpoint/dcp/reshard_comm.py (BroadcastCommunicator.communicate, the default
    comm_method "broadcast") moves every source and destination tensor of a broadcast to the
    GPU with ``Tensor.cuda()`` before broadcasting chunks; a CPU build raises "No available
    device found." there whenever a chunk must go from one rank to another. With
    ``Tensor.cuda`` returning the tensor itself, the chunks are broadcast from host memory over
    gloo and its final ``target.copy_(staged)`` copies a tensor onto itself.
    """
    original = paddle.Tensor.cuda

    def cuda_on_host(self, *args, **kwargs):
        return self

    cuda_on_host.original = original
    paddle.Tensor.cuda = cuda_on_host
    return True


class TorchLib:
    """torch.distributed.checkpoint with DTensors on a 1-D DeviceMesh of CPU gloo ranks."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self.torch, self.dist, self.dcp = torch, dist, dcp
        self.DTensor, self.Replicate, self.Shard = DTensor, Replicate, Shard
        dist.init_process_group("gloo")
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh("cpu", (self.ranks,))
        self.patched = False

    def tensor(self, spec, layout: str, values: np.ndarray):
        torch = self.torch
        placement = self.Replicate() if layout == "R" else self.Shard(int(layout[1:]))
        local = torch.from_numpy(values if values.flags.c_contiguous else values.copy())
        if spec.dtype == "bfloat16":
            local = local.to(torch.bfloat16)
        stride, acc = [], 1
        for n in reversed(spec.shape):
            stride.insert(0, acc)
            acc *= n
        return self.DTensor.from_local(
            local, self.mesh, [placement], run_check=False, shape=torch.Size(spec.shape), stride=tuple(stride)
        )

    def local(self, t) -> np.ndarray:
        local = t.to_local()
        if local.dtype == self.torch.bfloat16:
            return local.view(self.torch.int16).numpy().view(np.uint16)
        return local.numpy()

    def barrier(self):
        if self.ranks > 1:  # a job of one rank has no global group to wait on
            self.dist.barrier()

    def save(self, sd, path, async_save=False):
        """A save; with ``async_save``, DCP's async_save (its default: staging in the caller,
        writing in a thread) and a handle whose wait() waits for it."""
        if async_save:
            return _TorchHandle(self.dcp.async_save(sd, checkpoint_id=path))
        if "://" in path:  # object storage through fsspec; an fsync means nothing there
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            self.dcp.save(sd, storage_writer=FsspecWriter(path, sync_files=False))
        elif os.environ.get("PADDLE_DCP_BENCH_TORCH_NO_FSYNC"):  # DCP's default fsyncs every file
            self.dcp.save(sd, storage_writer=self.dcp.FileSystemWriter(path, sync_files=False))
        else:
            self.dcp.save(sd, checkpoint_id=path)

    def load(self, sd, path):
        if "://" in path:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            self.dcp.load(sd, storage_reader=FsspecReader(path))
        else:
            self.dcp.load(sd, checkpoint_id=path)

    @staticmethod
    def checkpoint(path: str, uid: int) -> tuple[str, dict]:
        """Where the save-async phase's ``uid``-th checkpoint goes: DCP has no ids in a
        directory, so each goes to a sub-directory of its own."""
        return os.path.join(path, str(uid)), {}

    def close(self):
        self.dist.destroy_process_group()


class _TorchHandle:
    """DCP's async_save result (a Future, or a response holding one) with our handle's wait()."""

    def __init__(self, result):
        self.future = getattr(result, "upload_completion", result)

    def wait(self):
        return self.future.result()


# ------------------------------------------------------------------------------ one phase
def build_state(lib, specs, layout_of, fill: bool) -> dict:
    """This rank's state dict: the values to save, or targets holding SENTINEL (memory touched
    before the timed call, so it does not count as the library's growth)."""
    sd = {}
    for spec in specs:
        layout = layout_of(spec)
        if fill:
            shape = tuple(s.stop - s.start for s in workload.local_slices(spec.shape, layout, lib.rank, lib.ranks))
            values = np.full(shape, SENTINEL, dtype=np.float32)
        else:
            values = workload.source_local(spec, layout, lib.rank, lib.ranks)
        sd[spec.name] = lib.tensor(spec, layout, values)
    return sd


def check_all(lib, sd, specs, layout_of) -> int:
    """Compare every loaded value with the oracle; the bytes checked."""
    checked = 0
    for spec in specs:
        value = lib.local(sd[spec.name])
        workload.check(value, spec, layout_of(spec), lib.rank, lib.ranks)
        checked += value.nbytes
    return checked


def read_files(directory: str, rank: int = 0, ranks: int = 1) -> None:
    """Read the files under ``directory`` (every ``ranks``-th, from the ``rank``-th, in sorted
    order), so that a load finds their pages in the page cache. The bench reads a checkpoint
    this way before each load's launch, and the ranks read their shares again just before the
    timed call: this VM's DAMON pages out memory it has seen idle (docs/performance.md,
    "Machine"), and in the ten seconds a launch takes before its call 1 to 9% of the pages were
    gone, read back from disk by whichever library met them first."""
    paths = sorted(os.path.join(root, name) for root, _, names in os.walk(directory) for name in names)
    buf = memoryview(bytearray(16 * MiB))
    for path in paths[rank::ranks]:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def cached_fraction(directory: str) -> float | None:
    """The fraction of the pages of the files in ``directory`` that the page cache holds
    (mincore over a read-only mapping: nothing is read), or None where mincore is unavailable."""
    import ctypes
    import mmap

    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    held = total = 0
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        if not size:
            continue
        pages = -(-size // mmap.PAGESIZE)
        vec = np.zeros(pages, dtype=np.uint8)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8)
            rc = mincore(view.ctypes.data, size, vec.ctypes.data)
            del view
        if rc != 0:
            return None
        held += int(np.count_nonzero(vec & 1))
        total += pages
    return held / total if total else None


def settle(lib) -> None:
    """Before a timed call: garbage collected, SETTLE seconds for the VM (see SETTLE), then
    every rank at a barrier."""
    gc.collect()
    time.sleep(SETTLE)
    lib.barrier()


def _next_saves(lib, sd, ckpt) -> dict:
    """After the first async save of this process (checkpoint 0): a second async save
    (checkpoint 1) and a plain save (checkpoint 2) of the same state, each after the settle
    wait and a barrier, timed as the first: what a training loop's later saves cost."""
    out = {}
    for uid, name, options in ((1, "next_async", {"async_save": True}), (2, "next_full", {})):
        settle(lib)
        memory = PeakRss()
        with memory:
            t0 = time.perf_counter()
            handle = lib.save(sd, lib.checkpoint(ckpt, uid)[0], **options)
            blocked = time.perf_counter() - t0
            at_return = memory.growth_so_far()
            if handle is not None:
                handle.wait()
            seconds = time.perf_counter() - t0
        out.update({f"{name}_blocked_seconds": blocked, f"{name}_seconds": seconds,
                    f"{name}_rss_growth_at_return": at_return, f"{name}_rss_growth": memory.growth})
    return out


def timed_call(lib, phase: str, sd: dict, ckpt: str, result: dict) -> None:
    """The phase's one timed call; its seconds, peak memory growth and CPU seconds (the S3
    server's too, when the bench runs one) go into ``result``."""
    memory = PeakRss()
    cpu0, server0 = os.times(), s3.server_cpu_seconds()
    with memory:
        t0 = time.perf_counter()
        if phase == "save-async":
            handle = lib.save(sd, lib.checkpoint(ckpt, 0)[0], async_save=True)
            # "seconds": until wait() returned; "blocked_seconds": until the call returned
            result.update(blocked_seconds=time.perf_counter() - t0, rss_growth_at_return=memory.growth_so_far())
            handle.wait()
        elif phase == "save-durable":
            lib.save(sd, ckpt, durable=True)
        elif phase == "save":
            lib.save(sd, ckpt)
        elif phase == "load-noverify":
            lib.load(sd, ckpt, verify=False)
        else:
            lib.load(sd, ckpt)
        seconds = time.perf_counter() - t0
    cpu1, server1 = os.times(), s3.server_cpu_seconds()
    result.update(seconds=seconds, rss_before=memory.before, rss_growth=memory.growth, rss_method=memory.method,
                  cpu_seconds=cpu1.user + cpu1.system - cpu0.user - cpu0.system)
    if server0 is not None and server1 is not None:  # the S3 server's, during this rank's call
        result["server_cpu_seconds"] = server1 - server0


def run(lib_name: str, phase: str, size: int, ckpt: str, result_dir: str) -> int:
    started = time.perf_counter()
    lib = TorchLib() if lib_name == "torch" else PaddleLib(lib_name)
    result = {"lib": lib_name, "phase": phase, "rank": lib.rank, "ranks": lib.ranks, "ok": False,
              "patched_gpu_staging": lib.patched}
    status = 0
    try:
        specs = workload.build(size)
        if phase == "reshard":
            layout_of = lambda s: s.reshard  # noqa: E731
        else:
            layout_of = lambda s: s.layout  # noqa: E731
        if phase in OURS_ONLY and lib_name != "ours" and (phase, lib_name) != ("save-async", "torch"):
            raise ValueError(f"phase {phase} is paddle_dcp's only")
        sd = build_state(lib, specs, layout_of, fill=phase not in SAVES)
        result["build_seconds"] = time.perf_counter() - started
        settle(lib)
        if phase not in SAVES and "://" not in ckpt:  # a local checkpoint: into the page cache
            read_files(ckpt, lib.rank, lib.ranks)
            lib.barrier()
            result["cached_before"] = cached_fraction(ckpt)
        timed_call(lib, phase, sd, ckpt, result)
        ids = [0]
        if phase == "save-async":
            # the first save of a process also creates the background save's process group;
            # the next ones (as in a training loop) do not: time one more async save, then a
            # plain save, in this same process
            result.update(_next_saves(lib, sd, ckpt))
            ids = [0, 1, 2]
        t1 = time.perf_counter()
        checked = 0
        if phase in ("save-async", "save-durable"):
            # nothing else reads these checkpoints: load each back, untimed, and check it
            del sd
            gc.collect()
            for uid in ids:
                sd = build_state(lib, specs, layout_of, fill=True)
                where, options = lib.checkpoint(ckpt, uid)
                lib.load(sd, where, **options)
                checked += check_all(lib, sd, specs, layout_of)
                del sd
        elif phase != "save":
            checked = check_all(lib, sd, specs, layout_of)
        if phase != "save":
            result.update(checked_bytes=checked, check_seconds=time.perf_counter() - t1)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - report, then stop this rank
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
        status = 1
    return finish(lib, result, result_dir, status)


def finish(lib, result: dict, result_dir: str, status: int, who: str = "io_worker") -> int:
    """The end of a rank: its ``result`` written to ``RESULT_DIR/rank{r}.json`` and printed;
    on failure (``status`` 1) the process exits at once, else it waits for the other ranks."""
    write_result(result_dir, lib.rank, result)
    print(f"{who} rank {lib.rank}: {json.dumps(result)}", flush=True)
    if status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # the launcher then stops the other ranks
    lib.barrier()  # nobody leaves (and takes the store down) while others still check
    lib.close()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 5 or argv[0] not in ("ours", "paddle", "torch") or argv[1] not in PHASES:
        print(__doc__, file=sys.stderr)
        return 2
    return run(argv[0], argv[1], int(argv[2]), argv[3], argv[4])


if __name__ == "__main__":
    sys.exit(main())
