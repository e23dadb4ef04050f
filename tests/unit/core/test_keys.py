"""paddle_dcp.core.keys: the policy for keys of a state dict that a checkpoint lacks (strict, not
strict, or strict but for the keys some patterns allow; what the error says), master weights'
two spellings matched, and a target's plain values reconciled with the saved ones (pure, no
paddle)."""
import logging

import numpy as np
import pytest

from paddle_dcp.core import keys, nested
from paddle_dcp.core.keys import MissingKeys, report
from paddle_dcp.errors import ArgumentError, MismatchError


LOG = logging.getLogger("test_keys")


def test_strict_refuses_every_missing_key_but_those_allowed(caplog):
    policy = MissingKeys.of(True, [r"\.inv_freq$", r"^opt\.lr"])
    assert policy.allows("model.layers.0.rotary_emb.inv_freq") and policy.allows("opt.lr_sched")
    assert not policy.allows("model.inv_freq_table") and not policy.allows("model.opt.lr")
    with caplog.at_level("WARNING"):
        report(["model.rotary_emb.inv_freq", "opt.lr_x"], [], "ck", policy, LOG)
    assert "model.rotary_emb.inv_freq" in caplog.text and "left unchanged" in caplog.text
    with pytest.raises(MismatchError) as info:
        report(["model.rotary_emb.inv_freq", "model.w"], [], "ck", policy, LOG)
    message = str(info.value)
    assert "1 key(s)" in message and "model.w" in message and "inv_freq" not in message
    assert "allow_missing=" in message and "strict=False" in message


def test_not_strict_warns_of_every_missing_key(caplog):
    with caplog.at_level("WARNING"):
        report(["a", "b"], ["c"], "ck", MissingKeys.of(False, None), LOG)
    assert "['a', 'b']" in caplog.text and "['c']" in caplog.text


def test_the_error_says_when_missing_keys_look_like_buffers():
    with pytest.raises(MismatchError) as info:
        report(["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq", "model.w"], [], "ck",
               MissingKeys(), LOG, buffers=["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"])
    message = str(info.value)
    assert "2 of them look like buffers" in message and "dist.shard_layer" in message
    assert r"allow_missing=['(^|\\.)inv_freq$', '(^|\\.)original_inv_freq$']" in message
    with pytest.raises(MismatchError) as info:
        report(["model.w"], [], "ck", MissingKeys(), LOG, buffers=["model.b"])  # b is not missing
    assert "buffers" not in str(info.value)


@pytest.mark.parametrize("bad", ["(unclosed", 7, [r"ok", None]])
def test_a_bad_pattern_is_an_argument_error(bad):
    with pytest.raises(ArgumentError, match="allow_missing"):
        MissingKeys.of(True, bad)


def test_one_pattern_or_several():
    assert MissingKeys.of(True, r"x$").allowed == (r"x$",)
    assert MissingKeys.of(True, (r"x$", r"y")).allowed == (r"x$", r"y")
    assert MissingKeys.of(False, None) == MissingKeys(strict=False, allowed=())


# ------------------------------------------------------------------ keys
@pytest.mark.parametrize(
    "a, b",
    [
        ("opt.master_weights.linear_0.w_0", "opt.linear_0.w_0_fp32_master_0"),
        ("optimizer.master_weights.embedding_0.w_0", "optimizer.embedding_0.w_0_fp32_master_0"),
    ],
)
def test_mw_compatible_name_maps_both_ways(a, b):
    assert keys.mw_compatible_name(a) == b
    assert keys.mw_compatible_name(b) == a


@pytest.mark.parametrize("key", ["model.linear_0.w_0", "opt.linear_0.w_0_moment1_0", "step"])
def test_mw_compatible_name_of_other_keys_is_none(key):
    assert keys.mw_compatible_name(key) is None


class _CountedKeys(list):
    """A list of keys that counts the times it is iterated over."""

    iterations = 0

    def __iter__(self):
        _CountedKeys.iterations += 1
        return super().__iter__()


