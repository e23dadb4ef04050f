"""load_state_dict(..., allow_missing=...) on a model whose non-persistable buffer came back as
persistable (what paddle's dist.shard_layer does to every buffer): the error says which keys
look like buffers and how to allow them; allowing them keeps strictness for the rest (one
process; paddle imported)."""
import numpy as np
import pytest

import paddle_dcp

paddle = pytest.importorskip("paddle")


class Rotary(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(4, 3)
        self.register_buffer("inv_freq", paddle.arange(4, dtype="float32"), persistable=False)


def resharded(model):
    """What dist.shard_layer's replicate_layer_params_and_buffers does: register_buffer(key,
    ...) with paddle's default, persistable."""
    model.register_buffer("inv_freq", model.inv_freq)
    return model


def test_allow_missing_lets_the_buffers_be_missing_and_keeps_the_rest_strict(tmp_path, caplog):
    paddle.seed(3)
    saved = Rotary()
    assert "inv_freq" not in saved.state_dict()
    paddle_dcp.save_state_dict(saved.state_dict(), str(tmp_path))
    paddle.seed(4)
    model = resharded(Rotary())
    assert "inv_freq" in model.state_dict()
    with pytest.raises(paddle_dcp.MismatchError) as info:
        paddle_dcp.load_state_dict(model.state_dict(), str(tmp_path))
    message = str(info.value)
    assert "inv_freq" in message and "look like buffers" in message and r"allow_missing=['(^|\\.)inv_freq$']" in message
    assert not np.array_equal(model.fc.weight.numpy(), saved.fc.weight.numpy())  # nothing changed yet
    with caplog.at_level("WARNING"):
        paddle_dcp.load_state_dict(model.state_dict(), str(tmp_path), allow_missing=r"(^|\.)inv_freq$")
    assert "inv_freq" in caplog.text
    np.testing.assert_array_equal(model.fc.weight.numpy(), saved.fc.weight.numpy())
    np.testing.assert_array_equal(model.inv_freq.numpy(), np.arange(4, dtype=np.float32))
    extra = dict(model.state_dict(), other=paddle.zeros([2]))
    with pytest.raises(paddle_dcp.MismatchError, match="other"):  # strict for every key not allowed
        paddle_dcp.load_state_dict(extra, str(tmp_path), allow_missing=[r"\.inv_freq$", r"^inv_freq$"])


def test_a_missing_parameter_is_not_called_a_buffer(tmp_path):
    paddle_dcp.save_state_dict({"fc.bias": paddle.zeros([3])}, str(tmp_path))
    with pytest.raises(paddle_dcp.MismatchError) as info:
        paddle_dcp.load_state_dict(Rotary().state_dict(), str(tmp_path))
    assert "fc.weight" in str(info.value) and "look like buffers" not in str(info.value)


@pytest.mark.parametrize("fails", [True, False])
def test_an_async_save_that_fails_while_the_interpreter_exits_makes_the_exit_status_one(tmp_path, fails):
    """A script that returns while its async save is still running: the exit waits for the
    save; when it fails, the error is logged and the process ends with status 1 (a scheduler
    must not take the run for a success), its output flushed; when it succeeds, status 0."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import logging, sys, time
        logging.basicConfig(level=logging.ERROR)
        from paddle_dcp import async_save

        def save():
            time.sleep(0.3)
            if {fails}:
                raise OSError("the disk filled up")
            return 1

        async_save.submit(save)
        print("script done", flush=False)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "script done" in run.stdout
    if fails:
        assert run.returncode == 1 and "an async save failed: the disk filled up" in run.stderr, run
    else:
        assert run.returncode == 0 and run.stderr == "", run
