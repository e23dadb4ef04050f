"""A training run resumed from a compressed checkpoint follows the run resumed from the
uncompressed one (issue 30, point 3): the tiny PaddleFormers Llama of the tests, trained with
AdamW under emulated O2 mixed precision (scripts/compress_train.py), saved at a step plain,
with int8 moments and with int4 moments and derived master weights, and resumed from each for
the next steps on the same batches. The yardstick is the uncompressed resume, which must equal
the uninterrupted run exactly; the tolerance is the one docs/performance.md states
(scripts/bench/compress.py ``TOLERANCE``). A control shows the tolerance is not vacuous: a resume
whose master weights came from the wrong parameters (two of one shape swapped, what a wrong
``source`` would do) is far outside it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

paddle = pytest.importorskip("paddle")
pytest.importorskip("paddleformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import paddle_dcp  # noqa: E402
from bench.compress import TOLERANCE, curve_difference, policy  # noqa: E402
from compress_train import Run, resume  # noqa: E402

SAVE_AT, STEPS = 100, 60
VARIANTS = ("int8", "int4+derived")


def test_resumes_from_compressed_checkpoints_stay_within_the_stated_tolerance_of_the_uncompressed_one(tmp_path):
    run = Run.start()
    run.train(1, SAVE_AT)
    state = run.checkpoint()
    for variant in ("plain",) + VARIANTS:
        paddle_dcp.save_state_dict(state, str(tmp_path / variant), compress=policy(variant))
    first, last = SAVE_AT + 1, SAVE_AT + STEPS
    uninterrupted = run.train(first, last)
    plain = resume(run, str(tmp_path / "plain"), first, last)
    assert plain == uninterrupted  # the yardstick is the run's own continuation, exactly
    for variant in VARIANTS:
        curve = resume(run, str(tmp_path / variant), first, last)
        assert curve != plain, variant  # the checkpoint did hold other values than the plain one
        d = curve_difference(curve, plain)
        assert d["mean"] <= TOLERANCE["mean"] and d["max"] <= TOLERANCE["max"], (variant, d)
    # the control: the derived master weights of two parameters of one shape swapped
    paddle_dcp.load_state_dict(run.target(), str(tmp_path / "int4+derived"))
    a, b = [p for p in run.params if tuple(p.shape) == (64, 64)][:2]
    saved_a = paddle.assign(a)
    a.set_value(b)
    b.set_value(saved_a)
    d = curve_difference(run.train(first, last), plain)
    assert d["mean"] > 3 * TOLERANCE["mean"] and d["max"] > TOLERANCE["max"], d
