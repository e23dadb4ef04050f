"""Ports for the servers the tests start: a two-node launch's master, the gloo store of spawned
ranks, the S3 server's many ports.

A port taken by binding to port 0 comes from the kernel's ephemeral range (32768-60999 on
Linux), the very range paddle's launcher picks its ranks' endpoints from (35100-64000). Between
a port being found free and its server binding it, a rank of another test running beside this
one (pytest-xdist) may start listening there: a two-node launch then finds "a master" that never
answers, and waits for ever. So ports are drawn from below both ranges, each test worker from a
slice of its own, and checked free by binding them.
"""
from __future__ import annotations

import os
import random
import socket

LOW, HIGH = 10000, 32768  # below the ephemeral range and paddle's launcher's PORT_RANGE


def _slice() -> range:
    """This test worker's share of [LOW, HIGH) (the whole of it without pytest-xdist)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    index = int(name[2:]) % workers if name.startswith("gw") and name[2:].isdigit() else 0
    span = (HIGH - LOW) // workers
    return range(LOW + index * span, LOW + (index + 1) * span)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now, from this worker's slice."""
    pool, pick, ports = _slice(), random.SystemRandom(), []
    for _ in range(100 * count + 1000):
        if len(ports) == count:
            return ports
        port = pick.choice(pool)
        if port not in ports and _bindable(port):
            ports.append(port)
    raise RuntimeError(f"fewer than {count} free ports in {pool.start}-{pool.stop - 1}")


def free_port() -> int:
    """One TCP port free on 127.0.0.1 right now (see :func:`free_ports`)."""
    return free_ports(1)[0]
