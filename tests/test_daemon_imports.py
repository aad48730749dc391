"""The daemon package depends on no feature and no concrete exporter: the commands (the
composition root) hand it extensions, exporters and key tables."""

from __future__ import annotations

import ast
from pathlib import Path

DAEMON = Path(__file__).resolve().parent.parent / "agent" / "daemon"
# Outside agent/daemon/: the agent's exception base, and the protocol every exporter implements.
ALLOWED = ("infersight.agent.daemon", "infersight.agent.errors", "infersight.exporters.base")


def imported_modules(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = "." * node.level + node.module
            out.add(base)
            out.update(base + "." + a.name for a in node.names)  # `from infersight.agent import oom`
    return out


def test_the_daemon_imports_no_feature_and_no_concrete_exporter() -> None:
    bad = {
        "%s: %s" % (path.name, module)
        for path in sorted(DAEMON.glob("*.py"))
        for module in imported_modules(path)
        if module.startswith(".")
        or (module.startswith(("infersight.agent", "infersight.exporters")) and not module.startswith(ALLOWED))
    }
    assert not bad, sorted(bad)
