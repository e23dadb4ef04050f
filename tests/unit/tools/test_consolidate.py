"""paddle_dcp.tools.consolidate: full tensors read as consecutive slabs, each within the slab
size; memory bounded by the slab while converting and verifying a 64 MiB tensor; a malformed
safetensors file refused. Oracle: the numpy arrays the checkpoint was saved from."""
import os
import tracemalloc

import numpy as np
import pytest

from paddle_dcp.errors import UnsupportedError
from paddle_dcp.io import local
from paddle_dcp.tools import consolidate
from paddle_dcp.io import storage as dcp_storage

from ..helpers import same_bits, save_checkpoint
from .commands import run


def test_slabs_are_consecutive_and_bounded(saved):
    path, oracle = saved
    meta = dcp_storage.read_metadata(local.LocalStorage(path), 0, lazy=True)
    with consolidate.TensorReader(path, meta, slab_bytes=16) as reader:
        for key, array in oracle.items():
            parts = [s.copy() for s in reader.slabs(key)]
            assert all(p.nbytes <= max(16, array.itemsize) for p in parts)
            joined = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0, array.dtype)
            assert same_bits(joined, array.reshape(-1)), key


def test_convert_memory_stays_bounded_by_the_slab(tmp_path, capsys, monkeypatch):
    """A 64 MiB tensor converted (and verified) in 4 MiB slabs: Python's peak allocation stays
    under 3 slabs."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = str(tmp_path / "big")
    os.makedirs(path)
    big = np.arange(16 << 20, dtype=np.float32).reshape(4096, 4096)
    save_checkpoint(path, {"w": big}, {"w": "float32"}, (2,), {"w": (0,)}, block_bytes=1 << 20)
    slab = 4 << 20
    monkeypatch.setattr(consolidate, "SLAB_BYTES", slab)
    out = tmp_path / "big.safetensors"
    tracemalloc.start()
    try:
        code, _, err = run(capsys, "convert", path, out)
        _, convert_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        verify_code = run(capsys, "verify", path)[0]
        _, verify_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 0 and verify_code == 0, err
    assert convert_peak < 3 * slab, convert_peak
    assert verify_peak < 3 * slab, verify_peak
    loaded = safetensors_numpy.load_file(str(out))
    assert same_bits(loaded["model.w"], big)


@pytest.mark.parametrize("content", [b"", b"\x05" + bytes(7) + b"{", (8).to_bytes(8, "little") + b"[1,2,3]", (1 << 40).to_bytes(8, "little")])
def test_reading_a_malformed_safetensors_file_is_a_format_error(tmp_path, content):
    from paddle_dcp.errors import FormatError

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    with pytest.raises(FormatError, match="bad.safetensors"):
        consolidate.read_safetensors(str(bad))


@pytest.mark.parametrize("key, safe", [
    ("/../../etc/evil", False), ("w/", False), ("a//b", False), ("a/./b", False), ("a\\..\\b", False),
    ("tab\tkey", False), ("w\x85", False), ("layers/0/w", True), ("model.w", True), ("w\u00e9", True),
])
def test_npz_member_names_that_would_leave_the_archive_are_refused(tmp_path, capsys, key, safe):
    """convert --to npz names each member after its key: a key that an unzip would put outside
    its directory is refused, naming the key, before the file is written; other keys, "/"
    inside them too, round-trip through numpy."""
    path = str(tmp_path / "ck")
    os.makedirs(path)
    save_checkpoint(path, {key: np.arange(6, dtype=np.float32)}, {key: "float32"}, (1,), {key: (None,)})
    meta = dcp_storage.read_metadata(local.LocalStorage(path), 0)
    renamed = consolidate.Selection(keys=("model." + key,), values={})
    out = str(tmp_path / "out.npz")
    if safe:
        consolidate.write_npz(path, meta, out, renamed)
        np.testing.assert_array_equal(np.load(out)["model." + key], np.arange(6, dtype=np.float32))
    else:
        with pytest.raises(UnsupportedError, match="cannot be an npz member name") as info:
            consolidate.write_npz(path, meta, out, renamed)
        assert repr("model." + key) in str(info.value) and not os.path.exists(out)
