"""mypy runs clean on the pure layers (core/, format/), on the storage layer (io/), on the
simulated ranks (tools/simulate.py, typed as the protocol's rank interfaces) and on the
in-memory test storage (tests/unit/io/memory_storage.py, typed as a Storage) with the repository's
mypy.ini, which requires every function of the pure layers to be annotated: a storage or a
simulated rank that lacks a method of its interface is a type error."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


CHECKED = ["paddle_dcp/core", "paddle_dcp/format", "paddle_dcp/io", "paddle_dcp/tools/simulate.py", "tests/unit/io/memory_storage.py"]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install mypy)")
def test_mypy_is_clean_on_core_format_io_the_simulated_ranks_and_the_test_storage(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "mypy.ini"), "--cache-dir", str(tmp_path), *CHECKED],
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
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "mypy.ini"), "--cache-dir", str(tmp_path / "cache"),
         "paddle_dcp/core"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert "no-untyped-def" in result.stdout and "assignment" in result.stdout


def test_a_storage_without_a_method_of_the_interface_is_a_type_error(tmp_path):
    # guards the first test: a class returned as a Storage must have every method of it
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install mypy)")
    (tmp_path / "lacking.py").write_text(
        "from paddle_dcp.io.storage import Storage\n\n\n"
        "class Lacking:\n"
        "    path = 'p'\n"
        "    seen_by_all = False\n\n"
        "    def list_names(self, temporary: bool = True) -> list[str]:\n"
        "        return []\n\n\n"
        "def opened() -> Storage:\n"
        "    return Lacking()\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "mypy.ini"), "--cache-dir", str(tmp_path / "cache"),
         str(tmp_path / "lacking.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert 'Incompatible return value type (got "Lacking", expected "Storage")' in result.stdout, result.stdout
