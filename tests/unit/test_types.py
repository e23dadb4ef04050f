"""mypy runs clean on the pure layers (core/, format/) and on the storage layer (io/) with the
repository's mypy.ini, which requires every function of the pure layers to be annotated."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install mypy)")
def test_mypy_is_clean_on_core_format_and_io():
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "mypy.ini"), "paddle_dcp/core", "paddle_dcp/format", "paddle_dcp/io"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_the_check_sees_a_type_error(tmp_path):
    # guards the test above: mypy with this config must refuse an unannotated function
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install mypy)")
    bad = tmp_path / "paddle_dcp" / "core"
    bad.mkdir(parents=True)
    (tmp_path / "paddle_dcp" / "__init__.py").write_text("")
    (bad / "__init__.py").write_text("")
    (bad / "bad.py").write_text("def f(x):\n    return x + 1\n\n\ny: int = 'a'\n")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "mypy.ini"), "paddle_dcp/core"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert "no-untyped-def" in result.stdout and "assignment" in result.stdout
