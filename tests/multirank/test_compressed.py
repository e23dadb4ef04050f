"""Compressed checkpoints on paddle ranks: moments saved quantized by 2 ranks (Shard on either
axis, float32 and bfloat16), loaded with the shards swapped and by 1 rank into whole tensors;
the values checked inside the workers against the unit tests' reference quantizer; float32
master weights derived from their bfloat16 parameters (each sharded on the other axis) load as
those parameters' values (scripts/compressed.py)."""
import pytest

from launcher import assert_passed, run_launch, script


@pytest.mark.device
def test_moments_saved_quantized_by_2_ranks_load_into_other_layouts_and_on_1_rank(tmp_path):
    work = tmp_path / "work"
    logs = run_launch(script("compressed.py"), 2, tmp_path, args=[work, "save2"])
    assert_passed(logs, ["save2", "swapped2"], 2)
    logs = run_launch(script("compressed.py"), 1, tmp_path, args=[work, "load1"])
    assert_passed(logs, ["whole1"], 1)
