"""Dependencies run one way: every import of every module of ours, checked against the layout's rules.

The checker reads the source with ``ast`` (no module is imported), so it sees imports inside
functions and under ``if TYPE_CHECKING:`` as well. Each import names a target: the module, or
``module.name`` for ``from module import name``. A rule picks importers by their path in the
checkout and says which targets of ours they may (``only``) or must not (``never``) import.
A new rule is one more line in :data:`RULES`.

No import cycle either, inside folders too (:func:`cycles`): every import counts, also one
inside a function or under ``TYPE_CHECKING``, because moving an import into a function hides a
cycle from the interpreter, not from the reader. What it cannot see: a module imported by a
computed name (``importlib.import_module(prefix + name)``) or looked up in ``sys.modules``; and
the packages that Python imports on the way to a module (``a/__init__.py`` for ``a.b``), which
order the imports but are no dependency of the importer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Checkout folder -> the package it is (pyproject.toml's package-dir).
FOLDERS = {
    "infersight": "infersight",
    "agent": "infersight.agent",
    "exporters": "infersight.exporters",
    "hooks": "infersight.hooks",
    "rules": "infersight.rules",
}

# Modules of infersight/ that anything may import: plain values and pure functions over them.
NEUTRAL = (
    "infersight.__version__",
    "infersight.telemetry",
    "infersight.redact",
    "infersight.settings",
    "infersight.errors",
    "infersight.tomlfile",
    "infersight.metricspec",
    "infersight.coldstart_stages",
    "infersight.instances",
    "infersight.statefiles",
    "infersight.sanitize",
    "infersight.weights_files",
    "infersight.latency",
    "infersight.bytesize",
)
ROLES = ("infersight.agent", "infersight.exporters", "infersight.hooks", "infersight.rules")

FEATURES = tuple("infersight.agent." + f for f in ("coldstart", "oom", "devices", "requests", "report", "routing"))
# Only the commands (the composition root) wire concrete exporters and extensions, by name.
COMPOSITION = ("infersight.agent.commands", "infersight.agent.cli")
# The hooks <-> agent contract (docs/wire.md): stdlib-only modules of the hooks that the agent
# reads too. ``_contract`` (attribute names and thresholds) is constants only: the neutral modules
# and the exporters read it too, since the hooks may import nothing outside hooks/ and the names
# are defined once.
CONTRACT = "infersight.hooks._contract"
# The hooks' cold-start instrumenters, and the modules that set them up (they alone know them all).
INSTRUMENTERS = tuple("infersight.hooks." + m for m in (
    "_imports", "_build", "_torch", "_weights", "_stagerules", "_checkpoint", "asgi"))
COLDSTART_SETUP = ("infersight.hooks._coldstart", "infersight.hooks._activate")
# What the daemon may use outside itself: the agent's error base, the exporter protocol, the
# hooks' wire format, paths, table of INFERSIGHT_* names and contract (both sides of the socket),
# and the neutral modules.
DAEMON_MAY_USE = ("infersight.agent.daemon", "infersight.agent.errors", "infersight.exporters.base",
                  "infersight.hooks._wire", "infersight.hooks._paths", "infersight.hooks._env", CONTRACT,
                  *NEUTRAL)


@dataclass(frozen=True)
class Rule:
    """Importers under ``path`` (a file or a folder ending in ``/``), bar ``exempt``, may import
    of ours only targets under ``only`` (when given) and none under ``never`` but those under ``unless``."""

    path: str
    why: str
    only: tuple[str, ...] | None = None
    never: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()

    def applies_to(self, rel: str) -> bool:
        return (rel == self.path or (self.path.endswith("/") and rel.startswith(self.path))) and rel not in self.exempt

    def allows(self, target: str) -> bool:
        if any(_under(target, p) for p in self.never) and not any(_under(target, p) for p in self.unless):
            return False
        return self.only is None or any(_under(target, p) for p in self.only)


RULES: tuple[Rule, ...] = (
    Rule("hooks/", "hooks/ imports nothing of ours outside hooks/", only=("infersight.hooks",)),
    Rule("rules/", "rules/ is pure", never=("infersight.agent", "infersight.exporters", "infersight.hooks")),
    Rule("exporters/", "exporters/ import only the telemetry items, neutral modules, the hooks' contract and "
         "their own settings", only=("infersight.exporters", CONTRACT, *NEUTRAL)),
    Rule("agent/daemon/", "the daemon knows no feature and no concrete exporter: the commands hand them in",
         only=DAEMON_MAY_USE),
    *(Rule("agent/%s/" % f.rsplit(".", 1)[1], "a feature is wired by the commands, not the other way round",
           never=COMPOSITION) for f in FEATURES),
    *(Rule("agent/%s/" % f.rsplit(".", 1)[1], "features never import one another: what they share is a neutral "
           "module, or the commands hand it in", never=tuple(g for g in FEATURES if g != f)) for f in FEATURES),
    Rule("infersight/", "the neutral modules import no role package (the hooks' contract aside)", never=ROLES,
         unless=(CONTRACT,),
         exempt=("infersight/__main__.py",)),  # `python -m infersight`: an entry point that runs the CLI
    Rule("hooks/_recorder.py", "the cold-start recorder is the instrumenters' base: it imports none of them, nor "
         "what sets them up", never=(*INSTRUMENTERS, *COLDSTART_SETUP)),
    *(Rule("hooks/%s.py" % m.rsplit(".", 1)[1], "an instrumenter builds on _recorder and _readiness: it imports "
           "neither what sets it up nor another instrumenter (_coldstart hands in what one needs of another)",
           never=tuple(t for t in (*INSTRUMENTERS, *COLDSTART_SETUP) if t != m)) for m in INSTRUMENTERS),
)  # fmt: skip


@dataclass(frozen=True)
class Edge:
    file: str  # relative to the checked root
    line: int
    target: str

    def __str__(self) -> str:
        return "%s:%d imports %s" % (self.file, self.line, self.target)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[parts[0]], *parts[1:]])


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:  # relative: from the importer's package, up level - 1 more
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        yield base + "." + alias.name if alias.name != "*" else base


def edges(root: Path) -> Iterator[tuple[str, Edge]]:
    """(importer's path relative to root, edge) for every import of ours under ``root``."""
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            module = module_name(rel)
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
            for node in sorted(imports, key=lambda n: n.lineno):
                for target in _targets(node, module, path.name == "__init__.py"):
                    if _under(target, "infersight"):
                        yield rel.as_posix(), Edge(rel.as_posix(), node.lineno, target)


def modules(root: Path) -> set[str]:
    return {module_name(p.relative_to(root)) for folder in FOLDERS for p in (root / folder).rglob("*.py")}


def module_graph(root: Path) -> dict[str, dict[str, Edge]]:
    """Importer module -> {module of ours it imports: the first import of it}. A target is the
    longest module it names (``a.b.name`` is module ``a.b`` unless ``a.b.name`` is a module)."""
    known = modules(root)
    graph: dict[str, dict[str, Edge]] = {m: {} for m in known}
    for rel, edge in edges(root):
        importer = module_name(Path(rel))
        target = edge.target
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != importer:
            graph[importer].setdefault(target, edge)
    return graph


def cycles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                out.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def describe(graph: dict[str, dict[str, Edge]], cycle: list[str]) -> str:
    return "\n".join("  %s" % graph[a][b] for a in cycle for b in sorted(graph[a]) if b in cycle)


def violations(root: Path, rules: tuple[Rule, ...] = RULES) -> list[str]:
    out = []
    for rel, edge in edges(root):
        for rule in rules:
            if rule.applies_to(rel) and not rule.allows(edge.target):
                out.append("%s (%s)" % (edge, rule.why))
    return out


def test_the_checkout_follows_the_dependency_rules() -> None:
    found = violations(ROOT)
    assert not found, "imports against the layout's rules:\n" + "\n".join(found)


def test_no_import_cycle() -> None:
    graph = module_graph(ROOT)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, c) for c in found)


