"""How bytes between two ranks should travel: paddle_dcp's TCP connections, a gloo group of the
pair, or the job's own communicator (NCCL on a GPU job), measured in one run.

Checkpoint bytes that move between ranks (node-local loads, save_gathered) start and end in host
memory. Three routes for the same messages, rank 0 sending to rank 1, 64 messages of each size:

- p2p: ``paddle_dcp.parallel.p2p`` (what paddle_dcp uses): host memory to host memory over TCP;
- gloo pair: a gloo process group of the two ranks, host tensors (what paddle_dcp used before);
- job communicator: the job's group with device tensors, as an NCCL job must use it: the host
  bytes copied to a device tensor, sent, received into a device tensor, copied back. Run under
  the fake GPU (``PADDLE_DCP_FAKE_GPU=1``, ``tests/worker_site`` on PYTHONPATH, as
  ``--fake-gpu`` arranges) the fake counts the device memory and the host/device copies this
  route costs; its wire is gloo on this machine, so its time here is not NCCL's.

Run: .venv/bin/python scripts/bench_p2p.py [--sizes 1M,16M,64M] [--fake-gpu]
Prints one line per route and size: GB/s (message bytes / time on rank 1), and for the job's
communicator the device bytes allocated and the bytes copied each way per byte sent.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNT = 64


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def route_p2p(rank: int, data, out) -> None:
    from paddle_dcp.parallel.state import STATE

    transport = STATE.groups.transport(rank)
    for _ in range(COUNT):
        if rank == 0:
            transport.send(1, "bench", data)
        else:
            transport.recv_into(0, "bench", out)
    transport.end_step("bench")


def route_gloo_pair(rank: int, data, out) -> None:
    from paddle_dcp.parallel.comm import host_tensor
    from paddle_dcp.parallel.state import STATE

    group = STATE.groups.get(rank, (0, 1), "bench")
    for _ in range(COUNT):
        if rank == 0:
            group.send(host_tensor(data), 1, True).wait()
        else:
            group.recv(host_tensor(out), 0, True).wait()


def route_job_communicator(rank: int, data, out) -> None:
    import paddle
    import paddle.distributed as dist

    for _ in range(COUNT):
        if rank == 0:
            dist.send(paddle.to_tensor(data), dst=1)  # host -> device, then the wire
        else:
            received = paddle.empty([out.nbytes], dtype="uint8")  # on the device
            dist.recv(received, src=0)
            out[...] = received.numpy()  # device -> host


def worker(sizes: list[int]) -> None:
    import numpy as np
    import paddle.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    fake = None
    if os.environ.get("PADDLE_DCP_FAKE_GPU") == "1":
        import fakegpu

        fake = fakegpu.ACCOUNT
    for size in sizes:
        data = np.arange(size, dtype=np.uint64).astype(np.uint8)
        out = np.empty(size, np.uint8)
        for name, route in (("p2p", route_p2p), ("gloo pair", route_gloo_pair), ("job communicator", route_job_communicator)):
            route(rank, data[: 1 << 10], out[: 1 << 10])  # connect / make the group outside the timing
            dist.barrier()
            if fake is not None:
                fake.reset()
            start = time.perf_counter()
            route(rank, data, out)
            seconds = time.perf_counter() - start
            if rank == 1:
                assert out.tobytes() == data.tobytes(), f"{name}: bytes differ"
            role = "sender  " if rank == 0 else "receiver"
            line = f"{name:17s} {size >> 20:5d} MiB x {COUNT} {role}: {COUNT * size / seconds / 1e9:6.2f} GB/s"
            if fake is not None:
                sent = COUNT * size
                line += (f"  peak device bytes {fake.peak['gpu'] / size:.1f} x message,"
                         f" copied per byte sent: host->device {fake.copied['h2d'] / sent:.1f},"
                         f" device->host {fake.copied['d2h'] / sent:.1f}")
            print(line, flush=True)
            dist.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--fake-gpu", action="store_true", help="run the ranks on the fake GPU (tests/fakegpu.py)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes)
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    if args.fake_gpu:
        env.update(PADDLE_DCP_FAKE_GPU="1")
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "tests", "worker_site"), env["PYTHONPATH"]])
    with tempfile.TemporaryDirectory() as logs:
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", logs,
               os.path.abspath(__file__), "--worker", "--sizes", args.sizes]
        code = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900).returncode
        for rank in (0, 1):
            with open(os.path.join(logs, f"workerlog.{rank}"), errors="replace") as f:
                print("".join(line for line in f if " x " in line and "GB/s" in line), end="")
        if code:
            with open(os.path.join(logs, "workerlog.0"), errors="replace") as f:
                print(f.read()[-3000:])
    return code


if __name__ == "__main__":
    sys.exit(main())
