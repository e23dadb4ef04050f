"""One rank of the suite p2p (bench/p2p.py): rank 0 sends COUNT messages of each size to rank
1 by each route, both time them; each rank writes its lines (GB/s, and on the fake GPU the
device memory and copies per byte sent) to ``RESULT_DIR/rank{r}.json``.

    p2p_worker.py --sizes 1M,16M,64M --result-dir RESULT_DIR
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

if __package__ in (None, ""):  # run by path: this directory is the package ``bench``
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench.launch import write_result  # noqa: E402
from bench.units import parse_size  # noqa: E402

COUNT = 64


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


def measure(rank: int, sizes: list[int], lines: list) -> None:
    """Every route at every size, a line each into ``lines``."""
    import numpy as np
    import paddle.distributed as dist

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
            lines.append(line)
            dist.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", required=True)
    p.add_argument("--result-dir", required=True)
    args = p.parse_args()
    import paddle.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    out: dict = {"rank": rank, "ok": False, "lines": []}
    code = 0
    try:
        measure(rank, [parse_size(s) for s in args.sizes.split(",")], out["lines"])
        out["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then exit 1
        traceback.print_exc()
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        code = 1
    write_result(args.result_dir, rank, out)
    return code


if __name__ == "__main__":
    sys.exit(main())