def test_a_planted_cycle_is_found_inside_a_folder_and_through_a_function(tmp_path: Path) -> None:
    _plant(tmp_path, {
        "hooks/__init__.py": "from . import _a\n",  # a package and its module: no cycle
        "hooks/_a.py": "from infersight.hooks import _b\n",
        "hooks/_b.py": "def f():\n    from ._c import g\n",  # hidden in a function: still a cycle
        "hooks/_c.py": "from infersight.hooks._a import x\n\n\ndef g():\n    pass\n",
        "agent/report/page.py": "from infersight.agent.report import html\n",
        "agent/report/html.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from infersight.agent.report.page import Report\n"
        ),
        "agent/report/svg.py": "from infersight.agent.report.html import esc\n",  # into a cycle, not on it
    })  # fmt: skip
    for folder in FOLDERS:
        (tmp_path / folder).mkdir(exist_ok=True)
    graph = module_graph(tmp_path)
    assert cycles(graph) == [
        ["infersight.agent.report.html", "infersight.agent.report.page"],
        ["infersight.hooks._a", "infersight.hooks._b", "infersight.hooks._c"],
    ]
    assert describe(graph, ["infersight.hooks._a", "infersight.hooks._b", "infersight.hooks._c"]).splitlines() == [
        "  hooks/_a.py:1 imports infersight.hooks._b",
        "  hooks/_b.py:2 imports infersight.hooks._c.g",
        "  hooks/_c.py:1 imports infersight.hooks._a.x",
    ]


