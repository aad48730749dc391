"""TOML source files: parse with errors at a :class:`Location`, and find where a key is.

``tomllib`` keeps no positions, so :class:`TomlKeys` is the one locator that the config,
the OOM rules and ``devices.toml`` use to name ``file:line`` for a key. Addresses are
the paths you index the parsed document with: ``("rule", 2, "condition")`` is
``doc["rule"][2]["condition"]``, and a dotted string ``"agent.socket"`` is
``("agent", "socket")``.

It is a line scan, not a second parser: it knows ``[table]`` and ``[[array]]`` headers,
dotted and quoted keys, and skips the lines of multi-line strings. A key inside an
inline table (``window = { samples = 1 }``) is found at the inline table's key.
"""

from __future__ import annotations

import bisect
import json
import re
import sys
from collections.abc import Sequence
from typing import Any, TypeAlias

from infersight.errors import Location, SourceError

KeyPath: TypeAlias = tuple[str | int, ...]

_PART = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_KEY = rf"{_PART}(?:\s*\.\s*{_PART})*"
_HEADER = re.compile(rf"\s*(\[\[?)\s*({_KEY})\s*\]\]?\s*(?:#.*)?$")
_ASSIGN = re.compile(rf"\s*({_KEY})\s*=")
_PARTS = re.compile(_PART)
_AT_LINE = re.compile(r"\(at line (\d+)")
_NEWLINE = re.compile("\n")


def loads(text: str, file: str) -> dict[str, Any]:
    """``tomllib.loads``; a syntax error is a :class:`SourceError` at the line tomllib names
    (its message keeps tomllib's ``(at line L, column C)``). tomllib is imported here, at
    the first file read: a process that reads none (``infersight launch`` without a config
    file) does not pay its import (~4-8 ms of CPU)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = _AT_LINE.search(str(exc))
        raise SourceError(f"TOML syntax: {exc}", Location(file, int(m.group(1)) if m else 1)) from None
    except RecursionError:  # tomllib recurses once per nested array or table
        raise SourceError("TOML nested too deeply", Location(file, 1)) from None


def _key_parts(key: str) -> tuple[str, ...]:
    parts: list[str] = []
    for m in _PARTS.finditer(key):
        p = m.group(0)
        if p.startswith('"'):
            try:
                p = json.loads(p)  # TOML's basic-string escapes, but for \U: good enough to match
            except ValueError:
                p = p[1:-1]
        elif p.startswith("'"):
            p = p[1:-1]
        parts.append(p)
    return tuple(parts)


class TomlKeys:
    """Where each key and table header of a TOML text is written (see the module doc)."""

    def __init__(self, text: str, file: str) -> None:
        self.file = file
        # character offset of each line's start; lines end at "\n" as in TOML
        self._starts = [0, *(m.end() for m in _NEWLINE.finditer(text))]
        self._at: dict[KeyPath, Location] = {}
        arrays: dict[KeyPath, int] = {}  # [[array]] path -> elements seen
        table: KeyPath = ()
        in_string: str | None = None  # the delimiter of the multi-line string we are in
        for n, line in enumerate(text.split("\n"), 1):
            if in_string is not None:
                if in_string in line:
                    in_string = None
                continue
            header = _HEADER.match(line)
            if header is not None:
                table = self._table(_key_parts(header.group(2)), header.group(1) == "[[", arrays)
                self._mark(table, Location(file, n, header.start(1) + 1))
                continue
            assign = _ASSIGN.match(line)
            if assign is not None:
                self._mark(table + _key_parts(assign.group(1)), Location(file, n, assign.start(1) + 1))
            for delim in ('"""', "'''"):
                if line.count(delim) % 2:
                    in_string = delim
                    break

    @staticmethod
    def _table(parts: tuple[str, ...], is_array: bool, arrays: dict[KeyPath, int]) -> KeyPath:
        """The path of a header's table; an array's element is the latest one."""
        path: KeyPath = ()
        for i, part in enumerate(parts):
            path += (part,)
            if is_array and i == len(parts) - 1:
                arrays[path] = arrays.get(path, 0) + 1
            if path in arrays:
                path += (arrays[path] - 1,)
        return path

    def _mark(self, path: KeyPath, where: Location) -> None:
        for n in range(1, len(path) + 1):  # the tables it opens are there too, unless seen before
            self._at.setdefault(path[:n], where)

    @staticmethod
    def _path(key: str | Sequence[str | int]) -> KeyPath:
        return tuple(key.split(".")) if isinstance(key, str) else tuple(key)

    def find(self, key: str | Sequence[str | int]) -> Location | None:
        """Where ``key`` (a dotted name or a path) is written; None when it is not."""
        return self._at.get(self._path(key))

    def nearest(self, key: str | Sequence[str | int]) -> Location:
        """Where ``key`` is written, else the nearest table around it that is, else line 1."""
        path = self._path(key)
        for n in range(len(path), 0, -1):
            where = self._at.get(path[:n])
            if where is not None:
                return where
        return Location(self.file, 1)

    def offset(self, where: Location) -> int:
        """The character offset of a location in the text."""
        return self._starts[min(where.line, len(self._starts)) - 1] + max(where.column - 1, 0)

    def location(self, offset: int) -> Location:
        """The location (line and column) of a character offset in the text."""
        line = bisect.bisect_right(self._starts, offset)
        return Location(self.file, line, offset - self._starts[line - 1] + 1)
