"""The node-local tier's benchmark, the suite tiers (scripts/bench/tiers.py): its figures, ratios and targets,
the check that a restore took its bytes from the source meant, and the state's layout."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench import tiers, tiers_worker  # noqa: E402

MiB = 1 << 20
A, B = tiers.NODES
SHARE = 512 * MiB


def restore_run(*seconds):
    return [{"seconds": s} for s in seconds]


def save_run(first, later):
    """One job's ranks: (blocked, total) of the first and the later save, per rank."""
    return [{"saves": [{"step": 1, "blocked": f[0], "total": f[1]}, {"step": 2, "blocked": l[0], "total": l[1]}]}
            for f, l in zip(first, later)]


def summary_of(local, peer, s3, local_async_blocked, async_blocked):
    runs = {"restore": {"local": [restore_run(*r) for r in local], "peer": [restore_run(*r) for r in peer],
                        "global-s3": [restore_run(*r) for r in s3]},
            "save": {"local-async": [save_run([(b, 5.0)] * 2, [(b, 4.0)] * 2) for b in local_async_blocked],
                     "async": [save_run([(b, 3.0)] * 2, [(b, 2.0)] * 2) for b in async_blocked]}}
    return tiers.summarize(runs)


def test_a_repeat_counts_its_slowest_rank_and_the_summary_is_best_and_median():
    s = summary_of(local=[(1.0, 2.0), (1.5, 0.5), (3.0, 0.1)], peer=[(2.0, 2.5)], s3=[(9.0, 9.0)],
                   local_async_blocked=[0.5, 0.3], async_blocked=[0.4, 0.6])
    assert s["restore.local"] == {"best": 1.5, "median": 2.0, "samples": [2.0, 1.5, 3.0]}
    assert s["restore.peer"]["best"] == 2.5 and "restore.global-disk" not in s
    assert s["save.local-async.later.blocked"]["best"] == 0.3 and s["save.local-async.first.total"]["best"] == 5.0
    assert s["save.async.later.blocked"]["median"] == pytest.approx(0.5)


def test_targets_hold_on_the_best_figures_and_say_when_the_medians_disagree():
    s = summary_of(local=[(1.0,), (1.0,)], peer=[(1.5,), (2.5,)], s3=[(6.0,), (6.0,)],
                   local_async_blocked=[0.3, 0.3], async_blocked=[0.3, 0.3])
    t = {x["target"]: x for x in tiers.check_targets(s)}
    s3 = t["peer restore >= 3x faster than S3"]
    assert s3["ratio"]["best"] == pytest.approx(4.0) and s3["ok"] is True and s3["median_ok"] is True
    near = t["peer restore within 2x of local"]
    assert near["ratio"] == {"best": pytest.approx(1.5), "median": pytest.approx(2.0)} and near["ok"] and near["median_ok"]
    assert t["local-tier async save blocks <= today's async (later save)"]["ok"] is True  # equal is within
    text = "\n".join(tiers.format_targets(s))
    assert "PASS peer restore >= 3x faster than S3" in text and "(target >= 3x)" in text
    s = summary_of(local=[(1.0,), (1.0,)], peer=[(1.5,), (3.5,)], s3=[(5.0,), (5.0,)],
                   local_async_blocked=[0.4, 0.4], async_blocked=[0.3, 0.3])
    t = {x["target"]: x for x in tiers.check_targets(s)}
    assert t["peer restore within 2x of local"]["ok"] is True and t["peer restore within 2x of local"]["median_ok"] is False
    assert t["peer restore >= 3x faster than S3"]["ok"] is True and t["peer restore >= 3x faster than S3"]["median_ok"] is False
    text = "\n".join(tiers.format_targets(s))
    assert "(median: MISS)" in text and "MISS local-tier async save blocks <= today's async (later save)" in text


def test_a_target_without_its_figures_is_not_measured():
    s = summary_of(local=[(1.0,)], peer=[(1.0,)], s3=[], local_async_blocked=[0.1], async_blocked=[0.1])
    t = {x["target"]: x for x in tiers.check_targets(s)}
    assert t["peer restore >= 3x faster than S3"]["ratio"] is None and t["peer restore >= 3x faster than S3"]["ok"] is None
    assert "NOT MEASURED peer restore >= 3x faster than S3" in tiers.format_targets(s)


def test_the_table_gives_seconds_and_gigabytes_per_second_at_the_best():
    s = summary_of(local=[(0.5,)], peer=[(1.0,)], s3=[(4.0,)], local_async_blocked=[0.1], async_blocked=[0.2])
    lines = tiers.format_table(s, 10**9)
    assert "| restore, own local tier | 0.50 | 0.50 | 2.00 | - |" in lines
    assert "| save, global only (async, today), later, blocked | 0.20 | 0.20 | 5.00 | |" in lines
    assert not any("global tier on disk" in line for line in lines)


def report(tier, local=0, peer=0, glob=0):
    return {"tier": tier, "bytes": {"local": local, "peer": peer, "global": glob}}


