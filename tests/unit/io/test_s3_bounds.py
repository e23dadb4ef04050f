"""Object storage on the session's real S3 server (SeaweedFS on 127.0.0.1): a rank's memory
stays within issue 17's bound, and a save and a load make only the listing requests they need.

Memory is the peak of Python's traced allocations during the call (tracemalloc: bytes,
bytearrays and numpy buffers, including those the S3 client allocates), so the figure does not
depend on the allocator or on what else runs on the machine. The state dict exists before the
measurement starts, as a training job's does.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import paddle_dcp

MiB = 1 << 20
SHARE = 96 * MiB  # one process: the whole checkpoint is its share
# small limits, so that copies per part or per range in flight show up clearly above them
OPTIONS = {
    "part_size": 5 * MiB, "parts_in_flight": 3,
    "read_chunk_bytes": 2 * MiB, "read_ahead_bytes": 8 * MiB, "read_cache_bytes": 4 * MiB,
}
MAX_READ = 32 * MiB  # the planner's largest read (load_plan.plan_reads' max_read_bytes)
MARGIN = 6 * MiB  # metadata, plans, the client's own buffers


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sd = {f"layer{i}.w": rng.standard_normal((768, 1024), dtype=np.float32) for i in range(24)}  # 3 MiB each
    sd["emb"] = rng.standard_normal((1536, 4096), dtype=np.float32)  # 24 MiB: one tensor of several parts
    assert sum(a.nbytes for a in sd.values()) == SHARE
    return sd


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def saved(s3_env):
    url = s3_env.url("bounds")
    sd = _state(0)
    paddle_dcp.save_state_dict(sd, url, storage_options=OPTIONS)  # warms the client up too
    return url, sd


def test_a_save_stays_within_the_disk_bound_plus_the_parts_in_flight(saved):
    url, _ = saved
    sd = _state(1)
    peak = _peak(lambda: paddle_dcp.save_state_dict(sd, url, storage_options=OPTIONS))
    bound = SHARE // 10 + OPTIONS["parts_in_flight"] * OPTIONS["part_size"] + MARGIN
    assert peak <= bound, f"save peak {peak / MiB:.1f} MiB > {bound / MiB:.1f} MiB"
    back = {k: np.zeros_like(v) for k, v in sd.items()}
    paddle_dcp.load_state_dict(back, url, storage_options=OPTIONS)
    assert all(np.array_equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_stays_within_the_disk_bound_plus_the_reads_in_flight(saved, verify):
    url, sd = saved
    back = {k: np.zeros_like(v) for k, v in sd.items()}
    peak = _peak(lambda: paddle_dcp.load_state_dict(back, url, storage_options=OPTIONS, verify=verify))
    in_flight = max(OPTIONS["read_ahead_bytes"], MAX_READ) + OPTIONS["read_cache_bytes"]
    bound = SHARE // 10 + in_flight + MARGIN
    assert peak <= bound, f"load peak {peak / MiB:.1f} MiB > {bound / MiB:.1f} MiB"
    assert all(np.array_equal(back[k], sd[k]) for k in sd)


