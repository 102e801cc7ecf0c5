"""eagle's modules import one another one way: no import circle, at module level or through a deferred import.

The graph is read from the source (AST): an edge A -> B for every ``import B`` / ``from B import ...`` (relative
ones resolved, ``from P import m`` counted as P.m when m is a module) of an eagle module in A. Imports at module
level make the strict graph; the full graph adds the imports inside functions, which run later but still tie the
two modules together (each needs the other to work). Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Cycles of the full graph allowed, each a set of modules (none: every circle is broken; an entry here would need
# its reason).
ALLOWED_CYCLES: list[set[str]] = []


def module_files(root: Path) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, whether it is a package's ``__init__``), for every .py file under ``root / "eagle"``."""
    modules = {}
    for path in sorted((root / "eagle").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)
    return modules


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and isinstance(test, (ast.Name, ast.Attribute)) and \
        (getattr(test, "id", None) or getattr(test, "attr", None)) == "TYPE_CHECKING"


def _import_nodes(tree: ast.Module, deferred: bool):
    """The import statements that run at import (module level, its blocks: ``try``, ``if``, and class bodies), and
    with ``deferred`` those inside functions too; never those under ``if TYPE_CHECKING:``."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if _type_checking_block(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif deferred or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([node.module] if node.module else []))
    found = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
    if base in modules and len(found) < len(node.names):
        found.add(base)
    return found


def import_graph(root: Path, deferred: bool) -> dict[str, set[str]]:
    """module -> the eagle modules it imports (module level only, or with ``deferred`` those in functions too)."""
    modules = module_files(root)
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[name] = set().union(*(_targets(node, package, modules) for node in _import_nodes(tree, deferred)))
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _describe(found: list[set[str]]) -> str:
    return "\n".join(" <-> ".join(sorted(component)) for component in found)


def test_no_import_circle_at_module_level():
    found = cycles(import_graph(ROOT, deferred=False))
    assert not found, "modules importing each other at module level:\n" + _describe(found)


def test_no_import_circle_through_deferred_imports():
    found = [component for component in cycles(import_graph(ROOT, deferred=True)) if component not in ALLOWED_CYCLES]
    assert not found, "modules importing each other (imports inside functions included):\n" + _describe(found)


def test_the_cycle_finder_catches_one(tmp_path):
    package = tmp_path / "eagle"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from eagle.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import eagle.sub.b\n"
                                  "from . import a\n")
    (package / "d.py").write_text("if TYPE_CHECKING:\n    from eagle import a\n")
    assert cycles(import_graph(tmp_path, deferred=False)) == []
    assert cycles(import_graph(tmp_path, deferred=True)) == [{"eagle.a", "eagle.sub.b", "eagle.c"}]
    assert import_graph(tmp_path, deferred=True)["eagle.d"] == set()
