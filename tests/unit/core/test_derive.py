"""Finding the parameter a master weight derives from (core/derive.py), on the keys and names
paddle's optimizer, flex checkpoints / PaddleFormers and paddle_dcp.get_state_dict produce
(written out here as those libraries spell them), and the coordinator's checks of what the
ranks found."""
from __future__ import annotations

import re

import pytest

from paddle_dcp.core.derive import MASTER_WEIGHTS, Candidate, check_sources, find_sources, param_name, stem_keys
from paddle_dcp.errors import MismatchError

W, B = (64, 32), (32,)


def c(key, dtype, shape, name=None) -> Candidate:
    return Candidate(key, dtype, shape, name)


def masters_of(tensors) -> list[str]:
    """The float32 keys the ready regex names (what a policy of it derives)."""
    return [t.key for t in tensors if t.dtype == "float32" and re.search(MASTER_WEIGHTS, t.key)]


# paddle's AdamW(multi_precision=True).state_dict() beside model.state_dict(): master weights
# keyed by the parameter's name, parameters by their structured key
PADDLE = [
    c("model.fc.weight", "bfloat16", W, "linear_0.w_0"),
    c("model.fc.bias", "bfloat16", B, "linear_0.b_0"),
    c("opt.linear_0.w_0_moment1_0", "float32", W, "linear_0.w_0_moment1_0"),
    c("opt.master_weights.linear_0.w_0", "float32", W, "linear_0.w_0_fp32_master_0"),
    c("opt.master_weights.linear_0.b_0", "float32", B, "linear_0.b_0_fp32_master_0"),
]
# flex checkpoint's AdamW.sharded_state_dict(model.sharded_state_dict()) in one dict with the
# model's: master weights "<struct>.w_0" (ShardedWeights named as paddle names master weights)
FLEX = [
    c("llama.embed_tokens.weight", "bfloat16", W, "embedding_0.w_0"),
    c("llama.embed_tokens.weight.moment1_0", "float32", W, "embedding_0.w_0_fp32_master_0_moment1_0"),
    c("llama.embed_tokens.weight.w_0", "float32", W, "embedding_0.w_0_fp32_master_0"),
]
# paddle_dcp.get_state_dict, saved as numpy arrays (no names): keys alone
TRAINING = [
    c("model.fc1.weight", "bfloat16", W),
    c("model.fc2.weight", "bfloat16", W),
    c("optim.fc1.weight.master_weight", "float32", W),
    c("optim.fc2.weight.master_weight", "float32", W),
    c("optim.fc1.weight.moment1", "float32", W),
]


@pytest.mark.parametrize(
    "tensors, want",
    [
        (PADDLE, {"opt.master_weights.linear_0.w_0": "model.fc.weight", "opt.master_weights.linear_0.b_0": "model.fc.bias"}),
        (FLEX, {"llama.embed_tokens.weight.w_0": "llama.embed_tokens.weight"}),
        (TRAINING, {"optim.fc1.weight.master_weight": "model.fc1.weight", "optim.fc2.weight.master_weight": "model.fc2.weight"}),
    ],
    ids=["paddle_optimizer", "flex_sharded", "get_state_dict"],
)
def test_each_producer_s_master_weights_find_their_parameter_and_nothing_else_is_derived(tensors, want):
    assert sorted(masters_of(tensors)) == sorted(want)
    assert find_sources(tensors, masters_of(tensors)) == want


def test_the_parameter_name_comes_from_the_key_or_from_the_master_weight_s_own_name():
    assert param_name("opt.master_weights.linear_0.w_0", None) == "linear_0.w_0"
    assert param_name("master_weights.linear_3.b_0", "whatever") == "linear_3.b_0"
    assert param_name("x.w_0", "embedding_0.w_0_fp32_master_0") == "embedding_0.w_0"
    assert param_name("x.w_0", "embedding_0.w_0_fp32_master") == "embedding_0.w_0"
    assert param_name("x.master_weight", None) is None and param_name("x.w_0", "linear_0.w_0") is None


