"""The checkpoint format does not drift: one fixed state dict, saved in one process, gives
files whose SHA-256 were recorded from the code before the architecture change (commit
9139390). A change that alters a single byte of a data file or of the metadata fails here; a
deliberate format change updates the digests together with docs/format.md and the version."""
import hashlib

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

import paddle_dcp as dcp  # noqa: E402

PINNED = {
    "0.metadata": "5f891f0b7243411f3f935f73cf041e7eccd0812c0e953bcadacc49ab152bd7a1",
    "0_0.distcp": "710e23588a8dc5172c3bf9db620ec28b984c432b35e1cc2361af1589d22ce273",
    "1.metadata": "8f3944830f493d41eb31732f603b22af4325c989d565772a062f3dc70748fd99",
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
