"""Tests and benches that set a hooks module's attribute (``_readiness.REPORT_FLUSH_S = 600.0``,
often inside a workload's source text) set one that exists: after a module is split, a name
set on the old module is a silent no-op and the test no longer tests what it says."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOK_MODULES = sorted(p.stem for p in (ROOT / "hooks").glob("_*.py") if p.stem != "__init__")
# ``_mod.NAME = value`` (not ``==``), ``_mod`` not itself an attribute (``self._buffer.x = ...``)
ASSIGNMENT = re.compile(r"(?<![\w.])(%s)\.([A-Za-z_]\w*)\s*=(?!=)" % "|".join(map(re.escape, HOOK_MODULES)))


def _assignments() -> list[tuple[str, str, str]]:
    found = []
    for folder in ("tests", "bench", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for m in ASSIGNMENT.finditer(path.read_text()):
                found.append((str(path.relative_to(ROOT)), m.group(1), m.group(2)))
    return found


def _read_there(source: str, name: str) -> bool:
    """``name`` is defined in ``source`` (then its own code reads the module's global), or
    imported and used there; not a name it imports and never reads."""
    n = re.escape(name)
    defined = re.search(r"^(?:%s\s*[:=]|(?:async )?def %s\b|class %s\b)" % (n, n, n), source, re.M)
    return defined is not None or len(re.findall(r"\b%s\b" % n, source)) >= 2


def test_the_scan_sees_the_assignments_it_checks() -> None:
    reexport = "from ._recorder import state, storage_ceiling\n\ndef f():\n    return state()\n"
    assert not _read_there(reexport, "storage_ceiling") and _read_there(reexport, "state")
    assert _read_there("REPORT_FLUSH_S = 1.0\n", "REPORT_FLUSH_S")
    assert ASSIGNMENT.search("        _readiness.REPORT_FLUSH_S = 600.0") is not None
    assert ASSIGNMENT.search("self._buffer.dropped = 0") is None
    assert ASSIGNMENT.search("_state.current.weights.module = torch") is None
    assert any(module == "_readiness" and name == "REPORT_FLUSH_S" for _, module, name in _assignments())


def test_every_hooks_attribute_set_by_a_test_or_bench_exists_and_is_read_there() -> None:
    """Set where the module itself reads it: a name it only re-exports (``from ._x import
    NAME``, never used) would change nothing for the code that reads it in ``_x``."""
    wrong = []
    for path, module, name in _assignments():
        source = (ROOT / "hooks" / (module + ".py")).read_text()
        if not hasattr(importlib.import_module("infersight.hooks." + module), name):
            wrong.append(f"{path}: {module}.{name} does not exist")
        elif not _read_there(source, name):
            wrong.append(f"{path}: {module}.{name} is not read in {module}")
    assert wrong == []
