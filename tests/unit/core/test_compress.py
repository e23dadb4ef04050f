"""The compress policy (core/compress.py): which keys are stored in which encoding, the ready
AdamW policies against the keys paddle's and PaddleFormers' optimizers produce (written out
here as those libraries spell them), and the arguments refused."""
from __future__ import annotations

import pytest

from paddle_dcp import ADAMW_MOMENTS_INT4, ADAMW_MOMENTS_INT8
from paddle_dcp.core.compress import Policy, policy_of
from paddle_dcp.errors import ArgumentError

# keys of AdamW's moments as each producer writes them (paddle 3.3.1's AdamW.state_dict(),
# flex checkpoint / PaddleFormers' sharded state dicts, PaddleFormers' unified checkpoint,
# paddle_dcp.get_state_dict), and keys of the same optimizers that are not moments
MOMENTS = [
    "opt.linear_0.w_0_moment1_0",
    "opt.linear_0.b_0_moment2_0",
    "opt.linear_0.w_0_moment2_max_0",
    "optimizer.llama.embed_tokens.weight.moment1_0",
    "llama.layers.1.mlp.gate_proj.weight/moment2_0",
    "optim.fc1.weight.moment1",
    "optim.fc1.weight.moment2",
]
NOT_MOMENTS = [
    "opt.linear_0.w_0_beta1_pow_acc_0",
    "opt.linear_0.w_0_beta2_pow_acc_0",
    "opt.master_weights.linear_0.w_0",
    "model.linear_0.w_0",
    "model.moment1_proj.weight",  # a layer named like a moment is not one
    "opt.LR_Scheduler.last_lr",
]


@pytest.mark.parametrize("policy, name", [(ADAMW_MOMENTS_INT8, "int8"), (ADAMW_MOMENTS_INT4, "int4")])
def test_the_adamw_policies_take_every_producer_s_moments_and_nothing_else(policy, name):
    p = policy_of(policy)
    for key in MOMENTS:
        assert p.encoding_of(key, "float32") == name, key
        assert p.encoding_of(key, "bfloat16") == name, key
    for key in NOT_MOMENTS:
        assert p.encoding_of(key, "float32") is None, key


def test_the_first_matching_regex_wins_and_each_is_searched_not_matched():
    p = policy_of({"moment2": "int4", "moment": "int8", "^w$": "int4"})
    assert p.encoding_of("a.moment2_0", "float32") == "int4"
    assert p.encoding_of("a.moment1_0", "float32") == "int8"
    assert p.encoding_of("x.w", "float32") is None
    assert p.encoding_of("w", "float16") == "int4"


@pytest.mark.parametrize("dtype", ["int64", "int32", "bool", "uint8", "float64", "complex64"])
def test_matched_tensors_of_other_dtypes_stay_plain(dtype):
    assert policy_of({".": "int8"}).encoding_of("opt.step", dtype) is None


def test_nothing_to_compress_is_no_policy_and_a_policy_passes_through():
    assert policy_of(None) is None and policy_of({}) is None
    p = policy_of({"a": "int8"})
    assert policy_of(p) is p and p == Policy((("a", "int8"),))


@pytest.mark.parametrize(
    "compress, words",
    [
        (["moment"], "mapping"),
        ("int8", "mapping"),
        ({"moment": "int3"}, "'int3'"),
        ({"moment": 8}, "8"),
        ({"(": "int8"}, "not a regular expression"),
        ({3: "int8"}, "regular expressions (str), got int"),
    ],
)
def test_bad_arguments_are_refused_naming_what_is_wrong(compress, words):
    with pytest.raises(ArgumentError, match="compress") as info:
        policy_of(compress)
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_derived_is_an_encoding_of_float32_tensors_only_and_the_ready_policy_takes_master_weights():
    from paddle_dcp import MASTER_WEIGHTS_DERIVED

    p = policy_of({**ADAMW_MOMENTS_INT4, **MASTER_WEIGHTS_DERIVED})
    assert p.derives and not policy_of(ADAMW_MOMENTS_INT8).derives
    for key in ("opt.master_weights.linear_0.w_0", "llama.embed_tokens.weight.w_0", "optim.fc1.weight.master_weight"):
        assert p.encoding_of(key, "float32") == "derived", key
        assert p.encoding_of(key, "bfloat16") is None and p.encoding_of(key, "float16") is None, key
    for key in MOMENTS:  # the two rules do not meet
        assert p.encoding_of(key, "float32") == "int4", key
    for key in ("model.fc.weight", "opt.linear_0.w_0_beta1_pow_acc_0", "model.w_0_proj.weight", "opt.LR_Scheduler.last_lr"):
        assert p.encoding_of(key, "float32") is None, key
    # the regex is a key's spelling only: a float32 tensor keyed by paddle's parameter name is
    # taken as flex's "<struct>.w_0" (docs/guide.md says so); a save then finds no parameter
    assert p.encoding_of("model.linear_0.w_0", "float32") == "derived"
    with pytest.raises(ArgumentError, match="int4, int8, derived"):
        policy_of({"x": "derive"})