def test_every_rule_applies_to_some_module() -> None:
    """A rule whose path matches nothing checks nothing (a typo, or a folder that moved)."""
    rels = {p.relative_to(ROOT).as_posix() for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    for rule in RULES:
        assert any(rule.applies_to(rel) for rel in rels), rule


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_a_planted_violation_is_reported_with_file_and_line(tmp_path: Path) -> None:
    _plant(tmp_path, {
        "infersight/__init__.py": '__version__ = "0"\n',
        "infersight/telemetry.py": "",
        "infersight/__main__.py": "from infersight.agent.cli import main\n",  # exempt
        "agent/__init__.py": "",
        "agent/daemon/__init__.py": "",
        "agent/daemon/config.py": "from infersight.exporters.mqtt import KEYS\n",  # the daemon may not
        "agent/commands/compose.py": "from infersight.exporters.mqtt import KEYS\n",  # the commands may
        "hooks/__init__.py": "from . import _client\n",
        "hooks/_client.py": "import os\n\n\ndef f():\n    from infersight.agent.daemon import config\n",
        "exporters/__init__.py": "",
        "exporters/mqtt.py": (
            "from typing import TYPE_CHECKING\n"
            "from infersight import __version__\n"
            "from infersight.telemetry import Item\n"
            "from infersight.agent.daemon.config import Key\n"
            "from . import base\n"
            "if TYPE_CHECKING:\n"
            "    from infersight.agent.daemon.assemble import Producer\n"
            "import infersight.rules.engine\n"
        ),
        "exporters/base.py": "from ..agent import cli\n",
        "rules/__init__.py": "",
        "rules/engine.py": "from infersight.hooks import _client\nfrom infersight.telemetry import Item\n",
    })  # fmt: skip
    found = violations(tmp_path)
    assert [v.split(" (")[0] for v in found] == [
        "agent/daemon/config.py:1 imports infersight.exporters.mqtt.KEYS",
        "exporters/base.py:1 imports infersight.agent.cli",
        "exporters/mqtt.py:4 imports infersight.agent.daemon.config.Key",
        "exporters/mqtt.py:7 imports infersight.agent.daemon.assemble.Producer",
        "exporters/mqtt.py:8 imports infersight.rules.engine",
        "hooks/_client.py:5 imports infersight.agent.daemon.config",
        "rules/engine.py:1 imports infersight.hooks._client",
    ]
    assert all(v.endswith(")") for v in found)  # each names the rule it breaks


def test_one_line_adds_a_rule(tmp_path: Path) -> None:
    _plant(tmp_path, {
        "agent/report/page.py": "from infersight.agent.daemon.lifecycle import Agent\n",
        "agent/commands/report.py": "from infersight.agent.daemon.lifecycle import Agent\n",
    })  # fmt: skip
    for folder in FOLDERS:
        (tmp_path / folder).mkdir(exist_ok=True)
    rule = Rule("agent/report/", "the report reads files, not a running agent", never=("infersight.agent.daemon",))
    assert violations(tmp_path) == []
    assert violations(tmp_path, (*RULES, rule)) == [
        "agent/report/page.py:1 imports infersight.agent.daemon.lifecycle.Agent "
        "(the report reads files, not a running agent)"
    ]