def test_a_strict_refusal_of_many_missing_keys_looks_at_the_buffers_a_constant_number_of_times():
    per_key = []
    for n in (1_000, 10_000):
        missing = [f"model.layers.{i}.w" for i in range(n)]
        buffers = _CountedKeys(f"model.layers.{i}.w" for i in range(0, n, 2))  # every other key
        _CountedKeys.iterations = 0
        with pytest.raises(MismatchError) as info:
            report(missing, [], "ck", MissingKeys(), LOG, buffers=buffers)
        assert f"{n} key(s)" in str(info.value) and f"{n // 2} of them look like buffers" in str(info.value)
        per_key.append(_CountedKeys.iterations / n)
    assert per_key[1] <= per_key[0] <= 0.01, per_key  # not once per missing key


def test_match_keys_reports_missing_and_unexpected():
    m = keys.match_keys(["a", "b", "c"], ["b", "c", "d", "e"])
    assert m.source == {"b": "b", "c": "c"}
    assert m.missing == ("a",)
    assert m.unexpected == ("d", "e")


def test_match_keys_loads_master_weights_saved_under_the_other_spelling():
    wanted = ["opt.master_weights.linear_0.w_0", "opt.linear_1.w_0_fp32_master_0", "model.w"]
    available = ["opt.linear_0.w_0_fp32_master_0", "opt.master_weights.linear_1.w_0", "model.w"]
    m = keys.match_keys(wanted, available)
    assert m.source == {
        "opt.master_weights.linear_0.w_0": "opt.linear_0.w_0_fp32_master_0",
        "opt.linear_1.w_0_fp32_master_0": "opt.master_weights.linear_1.w_0",
        "model.w": "model.w",
    }
    assert m.missing == () and m.unexpected == ()
    off = keys.match_keys(wanted, available, mw_name_compatibility=False)
    assert off.source == {"model.w": "model.w"}
    assert off.missing == tuple(wanted[:2])
    assert off.unexpected == tuple(available[:2])


def test_match_keys_prefers_the_exact_key():
    m = keys.match_keys(["opt.master_weights.w"], ["opt.master_weights.w", "opt.w_fp32_master_0"])
    assert m.source == {"opt.master_weights.w": "opt.master_weights.w"}
    assert m.unexpected == ("opt.w_fp32_master_0",)


# ------------------------------------------------------------------ reconcile
def _sk(sd):
    return nested.flatten(sd, lambda v: isinstance(v, np.ndarray)).skeleton


def test_reconcile_restores_plain_subtrees_whole_and_names_what_is_missing():
    t = np.zeros(1)
    saved = _sk({"w": t, "sched": {"milestones": [3, 1, 4, 1.5]}, "opt": [t, 5], "only_saved": 1})
    target = {"w": t, "sched": {"milestones": []}, "opt": [t, 0, 7], "extra": [1], "x": t}
    r = keys.reconcile(["w", "opt.0", "x"], _sk(target), ["w", "opt.0"], saved)
    assert dict(r.plain) == {("sched",): saved["d"][1][1], ("opt", 1): {"v": 5}}
    assert sorted(r.missing) == ["extra.0", "opt.2", "x"]
    assert r.unexpected == ("only_saved",)
    assert r.match.source == {"w": "w", "opt.0": "opt.0"}


def test_reconcile_leaves_a_target_subtree_holding_tensors_to_the_tensors():
    saved = _sk({"m": {}})
    r = keys.reconcile(["m.w"], _sk({"m": {"w": np.zeros(1)}}), [], saved)
    assert r.plain == () and r.missing == ("m.w",)


def test_reconcile_refuses_a_tensor_against_a_plain_value_either_way():
    with pytest.raises(MismatchError, match="step: the checkpoint holds a plain value here"):
        keys.reconcile(["step"], _sk({"step": np.zeros(1)}), [], _sk({"step": 3}))
    with pytest.raises(MismatchError, match="step: the checkpoint holds a tensor here"):
        keys.reconcile([], _sk({"step": 3}), ["step"], _sk({"step": np.zeros(1)}))


def test_missing_message_names_twenty_keys_and_counts_all():
    text = keys.missing_message([f"k{i}" for i in range(23)], "checkpoint 4 in /ck")
    assert text.startswith("23 key(s) of the state_dict are not in checkpoint 4 in /ck: k0, ")
    assert "k19 and 3 more" in text and "k20" not in text and "strict=False" in text
