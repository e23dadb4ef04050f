"""Node-local disks: ranks that lack the metadata or a data file get what they need from
ranks that have it; a data file nobody has raises on every rank instead of hanging."""
import pytest

from launcher import assert_passed, run_launch, script


def test_node_local_disks_4ranks_2nodes(tmp_path):
    logs = run_launch(script("nodelocal.py"), 4, tmp_path, args=[tmp_path / "work", 2])
    assert_passed(logs, ["save", "same_layout", "into_1d_s1", "into_reversed_2d", "into_replicate",
                         "into_plain", "file_missing_everywhere", "load_after_restoring_the_file",
                         "worker_groups_choose_the_sender"], 4)


@pytest.mark.device
def test_node_local_disks_2ranks_each_alone(tmp_path):
    logs = run_launch(script("nodelocal.py"), 2, tmp_path, args=[tmp_path / "work", 1])
    assert_passed(logs, ["save", "same_layout", "into_s1", "into_swapped_s0", "into_plain",
                         "file_missing_everywhere", "load_after_restoring_the_file"], 2)


def test_warnings_name_only_missing_keys_on_ranks_without_metadata(tmp_path):
    """Rank 1 has no metadata file and holds nothing of the tensors on the sub-mesh [0]: it
    must not warn that the checkpoint lacks them (only "extra" and "extra_value")."""
    cases = ["save", "warnings_name_only_missing_keys"]
    logs = run_launch(script("nodelocal.py"), 2, tmp_path, args=[tmp_path / "work", 1, *cases], timeout=120)
    assert_passed(logs, cases, 2)


def test_aoa_config_refused_when_a_rank_lacks_the_metadata(tmp_path):
    cases = ["save", "aoa_refused"]
    logs = run_launch(script("nodelocal.py"), 2, tmp_path, args=[tmp_path / "work", 1, *cases], timeout=120)
    assert_passed(logs, cases, 2)
