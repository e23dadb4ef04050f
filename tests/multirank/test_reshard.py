"""Load a checkpoint into another layout than it was saved from, and on another number of
ranks; every rank's values must equal the numpy oracle's slice."""
import pytest

from launcher import assert_passed, run_launch, script

CASES_2 = [
    "save_s0", "s0_into_s1", "s0_into_replicate", "s0_into_s0", "s0_into_s2",
    "s0_into_swapped_mesh_s0", "s0_into_submesh", "s0_into_plain", "s0_into_numpy",
    "s0_into_s1_offload", "save_replicate", "replicate_into_s0", "replicate_into_s1",
    "save_plain", "plain_into_s1", "save_s1_swapped", "s1_into_s0", "s1_into_plain",
    "save_partial_sum", "partial_sum_into_s1", "save_partial_max", "partial_max_into_s0",
    "s0_into_partial_sum", "s0_into_partial_max",
]
CASES_4 = [
    "save_2d", "2d_into_2d_transposed", "2d_into_2d_reversed_ranks", "2d_into_r_s0",
    "2d_into_replicate", "2d_into_1d_s0", "2d_into_1d_s1", "2d_into_submesh_s1", "2d_into_plain",
    "2d_into_numpy", "save_submesh", "submesh_into_2d", "save_1d_s1", "1d_into_2d",
    "save_partial_2d", "partial_2d_into_1d_s1", "2d_into_partial_2d",
]


@pytest.mark.device
def test_reshard_load(tmp_path):
    logs = run_launch(script("reshard.py"), 2, tmp_path, args=[tmp_path / "work", "2"])
    assert_passed(logs, CASES_2, 2)


def test_reshard_load_4ranks(tmp_path):
    logs = run_launch(script("reshard.py"), 4, tmp_path, args=[tmp_path / "work", "4"])
    assert_passed(logs, CASES_4, 4)


@pytest.mark.device
def test_save_half_partial_uneven(tmp_path):
    """[Partial, Shard(0)] bfloat16 (7 rows: 4 | 3) and float16 (1 row: 1 | 0) on a [2, 2]
    mesh: each rank reduces its own piece with the ranks along the partial mesh dim."""
    logs = run_launch(script("reshard.py"), 4, tmp_path, args=[tmp_path / "work", "partial_half"])
    assert_passed(logs, ["save_half_partial_uneven", "load_half_partial_uneven"], 4)


def test_reshard_across_world_sizes(tmp_path):
    """Saved by 2 ranks, loaded by 4 (and saved again); that loaded by 2."""
    work = tmp_path / "work"
    logs = run_launch(script("reshard.py"), 2, tmp_path, args=[work, "ws_save2"])
    assert_passed(logs, ["save_on_2"], 2)
    logs = run_launch(script("reshard.py"), 4, tmp_path, args=[work, "ws_load2_save4"])
    assert_passed(logs, ["load_2_into_2d", "load_2_into_1d_s1", "load_2_into_replicate", "save_on_4"], 4)
    logs = run_launch(script("reshard.py"), 2, tmp_path, args=[work, "ws_load4"])
    assert_passed(logs, ["load_4_into_s0", "load_4_into_s1", "load_4_into_plain"], 2)
    assert sorted(p.name for p in (work / "ws2").iterdir()) == ["0.0.claim", "0.metadata", "0_0.distcp", "1_0.distcp"]
    assert sorted(p.name for p in (work / "ws4").iterdir()) == ["0.0.claim", "0.metadata"] + [f"{r}_0.distcp" for r in range(4)]
