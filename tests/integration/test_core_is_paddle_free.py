"""The core of paddle_dcp (every module of core/ and format/, plus errors, io.storage and
parallel.wire) runs without paddle: these modules are what the unit tests, the planner and the file
format rely on."""
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PACKAGE = REPO / "paddle_dcp"
# every module of the pure subpackages, found by walking them (a new module is checked too)
PURE_DIRS = ["core", "format"]
# paddle-free modules that live elsewhere in the layout
OTHERS = ["errors", "io.storage", "parallel.wire"]


def pure_modules() -> list[str]:
    found = [
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for d in PURE_DIRS
        for path in sorted((PACKAGE / d).rglob("*.py"))
    ]
    return [m[: -len(".__init__")] if m.endswith(".__init__") else m for m in found]


CORE = pure_modules() + OTHERS


def test_the_walk_finds_the_core_modules():
    # guards the walk: an empty or wrong list would make the import test below pass vacuously
    for name in ("core.boxes", "core.metadata", "core.save_plan", "core.load_plan", "core.keys", "core.aoa", "format.safetensors", "format.hf_dir"):
        assert name in CORE, CORE


def run_without_paddle(code: str) -> subprocess.CompletedProcess:
    # sys.modules["paddle"] = None makes every `import paddle` raise ImportError.
    prelude = f"import sys\nsys.path.insert(0, {str(REPO)!r})\nsys.modules['paddle'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=60, cwd=REPO
    )


def test_core_modules_import_with_paddle_blocked():
    result = run_without_paddle(
        f"""
        import importlib
        for name in {CORE!r}:
            importlib.import_module("paddle_dcp." + name)
        assert sys.modules["paddle"] is None, "something replaced the blocked paddle module"
        loaded = sorted(m for m in sys.modules if m == "paddle" or m.startswith("paddle."))
        assert loaded == ["paddle"], loaded
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_blocking_paddle_really_blocks_it():
    # guards the test above: the prelude must make `import paddle` fail
    result = run_without_paddle("import paddle\n")
    assert result.returncode != 0
    assert "ImportError" in result.stderr or "ModuleNotFoundError" in result.stderr


def test_core_pipeline_runs_with_paddle_blocked(tmp_path):
    """Not just importable: a save and a load of numpy arrays go through with paddle blocked."""
    result = run_without_paddle(
        f"""
        import numpy as np
        from tests.unit.helpers import save_checkpoint, load_rank
        from paddle_dcp.core import load_plan
        from paddle_dcp.core.boxes import Box
        a = np.arange(30, dtype=np.float32).reshape(5, 6)
        save_checkpoint({str(tmp_path)!r}, {{"w": a}}, {{"w": "float32"}}, (2,), {{"w": (0,)}})
        t = load_plan.TargetPiece("model.w", "float32", (5, 6), Box((1, 2), (3, 3)))
        (out,), _ = load_rank({str(tmp_path)!r}, 0, [t])
        assert np.array_equal(out, a[1:4, 2:5])
        assert sys.modules["paddle"] is None
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
