"""The suite p2p: how bytes between two ranks should travel: paddle_dcp's TCP connections, a
gloo group of the pair, or the job's own communicator (NCCL on a GPU job), measured in one run.

Checkpoint bytes that move between ranks (node-local loads, save_gathered) start and end in host
memory. Three routes for the same messages, rank 0 sending to rank 1, 64 messages of each size:

- p2p: ``paddle_dcp.parallel.p2p`` (what paddle_dcp uses): host memory to host memory over TCP;
- gloo pair: a gloo process group of the two ranks, host tensors (what paddle_dcp used before);
- job communicator: the job's group with device tensors, as an NCCL job must use it: the host
  bytes copied to a device tensor, sent, received into a device tensor, copied back. Run under
  the fake GPU (``PADDLE_DCP_FAKE_GPU=1``, ``tests/worker_site`` on PYTHONPATH, as
  ``--fake-gpu`` arranges; p2p_worker.py is each rank) the fake counts the device memory and the host/device copies this
  route costs; its wire is gloo on this machine, so its time here is not NCCL's.

Run: .venv/bin/python scripts/bench p2p [--sizes 1M,16M,64M] [--fake-gpu]
Prints one line per route and size: GB/s (message bytes / time on rank 1), and for the job's
communicator the device bytes allocated and the bytes copied each way per byte sent.
"""
from __future__ import annotations

import argparse
import os
import tempfile

from bench import REPO, launch
from bench.units import parse_size

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "p2p_worker.py")
RANKS = 2


def main(argv: list | None = None, prog: str = "bench p2p") -> int:
    """The suite p2p: a line per route and size on stdout, rank 0's then rank 1's."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--fake-gpu", action="store_true", help="run the ranks on the fake GPU (tests/fakegpu.py)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the job may take before it is killed")
    args = p.parse_args(argv)
    for size in args.sizes.split(","):
        parse_size(size)  # a bad size stops here, not in the ranks
    env = launch.job_env()
    if args.fake_gpu:
        env["PADDLE_DCP_FAKE_GPU"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "tests", "worker_site"), env["PYTHONPATH"]])
    with tempfile.TemporaryDirectory() as work:
        results, logs = os.path.join(work, "result"), os.path.join(work, "log")
        argv_ = launch.launcher(WORKER, ["--sizes", args.sizes, "--result-dir", results], RANKS, logs)
        job = launch.run([launch.Command(argv_, work, os.path.join(work, "launcher.log"))], env, args.timeout,
                         results, RANKS, [work])
        for res in job.results:
            print("".join(line + "\n" for line in (res or {}).get("lines", [])), end="")
        if not job.ok:
            print(f"FAILED: {job.error}\n{job.tail(40)}")
    return 0 if job.ok else 1
