"""patch_paddle: which of paddle's names it replaces, that it puts them back, and the pickle-free
metadata PaddleFormers reads through ``paddle.load`` (one process; paddle imported)."""
import inspect
import pickle
import sys
import types

import numpy as np
import pytest

import paddle_dcp
from paddle_dcp import patching

from unit.helpers import save_checkpoint

paddle = pytest.importorskip("paddle")
import paddle.distributed as dist  # noqa: E402
from paddle.distributed.flex_checkpoint.dcp import load_state_dict as paddle_load_mod  # noqa: E402
from paddle.distributed.flex_checkpoint.dcp import save_state_dict as paddle_save_mod  # noqa: E402

# under other names: a patch replaces only bindings under the functions' own names
PADDLE_SAVE = paddle_save_mod.save_state_dict
PADDLE_LOAD = paddle_load_mod.load_state_dict
PADDLE_PLAIN_LOAD = paddle.framework.io.load
from paddle.distributed.auto_parallel import api as paddle_auto_api  # noqa: E402

PADDLE_SHARD_LAYER = paddle_auto_api.shard_layer


def routed_load(strict: bool = False):
    """What a patch puts in place of paddle's load_state_dict (one function per strictness)."""
    return patching._routes(strict)[patching._LOAD][1]


def paddles_names():
    """Every name this test expects to be replaced, with paddle's function behind it."""
    return {
        (dist, "save_state_dict"): PADDLE_SAVE,
        (paddle_save_mod, "save_state_dict"): PADDLE_SAVE,
        (dist, "load_state_dict"): PADDLE_LOAD,
        (paddle_load_mod, "load_state_dict"): PADDLE_LOAD,
        (paddle, "load"): PADDLE_PLAIN_LOAD,
        (paddle.framework, "load"): PADDLE_PLAIN_LOAD,
        (paddle.framework.io, "load"): PADDLE_PLAIN_LOAD,
        (dist, "shard_layer"): PADDLE_SHARD_LAYER,
        (paddle_auto_api, "shard_layer"): PADDLE_SHARD_LAYER,
    }


@pytest.fixture
def user_module():
    """A module that imported paddle's functions by name, as user code may."""
    mod = types.ModuleType("user_training_script")
    mod.save_state_dict, mod.load_state_dict, mod.load = PADDLE_SAVE, PADDLE_LOAD, PADDLE_PLAIN_LOAD
    mod.unrelated = len
    mod.builtin_load = PADDLE_LOAD  # another name: paddle's own, kept on purpose
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_every_name_is_routed_and_restored(user_module):
    with paddle_dcp.patch_paddle() as patch:
        assert dist.save_state_dict is paddle_dcp.save_state_dict
        assert paddle_save_mod.save_state_dict is paddle_dcp.save_state_dict
        assert dist.load_state_dict is routed_load()
        assert paddle_load_mod.load_state_dict is routed_load()
        assert paddle.load is paddle.framework.load is paddle.framework.io.load
        assert paddle.load is not PADDLE_PLAIN_LOAD and paddle.load.__wrapped__ is PADDLE_PLAIN_LOAD
        # imported by name before the patch: replaced too
        assert user_module.save_state_dict is paddle_dcp.save_state_dict
        assert user_module.load_state_dict is routed_load()
        assert user_module.load is paddle.load
        assert user_module.unrelated is len
        assert user_module.builtin_load is PADDLE_LOAD
        for (module, name) in paddles_names():
            assert f"{module.__name__}.{name}" in patch.replaced
    for (module, name), original in paddles_names().items():
        assert getattr(module, name) is original, f"{module.__name__}.{name} not restored"
    assert (user_module.save_state_dict, user_module.load_state_dict, user_module.load) == (
        PADDLE_SAVE, PADDLE_LOAD, PADDLE_PLAIN_LOAD,
    )


def test_a_module_imported_under_the_patch_gets_ours():
    patch = paddle_dcp.patch_paddle()
    try:
        from paddle.distributed import load_state_dict, save_state_dict

        assert save_state_dict is paddle_dcp.save_state_dict and load_state_dict is routed_load()
    finally:
        patch.undo()
    assert dist.load_state_dict is PADDLE_LOAD


def test_undo_twice_nested_patches_and_names_set_since_are_left_alone(user_module):
    outer = paddle_dcp.patch_paddle()
    inner = paddle_dcp.patch_paddle()  # finds nothing left of paddle's among the loaded names
    assert inner.replaced == []
    late = types.ModuleType("late_user_module")
    late.load_state_dict = PADDLE_LOAD  # bound after the first patch (e.g. a saved reference)
    sys.modules[late.__name__] = late
    try:
        again = paddle_dcp.patch_paddle()
        assert again.replaced == ["late_user_module.load_state_dict"]
        user_module.load_state_dict = "set by the user"
        outer.undo()
        outer.undo()
        assert dist.load_state_dict is PADDLE_LOAD
        assert user_module.load_state_dict == "set by the user"
        assert late.load_state_dict is routed_load()  # its own patch still holds it
        again.undo()
        assert late.load_state_dict is PADDLE_LOAD
    finally:
        del sys.modules[late.__name__]
        outer.undo()