def test_by_key_the_stem_itself_comes_first_then_keys_differing_in_their_first_component():
    keys = ["opt.fc.weight", "model.fc.weight", "ema.fc.weight", "model.fc.bias", "model.x.fc.weight", "fc.weight"]
    assert stem_keys("opt.fc.weight.w_0", keys) == ["opt.fc.weight", "ema.fc.weight", "model.fc.weight"]
    assert stem_keys("fc.weight.master_weight", keys) == ["fc.weight"]
    assert stem_keys("opt.master_weights.linear_0.w_1", keys) == []


def test_a_name_wins_over_a_key_and_tied_weights_give_the_first_of_their_keys():
    tensors = [
        c("model.lm_head.weight", "bfloat16", W, "embedding_0.w_0"),  # tied: one tensor, two keys
        c("model.embed.weight", "bfloat16", W, "embedding_0.w_0"),
        c("opt.embed.weight", "bfloat16", W, "other"),  # what the key alone would name
        c("opt.embed.weight.w_0", "float32", W, "embedding_0.w_0_fp32_master_0"),
    ]
    assert find_sources(tensors, ["opt.embed.weight.w_0"]) == {"opt.embed.weight.w_0": "model.embed.weight"}


def test_a_master_weight_whose_parameter_is_not_saved_is_an_error_naming_both():
    alone = [t for t in PADDLE if t.key.startswith("opt.")]  # PaddleFormers saves them apart
    with pytest.raises(MismatchError) as info:
        find_sources(alone, ["opt.master_weights.linear_0.w_0"])
    assert "opt.master_weights.linear_0.w_0" in str(info.value) and "'linear_0.w_0'" in str(info.value)
    with pytest.raises(MismatchError, match=r"optim\.fc1\.weight\.master_weight.*keyed as its stem"):
        find_sources(TRAINING[2:], ["optim.fc1.weight.master_weight"])


@pytest.mark.parametrize("dtype, shape", [("float32", W), ("bfloat16", (32, 64)), ("int8", W)])
def test_a_parameter_of_another_dtype_or_shape_is_an_error_naming_both_and_their_shapes(dtype, shape):
    tensors = [c("model.fc.weight", dtype, shape, "linear_0.w_0"), c("opt.master_weights.linear_0.w_0", "float32", W)]
    with pytest.raises(MismatchError) as info:
        find_sources(tensors, ["opt.master_weights.linear_0.w_0"])
    message = str(info.value)
    for word in ("opt.master_weights.linear_0.w_0", "model.fc.weight", dtype, str(shape), str(W)):
        assert word in message, (word, message)


def test_two_keys_that_could_each_be_the_parameter_are_an_error():
    tensors = [c("model.fc.weight", "bfloat16", W), c("ema.fc.weight", "bfloat16", W), c("opt.fc.weight.w_0", "float32", W)]
    with pytest.raises(MismatchError, match=r"\['ema\.fc\.weight', 'model\.fc\.weight'\]"):
        find_sources(tensors, ["opt.fc.weight.w_0"])
    tensors.append(c("opt.fc.weight", "bfloat16", W))  # the stem itself settles it
    assert find_sources(tensors, ["opt.fc.weight.w_0"]) == {"opt.fc.weight.w_0": "opt.fc.weight"}


INFO = {"m": ("float32", W, 0), "p": ("bfloat16", W, 0), "q": ("float16", W, 1), "b": ("bfloat16", B, 0)}


def test_the_coordinator_takes_what_the_ranks_found_when_they_agree():
    assert check_sources([(0, {"m": "p"}), (1, {"m": "p"}), (2, {})], INFO, ["m"]) == {"m": "p"}


@pytest.mark.parametrize(
    "found, words",
    [
        ([(0, {"m": "p"}), (3, {"m": "q"})], ["m:", "rank 0", "from p", "rank 3", "from q"]),
        ([(0, {})], ["m:", "no rank found"]),
        ([(0, {"m": "b"})], ["m (float32, shape (64, 32))", "b (bfloat16, shape (32,))"]),
        ([(0, {"m": "zz"})], ["zz (not in the save)"]),
    ],
)
def test_the_coordinator_refuses_ranks_that_disagree_or_found_nothing_or_a_misfit(found, words):
    with pytest.raises(MismatchError) as info:
        check_sources(found, INFO, ["m"])
    for word in words:
        assert word in str(info.value), (word, str(info.value))
