"""Resume on any layout and any number of ranks: checkpoints saved by 2 ranks loaded by 4,
saved by 4 loaded by 2 and by one process run without the launcher (4 -> 2 -> 1, 2 -> 4,
2 -> 1); the dtypes bfloat16, float16, float32, int64 and bool resharded (Shard(0) ->
Replicate / Shard(1); a [2, 2] mesh -> a 1-D mesh of 2 ranks, sub-meshes, other 2-D layouts;
uneven shapes); a trained model with its AdamW state (multi_precision master weights,
moments, beta powers, LR scheduler) and plain values; master-weight key spellings; warnings
naming keys; offload. One test: each job loads what the jobs before it saved."""
from launcher import assert_passed, run_launch, run_single, script

FIRST2 = [
    "dtypes_save_s0", "dtypes_s0_into_replicate", "dtypes_s0_into_s1", "dtypes_s0_into_swapped_s1",
    "dtypes_s0_into_swapped_s0", "save_two", "train_save", "train_into_other_layout",
    "train_into_static_mw_spelling", "mw_save", "mw_dynamic_into_static", "mw_static_into_dynamic",
    "mw_off_leaves_keys_and_warns", "mw_off_through_paddles_call", "warnings_name_keys", "offload_dist_s1",
    "offload_dtypes_s1", "offload_plain",
]
THEN4 = [
    "two_into_2d", "two_into_1d_s1", "dtypes_s0_into_2d", "dtypes_save_2d", "dtypes_2d_into_1d_of_2_low",
    "dtypes_2d_into_1d_of_2_high", "dtypes_2d_into_submesh", "dtypes_2d_into_one_rank",
    "dtypes_2d_into_2d_transposed", "dtypes_2d_into_replicate", "train2_into_4_and_save", "save_four",
]
THEN2 = [
    "four_into_s0", "four_into_s1", "four_into_replicate", "dtypes_2d_into_s0", "dtypes_2d_into_s1",
    "dtypes_2d_into_replicate", "train4_into_2", "four_into_s1_saved_as_four_two",
]
SINGLE = [
    "four_into_plain", "four_into_numpy", "four_into_one_rank_mesh", "two_into_plain", "two_into_numpy",
    "two_into_one_rank_mesh", "four_two_into_plain", "four_two_into_one_rank_mesh", "dtypes_s0_into_plain",
    "dtypes_s0_into_numpy", "dtypes_2d_into_one_rank_mesh", "train2_into_single", "train4_into_single",
    "offload_single_one_rank_mesh", "offload_single_plain",
]


def test_resume_across_layouts_and_world_sizes(tmp_path):
    work = tmp_path / "work"
    resume = script("resume.py")
    assert_passed(run_launch(resume, 2, tmp_path, args=[work, "first2"], timeout=150), FIRST2, 2)
    assert_passed(run_launch(resume, 4, tmp_path, args=[work, "then4"], timeout=150), THEN4, 4)
    assert_passed(run_launch(resume, 2, tmp_path, args=[work, "then2"], timeout=150), THEN2, 2)
    assert_passed(run_single(resume, tmp_path, args=[work, "single"], timeout=120), SINGLE, 1)
    # who wrote what: 2 ranks, then 4, then 2
    for name, writers in [("two", 2), ("dt_s0", 2), ("train2", 2), ("dt_2d", 4), ("four", 4),
                          ("train4", 4), ("four_two", 2)]:
        files = sorted(p.name for p in (work / name).iterdir())
        assert files == ["0.0.claim", "0.metadata"] + [f"{r}_0.distcp" for r in range(writers)], (name, files)
