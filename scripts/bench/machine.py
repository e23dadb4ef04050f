"""The machine a benchmark runs on, probed once for every suite: its description, and the
speeds that bound any library: the page cache's writes and reads, the checksum's, a memory copy
and a loopback TCP stream."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import threading
import time

from bench import REPO
from bench.report import log
from bench.threads import in_threads
from bench.units import GB, GiB, MiB

IO_BUFFER = 64 * MiB  # the page cache's writes and reads, a buffer at a time


def machine_info(workdir: str, library: str = REPO) -> dict:
    """The machine, the versions installed, and the commit of the paddle_dcp checkout at
    ``library`` (default this one) with its uncommitted changes."""
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": mem,
        "disk": _disk(workdir),
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": version("numpy"),
        "paddlepaddle": version("paddlepaddle") or version("paddlepaddle-gpu"),
        "torch": version("torch"),
        "paddle_dcp": version("paddle_dcp") or version("paddle-dcp"),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "paddle_dcp_commit": _git("rev-parse", "--short", "HEAD", repo=library),
        "paddle_dcp_uncommitted": _git("status", "--porcelain", "--", "paddle_dcp", repo=library),
    }


def _git(*args, repo: str = REPO) -> str | None:
    try:
        out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _disk(path: str) -> dict:
    """The filesystem holding ``path``: device, type, size (from /proc/mounts, longest match)."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, dev, fstype)
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    rotational = None
    dev = os.path.basename(best[1])
    for name in (dev, dev.rstrip("0123456789")):
        try:
            with open(f"/sys/block/{name}/queue/rotational") as f:
                rotational = f.read().strip() == "1"
                break
        except OSError:
            continue
    return {"mount": best[0], "device": best[1], "fstype": best[2], "size_bytes": usage.total,
            "free_bytes": usage.free, "rotational": rotational}


