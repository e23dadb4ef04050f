"""Failures raise on every rank (CollectiveError naming each failing rank and its error),
leave no metadata behind, and never leave a rank waiting."""
from launcher import assert_passed, run_launch, script

CASES = [
    "shape_mismatch", "dtype_mismatch", "mismatch_on_one_rank", "tensor_where_value_was_saved",
    "empty_directory", "missing_directory", "missing_unique_id", "bad_unique_id",
    "truncated_shard", "corrupted_byte", "checks_shared_in_a_reshard", "corrupted_byte_in_a_reshard",
    "future_format_version", "damaged_metadata",
    "data_file_missing", "unknown_keys_are_left_alone", "missing_keys_raise_on_every_rank",
    "missing_key_on_one_rank_raises_on_every_rank", "many_missing_keys_are_counted",
    "plain_values_are_restored_whole", "load_waits_for_this_process_async_save",
    "object_on_one_rank", "object_on_coordinator", "write_fails_on_one_rank", "async_save_without_bfloat16",
]


def test_errors_on_every_rank(tmp_path):
    logs = run_launch(script("errors.py"), 2, tmp_path, args=[tmp_path / "work"], timeout=150)
    assert_passed(logs, CASES, 2)


def test_async_save_of_bfloat16(tmp_path):
    """save_state_dict(async_save=True) of a state dict with a bfloat16 tensor, waited for,
    then loaded: every rank's values equal the oracle's."""
    logs = run_launch(script("errors.py"), 2, tmp_path, args=[tmp_path / "work", "async_save_bfloat16"], timeout=120)
    assert_passed(logs, ["async_save_bfloat16"], 2)
