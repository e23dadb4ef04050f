"""The suite many of the benchmarks (scripts/bench/many.py): its counts, its workload's mix,
the best run and the ratio of the time per tensor from the smallest count to the largest."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench import many, many_worker  # noqa: E402


def test_counts_take_k_for_thousands_and_come_sorted_once_each():
    assert many.parse_counts("100k, 10k,30k,10000") == [10_000, 30_000, 100_000]
    for bad in ("", "ten", "0", "-1k"):
        with pytest.raises(ValueError):
            many.parse_counts(bad)


def test_the_workload_is_small_tensors_mostly_sharded_each_named_once():
    specs = many_worker.build_specs(1000)
    assert len(specs) == 1000 and len({s.name for s in specs}) == 1000 and len({s.seed for s in specs}) == 1000
    sizes = sorted(s.nbytes for s in specs)
    assert sizes[0] == 1024 and sizes[-1] == 4096  # 1 to 4 KiB
    assert sum(s.layout != "R" for s in specs) == 800  # 8 in 10 sharded over the mesh
    assert sum(s.layout != s.reshard for s in specs) == 900  # the reshard moves all of those, and 1 in 10 more
    assert {(s.layout, s.reshard) for s in specs} == {("S0", "S1"), ("S1", "S0"), ("R", "R"), ("R", "S0")}


def run(phase, n, seconds, ok=True, cpu=None):
    return {"lib": "ours", "phase": phase, "tensors": n, "ok": ok, "seconds": seconds,
            "cpu_seconds": [cpu or seconds, 0.5 * (cpu or seconds)], "gc_seconds": [0.1, 0.2]}


def test_the_summary_takes_each_best_run_and_the_ratio_of_time_per_tensor():
    runs = [run("load", 10_000, 2.0), run("load", 10_000, 1.0, cpu=0.8), run("load", 100_000, 12.0, cpu=9.6),
            run("load", 30_000, 0.1, ok=False), run("save", 10_000, 3.0)]
    s = many.summarize(runs, [10_000, 30_000, 100_000])
    rows = {(e["phase"], e["tensors"]): e for e in s["table"]}
    assert set(rows) == {("load", 10_000), ("load", 100_000), ("save", 10_000)}  # a failed run counts for nothing
    assert rows[("load", 10_000)]["seconds"] == 1.0 and rows[("load", 10_000)]["us_per_tensor"] == pytest.approx(100)
    assert rows[("load", 10_000)]["cpu_us_per_tensor"] == pytest.approx(80) and rows[("load", 10_000)]["gc_seconds"] == 0.2
    assert s["ratios"]["ours.load"] == {"from": 10_000, "to": 100_000, "ratio": pytest.approx(1.2),
                                        "cpu_ratio": pytest.approx(1.2)}
    assert s["ratios"]["ours.save"] is None  # one count: no ratio
