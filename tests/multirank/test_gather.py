"""save_gathered: a sharded state dict gathered to one rank as one safetensors file, on 2 ranks
(1-D mesh, every dtype safetensors holds, Shard(0) / Shard(1) / Replicate / Partial, uneven
shapes and an empty shard, nested plain values, state_type "opt", errors) and 4 ranks (a
[2, 2] mesh and a 1-D mesh of 4); every file loaded with paddle.load(path, safetensors=True)
and with paddle_dcp.load_state_dict in the job and in one process without launch, compared bit
for bit with the numpy oracle; and the gathering rank's peak memory bounded by the group limit."""
import re
import pytest

from launcher import assert_passed, run_launch, run_single, script

TWO = ["save_files", "files_identical", "check_in_job", "load_into_dist_other_layout", "opt_union",
       "params_needs_same_keys", "complex_refused", "bad_arguments"]
FOUR = ["save_files", "files_identical", "check_in_job"]
SINGLE = ["single_files", "single_header_checks"]


def test_gather_2_and_4_ranks_then_one_process(tmp_path):
    work = tmp_path / "work"
    gather = script("gather.py")
    assert_passed(run_launch(gather, 2, tmp_path, args=[work, "two", *TWO], timeout=150), TWO, 2)
    assert_passed(run_launch(gather, 4, tmp_path, args=[work, "four"], timeout=150), FOUR, 4)
    assert_passed(run_single(gather, tmp_path, args=[work, "single"], timeout=120), SINGLE, 1)


@pytest.mark.device
def test_gather_group_limit_bounds_peak_memory(tmp_path):
    """256 MiB of float32 tensors on 2 ranks: the gathering rank's peak RSS grows by less than
    3 x 16 MiB + 16 MiB with max_grouped_size="16M", by at least the whole file with "1G"."""
    logs = run_launch(script("gather.py"), 2, tmp_path, args=[tmp_path / "work", "two", "memory_bound"], timeout=150)
    assert_passed(logs, ["memory_bound"], 2)
    lines = re.findall(r"^MEMORY .*$", logs, re.M)
    assert len(lines) == 2, logs[-2000:]
    print("\n".join(lines))
