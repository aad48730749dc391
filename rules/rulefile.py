"""What every rule file shares: the base of the rules' errors and the ``engine_version`` key.

A rule file (``oom.toml``, ``devices.toml``, a site's ``rules.d/*.toml``) declares the
version of its engine that it needs: ``engine_version = "MAJOR.MINOR"`` (or ``"MAJOR"``).
An engine loads it when the majors match and the file's minor is not newer than its own.
"""

from __future__ import annotations

import re

from infersight.errors import InfersightError

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
