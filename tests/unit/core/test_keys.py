"""paddle_dcp.core.keys' policy for keys of a state dict that a checkpoint lacks: strict, not
strict, or strict but for the keys some patterns allow; what the error says (pure, no paddle)."""
import logging

import pytest

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
