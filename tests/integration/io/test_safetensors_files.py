"""paddle_dcp.io.safetensors_files: a Hugging Face directory, written by the ``safetensors``
package, read through a storage as a checkpoint's metadata (each tensor at its bytes; a load
reads only the bytes it needs), and the errors that name what is wrong with it."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import paddle_dcp
from paddle_dcp.io import local, open_storage, safetensors_files
from paddle_dcp.errors import FormatError

from unit.format.hf_dirs import ARRAYS, hf_directory


@pytest.mark.parametrize("shards", [None, [["embed.w"], ["head.b", "norm"]]])
def test_directory_metadata_places_each_tensor_at_its_bytes(tmp_path, shards):
    d = hf_directory(tmp_path / "hf", ARRAYS, shards)
    meta = safetensors_files.directory_metadata(open_storage(str(d)))
    assert sorted(meta.tensors) == sorted(ARRAYS) and meta.checksum_algorithm == "none"
    for key, array in ARRAYS.items():
        t = meta.tensors[key]
        assert t.shape == array.shape and t.pieces.count == 1
        piece = t.piece(0)
        raw = (d / meta.files[piece.file].name).read_bytes()[piece.byte_offset : piece.byte_offset + piece.nbytes]
        assert raw == array.tobytes(), key


@pytest.mark.parametrize("shards", [None, [["embed.w", "norm"], ["head.b"]]])
def test_load_a_directory_into_parts_reads_only_their_bytes(tmp_path, shards, monkeypatch):
    d = hf_directory(tmp_path / "hf", ARRAYS, shards)
    read = []
    real = local.FileSet.mapped
    monkeypatch.setattr(local.FileSet, "mapped", lambda self, i, a, b, again=False: (read.append(b - a), real(self, i, a, b))[1])
    sd = {"embed": {"w": np.zeros((8, 6), np.float32)}, "head.b": np.zeros(5, np.int64), "norm": np.zeros(7, np.float16)}
    paddle_dcp.load_state_dict(sd, str(d), safetensors=True)
    assert np.array_equal(sd["embed"]["w"], ARRAYS["embed.w"]) and np.array_equal(sd["head.b"], ARRAYS["head.b"])
    assert np.array_equal(sd["norm"], ARRAYS["norm"])
    assert sum(read) == sum(a.nbytes for a in ARRAYS.values())


def test_without_safetensors_true_a_directory_is_no_checkpoint(tmp_path):
    d = hf_directory(tmp_path / "hf", ARRAYS, None)
    with pytest.raises(paddle_dcp.DcpError, match="no complete checkpoint|metadata"):
        paddle_dcp.load_state_dict({"norm": np.zeros(7, np.float16)}, str(d))


def test_directory_errors_name_what_is_wrong(tmp_path):
    d = hf_directory(tmp_path / "hf", ARRAYS, [["embed.w"], ["head.b", "norm"]])
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["ghost"] = doc["weight_map"]["norm"]
    index.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="ghost"):
        safetensors_files.directory_metadata(open_storage(str(d)))
    doc["weight_map"].pop("ghost")
    doc["weight_map"]["norm"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="norm"):
        safetensors_files.directory_metadata(open_storage(str(d)))
    doc["weight_map"]["norm"] = "../evil.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="plain file name"):
        safetensors_files.directory_metadata(open_storage(str(d)))
    doc["weight_map"]["norm"] = "gone.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="missing"):
        safetensors_files.directory_metadata(open_storage(str(d)))
    index.write_text('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}')
    with pytest.raises(FormatError, match="twice"):
        safetensors_files.directory_metadata(open_storage(str(d)))
    index.unlink()  # without the index: every shard, and a name in two of them is refused
    save_file({"norm": ARRAYS["norm"]}, str(d / "extra.safetensors"))
    with pytest.raises(FormatError, match="'norm' is in both"):
        safetensors_files.directory_metadata(open_storage(str(d)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FormatError, match="no checkpoint"):
        safetensors_files.directory_metadata(open_storage(str(empty)))
