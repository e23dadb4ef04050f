"""The checkpoint format does not drift: one fixed state dict, saved in one process, gives
files whose SHA-256 were recorded when the metadata became version 3 (issue 36: columns,
grids and digested groups; the data files kept their bytes). A change that alters a single byte of a data file or of the metadata fails here; a
deliberate format change updates the digests together with docs/format.md and the version."""
import hashlib

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_dcp as dcp  # noqa: E402

PINNED = {
    "0.0.claim": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",  # empty
    "1.0.claim": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "0.metadata": "b9d8fffd6120132e78841d7b66abbd902734eaf34ba95eec7c36ef024a8b5ffd",
    "0_0.distcp": "710e23588a8dc5172c3bf9db620ec28b984c432b35e1cc2361af1589d22ce273",
    "1.metadata": "d17b8f6a9169bb4f3ed649f20fb5f0c0aec4dadcea6ecac3f3edbfc12256e830",
    "0_1.distcp": "710e23588a8dc5172c3bf9db620ec28b984c432b35e1cc2361af1589d22ce273",
}


def _state():
    rng = np.random.default_rng(0)
    return {
        "a": paddle.to_tensor(rng.standard_normal((64, 33), dtype=np.float32)),
        "b": {
            "c": paddle.to_tensor(rng.standard_normal((5,), dtype=np.float32)).astype("bfloat16"),
            "n": 3, "s": "x", "l": [1, 2.5],
        },
        "i": paddle.to_tensor(np.arange(10, dtype=np.int64)),
    }


def test_a_fixed_state_dict_saves_to_the_pinned_bytes(tmp_path):
    sd = _state()
    dcp.save_state_dict(sd, str(tmp_path))
    dcp.save_state_dict(sd, str(tmp_path))  # the second id: numbering and metadata of id 1
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    assert got == PINNED
