"""What every rule file shares: the base of the rules' errors and the ``engine_version`` key.

A rule file (``oom.toml``, ``devices.toml``, a site's ``rules.d/*.toml``) declares the
version of its engine that it needs: ``engine_version = "MAJOR.MINOR"`` (or ``"MAJOR"``).
An engine loads it when the majors match and the file's minor is not newer than its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from infersight.errors import InfersightError, Location, SourceError
from infersight.tomlfile import TomlKeys, loads

SITE_RULES_DIR = "/etc/infersight/rules.d"  # the site's rule files (OOM rubric and stage rules)


def env_rules_dirs(env: Mapping[str, str]) -> list[str] | None:
    """``$INFERSIGHT_RULES_DIRS`` (the agent's ``rules.dirs``), ``:`` or ``,`` separated; None when unset."""
    raw = env.get("INFERSIGHT_RULES_DIRS")
    return None if raw is None else [d for d in re.split(r"[,:]", raw) if d]

ENGINE_VERSION_KEY = "engine_version"
_VERSION = re.compile(r"(\d{1,4})(?:\.(\d{1,4}))?")


class RulesError(InfersightError):
    """Base of the exceptions of infersight.rules."""


def needed_engine(declared: object, engine: tuple[int, int]) -> tuple[int, int]:
    """The (major, minor) engine version a file declares, checked against ``engine``;
    ValueError says why the file cannot load (None: the key is missing)."""
    if declared is None:
        raise ValueError("missing engine_version (this engine is %d.%d)" % engine)
    m = _VERSION.fullmatch(str(declared))
    if m is None or isinstance(declared, bool):
        raise ValueError(f"engine_version {declared!r} is not MAJOR or MAJOR.MINOR")
    needs = int(m.group(1)), int(m.group(2) or 0)
    if needs[0] != engine[0] or needs[1] > engine[1]:
        raise ValueError("needs engine %d.%d, this engine is %d.%d" % (*needs, *engine))
    return needs


class FileLoader:
    """What every rule file's loader shares: its text, the line of each key, and the errors
    collected with their file:line (a subclass reads its own tables)."""

    def __init__(self, path: str, text: str, lines: bool = True) -> None:
        self.path = path
        self.text = text
        # lines=False: every line is 0 and the key index is not built (a third of a large file's load); for a
        # file known to be valid, whose loader reloads it with lines when it finds an error after all
        self.lines = lines
        self._keys: TomlKeys | None = None
        self.errors: list[tuple[Location, str]] = []

    @property
    def keys(self) -> TomlKeys:
        """Where each key is written, built at first use."""
        if self._keys is None:
            self._keys = TomlKeys(self.text, self.path)
        return self._keys

    def line(self, *key: str | int) -> int:
        """The line of ``key`` (a path into the document), or of the nearest table around it."""
        return self.keys.nearest(key).line if self.lines else 0

    def err(self, line: int, msg: str) -> None:
        self.errors.append((Location(self.path, line), msg))

    def document(self) -> dict[str, Any] | None:
        """The file's TOML; None (the error noted) when it is not TOML."""
        try:
            return loads(self.text, self.path)
        except SourceError as exc:
            self.errors.append((exc.locations[0], exc.message))
            return None

    def check_top(self, doc: dict[str, Any], allowed: Collection[str], engine: tuple[int, int],
                  hint: str = "") -> None:
        """An error for each top-level key not ``allowed`` (``hint`` says what belongs there),
        and for an ``engine_version`` that ``engine`` cannot load."""
        for k in doc:
            if k not in allowed:
                self.err(self.line(k), f"unknown top-level key {k!r}{hint}")
        try:
            needed_engine(doc.get(ENGINE_VERSION_KEY), engine)
        except ValueError as exc:
            self.err(self.line(ENGINE_VERSION_KEY), str(exc))

    def rule_id(self, t: Mapping[str, object], allowed: Collection[str], line: Callable[[str], int], *, what: str,
                pattern: re.Pattern[str], id_error: str, fallback: str) -> str:
        """What every rule table opens with: an error for each key not ``allowed`` (``unknown
        {what} key 'k'``), then its ``id`` when ``pattern`` matches it whole; else the error
        ``id_error`` and ``fallback`` (the name its other errors give it)."""
        for k in t:
            if k not in allowed:
                self.err(line(k), f"unknown {what} key {k!r}")
        rid = t.get("id")
        if not isinstance(rid, str) or not pattern.fullmatch(rid):
            self.err(line("id"), id_error)
            return fallback
        return rid

    def rule_version(self, t: Mapping[str, object], line: Callable[[str], int], rid: str) -> int:
        """The rule's ``version``, a positive integer; else the error, and 0."""
        version = t.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            self.err(line("version"), f"{rid}: version must be a positive integer")
            return 0
        return version
