"""The tests' port helper (tests/ports.py): ports outside the ranges other processes draw from."""
import socket

import ports


def test_ports_are_distinct_free_and_below_the_ephemeral_and_launcher_ranges():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    got = ports.free_ports(13)
    assert len(set(got)) == 13
    assert all(ports.LOW <= p < min(ephemeral_low, 35100) for p in got)
    for p in got:  # free: each can be bound
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_each_test_worker_draws_from_a_slice_of_its_own(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(ports.free_ports(20)))
        assert slices[-1] <= set(ports._slice())
    assert not set(ports._slice()) & set(range(ports.LOW, ports.LOW + (ports.HIGH - ports.LOW) // 2))
    assert not slices[0] & slices[1]
