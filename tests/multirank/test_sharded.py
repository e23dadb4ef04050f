"""ShardedWeight state dicts (TP, sharding stage 1, stage 2 flattened) mixed with dist tensors,
plain tensors and numpy arrays: every layout loads into every other bit for bit; save_replicas
writes each holder's copy, so node-local disks load without exchange; paddle's built-in agrees."""
import pytest

from launcher import assert_passed, run_launch, script

CASES = [
    "save_mixed", "mixed_round_trip", "mixed_into_mixed2", "save_tp", "tp2_into_one_rank",
    "tp2_into_replicated", "tp_into_dist", "save_stage1", "stage1_into_stage2", "saved_as_boxes",
    "stage2_into_stage1", "stage2_into_other_cuts", "stage2_into_dist", "save_dist", "dist_into_tp",
    "dist_into_stage2", "replicas_written", "node_local_replicas",
]


@pytest.mark.device
def test_sharded_weight_layouts_and_replicas(tmp_path):
    logs = run_launch(script("sharded.py"), 2, tmp_path, args=[tmp_path / "work", *CASES])
    assert_passed(logs, CASES, 2)


def test_paddle_builtin_agrees_on_sharded_weights(tmp_path):
    cases = ["paddle_builtin_agrees"]
    logs = run_launch(script("sharded.py"), 2, tmp_path, args=[tmp_path / "work", *cases])
    assert_passed(logs, cases, 2)
