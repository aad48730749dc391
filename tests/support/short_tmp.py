"""A short TMPDIR for ``infersight launch`` in a test: one per test's tmp path, under the system's /tmp.

launch makes its private directory (and its socket, whose path must fit AF_UNIX's 108 bytes) in $TMPDIR,
and replays the leftovers of dead launches it finds there: a test's own short TMPDIR keeps other tests'
and other runs' leftovers out of its output. The directories are removed when the test ends (conftest),
with what the test's CMD left there (a Ray session's logs are about 150 MB).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

_MADE: set[str] = set()


def short_tmpdir(tmp: str, prefix: str = "isl-") -> str:
    """The TMPDIR of the test whose tmp path is ``tmp`` (the same for every call of that test)."""
    path = os.path.join(tempfile.gettempdir(), prefix + hashlib.sha1(tmp.encode()).hexdigest()[:12])
    os.makedirs(path, mode=0o700, exist_ok=True)
    _MADE.add(path)
    return path


def remove_short_tmpdirs() -> None:
    """Remove every directory ``short_tmpdir`` made (called after each test)."""
    while _MADE:
        shutil.rmtree(_MADE.pop(), ignore_errors=True)
