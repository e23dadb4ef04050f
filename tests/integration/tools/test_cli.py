"""paddle_dcp.tools.cli, the command line's arguments: its entry points and help, options
parsed (--unique-id, --storage-option), exit codes and one-line errors, and paddle never
imported by the commands that do not need it (each command's logic: its module's tests). Oracles are the numpy arrays a checkpoint was saved from; every converted value is
compared bit for bit, read back by the format's own reader (safetensors, numpy, paddle.load).
Tests that need paddle import it themselves (skipped without it)."""
import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paddle_dcp.tools import cli
from paddle_dcp.tools.console import UsageError

from unit.tools.commands import REPO, garbage, run


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


# ====================================================================== paddle is never imported
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


# ====================================================================== options
def test_storage_options_are_json_values_or_strings_for_a_url_only(monkeypatch):
    def options(path, *pairs):
        argv = ["inspect", path] + [x for pair in pairs for x in ("--storage-option", pair)]
        return cli._storage_options(cli.build_parser().parse_args(argv))

    assert options("s3://b/run", "part_size=8388608", "profile=dev", "anon=true") == {
        "part_size": 8388608, "profile": "dev", "anon": True
    }
    assert options("s3://b/run") is None
    with pytest.raises(UsageError, match="applies to a URL"):
        options("/local/ck", "part_size=1")
    with pytest.raises(UsageError, match="KEY=VALUE"):
        options("s3://b/run", "part_size")


def test_a_unique_id_is_a_non_negative_integer():
    assert cli._unique_id("12") == 12
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._unique_id(bad)
