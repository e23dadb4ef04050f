"""paddle_dcp.tools.run (the run command): a script run as python runs it, after
patch_paddle (replaced here by a recorder: the real one patches paddle for the process), with
its own arguments and exit code; its error shown as python shows it."""
import sys

import pytest

import paddle_dcp
from paddle_dcp.tools import cli


@pytest.fixture
def patched(monkeypatch):
    calls = []
    monkeypatch.setattr(paddle_dcp, "patch_paddle", lambda strict=False: calls.append(strict))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return calls


def script(tmp_path, body: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(body)
    return str(path)


def test_the_script_runs_as_main_with_its_arguments_after_the_patch(tmp_path, patched):
    out = tmp_path / "seen.txt"
    body = f"import sys\nif __name__ == '__main__':\n    open({str(out)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
    path = script(tmp_path, body)
    assert cli.main(["run", path, "--lr", "0.1", "-v"]) == 0
    assert out.read_text() == "--lr 0.1 -v" and patched == [False]
    assert sys.argv[0] == path and sys.path[0] == str(tmp_path)  # as python sets them


@pytest.mark.parametrize("body, code", [
    ("raise SystemExit(3)", 3), ("raise SystemExit(None)", 0), ("raise SystemExit('bye')", 1), ("x = 1", 0),
])  # fmt: skip
def test_the_scripts_exit_code_is_the_commands(tmp_path, patched, body, code):
    assert cli.main(["run", "--strict", script(tmp_path, body)]) == code
    assert patched == [True]


def test_the_scripts_error_is_a_traceback_and_exit_1(tmp_path, patched, capsys):
    assert cli.main(["run", script(tmp_path, "raise KeyError('lost')")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'lost'" in err
