"""Adopting an older agent's exporter spool (agent/daemon/exporter_spool_adopt.py): on real directories, on one
file system and across two (/dev/shm), after a crash half way, and what is refused."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infersight.agent.daemon.exporter_spool_adopt import COPYING, MARKER, adopt_old_spool
from infersight.agent.daemon.spool import DiskSpool
from infersight.telemetry import LogItem, Resource

RESOURCE = Resource.of({"service.name": "old"})
SUB = "exporters/otlp"


def _fill(directory: Path, batches: int = 6, per: int = 50, delivered: int = 1) -> None:
    spool = DiskSpool(str(directory), 128 << 10)
    n = 0
    for _ in range(batches):
        items = []
        for _ in range(per):
            n += 1
            items.append(LogItem(RESOURCE, time.time_ns(), 9, "INFO", "tick %d" % n, {"pad": "x" * 150}))
        spool.append(items)
    for _ in range(delivered):
        _items, records = spool.peek_many(per)
        spool.pop_many(records)
    spool.close()


def _bodies(directory: Path) -> list[str]:
    """Every item the spool at ``directory`` still holds, read as the agent's worker reads it."""
    spool = DiskSpool(str(directory), 128 << 10)
    out: list[str] = []
    try:
        while True:
            items, records = spool.peek_many(1000)
            if not records:
                return out
            out += [it.body for it in items if isinstance(it, LogItem)]
            spool.pop_many(records)
    finally:
        spool.close()


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    d = tmp_path / "spool"
    d.mkdir()
    return d


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def other_fs_spool() -> Iterator[Path]:
    """A spool directory on another file system than the tests' tmp (tmpfs /dev/shm): segments are copied."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tempfile.gettempdir()).st_dev:
        pytest.skip("no second file system")
    d = Path(tempfile.mkdtemp(prefix="isf-adopt-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d)


WANT = ["tick %d" % n for n in range(51, 301)]


def test_adopted_on_one_file_system_by_rename(spool_dir: Path, state_dir: Path) -> None:
    _fill(spool_dir / "exporters" / "otlp")
    inode = os.stat(spool_dir / "exporters" / "otlp" / "000000000002.seg").st_ino
    a = adopt_old_spool(str(spool_dir), str(state_dir), SUB, "otlp")
    assert a.warning is None and a.done is not None and ": renamed from " in a.done, a
    assert not (spool_dir / "exporters").exists()
    assert os.stat(state_dir / SUB / "000000000002.seg").st_ino == inode
    assert _bodies(state_dir / SUB) == WANT  # the read position came along: the delivered record is not sent again


def test_adopted_across_file_systems_by_copy(other_fs_spool: Path, state_dir: Path) -> None:
    _fill(other_fs_spool / "exporters" / "otlp")
    a = adopt_old_spool(str(other_fs_spool), str(state_dir), SUB, "otlp")
    assert a.warning is None and a.done is not None and ": copied from " in a.done, a
    assert not (other_fs_spool / "exporters").exists()
    assert sorted(os.listdir(state_dir / SUB)) == ["000000000001.seg", "000000000002.seg", "pos"]
    assert _bodies(state_dir / SUB) == WANT


def _adoption_begun(old: Path, state_dir: Path) -> Path:
    """An old spool ``old`` (filled) whose adoption into ``state_dir`` had begun and stopped: the new directory and
    its marker naming ``old`` are there."""
    _fill(old)
    new = state_dir / SUB
    new.mkdir(parents=True, mode=0o700)
    os.chmod(state_dir / "exporters", 0o700)
    (new / MARKER).write_text(str(old))
    return new


def test_a_copy_a_crash_interrupted_is_finished_once(other_fs_spool: Path, state_dir: Path) -> None:
    """The crash came after segment 1 was copied whole and before its old copy went, with segment 2's copy half
    written: the next start neither loses nor doubles a segment."""
    old = other_fs_spool / "exporters" / "otlp"
    new = _adoption_begun(old, state_dir)
    shutil.copyfile(old / "000000000001.seg", new / "000000000001.seg")
    (new / ("000000000002.seg" + COPYING)).write_bytes((old / "000000000002.seg").read_bytes()[:100])
    a = adopt_old_spool(str(other_fs_spool), str(state_dir), SUB, "otlp")
    assert a.warning is None, a.warning
    assert sorted(os.listdir(new)) == ["000000000001.seg", "000000000002.seg", "pos"]
    assert _bodies(new) == WANT


def test_a_spool_that_moved_on_after_a_stopped_adoption_is_not_merged(spool_dir: Path, state_dir: Path) -> None:
    old = spool_dir / "exporters" / "otlp"
    new = _adoption_begun(old, state_dir)
    (new / "000000000001.seg").write_bytes(b"\0\0\0\2\0\0\0\1[]")  # the new agent's own segment 1
    a = adopt_old_spool(str(spool_dir), str(state_dir), SUB, "otlp")
    assert a.warning is not None and "differs" in a.warning, a
    assert sorted(os.listdir(old)) == ["000000000001.seg", "000000000002.seg", "pos"]


def test_a_spool_another_uid_could_have_written_is_not_adopted(spool_dir: Path, state_dir: Path) -> None:
    """The old place is in the hooks' group-writable directory: a member's planted records are not exported."""
    old = spool_dir / "exporters" / "otlp"
    _fill(old)
    os.chmod(old, 0o770)
    a = adopt_old_spool(str(spool_dir), str(state_dir), SUB, "otlp")
    assert a.warning is not None and "is not this agent's own directory" in a.warning, a
    assert not (state_dir / SUB).exists()
    os.chmod(old, 0o700)
    os.chmod(old / "000000000001.seg", 0o620)
    a = adopt_old_spool(str(spool_dir), str(state_dir), SUB, "otlp")
    assert a.warning is not None and "000000000001.seg is not a file the agent wrote" in a.warning, a
    assert len(os.listdir(old)) == 3


def test_a_spool_an_older_agent_still_holds_is_left_alone(spool_dir: Path, state_dir: Path) -> None:
    old = spool_dir / "exporters" / "otlp"
    _fill(old)
    fd = os.open(old, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        a = adopt_old_spool(str(spool_dir), str(state_dir), SUB, "otlp")
    finally:
        os.close(fd)
    assert a.warning is not None and "in use by another agent" in a.warning, a
    assert len(os.listdir(old)) == 3


def test_nothing_to_adopt_is_silent(spool_dir: Path, state_dir: Path) -> None:
    assert adopt_old_spool(str(spool_dir), str(state_dir), SUB, "otlp") == (None, None)
    _fill(spool_dir / "exporters" / "otlp", batches=1, delivered=1)  # delivered: a read position alone
    assert adopt_old_spool(str(spool_dir), str(state_dir), SUB, "otlp") == (None, None)


def test_a_spool_dir_that_is_the_state_dir_holds_no_older_spool(state_dir: Path) -> None:
    """agent.spool_dir set to agent.state_dir: both places are one, the agent's own spool is no leftover."""
    _fill(state_dir / SUB)
    assert adopt_old_spool(str(state_dir), str(state_dir), SUB, "otlp") == (None, None)
    assert _bodies(state_dir / SUB) == WANT
