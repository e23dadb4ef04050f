"""The command line: inspect, verify, convert, import-paddle, clean; exit codes and one-line
errors. Oracles are the numpy arrays a checkpoint was saved from; every converted value is
compared bit for bit, read back by the format's own reader (safetensors, numpy, paddle.load).
Tests that need paddle import it themselves (skipped without it)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paddle_dcp.io import local
from paddle_dcp.errors import ArgumentError, UnsupportedError
from paddle_dcp.tools import cli, consolidate
from paddle_dcp.core.boxes import element_span, flat_range_boxes
from paddle_dcp.core.metadata import TensorEntry

from ..helpers import coords, fast, paddle_builtin_save, random_array, ref_box, same_bits, save_checkpoint

REPO = Path(__file__).resolve().parents[3]

# name -> (dtype, global shape, placements on a (2, 2) mesh): several pieces per tensor,
# uneven splits, a scalar, every dtype safetensors holds
TENSORS = {
    "w": ("float32", (6, 10), (0, 1)),
    "e": ("bfloat16", (5, 3), (1, None)),
    "i": ("int64", (7,), (0, None)),
    "b": ("bool", (4, 4), (None, 1)),
    "h": ("float16", (3, 5, 2), (2, 0)),
    "c": ("complex64", (4,), (None, 0)),
    "q": ("int8", (9, 2), (0, 0)),
    "s": ("float64", (), (None, None)),
}
VALUES = {"step": 5, "lr": float("nan"), "name": "run-1", "done": None}
MESH = (2, 2)


def expected_pieces(shape, placements) -> int:
    """Distinct non-empty boxes the ranks of MESH hold: what a save writes once each."""
    boxes = {ref_box(shape, MESH, placements, c) for c in coords(MESH)}
    return len([b for b in boxes if b.volume > 0 or not b.shape])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-rank checkpoint of every TENSORS entry (64-byte checksum blocks), and its oracle."""
    path = str(tmp_path_factory.mktemp("multi") / "ck")
    os.makedirs(path)
    rng = np.random.default_rng(7)
    arrays = {n: random_array(rng, d, s) for n, (d, s, _) in TENSORS.items()}
    save_checkpoint(
        path, arrays, {n: d for n, (d, _, _) in TENSORS.items()}, MESH,
        {n: p for n, (_, _, p) in TENSORS.items()}, block_bytes=64, values=dict(VALUES),
    )  # fmt: skip
    return path, {f"model.{n}": a for n, a in arrays.items()}


@pytest.fixture
def ck(saved, tmp_path):
    """A private copy of the checkpoint, to damage."""
    path = str(tmp_path / "ck")
    shutil.copytree(saved[0], path)
    return path


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def bf16_as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def piece_location(path, key, index=0):
    meta = local.read_metadata(path, 0)
    p = meta.tensors[key].pieces
    return os.path.join(path, meta.files[int(p.files[index])].name), int(p.byte_offsets[index])


# ====================================================================== help, entry points
def test_python_m_paddle_dcp_help_and_console_script():
    r = subprocess.run([sys.executable, "-m", "paddle_dcp", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    for command in ("inspect", "verify", "convert", "import-paddle", "clean"):
        assert command in r.stdout
    script = Path(sys.executable).with_name("paddle-dcp")
    if script.exists():  # installed with pip install -e
        r = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "paddle_dcp" in r.stdout


def test_every_subcommand_has_help(capsys):
    for command in ("inspect", "verify", "convert", "import-paddle", "clean"):
        code, out, _ = run(capsys, command, "--help")
        assert code == 0 and "usage:" in out
    code, out, _ = run(capsys, "clean", "--help")
    assert "node-local" in out  # the warning about --incomplete


def test_inspect_verify_convert_do_not_import_paddle(saved, tmp_path):
    """With paddle blocked (every import of it fails) and without blocking (nothing imports it)."""
    path = saved[0]
    code = f"""
        import sys
        BLOCK
        from paddle_dcp.tools.cli import main
        assert main(["inspect", {path!r}]) == 0
        assert main(["inspect", {path!r}, "--json"]) == 0
        assert main(["verify", {path!r}]) == 0
        assert main(["convert", {path!r}, {str(tmp_path / 'o.safetensors')!r}]) == 0
        assert main(["convert", {path!r}, {str(tmp_path / 'o.npz')!r}]) == 0
        assert main(["clean", {path!r}, "--dry-run"]) == 0
        assert "paddle" not in sys.modules or sys.modules["paddle"] is None, "paddle was imported"
        print("ok")
    """
    for block in ("sys.modules['paddle'] = None", "pass"):
        r = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code).replace("BLOCK", block)],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().endswith("ok")


