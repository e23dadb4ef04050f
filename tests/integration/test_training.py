"""paddle_dcp.training: get_state_dict keys a model's optimizer state by each parameter's
structured name plus the kind of state (the same keys whatever order the layers were made in),
creates states paddle has not made yet without a step, and set_state_dict copies a given state
into the live tensors and the LR scheduler. One process, plain layers; oracles: values set
here with numpy."""
import logging

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_dcp  # noqa: E402
from paddle_dcp.errors import MismatchError  # noqa: E402

KINDS = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")


class Model(paddle.nn.Layer):
    def __init__(self, reverse: bool = False):
        super().__init__()
        if reverse:  # paddle's generated names follow the order layers are made in
            fc2 = paddle.nn.Linear(2, 1)
            fc1 = paddle.nn.Linear(3, 2)
        else:
            fc1 = paddle.nn.Linear(3, 2)
            fc2 = paddle.nn.Linear(2, 1)
        self.fc1, self.fc2 = fc1, fc2


def model_and_optimizer(reverse: bool = False):
    model = Model(reverse)
    sched = paddle.optimizer.lr.StepDecay(0.1, step_size=2)
    return model, paddle.optimizer.Adam(sched, parameters=model.parameters()), sched


def test_optimizer_states_are_keyed_by_structured_names_whatever_the_layers_order():
    params = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    expected = {f"{p}.{k}" for p in params for k in KINDS} | {"LR_Scheduler"}
    for reverse in (False, True):
        model, opt, _ = model_and_optimizer(reverse)
        sd = paddle_dcp.get_state_dict(model, opt)
        assert sorted(sd["model"]) == sorted(params) and set(sd["optim"]) == expected
        assert sd["model"]["fc1.weight"] is model.fc1.weight  # the live tensors
    assert set(paddle_dcp.get_state_dict(model)) == {"model"}  # no optimizer: the model alone


def test_states_paddle_has_not_made_are_created_zero_without_a_step():
    model, opt, _ = model_and_optimizer()
    before = model.fc1.weight.numpy().copy()
    sd = paddle_dcp.get_state_dict(model, opt)
    assert (sd["optim"]["fc1.weight.moment1"].numpy() == 0).all()
    assert np.allclose(sd["optim"]["fc1.weight.beta1_pow_acc"].numpy(), 0.9)
    assert np.array_equal(model.fc1.weight.numpy(), before)  # no parameter changed
    assert sd["optim"]["LR_Scheduler"] == {"last_epoch": 0, "last_lr": 0.1}


def test_set_state_dict_copies_given_values_into_the_live_tensors_and_the_scheduler(caplog):
    model, opt, sched = model_and_optimizer()
    live = paddle_dcp.get_state_dict(model, opt)
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    m1 = np.full((3, 2), 0.5, np.float32)
    given = {"model": {"fc1.weight": w, "fc9.weight": w}, "optim": {"fc1.weight.moment1": m1,
             "LR_Scheduler": {"last_epoch": 4, "last_lr": 0.025}}}  # fmt: skip
    with caplog.at_level(logging.WARNING):
        paddle_dcp.set_state_dict(model, opt, given)
    assert np.array_equal(model.fc1.weight.numpy(), w)
    assert np.array_equal(live["optim"]["fc1.weight.moment1"].numpy(), m1)  # the live accumulator, filled
    assert sched.last_epoch == 4 and "fc2.weight" in caplog.text  # keys not given are named
    assert "keys of the given model state not in the state_dict (not loaded): ['fc9.weight']" in caplog.text


def test_a_given_tensor_of_another_shape_or_a_plain_value_is_a_mismatch():
    model, opt, _ = model_and_optimizer()
    with pytest.raises(MismatchError, match=r"model.fc1.weight: the given state has float32 of shape \(2, 3\)"):
        paddle_dcp.set_state_dict(model, None, {"model": {"fc1.weight": np.zeros((2, 3), np.float32)}})
    with pytest.raises(MismatchError, match="model.fc1.bias: expected a tensor, got list"):
        paddle_dcp.set_state_dict(model, None, {"model": {"fc1.bias": [0.0, 0.0]}})
