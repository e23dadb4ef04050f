"""The spill file of object-storage loads (paddle_dcp.io.spill): ranges kept and mapped back
exactly, where it goes by default, and a failing disk turning it off instead of failing a load."""
from __future__ import annotations

import os
import shutil

import numpy as np

from paddle_dcp.io import spill
from paddle_dcp.io.spill import Intervals, SpillFiles, filesystem_type, spill_directory

MOUNTS = """\
22 1 0:21 / / rw,relatime shared:1 - overlay overlay rw
23 22 0:22 / /tmp rw,nosuid shared:2 - tmpfs tmpfs rw
24 22 8:1 / /tmp/disk rw shared:3 - ext4 /dev/sda1 rw
25 22 8:2 / /my\\040data rw shared:4 - xfs /dev/sda2 rw
"""


def test_the_filesystem_is_that_of_the_longest_mount_point_holding_the_path(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTS)
    assert filesystem_type("/tmp/x", str(table)) == "tmpfs"
    assert filesystem_type("/tmp/disk/x", str(table)) == "ext4"
    assert filesystem_type("/tmpfoo", str(table)) == "overlay"  # not under /tmp
    assert filesystem_type("/my data/ckpt", str(table)) == "xfs"
    assert filesystem_type("/x", str(tmp_path / "missing")) is None


def test_auto_uses_the_temporary_directory_unless_it_is_memory(monkeypatch):
    monkeypatch.setattr(spill.tempfile, "gettempdir", lambda: "/scratch")
    monkeypatch.setattr(spill, "filesystem_type", lambda path: "ext4")
    assert spill_directory("auto") == "/scratch"
    monkeypatch.setattr(spill, "filesystem_type", lambda path: "tmpfs")
    assert spill_directory("auto") is None
    assert spill_directory("/fast/nvme") == "/fast/nvme"
    assert spill_directory(None) is None and spill_directory("") is None


def test_intervals_merge_and_cover():
    runs = Intervals()
    for a, b in ((10, 20), (30, 40), (20, 25), (50, 60), (24, 31), (5, 6)):
        runs.add(a, b)
    assert list(zip(runs.starts, runs.stops)) == [(5, 6), (10, 40), (50, 60)]
    assert runs.covers(10, 40) and runs.covers(12, 13) and runs.covers(55, 60)
    assert not runs.covers(5, 7) and not runs.covers(39, 51) and not runs.covers(0, 1) and not runs.covers(61, 62)
    runs.add(0, 100)
    assert list(zip(runs.starts, runs.stops)) == [(0, 100)]


def _keep(kept: SpillFiles, index: int, start: int, data: np.ndarray) -> bool:
    region = kept.region(index, start, start + len(data))
    if region is None:
        return False
    region.buf[:] = data
    region.close(kept=True)
    return True


def test_ranges_come_back_exactly_whichever_regions_kept_them_and_leave_no_file(tmp_path):
    rng = np.random.default_rng(0)
    data = {0: rng.integers(0, 256, 9000, dtype=np.uint8), 3: rng.integers(0, 256, 80000, dtype=np.uint8)}
    kept = SpillFiles(str(tmp_path))
    for index, cuts in ((0, (0, 5000, 9000)), (3, (4096, 30000, 74096))):
        for a, b in zip(cuts, cuts[1:]):
            assert _keep(kept, index, a, data[index][a:b])
    assert list(tmp_path.iterdir()) == []
    for index, a, b in ((0, 0, 9000), (0, 4000, 6000), (3, 4096, 74096), (3, 20000, 40000)):
        assert kept.covers(index, a, b)
        with kept.mapped(index, a, b) as got:
            assert np.array_equal(got, data[index][a:b])
    assert not kept.covers(3, 0, 5000) and not kept.covers(1, 0, 1) and not kept.covers(0, 8000, 9001)
    region = kept.region(0, 20000, 30000)  # a region not kept (its fetch failed) is not covered
    region.close(kept=False)
    assert not kept.covers(0, 20000, 20001)
    kept.close()


def test_a_full_disk_turns_spilling_off(tmp_path, monkeypatch, caplog):
    kept = SpillFiles(str(tmp_path))
    free = spill.MIN_FREE_BYTES + 100
    monkeypatch.setattr(spill.shutil, "disk_usage", lambda d: shutil._ntuple_diskusage(10 * free, 9 * free, free))
    assert _keep(kept, 0, 0, np.ones(100, np.uint8))
    assert kept.region(0, 100, 201) is None  # would leave less than the reserve
    assert "stopped" in caplog.text and not kept.enabled
    assert kept.region(0, 300, 301) is None
    assert kept.covers(0, 0, 100) and not kept.covers(0, 100, 201)
    kept.close()


def test_a_failing_allocation_turns_spilling_off(tmp_path, monkeypatch):
    kept = SpillFiles(str(tmp_path))

    def broken(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spill.os, "posix_fallocate", broken)
    assert kept.region(0, 0, 10) is None and not kept.enabled
    kept.close()
    assert os.listdir(tmp_path) == []
