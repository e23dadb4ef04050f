"""The package's directories draw its architecture: imports flow one way,
tools/ -> root (api, gather, singlefile, training) -> parallel/, io/ -> format/ -> core/,
and nothing outside tools/ imports tools/ (but ``__main__``, the command line's entry point);
among the root modules, in a declared order (ROOT_ORDER).
Every module is parsed with ``ast`` (nothing is imported), so an import hidden inside a
function counts too."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "paddle_dcp"
SUBPACKAGES = ("core", "format", "io", "parallel", "tools")

# the layers each layer may import (its own included); errors and version are leaves
BASE = {"errors", "version"}
ALLOWED = {
    "errors": set(),
    "version": set(),
    "core": {"errors", "core"},
    "format": BASE | {"core", "format"},
    "io": BASE | {"core", "format", "io"},
    "parallel": BASE | {"core", "format", "io", "parallel"},
    "root": BASE | {"core", "format", "io", "parallel", "root"},
    "tools": BASE | {"core", "format", "io", "parallel", "root", "tools"},
    "main": {"tools"},
}
# third-party packages a pure layer may import: numpy, and xxhash for the metadata digest
# (a required dependency, paddle-free); the standard library is always allowed
PURE_THIRD_PARTY = {"numpy", "xxhash"}
PURE_LAYERS = {"errors", "version", "core", "format"}


def layer_of(module: str) -> str:
    """'paddle_dcp.core.boxes' -> 'core'; root modules ('paddle_dcp.api', the package) -> 'root'."""
    parts = module.split(".")
    assert parts[0] == "paddle_dcp", module
    if len(parts) == 1:
        return "root"
    if parts[1] in SUBPACKAGES:
        return parts[1]
    if parts[1] == "__main__":
        return "main"
    if parts[1] in BASE:
        return parts[1]
    return "root"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the source, relative ones resolved. For
    ``from X import a``, ``X.a`` is listed when X is paddle_dcp or one of its subpackages (a
    submodule or a name of the root, e.g. ``from .. import errors``)."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if target == "paddle_dcp" or target in {f"paddle_dcp.{s}" for s in SUBPACKAGES}:
                found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    layer = layer_of(module)
    out = []
    for line, target in imports_of(source, module, is_package):
        top = target.split(".")[0]
        if top == "paddle_dcp":
            to = layer_of(target)
            if to not in ALLOWED[layer]:
                out.append(f"{module}:{line} ({layer}) imports {target} ({to})")
        elif layer in PURE_LAYERS and top not in sys.stdlib_module_names and top not in PURE_THIRD_PARTY:
            out.append(f"{module}:{line} ({layer}) imports {target} (only the standard library and numpy)")
    return out


def package_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


# the root modules, each importing only those before it: the save's pipeline runs down the
# list (the manager composes a node-local tier's steps and the api's driver runs them; the
# tier runs no save itself), and the package's __init__ re-exports above them all
ROOT_ORDER = ("async_save", "singlefile", "gather", "tiers", "api", "patching", "training", "manager")


def root_violations(source: str, module: str) -> list[str]:
    """The imports of root module ``module`` of a root module not before it in ROOT_ORDER."""
    name = module.split(".")[1]
    allowed = set(ROOT_ORDER[: ROOT_ORDER.index(name)])
    found = {t.split(".")[1] for _, t in imports_of(source, module, False)
             if t.startswith("paddle_dcp.") and layer_of(t) == "root" and t.split(".")[1] not in BASE}
    return sorted(f"{module} imports paddle_dcp.{t}, not before it in ROOT_ORDER" for t in found - allowed)


def test_every_root_module_has_its_place_in_the_declared_order():
    roots = {module_name(p).split(".")[1] for p in package_modules()
             if layer_of(module_name(p)) == "root" and module_name(p) != "paddle_dcp"}
    assert roots == set(ROOT_ORDER)


@pytest.mark.parametrize("name", ROOT_ORDER)
def test_root_modules_import_only_those_before_them(name):
    assert root_violations((PACKAGE / f"{name}.py").read_text(), f"paddle_dcp.{name}") == []


def test_the_order_checker_refuses_a_tier_that_imports_the_api():
    assert root_violations("from .api import run_save\n", "paddle_dcp.tiers") != []
    assert root_violations("def f():\n    from . import manager\n", "paddle_dcp.api") != []
    assert root_violations("from .tiers import LocalTier\nfrom .errors import DcpError\n", "paddle_dcp.manager") == []


def test_every_module_is_in_a_known_place():
    for path in package_modules():
        rel = path.relative_to(PACKAGE)
        assert len(rel.parts) == 1 or (len(rel.parts) == 2 and rel.parts[0] in SUBPACKAGES), rel
    for sub in SUBPACKAGES:
        assert (PACKAGE / sub / "__init__.py").is_file(), sub


@pytest.mark.parametrize("path", package_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_flow_one_way(path):
    module = module_name(path)
    assert violations(path.read_text(), module, path.name == "__init__.py") == []


# guards: the checker must see the imports it is meant to refuse
@pytest.mark.parametrize(
    "module, source",
    [
        ("paddle_dcp.core.boxes", "from ..parallel import comm\n"),
        ("paddle_dcp.core.boxes", "from ..parallel.comm import Comm\n"),
        ("paddle_dcp.core.planner", "from ..format.safetensors import read_header\n"),
        ("paddle_dcp.core.planner", "from ..io import storage\n"),
        ("paddle_dcp.core.planner", "from .. import version\n"),
        ("paddle_dcp.core.planner", "def f():\n    import paddle\n"),
        ("paddle_dcp.format.safetensors", "import paddle.distributed as dist\n"),
        ("paddle_dcp.format.hf_dir", "from ..io.storage import DataWriter\n"),
        ("paddle_dcp.io.storage", "from ..parallel import wire\n"),
        ("paddle_dcp.parallel.comm", "from .. import api\n"),
        ("paddle_dcp.parallel.comm", "from ..gather import parse_size\n"),
        ("paddle_dcp.api", "def f():\n    from .tools import cli\n"),
        ("paddle_dcp.gather", "from .tools.consolidate import Progress\n"),
        ("paddle_dcp.parallel.exchange", "import paddle_dcp.tools.simulate\n"),
        ("paddle_dcp.core.nested", "from paddle_dcp.tools import cli\n"),
        ("paddle_dcp", "from .tools.cli import main\n"),
    ],
)
def test_the_checker_refuses_imports_against_the_flow(module, source):
    assert violations(source, module, module == "paddle_dcp") != []


@pytest.mark.parametrize(
    "module, source",
    [
        ("paddle_dcp.core.planner", "from ..errors import PlanError\nfrom . import nested\nimport numpy as np\n"),
        ("paddle_dcp.format.hf_dir", "from ..core.save_plan import SavePlan\nfrom .safetensors import code_of\n"),
        ("paddle_dcp.parallel.exchange", "from ..io.storage import RangeReader\n"),
        ("paddle_dcp.api", "from .parallel import protocol\nfrom .format import hf_dir\n"),
        ("paddle_dcp.tools.cli", "from ..gather import parse_size\nfrom . import consolidate\n"),
        ("paddle_dcp.__main__", "from .tools.cli import main\n"),
    ],
)
def test_the_checker_lets_the_flow_through(module, source):
    assert violations(source, module) == []


def test_no_test_module_imports_another():
    """Tests share helpers and fakes (helpers.py, checkpoints.py, fakes.py, conftest.py), never
    another test module: importing one runs its tests' module code and couples their files."""
    tests = Path(__file__).resolve().parents[1]
    found = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.rsplit(".", 1)[-1].startswith("test_") for n in names):
                found.append(f"{path.relative_to(tests)}:{node.lineno}")
    assert found == []


