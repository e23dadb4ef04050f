"""safetensors=True without processes: the one strict reader against hostile headers, metadata
made from a Hugging Face directory, rank files written as safetensors, and convert --to hf.
Files are written here from the specification or by the ``safetensors`` package, and read back
by it: neither side is the code under test."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import paddle_dcp
from paddle_dcp.core import save_plan
from paddle_dcp.format import hf_dir, safetensors
from paddle_dcp.io import local, open_storage, safetensors_files, storage
from paddle_dcp.tools import cli
from paddle_dcp.core.boxes import Box
from paddle_dcp.errors import FormatError


def raw_file(path, header, data: bytes = b"") -> str:
    """A file of the given header (a dict, or raw bytes) and data, from the specification."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + data)
    return str(path)


def entry(code, shape, begin, end):
    return {"dtype": code, "shape": shape, "data_offsets": [begin, end]}


HOSTILE = {
    "not json": (b"{nope", b""),
    "not an object": (b"[1, 2]", b""),
    "duplicate key": (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', bytes(2)),
    "unknown dtype": ({"a": entry("F33", [1], 0, 4)}, bytes(4)),
    "negative shape": ({"a": entry("F32", [-1], 0, 4)}, bytes(4)),
    "bool offsets": ({"a": entry("U8", [1], False, True)}, bytes(1)),
    "length differs from shape": ({"a": entry("F32", [2], 0, 4)}, bytes(4)),
    "past the end": ({"a": entry("F32", [2], 0, 8)}, bytes(4)),
    "overlap": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, bytes(8)),
    "hole": ({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
    "trailing bytes": ({"a": entry("F32", [1], 0, 4)}, bytes(8)),
    "extra field": ({"a": {**entry("F32", [1], 0, 4), "x": 1}}, bytes(4)),
    "metadata not str": ({"__metadata__": {"a": 1}}, b""),
    "huge shape": ({"a": entry("U8", [1 << 40, 1 << 40], 0, 1)}, bytes(1)),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_one_reader_refuses_hostile_headers(tmp_path, name):
    header, data = HOSTILE[name]
    path = raw_file(tmp_path / "x.safetensors", header, data)
    for read in (safetensors.read_header, safetensors.read_arrays):
        with pytest.raises(FormatError, match="x.safetensors"):
            read(path)


def test_header_length_bounds(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", safetensors.MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(FormatError, match="header of"):
        safetensors.read_header(str(path))
    path.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(FormatError, match="truncated"):
        safetensors.read_header(str(path))


def test_reader_takes_what_the_safetensors_package_writes(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64), "c": np.ones((), np.float16)}
    save_file(arrays, str(tmp_path / "m.safetensors"))
    got = safetensors.read_arrays(str(tmp_path / "m.safetensors"))
    assert sorted(got) == ["a", "b", "c"]
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v)
    codes = {k: e.code for k, e in safetensors.read_header(str(tmp_path / "m.safetensors")).entries.items()}
    assert codes == {"a": "F32", "b": "I64", "c": "F16"}


def test_writer_output_opens_in_the_safetensors_package(tmp_path):
    a, b = np.arange(3, dtype=np.int32), np.arange(8, dtype=np.float64).reshape(2, 4)
    header = safetensors.encode_header([("a", "I32", a.shape, a.nbytes), ("b", "F64", b.shape, b.nbytes)], {"k": "v"}, align=64)
    assert len(header) % 64 == 0
    (tmp_path / "w.safetensors").write_bytes(header + a.tobytes() + b.tobytes())
    got = load_file(str(tmp_path / "w.safetensors"))
    assert np.array_equal(got["a"], a) and np.array_equal(got["b"], b)


# ------------------------------------------------------------------ Hugging Face directories
def hf_directory(path, arrays: dict, shards: list[list[str]] | None) -> Path:
    path = Path(path)
    path.mkdir()
    if shards is None:
        save_file(arrays, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: arrays[k] for k in keys}, str(path / name))
        weight_map.update(dict.fromkeys(keys, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


ARRAYS = {
    "embed.w": np.arange(48, dtype=np.float32).reshape(8, 6),
    "head.b": np.arange(5, dtype=np.int64) - 2,
    "norm": np.linspace(0, 1, 7).astype(np.float16),
}


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


# ------------------------------------------------------------------ save with safetensors=True
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
    assert sorted(os.listdir(tmp_path)) == ["0.metadata", "0_0.safetensors"]
    got = load_file(str(tmp_path / "0_0.safetensors"))
    assert np.array_equal(got["model.w"], w) and np.array_equal(got["model.b"], sd["model"]["b"])
    target = {"model": {"w": np.zeros_like(w), "b": np.zeros(3, np.int64)}, "step": 0}
    paddle_dcp.load_state_dict(target, str(tmp_path))
    assert np.array_equal(target["model"]["w"], w) and target["step"] == 5
    assert local.list_checkpoints(str(tmp_path)).data_names(0) == ["0_0.safetensors"]


def test_piece_names_carry_the_box():
    assert hf_dir.piece_name("w", (0, 0), (4, 6), (4, 6)) == "w"
    assert hf_dir.piece_name("w", (2, 0), (2, 6), (4, 6)) == "w[2:4,0:6]"


# ------------------------------------------------------------------ convert --to hf
def test_convert_to_hf_respects_the_shard_limit(tmp_path, capsys):
    rng = np.random.default_rng(1)
    arrays = {f"layer{i}.w": rng.standard_normal((50, 20)).astype(np.float32) for i in range(5)}  # 4000 bytes each
    arrays["big"] = rng.standard_normal((100, 30)).astype(np.float32)  # 12000 bytes: alone
    paddle_dcp.save_state_dict(dict(arrays, step=1), str(tmp_path / "ck"))
    out = tmp_path / "hf"
    assert cli.main(["convert", str(tmp_path / "ck"), str(out), "--to", "hf", "--max-shard-size", "9000", "--progress"]) == 0
    err = capsys.readouterr().err
    assert "convert 0" in err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(arrays)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] and set(index["weight_map"].values()) == set(shards)
    for name in shards:
        got = load_file(str(out / name))
        data = sum(a.nbytes for a in got.values())
        assert data <= 9000 or len(got) == 1, (name, data)
        for k, v in got.items():
            assert index["weight_map"][k] == name and np.array_equal(v, arrays[k])
    assert not list(out.glob("*.tmp.*"))
    target = {k: np.zeros_like(v) for k, v in arrays.items()}
    paddle_dcp.load_state_dict(target, str(out), safetensors=True)
    assert all(np.array_equal(target[k], arrays[k]) for k in arrays)


def test_convert_to_hf_refuses_a_used_directory_and_a_bad_size(tmp_path, capsys):
    paddle_dcp.save_state_dict({"w": np.ones(3, np.float32)}, str(tmp_path / "ck"))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "used"), "--to", "hf"]) == 2
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "new"), "--to", "hf", "--max-shard-size", "lots"]) == 2
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "one"), "--to", "hf"]) == 0
    assert sorted(os.listdir(tmp_path / "one")) == ["model.safetensors"]


