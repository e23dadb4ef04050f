"""The public surface: what ``import paddle_dcp`` exports, and one exception hierarchy."""
import inspect
import subprocess
import sys

import paddle_dcp
from paddle_dcp import errors

EXPECTED = {
    "save_state_dict",
    "load_state_dict",
    "read_metadata",
    "wait_async_save",
    "close",
    "process_state",
    "AsyncSave",
    "CheckpointManager",
    "save_gathered",
    "get_state_dict",
    "set_state_dict",
    "patch_paddle",
    "PaddlePatch",
    "read_state_dict_metadata",
    "StateDictMetadata",
    "DcpError",
    "ArgumentError",
    "FormatError",
    "IntegrityError",
    "MismatchError",
    "StateDictError",
    "StorageError",
    "CollectiveError",
    "CollectiveMismatchError",
    "PlanError",
    "UnsupportedError",
    "FORMAT_VERSION",
    "ADAMW_MOMENTS",
    "ADAMW_MOMENTS_INT8",
    "ADAMW_MOMENTS_INT4",
    "MASTER_WEIGHTS",
    "MASTER_WEIGHTS_DERIVED",
    "__version__",
}


def test_all_is_the_expected_set_of_names():
    assert set(paddle_dcp.__all__) == EXPECTED
    assert len(paddle_dcp.__all__) == len(EXPECTED)
    for name in EXPECTED:
        assert getattr(paddle_dcp, name) is not None


def test_import_paddle_dcp_does_not_import_paddle():
    code = "import sys, paddle_dcp; print('paddle' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_every_exception_derives_from_dcp_error():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, BaseException)]
    assert {c.__name__ for c in classes} >= {n for n in EXPECTED if n.endswith("Error")}
    for c in classes:
        assert issubclass(c, errors.DcpError), c
        assert getattr(paddle_dcp, c.__name__) is c
    assert issubclass(errors.IntegrityError, errors.FormatError)


def test_save_and_load_take_paddles_arguments_in_paddles_order():
    """Switching is one import: every parameter of paddle 3.3.1's two calls is ours too, at the
    same position with the same default; ours add only keyword-only ones after them."""
    from paddle.distributed.flex_checkpoint.dcp import load_state_dict as pl, save_state_dict as ps

    for theirs, ours in ((ps.save_state_dict, paddle_dcp.save_state_dict), (pl.load_state_dict, paddle_dcp.load_state_dict)):
        their_params = list(inspect.signature(theirs).parameters.values())
        our_params = list(inspect.signature(ours).parameters.values())
        assert [(p.name, p.default) for p in their_params] == [(p.name, p.default) for p in our_params[: len(their_params)]]
        assert all(p.kind is p.KEYWORD_ONLY for p in our_params[len(their_params):])


def test_the_process_state_is_one_object_the_caller_sees_and_resets(tmp_path):
    """Plans, traffic, staging and groups live in paddle_dcp.process_state(), not in module
    globals; reset() forgets them and the next save plans again."""
    import numpy as np

    state = paddle_dcp.process_state()
    assert state is paddle_dcp.process_state()
    sd = {"w": np.arange(6.0)}
    paddle_dcp.save_state_dict(sd, str(tmp_path / "a"))
    assert state.save_plans and "save" in state.traffic
    state.reset()
    assert not state.save_plans and not state.traffic and len(state.groups) == 0
    paddle_dcp.save_state_dict(sd, str(tmp_path / "c"))
    assert state.save_plans
    paddle_dcp.close()
    assert not state.save_plans
