"""paddle_dcp.format.hf_dir: a Hugging Face directory's index and file names checked, and each
rank's data file laid out as a safetensors file (its header counted; files the ``safetensors``
package opens)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import paddle_dcp
from paddle_dcp.core import save_plan
from paddle_dcp.format import hf_dir
from paddle_dcp.io import local
from paddle_dcp.io import storage as dcp_storage
from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import FormatError


def test_rank_file_layout_counts_the_header():
    plan = save_plan.plan_save([
        save_plan.SaveSummary.from_pieces(r, {"d": [["w", {"t": 0}], ["b", {"t": 0}]]}, [
            save_plan.LocalPiece("w", "float32", (4, 6), Box((2 * r, 0), (2, 6))),
            save_plan.LocalPiece("b", "int64", (3,), Box((0,), (3,))),
        ])
        for r in range(2)
    ])
    laid = hf_dir.layout_plan(plan)
    for r, size in laid.file_bytes.items():
        rows = np.flatnonzero(laid.piece_writer == r)
        rows = rows[np.argsort(laid.piece_leaf[rows])]
        first = int(laid.piece_byte_offset[rows[0]])
        assert first % 64 == 0 and first > 8
        ends = laid.piece_byte_offset[rows] + laid.piece_nbytes[rows]
        assert list(laid.piece_byte_offset[rows[1:]]) == list(ends[:-1]) and int(ends[-1]) == size


def test_save_with_safetensors_writes_files_the_package_opens(tmp_path):
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    sd = {"model": {"w": w, "b": np.arange(3, dtype=np.int64)}, "step": 5}
    paddle_dcp.save_state_dict(sd, str(tmp_path), safetensors=True)
    assert sorted(os.listdir(tmp_path)) == ["0.0.claim", "0.metadata", "0_0.safetensors"]
    got = load_file(str(tmp_path / "0_0.safetensors"))
    assert np.array_equal(got["model.w"], w) and np.array_equal(got["model.b"], sd["model"]["b"])
    target = {"model": {"w": np.zeros_like(w), "b": np.zeros(3, np.int64)}, "step": 0}
    paddle_dcp.load_state_dict(target, str(tmp_path))
    assert np.array_equal(target["model"]["w"], w) and target["step"] == 5
    assert dcp_storage.list_checkpoints(local.LocalStorage(str(tmp_path))).data_names(0) == ["0_0.safetensors"]


def test_piece_names_carry_the_box():
    assert hf_dir.piece_name("w", (0, 0), (4, 6), (4, 6)) == "w"
    assert hf_dir.piece_name("w", (2, 0), (2, 6), (4, 6)) == "w[2:4,0:6]"


def test_an_index_gives_its_weight_map_checked():
    raw = json.dumps({"metadata": {"total_size": 8}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}})
    assert hf_dir.parse_index(raw.encode(), "ix") == {"a": "m-1.safetensors", "b": "m-2.safetensors"}


@pytest.mark.parametrize("raw, words", [
    (b"\xff", "the index is not valid JSON (UnicodeDecodeError"),
    (b"[1]", "weight_map object"),
    (b'{"weight_map": []}', "weight_map object"),
    (b'{"weight_map": {"a": 3}}', "weight_map['a'] must be a file name"),
    (b'{"weight_map": {"a": "../x.safetensors"}}', "plain file name"),
    (b'{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "twice"),
])  # fmt: skip
def test_a_malformed_index_is_a_format_error_naming_it(raw, words):
    with pytest.raises(FormatError, match="^ix: ") as info:
        hf_dir.parse_index(raw, "ix")
    assert words in str(info.value)


def test_an_index_over_the_size_limit_is_refused_unread(monkeypatch):
    monkeypatch.setattr(hf_dir, "MAX_INDEX_BYTES", 10)
    with pytest.raises(FormatError, match="more than the 10 bytes"):
        hf_dir.parse_index(b'{"weight_map": {}}', "ix")


def test_the_one_index_of_a_directory_is_found_and_two_are_refused():
    names = ["model.safetensors.index.json", "model-00001-of-00001.safetensors", "config.json"]
    assert hf_dir.index_name(names, "d") == "model.safetensors.index.json"
    assert hf_dir.index_name(["model.safetensors"], "d") is None
    with pytest.raises(FormatError, match="more than one safetensors index"):
        hf_dir.index_name(names + ["other.safetensors.index.json"], "d")


def test_without_an_index_every_safetensors_file_but_our_rank_files_holds_tensors():
    names = ["b.safetensors", "a.safetensors", "0_3.safetensors", "notes.txt", "1_3.2.safetensors"]
    assert hf_dir.shard_files(names, "d") == ["a.safetensors", "b.safetensors"]
    with pytest.raises(FormatError, match="no checkpoint in d"):
        hf_dir.shard_files(["0_3.safetensors", "x.bin"], "d")
