"""setup.py asks pip only for what the package registries have: no extra names
paddlepaddle-gpu, which PyPI does not serve at 3.x (Paddle's own index does; README.md says
how to install it first)."""
import ast
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def extras() -> dict:
    for node in ast.walk(ast.parse(SETUP.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def test_no_extra_asks_pip_for_paddlepaddle_gpu():
    found = extras()
    assert "gpu" in found  # `pip install .[gpu]` keeps working
    assert not [r for reqs in found.values() for r in reqs if r.lower().startswith("paddlepaddle-gpu")], found


def test_the_readme_says_where_paddlepaddle_gpu_comes_from():
    readme = (SETUP.parent / "README.md").read_text()
    assert "pip install paddlepaddle-gpu==3.3.1 -i https://www.paddlepaddle.org.cn/packages/stable/" in readme
    assert "python scripts/gpu_check.py" in readme
