"""A real small filesystem for the full-disk tests: a tmpfs mounted for the test (needs root and mount
rights; the test is skipped with the reason where it cannot mount), unmounted after it."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, options: str = "size=64k,mode=0700") -> Iterator[Path]:
    """``path`` (made if missing) as a tmpfs mounted with ``options``, for the ``with`` block."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (%s): needs root and a kernel that allows it" % r.stderr.strip())
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
