"""Check stage rule files as both readers see them (``launch --rules-dir``, tests).

``infersight.rules.stage_rules`` validates with tomllib (file:line errors); the hooks read the
same files with their own small reader (``infersight.hooks._stagerules``, no tomllib on Python
3.9). A file is accepted only when both read the same rules from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from infersight.errors import Location
from infersight.hooks import _stagerules
from infersight.rules.stage_rules import (
    StageRuleFileError,
    StageRuleSet,
    default_stage_rule_paths,
    is_stage_rule_text,
    load_stage_rules,
    rules_dirs,
)


def check_files(paths: Iterable[Path | str]) -> StageRuleSet:
    """Load ``paths`` (``StageRuleFileError`` at file:line) and refuse a rule the hooks read otherwise."""
    files = [p if isinstance(p, Path) else Path(str(p)) for p in paths]
    rs = load_stage_rules(files)
    errors: list[tuple[Location, str]] = []
    for p in files:
        text = p.read_text(encoding="utf-8")
        if not is_stage_rule_text(text):
            continue
        seen, problems = _stagerules.parse(text)
        errors.extend((Location(str(p), line), "the hooks cannot read this: " + msg) for line, msg in problems)
        hooks = {rid: (stage, targets, ready, until) for rid, stage, targets, ready, until in seen}
        errors.extend((r.where, f"{r.id}: the hooks read this rule as {hooks.get(r.id)!r}: write id, stage, "
                                "targets and until as plain strings, ready as a bare true or false or 'entry', "
                                "each key on its own line")
                      for r in rs.rules
                      if r.where.file == str(p) and hooks.get(r.id) != (r.stage, r.targets, r.ready, r.until))
    if errors:
        raise StageRuleFileError(errors)
    return rs


def check_dirs(extra: Iterable[str | Path] = ()) -> StageRuleSet:
    """The shipped rules and every rules directory the hooks will read, ``extra`` included."""
    return check_files(Path(str(p)) for p in default_stage_rule_paths(rules_dirs(extra)))
