"""A script written for paddle.distributed alone, run unchanged under ``paddle-dcp run`` (the
patch applied from outside it, as a user's training script would be), through the flows
Paddle's own semi-auto save/load tests exercise: save on 1 (no launcher), 2 and 4 ranks, load
on 1, 2, 4 and 8, into another layout, every value against numpy; a replicated tensor
saved once; a key the checkpoint lacks keeps paddle's contract (scripts/paddle_flow.py)."""
import json
import os
import sys
import pytest
from pathlib import Path

import metadoc
from launcher import assert_passed, run_launch, run_single, script

PADDLE_DCP = str(Path(sys.executable).parent / "paddle-dcp")  # the console script pip installed
FLOW = script("paddle_flow.py")


def run(nproc: int, root: str, phase: str, tmp_path: Path) -> None:
    args = ["run", FLOW, root, phase]
    if nproc == 1:
        out = run_single(PADDLE_DCP, tmp_path, args=args, timeout=120)
        assert f"PASS {phase} rank=0" in out, out
    else:
        assert_passed(run_launch(PADDLE_DCP, nproc, tmp_path, args=args, timeout=180), [phase], nproc)


def test_save_on_1_2_and_4_load_on_1_2_4_and_8(tmp_path):
    roots = []
    for saved_on in (1, 2, 4):
        root = tmp_path / f"saved_on_{saved_on}"
        run(saved_on, str(root), "save", tmp_path)
        meta = metadoc.read((root / "flow" / "0.metadata").read_bytes())  # paddle_dcp's metadata, not paddle's pickle
        assert "format_version" in meta
        pieces = {key: entry["count"] for key, entry in meta["tensors"].items()}
        # replicated: saved once (dedup); rows: one piece per rank holding any
        assert pieces == {"model.b": 1, "model.w": saved_on, "model.uneven": saved_on, "model.emb": min(saved_on, 3),
                          "opt.state.m": 1}, pieces
        roots.append(str(root))
    for load_on in (1, 2, 4, 8):  # each launch loads the three checkpoints
        run(load_on, os.pathsep.join(roots), "load", tmp_path)


@pytest.mark.device
def test_dynamic_static_mutual_load_in_one_process(tmp_path):
    """A DistModel's state dict (learning_rate_0 besides the parameters) loads the dynamic
    model's checkpoint under paddle's contract, and the other way round (one process: the CPU
    build's static engine asserts "No CUDA device found" when it sets up a group of two)."""
    run(1, tmp_path / "dynamic_static", "dynamic_static", tmp_path)
