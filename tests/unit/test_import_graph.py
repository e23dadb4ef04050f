"""No import cycle in the package: the graph of every ``import`` of a paddle_dcp module by
another (at the top of a module or inside a function; ``if TYPE_CHECKING:`` blocks aside, which
never run) has no cycle. Read from the sources with ast, so nothing is imported."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "paddle_dcp"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    out.add(f"{target}.{alias.name}")
                elif target in known:
                    out.add(target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
    out.discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    known = modules()
    assert "paddle_dcp.core.metadata" in known and "paddle_dcp.core.metadata_parse" in known
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "paddle_dcp.core.metadata" in graph["paddle_dcp.core.metadata_parse"]  # the graph is read
    assert cycles(graph) == []
