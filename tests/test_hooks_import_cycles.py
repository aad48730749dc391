"""No import cycle inside hooks/ (issue 25), and the cold-start hooks in layers.

Read with ``ast`` (nothing is imported), so an import inside a function or under ``if
TYPE_CHECKING:`` counts, and so does a sibling looked up in ``sys.modules`` by name (the way
a cycle used to be dodged). The layers: ``_recorder`` (what every instrumenter uses) imports
no instrumenter; the instrumenters import neither ``_coldstart`` (which sets them up) nor
each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

HOOKS = Path(__file__).resolve().parent.parent / "hooks"
INSTRUMENTERS = ("_imports", "_build", "_torch", "_weights", "_stagerules", "_checkpoint", "asgi")


def imports_of(folder: Path) -> dict[str, dict[str, int]]:
    """Module -> {sibling module it imports: first line}, for the modules directly in ``folder``."""
    names = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, dict[str, int]] = {}
    for path in sorted(folder.glob("*.py")):
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:  # from ._x import y
                    found.append(node.module.split(".")[0])
                else:  # from . import _x, _y
                    found.extend(a.name for a in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("._"):
                found.append(node.value[1:])  # sys.modules.get(pkg + "._x")
            for name in found:
                if name in names and name not in (path.stem, "__init__"):
                    edges.setdefault(name, node.lineno)
        graph[path.stem] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _describe(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    return "; ".join("%s -> %s (line %d)" % (a, b, line) for a in comp for b, line in graph[a].items() if b in comp)


def test_no_import_cycle_in_hooks() -> None:
    graph = imports_of(HOOKS)
    assert "_coldstart" in graph and "_recorder" in graph  # the checker reads the real folder
    found = cycles(graph)
    assert not found, "\n".join(_describe(graph, c) for c in found)


def test_the_recorder_imports_no_instrumenter_nor_what_sets_them_up() -> None:
    graph = imports_of(HOOKS)
    assert set(graph["_recorder"]).isdisjoint({*INSTRUMENTERS, "_coldstart", "_readiness", "_activate"})


def test_instrumenters_import_neither_coldstart_nor_each_other() -> None:
    graph = imports_of(HOOKS)
    for name in INSTRUMENTERS:
        wrong = set(graph[name]) & {*INSTRUMENTERS, "_coldstart", "_activate"}
        assert not wrong, "%s imports %s" % (name, sorted(wrong))
        assert "_recorder" in graph[name] or "_readiness" in graph[name], name


def test_a_planted_cycle_is_found_even_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "_a.py").write_text("from . import _c\n\ndef f():\n    from . import _b\n")
    (tmp_path / "_b.py").write_text("import sys\n\ndef g():\n    return sys.modules.get(__package__ + '._a')\n")
    (tmp_path / "_c.py").write_text("from ._b import g\n")
    graph = imports_of(tmp_path)
    assert graph["_a"] == {"_c": 1, "_b": 4}
    assert graph["_c"] == {"_b": 1}
    assert cycles(graph) == [["_a", "_b", "_c"]]  # _a -> _b -> _a, and _a -> _c -> _b -> _a