def hub_cache_snapshot(cache: Path, arrays: dict, shards: list[list[str]]) -> Path:
    """A Hugging Face hub cache as huggingface_hub lays it out: every file's bytes in
    ``models--org--tiny/blobs/<sha256>``, the snapshot's files relative symlinks to them."""
    import hashlib

    plain = hf_directory(cache.parent / f"{cache.name}-files", arrays, shards)
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in sorted(plain.iterdir()):
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / f.name)
    return snapshot


def test_a_snapshot_of_the_hugging_face_cache_loads_through_its_symlinks(tmp_path):
    from huggingface_hub import scan_cache_dir

    cache = tmp_path / "hub"
    snapshot = hub_cache_snapshot(cache, ARRAYS, [["embed.w", "norm"], ["head.b"]])
    repos = scan_cache_dir(cache).repos  # huggingface_hub's own reading of the layout
    assert [r.repo_id for r in repos] == ["org/tiny"] and len(next(iter(repos)).revisions) == 1
    sd = {"embed.w": np.zeros((8, 6), np.float32), "head.b": np.zeros(5, np.int64), "norm": np.zeros(7, np.float16)}
    paddle_dcp.load_state_dict(sd, str(snapshot), safetensors=True)
    assert all(np.array_equal(sd[k], ARRAYS[k]) for k in ARRAYS)


def test_a_snapshot_link_out_of_its_repository_is_still_refused(tmp_path):
    snapshot = hub_cache_snapshot(tmp_path / "hub", ARRAYS, None)
    elsewhere = tmp_path / "elsewhere.safetensors"
    save_file(ARRAYS, str(elsewhere))
    (snapshot / "model.safetensors").unlink()
    os.symlink(elsewhere, snapshot / "model.safetensors")
    sd = {"norm": np.zeros(7, np.float16)}
    with pytest.raises(FormatError, match="outside the checkpoint directory"):
        paddle_dcp.load_state_dict(sd, str(snapshot), safetensors=True)
    # a blobs directory of another repository is no better
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    os.rename(elsewhere, other / "x")
    (snapshot / "model.safetensors").unlink()
    os.symlink("../../../models--org--other/blobs/x", snapshot / "model.safetensors")
    with pytest.raises(FormatError, match="outside the checkpoint directory"):
        paddle_dcp.load_state_dict(sd, str(snapshot), safetensors=True)