# ====================================================================== inspect
def test_inspect_text_lists_every_key_file_and_value(saved, capsys):
    path, oracle = saved
    code, out, err = run(capsys, "inspect", path)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"checkpoint directory {path}"
    assert "  complete ids: 0" in lines
    for name, (dtype, shape, placements) in TENSORS.items():
        nbytes = oracle[f"model.{name}"].nbytes
        row = f"model.{name} {tuple(shape)} {dtype} {expected_pieces(shape, placements)} {nbytes}"
        assert row in [" ".join(line.split()) for line in lines], row
    meta = json.loads(open(os.path.join(path, "0.metadata")).read())
    for f in meta["files"]:
        assert f"{f['name']} {os.path.getsize(os.path.join(path, f['name']))}" in [" ".join(x.split()) for x in lines]
    assert "  step = 5" in lines and '  name = "run-1"' in lines and "  done = null" in lines
    assert "  lr = NaN" in lines
    total = sum(a.nbytes for a in oracle.values())
    assert any(line.startswith(f"total: {total} bytes") for line in lines)


def test_inspect_json_is_exact(saved, capsys):
    path, oracle = saved
    code, out, _ = run(capsys, "inspect", path, "--json")
    assert code == 0
    doc = json.loads(out)
    files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    assert doc == {
        "path": path,
        "complete": [0],
        "incomplete": [],
        "temporary": [],
        "problems": [],
        "checkpoint": {
            "unique_id": 0,
            "format_version": 1,
            "world_size": 4,
            "created_by": "",
            "checksum": "xxh3_64",
            "block_bytes": 64,
            "tensors": {
                f"model.{n}": {
                    "shape": list(s),
                    "dtype": d,
                    "pieces": expected_pieces(s, p),
                    "bytes": oracle[f"model.{n}"].nbytes,
                }
                for n, (d, s, p) in sorted(TENSORS.items())
            },
            "files": [{"name": n, "bytes": os.path.getsize(os.path.join(path, n))} for n in files],
            "values": {"step": 5, "lr": "nan", "name": "run-1", "done": None},
            "tensor_bytes": sum(a.nbytes for a in oracle.values()),
            "file_bytes": sum(os.path.getsize(os.path.join(path, n)) for n in files),
        },
    }


def test_inspect_shows_incomplete_ids_and_temporary_files(ck, capsys):
    for name in ("0_9.distcp", "1_9.distcp", "0_9.distcp.tmp.0badf00d"):
        open(os.path.join(ck, name), "wb").close()
    code, out, _ = run(capsys, "inspect", ck, "--json")
    doc = json.loads(out)
    assert code == 0
    assert (doc["complete"], doc["incomplete"], doc["temporary"]) == ([0], [9], ["0_9.distcp.tmp.0badf00d"])
    code, out, err = run(capsys, "inspect", ck)
    assert "incomplete ids: 9" in out and "0_9.distcp.tmp.0badf00d" in out
    code, out, err = run(capsys, "inspect", ck, "--unique-id", 9)
    assert code == 1 and "checkpoint 9" in err and "incomplete" in err
    code, out, err = run(capsys, "inspect", ck, "--unique-id", 42)
    assert code == 2 and "no checkpoint 42" in err and len(err.strip().splitlines()) == 1


