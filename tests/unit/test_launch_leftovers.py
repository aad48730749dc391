"""What a dead launch left in the temporary directory: found without reading every name a member planted there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_a_flood_of_launch_directories_costs_another_users_launch_a_bounded_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A member made 300k ``infersight-launch-*`` directories in /tmp: every launch of another user's looked at
    each (lstat) for a dead launch's leftovers, and its end took 3.5 s instead of 0.5 s (a review's attack).
    At most MAX_DEAD_LOOKED names are looked at; what is beyond waits for a later launch."""
    from infersight.agent.commands import launch_base

    monkeypatch.setattr(launch_base, "MAX_DEAD_LOOKED", 50)
    for i in range(400):
        (tmp_path / ("%s%012x" % (launch_base.PRIVATE_PREFIX, i))).mkdir(mode=0o700)
    looked: list[str] = []
    real = os.lstat
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: (looked.append(str(p)), real(p, *a, **k))[1])
    assert list(launch_base.dead_launch_dirs(str(tmp_path), "", exclusive=False)) == []  # (no lock: none is one)
    assert 0 < len(looked) <= 50
