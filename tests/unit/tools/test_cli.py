"""paddle_dcp.tools.cli, the command line: its entry points and help, inspect, clean, exit
codes and one-line errors (verify, convert and import-paddle: their modules' tests). Oracles are the numpy arrays a checkpoint was saved from; every converted value is
compared bit for bit, read back by the format's own reader (safetensors, numpy, paddle.load).
Tests that need paddle import it themselves (skipped without it)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from .commands import REPO, TENSORS, expected_pieces, garbage, run


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
