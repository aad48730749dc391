"""An operator's socket directory where another user could replace the socket is said at start.

A Kubernetes emptyDir is 2777 without the sticky bit: a socket at its top could be renamed away by
the model server's uid and a listener of its own put in its place (a review did it, and the
sidecar's own probe then talked to the fake). The pod manifest now names a subdirectory, which
the agent makes 0750 (2750 under the emptyDir's setgid); a directory that is still open to others
is used as configured, with a warning.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from infersight.agent.daemon.ingest_server import ensure_socket_dir


def test_a_socket_at_the_top_of_a_shared_volume_is_warned_about(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    volume = tmp_path / "run"
    volume.mkdir()
    volume.chmod(0o2777)  # as kubelet makes an emptyDir with fsGroup
    with caplog.at_level(logging.WARNING, logger="infersight.agent"):
        ensure_socket_dir(str(volume / "agent.sock"))
    assert "could remove or replace the agent's socket" in caplog.text
    assert "2777: writable by others without the sticky bit" in caplog.text


def test_the_subdirectory_the_agent_makes_is_its_own(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    volume = tmp_path / "run"
    volume.mkdir()
    volume.chmod(0o2777)
    with caplog.at_level(logging.WARNING, logger="infersight.agent"):
        ensure_socket_dir(str(volume / "agent" / "agent.sock"))
    made = os.lstat(volume / "agent")
    assert made.st_uid == os.geteuid() and not stat.S_IMODE(made.st_mode) & 0o022
    assert "replace the agent's socket" not in caplog.text
    # a sticky shared directory (/tmp-like) is no problem either: nobody removes another's file there
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infersight.agent"):
        ensure_socket_dir(str(sticky / "agent.sock"))
    assert "replace the agent's socket" not in caplog.text
