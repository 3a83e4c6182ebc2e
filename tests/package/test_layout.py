"""The package's shape: no import cycle (function-level imports counted), no module over 400 lines.

The import graph is read from the source with ``ast``, not from ``sys.modules``, so an
import that only runs inside a function, or only on one code path, still counts. Imports
under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
MAX_LINES = 400


def package_modules(root: Path) -> dict[str, Path]:
    """``{dotted name: file}`` for fastpipe's modules, ``kernels/`` mapped to ``fastpipe.kernels``."""
    trees = {"fastpipe": root / "fastpipe", "fastpipe.kernels": root / "kernels"}
    modules: dict[str, Path] = {}
    for prefix, base in trees.items():
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth, less those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                for other in child.orelse:  # type: ignore[attr-defined]
                    walk(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)

    walk(tree)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Edges ``module -> modules it imports`` inside the package.

    ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``.
    A parent package's ``__init__`` that Python runs implicitly is not an edge: it would put
    every module on a cycle through ``fastpipe/__init__.py``.
    """
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for target in targets:  # fastpipe._C, the compiled extension, imports nothing back
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = import_graph(package_modules(ROOT))
    assert len(graph) > 50  # the walk found the package
    assert cycles(graph) == []


def test_the_cycle_finder_sees_function_level_imports(tmp_path):
    (tmp_path / "fastpipe").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "fastpipe" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "fastpipe" / "a.py").write_text("from fastpipe.b import f\n")
    (tmp_path / "fastpipe" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "fastpipe" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fastpipe import a\n"
    )
    graph = import_graph(package_modules(tmp_path))
    assert graph["fastpipe.a"] == {"fastpipe.b"} and graph["fastpipe.b"] == {"fastpipe.a"}
    assert graph["fastpipe.c"] == set()
    assert cycles(graph) == [["fastpipe.a", "fastpipe.b"]]


@pytest.mark.parametrize("name", sorted(package_modules(ROOT)))
def test_module_is_small(name):
    path = package_modules(ROOT)[name]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines; split it by job (at most {MAX_LINES})"
