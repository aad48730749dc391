"""launch's default output file in a working directory another user may write (a group-shared project directory,
2775, where ``fs.protected_symlinks`` does not apply). Its name, ``infersight-<YYYYmmdd-HHMMSS>.otlp.jsonl``, is
predictable: a red-team review planted names for the next minutes and each launch wrote through a link into the
victim's ``~/notes.txt`` (cutting its last line as a "partial line"), hung on a FIFO before CMD started, or wrote
the victim's telemetry into the attacker's readable file. The default file is now made exclusively and never
through a link; a taken name gets a random suffix, and the file is opened again only while it is the run's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infersight.exporters.file import FileExporter
from infersight.statefiles import OWN_FILES, create_own_file
from infersight.telemetry import LogItem, Resource

AHEAD_S = 30  # names planted for the seconds to come


def _names(start: float) -> list[str]:
    return ["infersight-%s.otlp.jsonl" % time.strftime("%Y%m%d-%H%M%S", time.localtime(start + s))
            for s in range(-1, AHEAD_S)]


def _launch(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT")}
    return subprocess.run([sys.executable, "-m", "infersight", "launch", "--agent", "embedded", "--no-console", "--",
                           sys.executable, "-c", "print('served')"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def _written(cwd: Path, planted: set[str]) -> list[Path]:
    return [p for p in cwd.glob("infersight-*.otlp.jsonl") if p.name not in planted and p.stat().st_size > 0]


def test_a_planted_link_is_not_written_through(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("line one\nlast line without newline")
    cwd = tmp_path / "shared"
    cwd.mkdir()
    planted = set(_names(time.time()))
    for name in planted:
        os.symlink(notes, cwd / name)
    r = _launch(cwd)
    assert r.returncode == 0, r.stderr
    assert notes.read_text() == "line one\nlast line without newline"  # not cut, not appended to
    assert len(_written(cwd, planted)) == 1, (r.stderr, sorted(os.listdir(cwd)))


def test_a_planted_fifo_does_not_hang_launch(tmp_path: Path) -> None:
    cwd = tmp_path / "shared"
    cwd.mkdir()
    planted = set(_names(time.time()))
    for name in planted:
        os.mkfifo(cwd / name, 0o666)
    r = _launch(cwd)  # timed out (hung before CMD started) before
    assert r.returncode == 0 and "served" in r.stdout, r.stderr
    assert len(_written(cwd, planted)) == 1


def test_a_planted_file_of_another_user_is_not_written_into(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to plant a file of another uid")
    cwd = tmp_path / "shared"
    cwd.mkdir()
    planted = set(_names(time.time()))
    for name in planted:
        (cwd / name).write_text("")
        os.chown(cwd / name, 65534, 65534)
        os.chmod(cwd / name, 0o666)
    r = _launch(cwd)
    assert r.returncode == 0, r.stderr
    assert all((cwd / name).stat().st_size == 0 for name in planted)
    assert len(_written(cwd, planted)) == 1


async def test_a_file_replaced_after_the_run_made_it_is_not_opened(tmp_path: Path) -> None:
    """The name the run made, removed and replaced by a link (the directory lets others unlink) before the
    exporter opens it: the exporter refuses, the link's target is untouched."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    made = create_own_file(str(tmp_path / "infersight-x.otlp.jsonl"))
    try:
        os.unlink(made)
        os.symlink(notes, made)
        fe = FileExporter(made)
        with pytest.raises(OSError):
            await fe.start()
        assert notes.read_text() == "mine\n"
        os.unlink(made)
        Path(made).write_text("")
        os.chmod(made, 0o666)
        if os.geteuid() == 0:  # another user's file in its place
            os.chown(made, 65534, 65534)
            with pytest.raises(OSError):
                await FileExporter(made).start()
    finally:
        OWN_FILES.discard(os.path.abspath(made))


async def test_the_runs_own_file_is_written(tmp_path: Path) -> None:
    made = create_own_file(str(tmp_path / "infersight-y.otlp.jsonl"))
    again = create_own_file(str(tmp_path / "infersight-y.otlp.jsonl"))  # the name is taken: a suffix
    try:
        assert again != made and again.endswith(".otlp.jsonl") and Path(again).name.startswith("infersight-y-")
        fe = FileExporter(made)
        await fe.start()
        await fe.export([LogItem(Resource.of({"service.name": "s"}), 1, 9, "INFO", "hello")])
        await fe.shutdown()
        assert "hello" in Path(made).read_text()
    finally:
        OWN_FILES.discard(os.path.abspath(made))
        OWN_FILES.discard(os.path.abspath(again))
