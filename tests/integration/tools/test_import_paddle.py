"""paddle_dcp.tools.import_paddle (the import-paddle command): refused without --trust (it
unpickles); a checkpoint of paddle.distributed.save_state_dict imported piece for piece, with
flattened ranges kept and replicas skipped, then verified and loaded bit for bit."""
import json
import os

import numpy as np
import pytest

from unit.helpers import paddle_builtin_save, same_bits
from unit.tools.commands import run


def test_import_paddle_refuses_without_trust(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "0.metadata").write_bytes(b"not even read")
    code, out, err = run(capsys, "import-paddle", src, tmp_path / "out")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--trust" in err and "unpickle" in err
    assert not (tmp_path / "out").exists()


def test_import_paddle_builtin_checkpoint(tmp_path, capsys):
    paddle = pytest.importorskip("paddle")
    import paddle_dcp

    src, out = tmp_path / "paddle", tmp_path / "ours"
    oracle = paddle_builtin_save(paddle, src)
    code, stdout, err = run(capsys, "import-paddle", src, out, "--trust")
    assert code == 0, err
    assert "imported checkpoint 0" in stdout
    assert run(capsys, "verify", out)[0] == 0
    state = {
        "model": {"w": np.zeros((4, 6), np.float32), "e": paddle.zeros([3, 5], dtype="bfloat16")},
        "opt": {"n": np.zeros(5, np.int64)},
    }
    paddle_dcp.load_state_dict(state, str(out))
    assert same_bits(state["model"]["w"], oracle["model.w"])
    assert same_bits(state["model"]["e"].numpy(), oracle["model.e"])
    assert same_bits(state["opt"]["n"], oracle["opt.n"])
    # into the same directory: paddle's file names are ours
    code, _, err = run(capsys, "import-paddle", src, src, "--trust")
    assert code == 2 and "another directory" in err
    code, _, err = run(capsys, "import-paddle", src, out, "--trust")
    assert code == 2 and "already holds" in err


def test_import_paddle_keeps_pieces_flattened_ranges_and_skips_replicas(tmp_path, capsys):
    """Two ranks' files written as paddle's save writes them (its own dataclasses, paddle.save):
    w split by rows, m saved as flat ranges of its elements (sharding stage 2), b saved with
    save_replicas (a copy in each file)."""
    paddle = pytest.importorskip("paddle")
    from paddle.distributed.flex_checkpoint.dcp.metadata import LocalTensorIndex, LocalTensorMetadata
    from paddle.distributed.flex_checkpoint.dcp.metadata import Metadata as PaddleMetadata

    import paddle_dcp

    src, out = tmp_path / "paddle", tmp_path / "ours"
    src.mkdir()
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    m = (np.arange(12, dtype=np.int32) * 7 - 30).reshape(3, 4)
    b = np.array([1.5, -2.0, 3.25], dtype=np.float64)
    sdm, stm, files = {}, {}, {0: {}, 1: {}}
    for r, rows in ((0, slice(0, 1)), (1, slice(1, 4))):
        lo, n = rows.start, rows.stop - rows.start
        sdm.setdefault("model.w", []).append(LocalTensorMetadata((lo, 0), (n, 6), "float32", (4, 6)))
        stm[LocalTensorIndex("model.w", (lo, 0), local_shape=(n, 6))] = f"{r}_0.distcp"
        files[r]["model.w"] = paddle.to_tensor(w[rows])
    for r, (lo, hi) in ((0, (0, 5)), (1, (5, 12))):
        sdm.setdefault("model.m", []).append(LocalTensorMetadata((0, 0), (3, 4), "int32", (3, 4), True, (lo, hi)))
        idx = LocalTensorIndex("model.m", (0, 0), True, (lo, hi), local_shape=(3, 4))
        stm[idx] = f"{r}_0.distcp"
        files[r]["model.m"] = paddle.to_tensor(m.reshape(-1)[lo:hi])
    sdm["b"] = [LocalTensorMetadata((0,), (3,), "float64", (3,))]
    for r in (0, 1):
        stm[LocalTensorIndex("b", (0,), replica_id=r, local_shape=(3,))] = f"{r}_0.distcp"
        files[r]["b"] = paddle.to_tensor(b)
    mapping = {"model.w": ("model", "w"), "model.m": ("model", "m"), "b": ("b",)}
    paddle.save(PaddleMetadata(sdm, stm, mapping), str(src / "0.metadata"))
    for r, state in files.items():
        paddle.save(state, str(src / f"{r}_0.distcp"))

    code, _, err = run(capsys, "import-paddle", src, out, "--trust")
    assert code == 0, err
    code, stdout, _ = run(capsys, "inspect", out, "--json")
    tensors = json.loads(stdout)["checkpoint"]["tensors"]
    assert {k: t["pieces"] for k, t in tensors.items()} == {"model.w": 2, "model.m": 4, "b": 1}
    assert run(capsys, "verify", out)[0] == 0
    state = {"model": {"w": np.zeros_like(w), "m": np.zeros_like(m)}, "b": np.zeros_like(b)}
    paddle_dcp.load_state_dict(state, str(out))
    assert same_bits(state["model"]["w"], w) and same_bits(state["model"]["m"], m) and same_bits(state["b"], b)

    # a piece missing from paddle's metadata leaves a gap: refused, nothing left behind
    del stm[LocalTensorIndex("model.w", (0, 0), local_shape=(1, 6))]
    paddle.save(PaddleMetadata(sdm, stm, mapping), str(src / "0.metadata"))
    out2 = tmp_path / "ours2"
    code, _, err = run(capsys, "import-paddle", src, out2, "--trust")
    assert code == 1 and "model.w" in err and "gap" in err
    assert [n for n in os.listdir(out2)] == []
