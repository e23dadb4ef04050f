"""The object-storage side of the benchmarks (scripts/bench/s3.py): the server's own speed as the
limit, and how ours is set against it and against the memory bound."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench import io_report, s3  # noqa: E402
from bench.io import Run  # noqa: E402

MiB = 1 << 20


def sample(put1, put4, get1, get4, cpu=6.0):
    return {"bytes": 64 * MiB, "part_bytes": 32 * MiB, "put_gbps": {"1": put1, "4": put4},
            "get_gbps": {"1": get1, "4": get4}, "put_server_cpu_s_per_gb": {"1": cpu, "4": cpu + 1},
            "get_server_cpu_s_per_gb": {"1": cpu / 10, "4": None}}


def entry(phase, ours_gbps, rss_mib, share=512 * MiB):
    return {"phase": phase, "share_bytes": share, "targets": {},
            "libs": {"ours": {"best_gbps": ours_gbps, "rss_growth_max_bytes": rss_mib * MiB}}}


def test_the_limit_is_the_best_repeat_and_the_least_cpu():
    best = s3.best_server_speed([sample(0.1, 0.2, 0.5, 0.4, cpu=7.0), sample(0.3, 0.1, 0.2, 0.9, cpu=6.0)])
    assert best["put_gbps"] == {"1": 0.3, "4": 0.2} and best["get_gbps"] == {"1": 0.5, "4": 0.9}
    assert best["put_server_cpu_s_per_gb"] == {"1": 6.0, "4": 7.0}
    assert best["get_server_cpu_s_per_gb"] == {"1": 0.6, "4": None}  # never measured: none
    assert s3.best_server_speed([]) == {}


def test_ours_against_the_server_put_for_a_save_get_for_a_load():
    server = s3.best_server_speed([sample(0.2, 0.25, 0.5, 1.0)])
    save = s3.limit_targets(entry("save", 0.2, 100), server)
    assert save["server_gbps"] == 0.25 and save["fraction"] == pytest.approx(0.8) and save["met"] is True
    load = s3.limit_targets(entry("load", 0.5, 100), server)
    assert load["server_gbps"] == 1.0 and load["met"] is False  # 50% < 60%
    reshard = s3.limit_targets(entry("reshard", 0.9, 100), server)
    assert reshard["fraction"] == pytest.approx(0.9) and reshard["at_least"] is None and reshard["met"] is None
    assert s3.limit_targets({"phase": "save", "libs": {}}, server) is None


def test_memory_bound_is_the_disk_bound_plus_the_parts_in_flight():
    limit = 0.1 * 512 * MiB + 64 * MiB + s3.PARTS_IN_FLIGHT * s3.PART_BYTES
    assert s3.memory_target(entry("save", 0.1, 240)) == {"limit_bytes": limit, "met": True}
    assert s3.memory_target(entry("save", 0.1, 250))["met"] is False
    e = entry("save", 0.2, 250)
    server = s3.best_server_speed([sample(0.2, 0.25, 0.5, 1.0)])
    e["targets"] = {"server": s3.limit_targets(e, server), "memory": s3.memory_target(e)}
    text = "\n".join(s3.report_lines(e, server))
    assert "PUT GB/s of one 64 MiB object" in text and "0.20 / 0.25" in text and "6.00 / 7.00" in text
    assert "80% of the server's best (0.25 GB/s); target >= 60%: met" in text and "-> over" in text


def test_server_speed_writes_reads_and_compares_on_the_real_server(s3_env):
    import s3fs

    store = s3.S3Store(s3_env, s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False))
    out = s3.server_speed(store, 3 * MiB + 5, streams=(1, 3))
    assert set(out["put_gbps"]) == set(out["get_gbps"]) == set(out["get_gbps_s3fs"]) == set(out["get_gbps_lean"]) == {"1", "3"}
    assert all(v > 0 for v in [*out["put_gbps"].values(), *out["get_gbps"].values()])
    # the limit is the faster of the two readers (each compared its bytes with what was written)
    assert out["get_gbps"] == {k: max(out["get_gbps_s3fs"][k], out["get_gbps_lean"][k]) for k in ("1", "3")}
    assert all(v is not None and v >= 0 for v in out["put_server_cpu_s_per_gb"].values())
    assert not store.holds(store.path("server-limit"))  # it cleans up after itself


def test_a_loads_memory_bound_is_the_disk_bound_plus_its_reads_in_flight():
    limit = 0.1 * 512 * MiB + 64 * MiB + s3.READS_IN_FLIGHT
    for phase in ("load", "reshard"):
        assert s3.memory_target(entry(phase, 0.1, 210)) == {"limit_bytes": limit, "met": True}
        assert s3.memory_target(entry(phase, 0.1, 212))["met"] is False


def test_the_cpu_the_ranks_and_the_server_spent_is_set_against_the_cores(monkeypatch):
    monkeypatch.setattr(io_report.os, "cpu_count", lambda: 2)
    run = Run("ours", "load", 2, 0, ok=True, seconds=[1.0, 1.1], cpu=[0.5, 0.6], server_cpu=1.0)
    use = io_report._cpu_use(run)
    assert use["ranks_seconds"] == pytest.approx(1.1) and use["server_seconds"] == 1.0
    assert use["available_seconds"] == pytest.approx(2.2) and use["busy_fraction"] == pytest.approx(2.1 / 2.2)
    assert io_report._cpu_use(Run("ours", "load", 2, 0, seconds=[1.0, 1.0], cpu=[0.5, None])) is None

    e = entry("load", 1.0, 100)
    e["libs"]["ours"]["best_cpu"] = use
    e["libs"]["torch"] = {"best_cpu": dict(use, server_seconds=None)}  # no server figure: no line
    server = s3.best_server_speed([sample(0.2, 0.25, 0.5, 1.0)])
    lines = [x for x in s3.report_lines(e, server) if x.startswith("CPU seconds")]
    assert lines == ["CPU seconds in paddle_dcp's best run: ranks 1.10 + server 1.00 of the 2.20 the "
                     "machine's cores offer in that time (95% busy)"]


def test_a_worker_reads_the_servers_cpu_time_from_its_pid(monkeypatch):
    import os

    monkeypatch.delenv(s3.SERVER_PID_ENV, raising=False)
    assert s3.server_cpu_seconds() is None
    monkeypatch.setenv(s3.SERVER_PID_ENV, str(os.getpid()))
    first = s3.server_cpu_seconds()
    sum(i * i for i in range(2_000_000))  # spend some CPU
    assert first is not None and s3.server_cpu_seconds() > first