def test_paddle_load_of_our_metadata_is_pickle_free_and_shaped_like_paddles(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((6, 4)).astype(np.float32), "b": np.arange(5, dtype=np.int64)}
    saved = save_checkpoint(str(tmp_path), arrays, {"w": "float32", "b": "int64"}, (2,), {"w": [0], "b": [None]})
    meta_file = tmp_path / "0.metadata"
    assert patching.is_dcp_metadata_file(meta_file) and patching.is_dcp_metadata_file(str(meta_file))

    def no_pickle(*a, **k):
        raise AssertionError("pickle used on a load path")

    with paddle_dcp.patch_paddle():
        monkeypatch.setattr(pickle, "load", no_pickle)
        monkeypatch.setattr(pickle, "loads", no_pickle)
        got = paddle.load(str(meta_file))
        monkeypatch.undo()
    assert isinstance(got, paddle_dcp.StateDictMetadata) and got.unique_id == saved.unique_id
    sdm = got.state_dict_metadata
    assert sorted(sdm) == ["model.b", "model.w"]
    w = sorted(sdm["model.w"], key=lambda m: m.global_offset)
    assert [(m.global_offset, m.local_shape, m.dtype, m.global_shape) for m in w] == [
        ((0, 0), (3, 4), "float32", (6, 4)), ((3, 0), (3, 4), "float32", (6, 4)),
    ]
    assert [(m.global_offset, m.local_shape, m.dtype, m.global_shape) for m in sdm["model.b"]] == [
        ((0,), (5,), "int64", (5,)),
    ]
    assert all(not m.is_flattened and m.flattened_range is None for m in w)
    assert got.flat_mapping == {"model.w": ("model", "w"), "model.b": ("model", "b")}  # paddle's attribute
    # the same from the directory, and the directory with an id
    assert paddle_dcp.read_state_dict_metadata(str(tmp_path)) == got
    assert paddle_dcp.read_state_dict_metadata(str(tmp_path), 0) == got
    assert paddle_dcp.read_state_dict_metadata(meta_file, 0) == got
    with pytest.raises(paddle_dcp.ArgumentError, match="not unique_id=1"):
        paddle_dcp.read_state_dict_metadata(meta_file, 1)
    with pytest.raises(paddle_dcp.StorageError, match="checkpoint 1 has no metadata file"):
        paddle_dcp.read_state_dict_metadata(str(tmp_path), 1)


def test_paddle_load_of_anything_else_is_paddles(tmp_path):
    pickled = tmp_path / "x.pdparams"
    paddle.save({"a": paddle.to_tensor([1.0, 2.0])}, str(pickled))
    named_like_metadata = tmp_path / "3.metadata"  # paddle's own metadata is a pickle
    paddle.save({"b": 7}, str(named_like_metadata))
    with paddle_dcp.patch_paddle():
        assert paddle.load(str(pickled))["a"].numpy().tolist() == [1.0, 2.0]
        assert paddle.load(str(named_like_metadata)) == {"b": 7}
        assert not patching.is_dcp_metadata_file(named_like_metadata)
        assert not patching.is_dcp_metadata_file(tmp_path / "missing" / "0.metadata")


def test_options_for_our_metadata_are_refused_not_ignored(tmp_path):
    save_checkpoint(str(tmp_path), {"w": np.ones((2, 2), np.float32)}, {"w": "float32"}, (1,), {"w": [None]})
    with paddle_dcp.patch_paddle():
        with pytest.raises(paddle_dcp.ArgumentError, match="return_numpy"):
            paddle.load(str(tmp_path / "0.metadata"), return_numpy=True)


def test_paddleformers_picks_a_comm_method_we_take():
    """PaddleFormers' select_flex_ckpt_comm_method picks "parallel_broadcast" (for more than 64
    ranks, with worker_groups that may hold None) when the source of dist.load_state_dict
    mentions it, else "broadcast": whichever it picks for ours, ours takes it."""
    from paddle_dcp import api

    source = inspect.getsource(paddle_dcp.load_state_dict)
    picked = "parallel_broadcast" if "parallel_broadcast" in source else "broadcast"
    assert picked in api.COMM_METHODS
    assert api._worker_peers([None, None], picked) == frozenset()


def test_routed_loads_keep_paddles_contract_for_missing_keys(tmp_path, caplog):
    """Code written for paddle (its load_state_dict, reached through the patch) gets paddle's
    contract: a key the checkpoint lacks is a warning naming it and that target is left as it
    was; patch_paddle(strict=True) opts into our error, a call's own strict= wins, and a direct
    call of paddle_dcp.load_state_dict stays strict."""
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    save_checkpoint(str(tmp_path), arrays, {"w": "float32"}, (1,), {"w": [None]})

    def target():
        return {"model": {"w": paddle.zeros([2, 3]), "extra": paddle.full([2], 5.0)}}

    with paddle_dcp.patch_paddle():
        assert dist.load_state_dict.__wrapped__ is paddle_dcp.load_state_dict
        sd = target()
        with caplog.at_level("WARNING"):
            dist.load_state_dict(sd, str(tmp_path))
        assert "model.extra" in caplog.text and "left unchanged" in caplog.text
        np.testing.assert_array_equal(sd["model"]["w"].numpy(), arrays["w"])
        np.testing.assert_array_equal(sd["model"]["extra"].numpy(), [5.0, 5.0])
        with pytest.raises(paddle_dcp.MismatchError, match="model.extra"):
            dist.load_state_dict(target(), str(tmp_path), strict=True)
        with pytest.raises(paddle_dcp.MismatchError, match="model.extra"):
            paddle_dcp.load_state_dict(target(), str(tmp_path))
    with paddle_dcp.patch_paddle(strict=True) as patch:
        assert "paddle.distributed.load_state_dict" in patch.replaced
        with pytest.raises(paddle_dcp.MismatchError, match="model.extra"):
            dist.load_state_dict(target(), str(tmp_path))
        sd = target()
        dist.load_state_dict(sd, str(tmp_path), strict=False)
        np.testing.assert_array_equal(sd["model"]["w"].numpy(), arrays["w"])
    assert dist.load_state_dict is PADDLE_LOAD
