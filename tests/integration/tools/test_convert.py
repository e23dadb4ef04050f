"""paddle_dcp.tools.convert (the convert command): a checkpoint to safetensors, npz and pdparams
read back by each format's own reader and compared bit for bit with the arrays it was saved
from; key selection, tiny slabs, refusals (a dtype the format cannot hold, a damaged
checkpoint, a bad pattern), and the library's words kept apart from the command line's."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import paddle_dcp
from paddle_dcp.errors import ArgumentError, UnsupportedError
from paddle_dcp.tools import cli, consolidate
from paddle_dcp.io import storage as dcp_storage

from unit.helpers import same_bits, save_checkpoint
from unit.tools.commands import TENSORS, VALUES, bf16_as_f32, check_all, flip_byte, run


def test_convert_safetensors_read_back_by_safetensors(saved, tmp_path, capsys):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open

    path, oracle = saved
    out = tmp_path / "all.safetensors"
    code, stdout, err = run(capsys, "convert", path, out, "--to", "safetensors")
    assert code == 0, err
    assert f"wrote {len(oracle)} tensors" in stdout
    with safe_open(str(out), framework="np") as f:
        extra = dict(f.metadata())
        structure = json.loads(extra.pop("structure"))  # the nesting, for load_state_dict
        assert extra == {k: json.dumps(v) for k, v in VALUES.items()}
        assert [k for k, _ in structure["d"]][:1] == ["model"]
        no_bf16 = {k: f.get_tensor(k) for k in f.keys() if k != "model.e"}
    check_all(no_bf16, oracle, [k for k in sorted(oracle) if k != "model.e"])
    torch = pytest.importorskip("torch")
    import safetensors.torch

    e = safetensors.torch.load_file(str(out))["model.e"]
    assert e.dtype == torch.bfloat16
    assert same_bits(e.view(torch.int16).numpy().view(np.uint16), oracle["model.e"])
    # numpy's reader of the whole file: bfloat16 as float32 values
    out32 = tmp_path / "f32.safetensors"
    assert run(capsys, "convert", path, out32, "--bf16-as-float32")[0] == 0
    loaded = safetensors_numpy.load_file(str(out32))
    expect = dict(oracle, **{"model.e": bf16_as_f32(oracle["model.e"])})
    check_all(loaded, expect)


def test_convert_npz_read_back_by_numpy(saved, tmp_path, capsys):
    path, oracle = saved
    out = tmp_path / "all.npz"
    code, _, err = run(capsys, "convert", path, out, "--to", "npz")
    assert code == 0
    assert "uint16" in err  # the note about bfloat16
    with np.load(out, allow_pickle=False) as z:
        loaded = {k: z[k] for k in z.files}
    info = json.loads(str(loaded.pop("__metadata__")))
    check_all(loaded, oracle)
    assert info["dtypes"] == {k: TENSORS[k.split(".")[1]][0] for k in oracle}
    assert info["values"] == {"step": 5, "lr": "nan", "name": "run-1", "done": None}
    out32 = tmp_path / "f32.npz"
    assert run(capsys, "convert", path, out32, "--bf16-as-float32")[0] == 0
    with np.load(out32) as z:
        assert same_bits(z["model.e"], bf16_as_f32(oracle["model.e"]))


def test_convert_pdparams_read_back_by_paddle_load(saved, tmp_path, capsys):
    paddle = pytest.importorskip("paddle")
    path, oracle = saved
    out = tmp_path / "all.pdparams"
    code, _, err = run(capsys, "convert", path, out)
    assert code == 0, err
    loaded = paddle.load(str(out))
    assert loaded["model.e"].dtype == paddle.bfloat16
    tensors = {k: v.numpy() for k, v in loaded.items() if k.startswith("model.")}
    check_all(tensors, oracle)
    assert loaded["step"] == 5 and loaded["name"] == "run-1" and loaded["done"] is None
    assert np.isnan(loaded["lr"])


def test_convert_keys_selects_tensors_and_values(saved, tmp_path, capsys):
    path, oracle = saved
    out = tmp_path / "sel.npz"
    code, stdout, _ = run(capsys, "convert", path, out, "--keys", r"model\.[wq]$|^step")
    assert code == 0 and "wrote 2 tensors" in stdout and "1 values" in stdout
    with np.load(out) as z:
        loaded = {k: z[k] for k in z.files}
    assert json.loads(str(loaded.pop("__metadata__")))["values"] == {"step": 5}
    check_all(loaded, oracle, ["model.q", "model.w"])
    code, _, err = run(capsys, "convert", path, tmp_path / "none.npz", "--keys", "nothing-matches")
    assert code == 2 and "matches no key" in err
    code, _, err = run(capsys, "convert", path, tmp_path / "bad.npz", "--keys", "(")
    assert code == 1 and "regular expression" in err


@pytest.mark.parametrize("fmt", ["safetensors", "npz", "pdparams"])
def test_convert_in_tiny_slabs_is_exact(saved, tmp_path, capsys, monkeypatch, fmt):
    """Slabs far smaller than a row: every tensor is assembled from many reads of many pieces."""
    if fmt == "pdparams":
        paddle = pytest.importorskip("paddle")
    path, oracle = saved
    monkeypatch.setattr(consolidate, "SLAB_BYTES", 24)
    out = tmp_path / f"tiny.{fmt}"
    assert run(capsys, "convert", path, out, "--bf16-as-float32")[0] == 0
    expect = dict(oracle, **{"model.e": bf16_as_f32(oracle["model.e"])})
    if fmt == "safetensors":
        import safetensors.numpy

        loaded = safetensors.numpy.load_file(str(out))
    elif fmt == "npz":
        with np.load(out) as z:
            loaded = {k: z[k] for k in z.files if k != "__metadata__"}
    else:
        loaded = {k: v.numpy() for k, v in paddle.load(str(out)).items() if k.startswith("model.")}
    check_all(loaded, expect)


def test_convert_refuses_what_the_format_cannot_hold(ck, tmp_path, capsys):
    path = str(tmp_path / "c128")
    os.makedirs(path)
    save_checkpoint(path, {"z": np.ones(3, np.complex128)}, {"z": "complex128"}, (1,), {"z": (None,)})
    out = tmp_path / "z.safetensors"
    code, _, err = run(capsys, "convert", path, out)
    assert code == 1 and "model.z" in err and "complex128" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    assert run(capsys, "convert", path, tmp_path / "z.npz")[0] == 0
    code, _, err = run(capsys, "convert", ck, tmp_path / "out.bin")
    assert code == 2 and "--to" in err


def test_a_damaged_checkpoint_converts_to_nothing(ck, tmp_path, capsys):
    flip_byte(ck, "model.w")
    out = tmp_path / "o.safetensors"
    code, _, err = run(capsys, "convert", ck, out)
    assert code == 1 and "model.w" in err and "checksum" in err
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith("o.safetensors")]


def test_a_converted_safetensors_file_loads_back_whole_with_load_state_dict(tmp_path, capsys):
    """convert writes the nesting and plain values too: paddle_dcp.load_state_dict reads the
    single file back into a state dict of the same shape (no paddle needed for numpy leaves)."""
    import paddle_dcp

    path = str(tmp_path / "ck")
    saved = {"model": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "i": np.arange(5, dtype=np.int64)},
             "opt": {"lrs": [0.1, 0.2], "name": "adamw"}, "step": 7}  # fmt: skip
    paddle_dcp.save_state_dict(saved, path)
    out = tmp_path / "all.safetensors"
    assert run(capsys, "convert", path, out)[0] == 0
    target = {"model": {"w": np.zeros((3, 4), np.float32), "i": np.zeros(5, np.int64)},
              "opt": {"lrs": [0.0, 0.0], "name": ""}, "step": 0}  # fmt: skip
    paddle_dcp.load_state_dict(target, str(out))
    assert same_bits(target["model"]["w"], saved["model"]["w"]) and same_bits(target["model"]["i"], saved["model"]["i"])
    assert target["opt"] == {"lrs": [0.1, 0.2], "name": "adamw"} and target["step"] == 7


# ====================================================================== the library's words, the cli's options
def test_a_bad_key_pattern_is_an_argument_error_the_cli_names_by_its_option(saved, tmp_path, capsys):
    with pytest.raises(ArgumentError) as info:
        consolidate.key_filter("(")
    assert "--keys" not in str(info.value) and "'(' is not a regular expression" in str(info.value)
    code, _, err = run(capsys, "convert", saved[0], tmp_path / "bad.npz", "--keys", "(")
    assert code == 1 and "error: --keys '(' is not a regular expression" in err


def test_a_dtype_safetensors_refuses_gets_the_cli_options_only_from_the_cli(tmp_path, capsys):
    path = str(tmp_path / "c128")
    (tmp_path / "c128").mkdir()
    save_checkpoint(path, {"z": np.ones(3, np.complex128)}, {"z": "complex128"}, (1,), {"z": (None,)})
    meta = dcp_storage.read_metadata(consolidate.open_storage(path), 0)
    with pytest.raises(UnsupportedError) as info:
        consolidate.convert(path, meta, str(tmp_path / "z.safetensors"), "safetensors", consolidate.select(meta))
    assert "--" not in str(info.value) and "complex128" in str(info.value)
    code, _, err = run(capsys, "convert", path, tmp_path / "z.safetensors")
    assert code == 1 and err.strip().endswith("; leave it out with --keys or convert --to npz"), err
    with pytest.raises(ArgumentError, match="unknown output format"):
        consolidate.convert(path, meta, str(tmp_path / "z.x"), "x", consolidate.select(meta))


# ====================================================================== convert --to hf
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


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_quantized_tensors_convert_to_their_dequantized_values_in_their_dtype(compressed, tmp_path, capsys, fmt):
    path, loaded = compressed
    out = tmp_path / f"all.{fmt}"
    code, _, err = run(capsys, "convert", path, out)
    assert code == 0, err
    assert "2 tensors stored quantized (int4, int8) are written dequantized" in err
    if fmt == "npz":
        with np.load(out, allow_pickle=False) as z:
            got = {k: z[k] for k in z.files if k != "__metadata__"}
    else:
        got = _safetensors_raw(out)  # numpy's reader has no bfloat16
    assert sorted(got) == sorted(loaded)
    for key, want in loaded.items():
        assert same_bits(got[key], want), key


def _safetensors_raw(path) -> dict:
    """Every tensor of a safetensors file as its bytes' numpy dtype (bfloat16 as uint16), read
    from the format's definition (numpy's reader has no bfloat16)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    kinds = {"F32": "<f4", "BF16": "<u2", "I64": "<i8"}
    return {
        k: np.frombuffer(raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]], kinds[v["dtype"]]).reshape(v["shape"])
        for k, v in header.items() if k != "__metadata__"
    }  # fmt: skip