def test_each_restore_must_take_its_bytes_from_the_source_meant():
    check = tiers.source_check
    assert check("local", [(A, report("local", SHARE)), (B, report("local", SHARE))], SHARE) == ""
    assert "own node" in check("local", [(A, report("local", SHARE)), (B, report("local", 0, SHARE))], SHARE)
    assert check("peer", [(A, report("local", SHARE)), (B, report("local", 0, SHARE))], SHARE) == ""
    assert "other node" in check("peer", [(A, report("local", SHARE)), (B, report("local", SHARE))], SHARE)
    assert "expected local" in check("peer", [(A, report("global", glob=SHARE)), (B, report("global", glob=SHARE))], SHARE)
    # the global tier: every rank from it, or only the wiped node's ranks (the library repairing the lost files)
    assert check("global-s3", [(A, report("global", glob=SHARE)), (B, report("global", glob=SHARE))], SHARE) == ""
    assert check("global-disk", [(A, report("local", SHARE)), (B, report("local", glob=SHARE))], SHARE) == ""
    assert "global tier" in check("global-s3", [(A, report("local", SHARE)), (B, report("local", 0, SHARE))], SHARE)
    assert "both" in check("local", [(A, report("local", SHARE)), (A, report("local", SHARE))], SHARE)
    # both nodes' local directories deleted: a load of the global tier alone
    assert check("global-s3-all", [(A, report("global", glob=SHARE)), (B, report("global", glob=SHARE))], SHARE) == ""
    assert "global tier" in check("global-disk-all", [(A, report("local", SHARE)), (B, report("local", glob=SHARE))], SHARE)


@pytest.mark.parametrize("size,ranks", [(1 << 30, 2), (1 << 30, 4), (64 * MiB, 2), (100 * MiB + 12345, 2)])
def test_the_state_is_float32_in_tensors_of_at_most_64_mib_split_evenly_over_the_ranks(size, ranks):
    shapes = [shape for _, shape in tiers_worker.layout(size, ranks)]
    row = 4 * tiers_worker.COLS
    assert all(rows % ranks == 0 and rows * row <= tiers_worker.TENSOR_BYTES for rows, _ in shapes)
    total = sum(rows * row for rows, _ in shapes)
    assert size - row * ranks < total <= size
    assert len({key for key, _ in tiers_worker.layout(size, ranks)}) == len(shapes)


def test_pieces_differ_by_step_rows_and_tensor():
    pieces = [tiers_worker.piece(i, r, s, 4) for i, r, s in ((0, 0, 1), (0, 0, 2), (0, 4, 1), (1, 0, 1))]
    digests = {tiers_worker.digest(p) for p in pieces}
    assert len(digests) == len(pieces)
    assert tiers_worker.digest(tiers_worker.piece(0, 0, 1, 4)) == tiers_worker.digest(pieces[0])


def test_the_pieces_of_any_rank_count_are_rows_of_one_tensor():
    """A job resumed on another rank count checks its pieces against the same global values."""
    whole = tiers_worker.piece(3, 0, 2, 8)
    halves = [tiers_worker.piece(3, r * 4, 2, 4) for r in range(2)]
    assert np.array_equal(np.concatenate(halves), whole)


def test_a_resume_on_the_node_left_takes_every_byte_from_that_node():
    check = tiers.source_check
    both = 2 * SHARE
    assert check("survivor", [(A, report("local", both))], both) == ""
    assert check("survivor", [(A, report("local", SHARE, SHARE))], both) == ""  # the lost node's files: its copies
    assert "alone" in check("survivor", [(A, report("local", SHARE)), (B, report("local", SHARE))], both)
    assert "alone" in check("survivor", [(A, report("local", SHARE, glob=SHARE))], both)
    assert "alone" in check("survivor", [(A, report("local", SHARE))], both)  # bytes missing


def test_the_load_step_is_read_from_the_workers_logs_and_summarized(tmp_path):
    for node, seconds in zip(tiers.NODES, ("0.115", "0.478")):
        log = tmp_path / node / "log-restore-peer"
        log.mkdir(parents=True)
        (log / "workerlog.0").write_text(
            "noise\n[..] INFO api.py:275 - loaded checkpoint 2 from local: 536870912 bytes by this rank in "
            f"{seconds} s\n")
    assert tiers.load_seconds(str(tmp_path), "restore-peer", 1) == [0.115, 0.478]
    assert tiers.load_seconds(str(tmp_path), "restore-local", 1) == [None, None]
    runs = {"restore": {"peer": [[{"seconds": 0.7, "load_seconds": 0.1}, {"seconds": 0.75, "load_seconds": 0.5}]],
                        "local": [[{"seconds": 0.5, "load_seconds": None}, {"seconds": 0.5}]]}}
    s = tiers.summarize(runs)
    assert s["restore.peer.load"]["best"] == 0.5 and "restore.local.load" not in s
    assert "| restore, other node's copies | 0.75 | 0.75 | 1.33 | 0.50 (0.50) |" in tiers.format_table(s, 10**9)


def test_a_saves_written_time_is_read_from_the_workers_logs_the_first_line_of_each_step(tmp_path):
    for node in tiers.NODES:
        log = tmp_path / node / "log-save-local"
        log.mkdir(parents=True)
        (log / "workerlog.0").write_text(
            "[..] INFO api.py:165 - saved checkpoint 1 to local: 536870912 bytes written by this rank in 6.534 s\n"
            "[..] INFO api.py:165 - saved checkpoint 2 to local: 536870912 bytes written by this rank in 3.231 s (plan reused)\n"
            "[..] INFO api.py:165 - saved checkpoint 2 to local0: 536870912 bytes written by this rank in 0.669 s\n")
    assert tiers.written_seconds(str(tmp_path), "save-local", 1) == [{1: 6.534, 2: 3.231}] * 2
    res = [{"saves": [{"step": 1, "blocked": 1.0, "total": 9.0}, {"step": 2, "blocked": 0.2, "total": 5.0}]}
           for _ in range(2)]
    tiers._add_written(res, str(tmp_path), "save-local", 1)
    s = tiers.summarize({"save": {"local-async": [res]}})
    assert s["save.local-async.later.written"]["best"] == 3.231
    line = next(x for x in tiers.format_table(s, 10**9) if "later, total" in x)
    assert line.endswith("| 3.23 (3.23) |")
