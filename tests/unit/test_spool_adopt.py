"""Moving an earlier process's private spool files to the agent's spool: only ended ones, only ours."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from infersight.hooks import _spool_adopt


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir(mode=0o700)
    return private, shared


def test_an_ended_processs_file_moves_whole_and_a_live_ones_stays(tmp_path: Path) -> None:
    private, shared = _dirs(tmp_path)
    (private / "ended-1.spool").write_bytes(b"x" * 3_000_000)
    live = private / "live-2.spool"
    live.write_bytes(b"y")
    (private / "notes.txt").write_text("not a spool file")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # its process still runs: it replays the file itself
    try:
        assert _spool_adopt.adopt(str(private), str(shared)) == 1
    finally:
        os.close(fd)
    assert (shared / "ended-1.spool").read_bytes() == b"x" * 3_000_000
    assert os.stat(shared / "ended-1.spool").st_nlink == 1 and not list(shared.glob(".*"))
    assert not (private / "ended-1.spool").exists() and live.exists() and (private / "notes.txt").exists()


def test_a_link_or_a_name_taken_is_left_alone(tmp_path: Path) -> None:
    private, shared = _dirs(tmp_path)
    os.symlink("/etc/passwd", private / "link-3.spool")
    (private / "taken-4.spool").write_bytes(b"mine")
    (shared / "taken-4.spool").write_bytes(b"theirs")
    assert _spool_adopt.adopt(str(private), str(shared)) == 0
    assert (shared / "taken-4.spool").read_bytes() == b"theirs" and (private / "taken-4.spool").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another uid needs root")
def test_a_private_directory_of_another_uid_is_not_read(tmp_path: Path) -> None:
    private, shared = _dirs(tmp_path)
    (private / "x-5.spool").write_bytes(b"z")
    os.chown(private, 65534, 65534)
    assert _spool_adopt.adopt(str(private), str(shared)) == 0
