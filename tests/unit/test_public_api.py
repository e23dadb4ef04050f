"""The public surface: what ``import paddle_dcp`` exports, and one exception hierarchy."""
import inspect
import pickle
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


def test_collective_error_names_ranks_and_survives_pickling():
    e = errors.CollectiveError("write", {3: "OSError: disk full", 1: "FormatError: bad"})
    assert list(e.failures) == [1, 3] and e.step == "write"
    assert "rank 1: FormatError: bad" in str(e) and "2 rank(s)" in str(e)
    back = pickle.loads(pickle.dumps(e))
    assert back.step == e.step and back.failures == e.failures and str(back) == str(e)
    one, two = errors.MismatchError("2 key(s) ..."), errors.MismatchError("1 key(s) ...")
    mismatch = errors.collective_error("plan", {0: errors.Failure.of(one), 1: errors.Failure.of(two)})
    assert isinstance(mismatch, errors.MismatchError) and isinstance(mismatch, errors.CollectiveError)
    assert mismatch.failures == {0: "MismatchError: 2 key(s) ...", 1: "MismatchError: 1 key(s) ..."}
    back = pickle.loads(pickle.dumps(mismatch))
    assert type(back) is errors.CollectiveMismatchError and back.errors == mismatch.errors
    other = errors.collective_error("plan", {0: errors.Failure.of(one), 1: errors.Failure.of(OSError("b"))})
    assert not isinstance(other, errors.MismatchError)
    many = errors.CollectiveError("plan", {r: "x" for r in range(20)})
    assert "and 12 more ranks" in str(many)


def test_storage_error_keeps_its_path():
    assert errors.StorageError("cannot read", "/ck/0.metadata").path == "/ck/0.metadata"


def test_a_cpu_build_places_every_tensor_in_host_memory_without_asking_each():
    import paddle

    from paddle_dcp.parallel import device

    assert device.host_only_build() == (not paddle.is_compiled_with_cuda())
    t = paddle.ones([3, 2])
    assert device.is_host(t)
    # a build with a device asks the tensor: a CPU tensor is still in host memory
    device.host_only_build.cache_clear()
    real = paddle.is_compiled_with_cuda
    paddle.is_compiled_with_cuda = lambda: True
    try:
        assert not device.host_only_build()
        assert device.is_host(t)
    finally:
        paddle.is_compiled_with_cuda = real
        device.host_only_build.cache_clear()
    assert device.host_only_build() == (not paddle.is_compiled_with_cuda())


def test_save_and_load_take_paddles_arguments_in_paddles_order():
    """Switching is one import: every parameter of paddle 3.3.1's two calls is ours too, at the
    same position with the same default; ours add only keyword-only ones after them."""
    from paddle.distributed.flex_checkpoint.dcp import load_state_dict as pl, save_state_dict as ps

    for theirs, ours in ((ps.save_state_dict, paddle_dcp.save_state_dict), (pl.load_state_dict, paddle_dcp.load_state_dict)):
        their_params = list(inspect.signature(theirs).parameters.values())
        our_params = list(inspect.signature(ours).parameters.values())
        assert [(p.name, p.default) for p in their_params] == [(p.name, p.default) for p in our_params[: len(their_params)]]
        assert all(p.kind is p.KEYWORD_ONLY for p in our_params[len(their_params):])


def test_a_bad_state_dict_is_a_mismatch_and_still_a_format_error():
    assert issubclass(errors.StateDictError, errors.MismatchError)
    assert issubclass(errors.StateDictError, errors.FormatError)
    bad = errors.Failure.of(errors.StateDictError("bad: cannot save a value of type object"))
    assert bad.line() == "StateDictError (FormatError): bad: cannot save a value of type object"
    assert errors.Failure.of(OSError("disk full")).line() == "OSError: disk full"
    both = errors.collective_error("flatten", {0: bad, 1: errors.Failure.of(errors.MismatchError("1 key(s) ..."))})
    assert isinstance(both, errors.CollectiveMismatchError) and "rank 0: StateDictError" in str(both)
    assert type(errors.collective_error("flatten", {0: bad, 1: errors.Failure.of(OSError("b"))})) is errors.CollectiveError


def test_a_failure_crosses_ranks_as_data_not_as_text_to_parse():
    """Its class and message travel as JSON fields: a message that reads like another class
    is not taken for one (text parsing did that), and what does not decode says so."""
    f = errors.Failure.of(errors.IntegrityError("0_0.distcp: bytes [0, 64) fail their checksum"))
    assert errors.Failure.decode(f.encode()) == f and f.kind == "IntegrityError" and not f.mismatch
    posing = errors.Failure.of(OSError("MismatchError: a key is missing"))
    assert not errors.Failure.decode(posing.encode()).mismatch
    assert type(errors.collective_error("load", {0: posing})) is errors.CollectiveError
    assert errors.Failure.decode(b"MismatchError: plain text").kind == ""
    assert "malformed failure report" in errors.Failure.decode(b"{not json").message
    assert len(errors.Failure.of(OSError("x" * 10000)).encode(limit=100)) < 300


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