# ------------------------------------------------------------------------------ page cache
def _write_file(path: str, nbytes: int, buf: memoryview, direct: bool = False) -> None:
    """Write ``nbytes`` from ``buf`` (repeated) to ``path``; ``direct``: with O_DIRECT (the page
    cache bypassed), ``buf`` page-aligned and sizes multiples of 4096."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, buf[: min(left, len(buf))])
    finally:
        os.close(fd)


def _read_file(path: str, buf: memoryview) -> int:
    got = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return got
            got += n


def page_cache_speed(directory: str, nbytes: int, threads: int, settle: float) -> dict:
    """Write ``nbytes`` as ``threads`` fresh files from as many threads, then read them back.

    "cold": the files are written ``settle`` seconds after the previous ones were deleted, as
    a fresh process writing a new checkpoint meets the page cache (in a VM with free page
    reporting the freed memory has gone back to the host by then). "warm": written again at
    once into the memory just freed by deleting them. Reads land in buffers touched before.
    """
    import numpy as np

    os.makedirs(directory, exist_ok=True)
    per_file = nbytes // threads // 4096 * 4096  # O_DIRECT wants whole pages
    total = per_file * threads
    paths = [os.path.join(directory, f"pagecache.{i}") for i in range(threads)]

    def remove():
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)

    pattern = np.random.default_rng(0).integers(0, 256, min(IO_BUFFER, max(per_file, 1)), dtype=np.uint8)
    wbuf = memoryview(pattern)
    rbufs = [memoryview(np.ones(min(IO_BUFFER, max(per_file, 1)), dtype=np.uint8)) for _ in paths]
    out = {"threads": threads, "bytes": total}
    remove()
    os.sync()  # no dirty pages of earlier steps are written back during the measurement
    time.sleep(settle)
    out["write_cold_gbps"] = total / in_threads(_write_file, [(p, per_file, wbuf) for p in paths]) / GB
    read1 = in_threads(_read_file, list(zip(paths, rbufs)))
    remove()
    out["write_warm_gbps"] = total / in_threads(_write_file, [(p, per_file, wbuf) for p in paths]) / GB
    read2 = in_threads(_read_file, list(zip(paths, rbufs)))
    out["read_gbps"] = total / min(read1, read2) / GB
    remove()
    os.sync()
    out["write_direct_gbps"] = None
    if hasattr(os, "O_DIRECT") and per_file % 4096 == 0:
        import mmap

        aligned = mmap.mmap(-1, len(wbuf))  # anonymous maps are page-aligned
        aligned[:] = wbuf
        try:
            seconds = in_threads(_write_file, [(p, per_file, memoryview(aligned), True) for p in paths])
            out["write_direct_gbps"] = total / seconds / GB
        except OSError as exc:  # a filesystem without O_DIRECT (tmpfs)
            log(f"O_DIRECT writes not measured: {exc}")
        finally:
            remove()
            aligned.close()
    return out


CHECKSUM_BUFFER = 256 * MiB


def _library_block_bytes() -> int:
    """paddle_dcp's checksum block (metadata.DEFAULT_BLOCK_BYTES), read from its source: importing
    the package would import paddle into this driver process."""
    import re

    try:
        with open(os.path.join(REPO, "paddle_dcp", "core", "metadata.py")) as f:
            m = re.search(r"^DEFAULT_BLOCK_BYTES\s*=\s*(\d+)(?:\s*<<\s*(\d+))?\s*$", f.read(), re.M)
        if m:
            return int(m.group(1)) << int(m.group(2) or 0)
    except OSError:
        pass
    return 4 * MiB


def checksum_speed(nbytes: int = CHECKSUM_BUFFER, rounds: int = 5) -> dict:
    """xxh3_64 (the python-xxhash the library uses) over a ``nbytes`` buffer already in memory,
    from one thread: once as one call, once in the library's checksum blocks (metadata
    DEFAULT_BLOCK_BYTES, each with its own seed). Best of ``rounds``, GB/s."""
    import numpy as np
    import xxhash

    block = _library_block_bytes()
    buf = np.arange(nbytes // 8, dtype=np.uint64).view(np.uint8)  # touched: no first-touch cost timed
    view = memoryview(buf)
    whole, blocks = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(view)
        whole.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k, i in enumerate(range(0, nbytes, block)):
            xxhash.xxh3_64_intdigest(view[i : i + block], seed=k)
        blocks.append(time.perf_counter() - t0)
    return {"bytes": nbytes, "block_bytes": block, "xxhash": importlib.metadata.version("xxhash"),
            "whole_gbps": nbytes / min(whole) / GB, "blocks_gbps": nbytes / min(blocks) / GB}


def memcpy_speed(nbytes: int, rounds: int = 3) -> float:
    """GB/s of one numpy copy of ``nbytes`` between buffers touched before, best of ``rounds``."""
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


def tcp_loopback_speed(nbytes: int, rounds: int = 2, chunk: int = 4 * MiB) -> float:
    """GB/s of one TCP stream over 127.0.0.1 (a sender thread, ``recv_into`` a buffer touched
    before): the wire that bytes between two ranks of this machine cross. Best of ``rounds``."""
    import numpy as np

    data = memoryview(np.ones(chunk, np.uint8))
    out = memoryview(np.zeros(nbytes, np.uint8))
    best = float("inf")
    for _ in range(rounds):
        with socket.create_server(("127.0.0.1", 0)) as srv:
            port = srv.getsockname()[1]

            def send():
                with socket.create_connection(("127.0.0.1", port)) as c:
                    left = nbytes
                    while left:
                        n = min(left, chunk)
                        c.sendall(data[:n])
                        left -= n

            t = threading.Thread(target=send)
            t.start()
            conn, _ = srv.accept()
            with conn:
                t0 = time.perf_counter()
                got = 0
                while got < nbytes:
                    n = conn.recv_into(out[got:], min(chunk, nbytes - got))
                    if not n:
                        raise RuntimeError("the loopback stream ended early")
                    got += n
                best = min(best, time.perf_counter() - t0)
            t.join()
    return nbytes / best / GB


def describe(info: dict) -> str:
    """The report's line for a :func:`machine_info`: hardware, versions, commit, date."""
    disk = info.get("disk") or {}
    dirty = info.get("paddle_dcp_uncommitted")
    return (f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_bytes'] / GiB:.1f} GiB RAM, "
            f"disk {disk.get('device', '?')} ({disk.get('fstype', '?')}); python {info['python']}, "
            f"paddle {info['paddlepaddle']}, torch {info['torch'] or '-'}; paddle_dcp commit "
            f"{info.get('paddle_dcp_commit') or '?'}"
            + (f", with uncommitted changes: {' '.join(dirty.split())}" if dirty else "") + f"; {info['date']}")