def test_inspect_empty_directory_is_a_problem(tmp_path, capsys):
    code, out, err = run(capsys, "inspect", tmp_path)
    assert code == 1 and "no complete checkpoint" in err
    code, out, _ = run(capsys, "inspect", tmp_path, "--json")
    assert code == 1 and json.loads(out)["checkpoint"] is None


# ====================================================================== verify
def test_verify_good_checkpoint(saved, capsys):
    code, out, err = run(capsys, "verify", saved[0])
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("checkpoint 0: OK")
    assert err == ""  # stderr is not a terminal: no progress bar


def test_verify_progress_bar_on_request(saved, capsys):
    code, _, err = run(capsys, "verify", saved[0], "--progress")
    total = sum(a.nbytes for a in saved[1].values())
    assert code == 0
    assert "verify 0" in err and "/s" in err and ("100%" in err or "B/s" in err)
    assert f"{total}" in err or "B /" in err


def flip_byte(path, key):
    name, offset = piece_location(path, key)
    with open(name, "r+b") as f:
        f.seek(offset + 1)
        b = f.read(1)
        f.seek(offset + 1)
        f.write(bytes([b[0] ^ 0x40]))
    return name


def truncate(path, key):
    name, _ = piece_location(path, key)
    os.truncate(name, os.path.getsize(name) - 3)
    return name


def remove(path, key):
    name, _ = piece_location(path, key)
    os.unlink(name)
    return name


def overlap(path, key):
    """Metadata whose pieces of ``key`` overlap: the second piece moved onto the first."""
    name = os.path.join(path, "0.metadata")
    meta = local.read_metadata(path, 0)
    entry = meta.tensors[key]
    offsets = entry.pieces.offsets.copy()
    offsets[1] = offsets[0]
    pieces = replace(entry.pieces, offsets=offsets)
    tensors = dict(meta.tensors)
    tensors[key] = TensorEntry(key, entry.dtype, entry.shape, pieces, entry.block_bytes)
    with open(name, "wb") as f:
        f.write(replace(meta, tensors=tensors).to_json())
    return name


def garbage(path, key):
    name = os.path.join(path, "0.metadata")
    with open(name, "wb") as f:
        f.write(b'{"format": "paddle_dcp", "format_version": 1, "tens')
    return name


@pytest.mark.parametrize("damage, what", [
    (flip_byte, "checksum"), (truncate, "bytes, the metadata says"), (remove, "missing"),
    (overlap, "overlap"), (garbage, "not valid JSON"),
])  # fmt: skip
def test_verify_names_file_key_and_problem(ck, capsys, damage, what):
    name = damage(ck, "model.w")
    code, out, err = run(capsys, "verify", ck)
    assert code == 1, out
    problems = [line for line in out.splitlines() if not line.startswith("checkpoint 0:")]
    assert problems, out
    hit = [p for p in problems if p.startswith(name) and what in p]
    assert hit, out
    if damage is not garbage:  # a metadata that does not parse names no key
        assert "model.w" in hit[0]
    assert "problem" in out.splitlines()[-1]


def edit_value(path, key):
    """A plain value changed by hand in the metadata, which stays valid JSON of a valid
    checkpoint: only its digest tells."""
    name = os.path.join(path, "0.metadata")
    with open(name, "rb") as f:
        data = f.read()
    assert data.count(b'"run-1"') == 1
    with open(name, "wb") as f:
        f.write(data.replace(b'"run-1"', b'"run-2"'))
    return name


def remove_metadata(path, key):
    name = os.path.join(path, "0.metadata")
    os.unlink(name)
    return name


