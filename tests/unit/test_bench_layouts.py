"""The suite layouts of the benchmarks (scripts/bench/layouts.py): the staggered and guillotine
layouts it writes tile their tensor and are no grid (the guillotine one undecided by any split); the checkpoint its builder writes with the library's own
parts verifies, reads and loads exactly, and a damaged one fails each measure; the summary's
best, median and ratio; a call over its timeout is stopped."""
import gc
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench import layouts  # noqa: E402

import paddle_dcp  # noqa: E402
from paddle_dcp.core.grids import find_grids  # noqa: E402
from paddle_dcp.tools.verify import verify_checkpoint  # noqa: E402


@pytest.mark.parametrize("rows, cols", [(2, 32), (5, 7)])
def test_staggered_bricks_tile_the_matrix_once_and_are_no_grid(rows, cols):
    shape, offsets, shapes = layouts.staggered(rows, cols)
    assert shape == (rows, 2 * cols) and len(offsets) == rows * cols + rows // 2
    cover = np.zeros(shape, np.int64)
    for (r, c), (h, w) in zip(offsets.tolist(), shapes.tolist()):
        cover[r : r + h, c : c + w] += 1
    assert (cover == 1).all()
    grid = find_grids(np.array([0, len(offsets)]), offsets, shapes, np.array([2]), np.array([shape]))
    assert not grid.grid[0]
    assert layouts.bricks_for(16_000, 2) == (2, 8000)  # 16,001 pieces, the count of issue 38
    assert [r * c + r // 2 for r, c in (layouts.bricks_for(n, 3) for n in (1, 64, 1000))] == [1, 64, 1000]


def test_the_guillotine_cube_tiles_once_and_no_split_decides_it():
    from paddle_dcp.core import boxes

    shape, offsets, shapes = layouts.layout_for("guillotine", 500, rows=2)
    assert len(offsets) == 500 and len(shape) == 3
    cover = np.zeros(shape, np.int64)
    for at, extent in zip(offsets.tolist(), shapes.tolist()):
        cover[tuple(slice(a, a + n) for a, n in zip(at, extent))] += 1
    assert (cover == 1).all()
    assert boxes.first_overlap_nd(offsets, offsets + shapes) is boxes.UNDECIDED


@pytest.fixture
def without_paddle(monkeypatch):
    """paddle unimportable: a load is a world of one (parallel.comm.make_comm), as the suite's
    is in a process without a job, and no unit test imports paddle."""
    monkeypatch.setitem(sys.modules, "paddle", None)


def test_the_checkpoint_written_verifies_and_loads_exactly(tmp_path, without_paddle):
    built = layouts.write_checkpoint(str(tmp_path), layouts.staggered(2, 32), files=3)
    assert (built.pieces, built.shape, built.files) == (65, (2, 64), 3)
    problems, counts = verify_checkpoint(str(tmp_path), built.unique_id)
    assert problems == [] and counts["pieces"] == 65 and counts["files"] == 3
    meta = paddle_dcp.read_metadata(str(tmp_path)).validate()
    assert meta.tensors[layouts.KEY].pieces.count == 65
    target = np.full(built.shape, np.nan, np.float32)
    paddle_dcp.load_state_dict({layouts.KEY: target}, str(tmp_path))
    assert np.array_equal(target, np.arange(128, dtype=np.float32).reshape(2, 64))
    for m in layouts.MEASURES:
        run = layouts.measure_one(m, built, timeout=60)
        assert run["ok"] and run["seconds"] >= 0 and run["cpu_seconds"] >= 0, run


def test_a_guillotine_checkpoint_verifies_and_loads_exactly(tmp_path, without_paddle):
    built = layouts.write_checkpoint(str(tmp_path), layouts.guillotine(300), files=2)
    assert built.pieces == 300
    target = np.full(built.shape, np.nan, np.float32)
    paddle_dcp.load_state_dict({layouts.KEY: target}, str(tmp_path))
    layouts.check_loaded(target, built.shape)
    assert verify_checkpoint(str(tmp_path), built.unique_id)[0] == []


def test_a_damaged_checkpoint_fails_every_measure_that_reads_it(tmp_path, without_paddle):
    built = layouts.write_checkpoint(str(tmp_path), layouts.staggered(2, 32), files=1)
    data = tmp_path / "0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[4] ^= 0xFF  # a value of the first brick
    data.write_bytes(bytes(raw))
    for m in ("verify", "load"):
        run = layouts.measure_one(m, built, timeout=60)
        assert not run["ok"] and not run["over"] and run["error"], run
    assert layouts.measure_one("metadata", built, timeout=60)["ok"]  # the metadata is intact
    with pytest.raises(RuntimeError, match="wrong values"):
        layouts.check_loaded(np.zeros(built.shape, np.float32), built.shape)


def run(measure, n, seconds, cpu, ok=True, over=False):
    return {"measure": measure, "pieces": n, "ok": ok, "over": over, "seconds": seconds, "cpu_seconds": cpu,
            "gc_seconds": seconds and seconds / 10, "error": "over 5 s" if over else None}


def test_the_summary_takes_best_and_median_and_the_ratio_of_time_per_piece():
    runs = [run("verify", 1000, 0.3, 0.2), run("verify", 1000, 0.1, 0.1), run("verify", 1000, 0.2, 0.3),
            run("verify", 4000, 0.8, 0.8), run("verify", 4000, None, None, ok=False),
            run("load", 1000, 0.5, 0.5), run("load", 4000, None, None, ok=False, over=True)]
    s = layouts.summarize(runs)
    rows = {(e["measure"], e["pieces"]): e for e in s["table"]}
    v = rows[("verify", 1000)]
    assert (v["best"], v["median"], v["cpu_best"], v["cpu_median"], v["runs"]) == (0.1, 0.2, 0.1, 0.2, 3)
    assert v["us_per_piece"] == pytest.approx(100) and v["gc_seconds"] == pytest.approx(0.01)  # the best run's
    assert s["ratios"]["verify"] == {"from": 1000, "to": 4000, "ratio": pytest.approx(2.0), "cpu_ratio": pytest.approx(2.0)}
    assert rows[("load", 4000)]["over"] == "over 5 s" and "best" not in rows[("load", 4000)]
    assert s["ratios"]["load"] is None and s["ratios"]["metadata"] is None


def test_a_call_over_its_timeout_is_stopped():
    t0 = time.perf_counter()
    with pytest.raises(layouts.Overtime):
        layouts.timed(lambda: time.sleep(5), 0.05)
    assert time.perf_counter() - t0 < 2
    wall, cpu, collecting = layouts.timed(lambda: gc.collect(), 30)
    layouts.timed(lambda: None, 0.05)
    time.sleep(0.1)  # the alarm was cancelled: nothing goes off later
    assert wall >= collecting > 0 and cpu >= 0 and layouts.timed(lambda: None, 0)[2] == 0
