"""The package's import graph, built from the source, has no circles.

Every ``import`` and ``from ... import`` counts, those inside functions too (a lazy import still
ties two modules together); imports under ``if TYPE_CHECKING:`` do not (they never run). A
module importing a name from its package's ``__init__`` counts as importing the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

ROOT = REPO / "python"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "sglang_pic").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for sub in node.body:
                skip.update(id(x) for x in ast.walk(sub))
    return skip


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names]
                found = [s for s in subs if s in modules]
                if len(found) < len(subs):
                    found.append(target)
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            graph[name].update(f for f in found if f in modules and f != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in graph:
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "sglang_pic.spans.factory" in graph["sglang_pic.spans"]  # inside register()
    assert "sglang_pic.prompt_ids" in graph["sglang_pic.spans.request"]


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    assert circles(import_graph()) == []