@pytest.mark.parametrize("damage, verify_says, load_raises", [
    (edit_value, "digest does not match", "digest does not match"),
    (flip_byte, "checksum", "checksum"),
    (truncate, "bytes, the metadata says", "model.w"),
    (remove, "missing", "model.w"),
    (remove_metadata, "no *.metadata file (incomplete ids: 0)", "no complete checkpoint"),
])  # fmt: skip
def test_each_damage_is_caught_by_verify_and_by_a_load(ck, capsys, damage, verify_says, load_raises):
    """What a load refuses, verify reports (it said OK to an edited metadata value that the
    load refused), and the other way round."""
    import paddle_dcp

    paddle_dcp.load_state_dict({"model": {"w": np.zeros((6, 10), np.float32)}}, ck)  # sound before
    name = damage(ck, "model.w")
    code, out, err = run(capsys, "verify", ck)
    assert code == 1, out + err
    assert verify_says in out + err, out + err
    assert name in out or damage is remove_metadata, out  # the file, where one is damaged
    target = {"model": {"w": np.zeros((6, 10), np.float32)}}
    with pytest.raises(paddle_dcp.DcpError) as info:
        paddle_dcp.load_state_dict(target, ck, unique_id=None if damage is remove_metadata else 0)
    assert load_raises in str(info.value), str(info.value)
    assert not target["model"]["w"].any()  # nothing loaded


def test_verify_lists_every_problem_and_reads_in_small_windows(ck, capsys, monkeypatch):
    monkeypatch.setattr(consolidate, "SLAB_BYTES", 64)  # one checksum block per read
    flipped = flip_byte(ck, "model.w")
    missing_name, _ = piece_location(ck, "model.q", 0)
    if missing_name == flipped:
        missing_name, _ = piece_location(ck, "model.q", 1)
    os.unlink(missing_name)
    code, out, _ = run(capsys, "verify", ck)
    assert code == 1
    assert any(line.startswith(flipped) and "model.w" in line for line in out.splitlines())
    assert any(line.startswith(missing_name) and "missing" in line and "model.q" in line for line in out.splitlines())


def test_verify_all_checks_every_complete_id(ck, capsys):
    shutil.copy(os.path.join(ck, "0.metadata"), os.path.join(ck, "1.metadata"))  # names id 0 inside
    code, out, _ = run(capsys, "verify", ck, "--all")
    assert code == 1
    assert "checkpoint 0: OK" in out and "checkpoint 1: 1 problem" in out
    assert "describes checkpoint 0, not 1" in out


# ====================================================================== convert
def check_all(loaded: dict, oracle: dict, keys=None):
    keys = sorted(oracle) if keys is None else keys
    assert sorted(loaded) == sorted(keys)
    for key in keys:
        assert same_bits(np.asarray(loaded[key]), oracle[key]), key


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


def test_slabs_are_consecutive_and_bounded(saved):
    path, oracle = saved
    meta = local.read_metadata(path, 0, lazy=True)
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


# ====================================================================== errors
def test_errors_are_one_line_without_traceback_unless_debug(ck, tmp_path, capsys):
    code, out, err = run(capsys, "inspect", tmp_path / "missing")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "does not exist" in err and "Traceback" not in err
    garbage(ck, "model.w")
    code, _, err = run(capsys, "convert", ck, tmp_path / "o.npz")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "0.metadata" in err
    assert "Traceback" not in err
    code, _, err = run(capsys, "--debug", "convert", ck, tmp_path / "o.npz")
    assert code == 1 and "Traceback" in err and "FormatError" in err
    code, _, err = run(capsys, "convert", ck, tmp_path / "o.npz", "--debug")
    assert code == 1 and "Traceback" in err
    code, _, err = run(capsys, "convert", ck)  # missing OUT: argparse's usage error
    assert code == 2 and "usage:" in err
    code, _, err = run(capsys, "verify", ck, "--unique-id", "-1")
    assert code == 2


# ====================================================================== import-paddle
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


@fast(200)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_flat_range_boxes_are_the_range_in_order(shape, data):
    n = int(np.prod(shape))
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    got = []
    for box in flat_range_boxes(shape, start, stop):
        first, end = element_span(shape, box) if shape else (0, 1)
        assert end - first == box.volume  # one contiguous run
        got.extend(range(first, end))
    assert got == list(range(start, stop))


# ====================================================================== clean
LEFTOVERS = {
    "temporary": ["0_1.distcp.tmp.0badf00d", "1.metadata.tmp.deadbeef"],
    "incomplete": ["0_7.distcp", "1_7.distcp"],
    "superseded": ["2_0.1.distcp"],  # a generation the metadata of checkpoint 0 does not list
}


