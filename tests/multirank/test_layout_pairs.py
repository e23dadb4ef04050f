"""The same PaddleFormers model on six layouts (one process, tensor parallel, DP x TP, sharding
stages 1, 2 and 3): get_state_dict gives the same keys on each, though paddle's own
dist.shard_layer makes the rotary buffers persistable, and every checkpoint loads strictly on
every layout, every value checked against numpy (scripts/layouts.py). Issue 27, point 2."""
import json

import pytest

pytest.importorskip("paddleformers")

from launcher import assert_passed, run_launch, run_single, script  # noqa: E402

LAYOUTS = script("layouts.py")
BY_RANKS = {1: ["one"], 2: ["tp2", "stage1", "stage2", "stage3"], 4: ["dp2tp2"]}


def phase(name: str, nproc: int, root, tmp_path) -> None:
    layouts = BY_RANKS[nproc]
    everyone = [n for group in BY_RANKS.values() for n in group]
    if name == "save":
        cases = [f"save_{layout}" for layout in layouts]
    else:  # every pair of (this layout, a saved one)
        cases = [f"load_{layout}_from_{source}" for layout in layouts for source in everyone]
    if name == "save" and "stage3" in layouts:
        cases.append("stage3_tied_weights_refused")
    args = [root, name, *layouts]
    if nproc == 1:
        out = run_single(LAYOUTS, tmp_path, args=args, timeout=180)
        assert all(f"PASS {case} rank=0" in out for case in cases), out[-3000:]
    else:
        assert_passed(run_launch(LAYOUTS, nproc, tmp_path, args=args, timeout=300), cases, nproc)


def test_every_layout_pair_loads_strictly(tmp_path):
    root = tmp_path / "work"
    for nproc in BY_RANKS:
        phase("save", nproc, root, tmp_path)
    keys = {layout: json.loads((root / f"{layout}.keys.json").read_text()) for layouts in BY_RANKS.values()
            for layout in layouts}
    assert all(k == keys["one"] for k in keys.values()), {n: len(k) for n, k in keys.items()}
    assert not [k for k in keys["one"] if "inv_freq" in k]
    assert any(k.endswith(".moment1") for k in keys["one"])  # the optimizer's states are there
    for nproc in BY_RANKS:
        phase("load", nproc, root, tmp_path)