# ---------------------------------------------------------------------- tests mirror the package
TESTS = Path(__file__).resolve().parent
INTEGRATION = TESTS.parent / "integration"  # the mirrored tests that run paddle or a process
EXEMPT = {"__init__.py", "__main__.py", "version.py"}  # unless they define a function
def has_logic(source: str, name: str) -> bool:
    """Whether a module holds logic: a function or class definition (a package's
    ``__init__``, ``__main__`` and ``version`` only a function)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef) + (() if name in EXEMPT else (ast.ClassDef,))
    return any(isinstance(node, kinds) for node in ast.walk(ast.parse(source)))


def mirror_of(rel: Path) -> Path:
    """The unit test module of the package module ``rel`` (relative to paddle_dcp/):
    ``core/boxes.py`` -> ``core/test_boxes.py``; a package's ``io/__init__.py`` ->
    ``io/test_init.py``."""
    stem = "init" if rel.name == "__init__.py" else rel.stem
    return rel.parent / f"test_{stem}.py"


def missing_mirrors(package: Path, *tests: Path) -> list[str]:
    """The modules under ``package`` with logic and no test module at their mirrored path in
    any of the ``tests`` directories."""
    return [
        str(rel)
        for rel in (p.relative_to(package) for p in sorted(package.rglob("*.py")))
        if has_logic((package / rel).read_text(), rel.name) and not any((t / mirror_of(rel)).is_file() for t in tests)
    ]


def test_every_module_with_logic_has_its_test_module_at_the_mirrored_path():
    assert missing_mirrors(PACKAGE, TESTS, INTEGRATION) == [], \
        "modules without tests/unit/<subpackage>/test_<module>.py (or tests/integration/...)"


def test_the_mirror_checker_reports_a_module_without_its_test_module(tmp_path):
    package, tests = tmp_path / "pkg", tmp_path / "tests"
    for rel, text in {
        "__init__.py": "X = 1\n",  # no logic
        "version.py": "__version__ = '1'\n",
        "io/__init__.py": "def open_storage(path):\n    return path\n",  # a package's function
        "core/boxes.py": "class Box:\n    pass\n",
        "core/naming.py": "import re\nNAME = re.compile('x')\n",  # constants only
        "tools/cli.py": "def main():\n    return 0\n",
    }.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    (tests / "core").mkdir(parents=True)
    (tests / "core" / "test_boxes.py").write_text("")
    (tests / "test_cli.py").write_text("")  # not at the mirrored path: tools/test_cli.py
    assert missing_mirrors(package, tests) == ["io/__init__.py", "tools/cli.py"]
    (tests / "io").mkdir()
    (tests / "io" / "test_init.py").write_text("")
    assert missing_mirrors(package, tests) == ["tools/cli.py"]
    other = tmp_path / "integration"  # a second directory of mirrored tests
    (other / "tools").mkdir(parents=True)
    (other / "tools" / "test_cli.py").write_text("")
    assert missing_mirrors(package, tests, other) == []
