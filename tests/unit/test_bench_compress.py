"""The arithmetic of the suite compress (scripts/bench/compress.py): errors against originals, loss curves against
the uncompressed resume, ratios to plain and the targets' verdicts, with hand-computed oracles."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench import compress as bc  # noqa: E402


def test_relative_errors_per_element_skip_zeros_and_per_tensor_use_the_range_and_the_sums():
    x = np.array([0.0, 1.0, -2.0, 4.0], np.float32)
    y = np.array([0.5, 1.5, -2.0, 3.0], np.float32)
    e = bc.relative_errors(x, y)
    assert (e["elements"], e["nonzero"]) == (4, 3)
    assert e["max"] == pytest.approx(0.5) and e["mean"] == pytest.approx((0.5 + 0 + 0.25) / 3)
    assert e["max_of_range"] == pytest.approx(1.0 / 4.0) and e["l1"] == pytest.approx(2.0 / 7.0)
    assert bc.relative_errors(x, x)["max"] == 0.0


def test_merged_errors_take_maxima_and_means_weighted_by_nonzero_elements():
    a = {"elements": 4, "nonzero": 3, "max": 0.5, "mean": 0.2, "max_of_range": 0.1, "l1": 0.3}
    b = {"elements": 10, "nonzero": 1, "max": 0.9, "mean": 0.6, "max_of_range": 0.05, "l1": 0.1}
    m = bc.merge_errors([a, b])
    assert (m["tensors"], m["elements"], m["max"], m["max_of_range"], m["l1_max"]) == (2, 14, 0.9, 0.1, 0.3)
    assert m["mean"] == pytest.approx((0.2 * 3 + 0.6) / 4)
    assert bc.merge_errors([]) == {}


def test_a_curve_against_its_reference():
    ref = np.linspace(3.0, 2.0, 30)
    curve = ref * 1.01
    curve[0] = ref[0] * 1.10
    d = bc.curve_difference(curve, ref)
    assert d["max"] == pytest.approx(0.10) and d["mean"] == pytest.approx((0.10 + 29 * 0.01) / 30)
    assert d["first10_mean"] == pytest.approx((0.10 + 9 * 0.01) / 10)
    assert d["last20"] == pytest.approx(curve[-20:].mean()) and d["last20_reference"] == pytest.approx(ref[-20:].mean())


def test_loss_noise_is_the_spread_around_the_moving_mean():
    flat = np.full(40, 2.0)
    assert bc.loss_noise(flat) == 0.0
    wobble = 2.0 + 0.02 * np.where(np.arange(40) % 2, 1.0, -1.0)  # +-1% around 2, alternating
    assert bc.loss_noise(wobble) == pytest.approx(0.01, rel=0.15)
    assert np.isnan(bc.loss_noise(flat[:5]))


def timing(save, load, files, opt, model, moments):
    return {"save_s": save, "load_s": load, "bytes": {"files": files, "metadata": 0, "optimizer": opt, "model": model,
                                                      "moments": moments}}


def test_summaries_and_sizes_are_ratios_to_plain():
    times = {"plain": timing([2.0, 4.0, 3.0], [1.0, 1.0, 2.0], 1400, 1200, 200, 800),
             "int8": timing([1.0, 1.5, 2.0], [0.5, 1.0, 1.0], 800, 600, 200, 200)}
    s = bc.summarize(times)
    assert s["int8"]["save_s"] == {"best": 1.0, "median": 1.5, "ratio_best": 0.5, "ratio_median": 0.5}
    assert s["int8"]["load_s"]["ratio_median"] == pytest.approx(1.0)
    sizes = bc._sizes({k: t["bytes"] for k, t in times.items()})
    assert sizes["int8"]["whole_ratio"] == pytest.approx(800 / 1400) and sizes["int8"]["optimizer_ratio"] == 0.5
    assert sizes["int8"]["moments_ratio"] == 0.25


def test_targets_pass_or_miss_on_the_figures():
    sizes = {"int8": {"optimizer_ratio": 0.34, "moments_ratio": 0.26}, "int4+derived": {"optimizer_ratio": 0.19}}
    s3 = {v: {"save_s": {"ratio_best": 0.9 if v != "int4" else 1.1, "ratio_median": 1.0}} for v in bc.VARIANTS}
    diff = {v: {"mean": 0.001, "max": 0.01} for v in bc.VARIANTS}
    diff["int4"] = {"mean": 0.011, "max": 0.01}
    verdicts = {name: ok for name, _, ok in bc.check_targets(sizes, s3, {"difference": diff})}
    assert verdicts["optimizer part, int8 / plain <= 1/3"] is False
    assert verdicts["optimizer part, int4+derived / plain <= 1/5"] is True
    assert verdicts["optimizer part without master weights (a float32 job), int8 / plain <= 1/3"] is True
    assert verdicts["S3 save time, int4 / plain <= 1"] is False and verdicts["S3 save time, int8 / plain <= 1"] is True
    assert verdicts["resumed losses, int4: mean <= 1%, max <= 5%"] is False
    assert verdicts["resumed losses, int8: mean <= 1%, max <= 5%"] is True
    assert not any(name.startswith("S3") for name, _, _ in bc.check_targets(sizes, None, {"difference": diff}))


def test_each_variant_names_its_policy():
    import paddle_dcp as dcp

    assert bc.policy("plain") is None
    assert bc.policy("int8") == dict(dcp.ADAMW_MOMENTS_INT8)
    assert bc.policy("int4+derived") == {**dcp.ADAMW_MOMENTS_INT4, **dcp.MASTER_WEIGHTS_DERIVED}
