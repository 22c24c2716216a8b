"""No import cycles inside a package: the modules of `rollout.spec`, `.protocol`, `.engine`,
and `.bench` import each other in one direction only, read from their source (every
`import`, at module level, inside functions and under `TYPE_CHECKING` alike).

`from . import name` counts as an import of the package itself (its `__init__`), as well as of
the submodule `name`: a module that reaches back into its package's namespace is a cycle
waiting to happen, since the package's `__init__` imports the modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Import package -> its folder in the checkout (pyproject's package-dir).
PACKAGES = {
    "rollout.spec": "spec",
    "rollout.protocol": "protocol",
    "rollout.engine": "engine",
    "rollout.bench": "bench",
}


def module_files(package: str, folder: str) -> dict[str, Path]:
    """Module name -> source file, for the package and its modules."""
    out = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def imports_of(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules among `known` that `module` (at `path`) imports."""
    known = set(known)
    package = module if path.stem == "__init__" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} & known
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rsplit(".", 1)[0]
            if node.level:
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found |= {target} & known
            found |= {f"{target}.{alias.name}" for alias in node.names} & known
    found.discard(module)
    return found


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph(package: str, folder: str) -> dict[str, set[str]]:
    files = module_files(package, folder)
    return {module: imports_of(module, path, files) for module, path in files.items()}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle_inside_the_package(package: str) -> None:
    graph = import_graph(package, PACKAGES[package])
    assert len(graph) > 3
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles(tmp_path: Path) -> None:
    """The finder itself: `from . import` reaches the package, a two-module cycle, a longer
    one, and a graph without cycles."""
    (tmp_path / "_a.py").write_text("from . import _b\nfrom ._c import x\nimport p._d\n")
    names = {"p", "p._a", "p._b", "p._c", "p._d"}
    assert imports_of("p._a", tmp_path / "_a.py", names) == {"p", "p._b", "p._c", "p._d"}
    assert cycles({"p": {"p._a"}, "p._a": {"p"}}) == [["p", "p._a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    source = ROOT / "spec" / "_runner.py"
    names = {"rollout.spec", "rollout.spec._catalog", "rollout.spec._context"}
    assert imports_of("rollout.spec._runner", source, names) == names - {"rollout.spec"}
