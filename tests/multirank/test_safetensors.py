"""safetensors=True across 2 ranks: Hugging Face directories loaded into any layout (each rank
reading only its byte ranges, as paddle's built-in gives), and rank files saved as safetensors."""
import pytest

from launcher import assert_passed, run_launch, script

LOADS = [f"{d}_into_{lay}" for d in ("sharded", "single") for lay in ("s0", "s1", "r")]
CASES = ["make", *LOADS, "builtin_sharded", "save", "saved_into_s0", "saved_into_s1", "saved_into_r"]


@pytest.mark.device
def test_safetensors_directories_and_rank_files(tmp_path):
    logs = run_launch(script("safetensors_load.py"), 2, tmp_path, args=[tmp_path / "work"])
    assert_passed(logs, CASES, 2)