def test_quantized_tensors_export_to_a_hugging_face_directory_dequantized(compressed, tmp_path, capsys):
    path, loaded = compressed
    out = tmp_path / "hf"
    code, _, err = run(capsys, "convert", path, out, "--to", "hf", "--bf16-as-float32")
    assert code == 0, err
    assert "written dequantized" in err
    got = load_file(str(out / "model.safetensors"))
    assert same_bits(got["model.m2"], bf16_as_f32(loaded["model.m2"]))
    assert same_bits(got["model.m1"], loaded["model.m1"]) and same_bits(got["model.n"], loaded["model.n"])


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_a_derived_tensor_converts_to_its_parameter_cast_and_keys_can_leave_it_out(derived, tmp_path, capsys, fmt):
    path, loaded = derived
    out = tmp_path / f"all.{fmt}"
    code, _, err = run(capsys, "convert", path, out, "--bf16-as-float32")
    assert code == 0, err
    assert "1 tensors the checkpoint derives" in err and "model.p.w_0" in err and "cast to their dtype" in err
    if fmt == "npz":
        with np.load(out, allow_pickle=False) as z:
            got = {k: z[k] for k in z.files if k != "__metadata__"}
    else:
        got = load_file(str(out))
    assert sorted(got) == sorted(loaded)
    assert got["model.p.w_0"].dtype == np.float32 and same_bits(got["model.p.w_0"], loaded["model.p.w_0"])
    assert same_bits(got["model.p"], bf16_as_f32(loaded["model.p"])) and same_bits(got["model.q"], loaded["model.q"])
    code, _, err = run(capsys, "convert", path, tmp_path / f"some.{fmt}", "--keys", r"\.[pq]$")
    assert code == 0 and "derives" not in err


def test_a_derived_tensor_exports_to_a_hugging_face_directory_as_its_parameter_cast(derived, tmp_path, capsys):
    path, loaded = derived
    code, _, err = run(capsys, "convert", path, tmp_path / "hf", "--to", "hf")
    assert code == 0 and "derives" in err, err
    got = _safetensors_raw(tmp_path / "hf" / "model.safetensors")
    assert got["model.p.w_0"].dtype == np.float32 and same_bits(got["model.p.w_0"], loaded["model.p.w_0"])
    assert same_bits(got["model.p"], loaded["model.p"])