def add_leftovers(path):
    for names in LEFTOVERS.values():
        for name in names:
            with open(os.path.join(path, name), "wb") as f:
                f.write(b"x" * 10)


def test_clean_dry_run_changes_nothing(ck, capsys):
    add_leftovers(ck)
    before = sorted(os.listdir(ck))
    code, out, _ = run(capsys, "clean", ck, "--dry-run")
    assert code == 0 and sorted(os.listdir(ck)) == before
    assert {line.split("/")[-1] for line in out.splitlines() if line.startswith("would remove ")} == set(
        LEFTOVERS["temporary"]
    )
    code, out, _ = run(capsys, "clean", ck, "--incomplete", "--dry-run")
    assert code == 0 and sorted(os.listdir(ck)) == before
    listed = {line.split("/")[-1] for line in out.splitlines() if line.startswith("would remove ")}
    assert listed == {n for names in LEFTOVERS.values() for n in names}
    assert "total: 5 files (50 bytes) would be removed" in out


def test_clean_removes_temporary_files_then_incomplete_ones(ck, capsys):
    complete = sorted(os.listdir(ck))
    add_leftovers(ck)
    code, out, _ = run(capsys, "clean", ck)
    assert code == 0
    assert sorted(os.listdir(ck)) == sorted(complete + LEFTOVERS["incomplete"] + LEFTOVERS["superseded"])
    assert f"removed {os.path.join(ck, LEFTOVERS['temporary'][0])}" in out
    code, out, _ = run(capsys, "clean", ck, "--incomplete")
    assert code == 0 and sorted(os.listdir(ck)) == complete
    assert "total: 3 files (30 bytes) removed" in out
    code, out, _ = run(capsys, "clean", ck, "--incomplete")
    assert code == 0 and "nothing to remove" in out
    assert run(capsys, "verify", ck)[0] == 0


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


@pytest.mark.parametrize("content", [b"", b"\x05" + bytes(7) + b"{", (8).to_bytes(8, "little") + b"[1,2,3]", (1 << 40).to_bytes(8, "little")])
def test_reading_a_malformed_safetensors_file_is_a_format_error(tmp_path, content):
    from paddle_dcp.errors import FormatError

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    with pytest.raises(FormatError, match="bad.safetensors"):
        consolidate.read_safetensors(str(bad))


def test_verify_takes_the_copies_of_a_save_replicas_checkpoint(tmp_path):
    """Every holder's copy of a replicated piece (save_replicas) is one box saved twice, in two
    files: verify checks each copy's bytes and does not call the copies an overlap."""
    from paddle_dcp.tools import verify

    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    saved = save_checkpoint(str(tmp_path), {"w": w}, {"w": "float32"}, (2,), {"w": (None,)}, replicas=True)
    assert saved.meta.replicas and saved.meta.tensors["model.w"].pieces.count == 2
    problems, counts = verify.verify_checkpoint(str(tmp_path), 0)
    assert problems == [] and counts["pieces"] == 2 and counts["files"] == 2
    with open(tmp_path / "1_0.distcp", "r+b") as f:  # damage the second copy only
        f.write(b"\xff")
    problems, _ = verify.verify_checkpoint(str(tmp_path), 0)
    assert len(problems) == 1 and "1_0.distcp" in problems[0] and "model.w" in problems[0], problems


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
    meta = consolidate.open_storage(path).read_metadata(0)
    with pytest.raises(UnsupportedError) as info:
        consolidate.convert(path, meta, str(tmp_path / "z.safetensors"), "safetensors", consolidate.select(meta))
    assert "--" not in str(info.value) and "complex128" in str(info.value)
    code, _, err = run(capsys, "convert", path, tmp_path / "z.safetensors")
    assert code == 1 and err.strip().endswith("; leave it out with --keys or convert --to npz"), err
    with pytest.raises(ArgumentError, match="unknown output format"):
        consolidate.convert(path, meta, str(tmp_path / "z.x"), "x", consolidate.select(meta))
