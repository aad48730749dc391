"""``infersight agent`` (agent/commands/agent.py): what it does before the agent serves."""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from infersight.agent.commands import agent as agent_cmd
from infersight.agent.commands import compose, extensions


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state directory of the agent's own, group-writable (``chmod 0770``), and no config file."""
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o770)
    monkeypatch.setenv("INFERSIGHT_CONFIG", str(tmp_path / "absent.toml"))
    monkeypatch.setenv("INFERSIGHT_STATE_DIR", str(state))
    monkeypatch.setenv("INFERSIGHT_SOCKET", str(tmp_path / "run" / "agent.sock"))
    monkeypatch.setenv("INFERSIGHT_SPOOL_DIR", str(tmp_path / "spool"))
    return state


def test_the_state_dir_is_fixed_and_logged_before_the_extensions_read_it(
    env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The extensions (the cold-start history) were built before the state directory's check: the
    history load met the 0770 mode ("is unreadable ...: starting without it"), ETAs started from
    nothing, and the check that then fixed the mode said nothing."""
    seen: list[int] = []

    def build(conf: Any) -> list[Any]:
        seen.append(stat.S_IMODE(os.stat(env).st_mode))
        return []

    async def serve(*_: Any) -> int:
        return 0

    monkeypatch.setattr(extensions, "build_extensions", build)
    monkeypatch.setattr(compose, "build_exporters", lambda conf: [])
    monkeypatch.setattr(compose, "file_is_default", lambda conf, exporters: None)
    monkeypatch.setattr(agent_cmd, "serve", serve)
    caplog.set_level(logging.WARNING)
    assert agent_cmd.run(argparse.Namespace(config=None, socket=None)) == 0
    assert seen == [0o750], "checked and fixed before the extensions were built"
    assert any("those bits are removed" in r.getMessage() and "0770" in r.getMessage() for r in caplog.records), \
        caplog.text


def test_a_state_dir_it_refuses_stops_it_before_the_extensions(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.setenv("INFERSIGHT_STATE_DIR", str(link))
    built: list[object] = []
    monkeypatch.setattr(extensions, "build_extensions", lambda conf: built.append(conf) or [])
    assert agent_cmd.run(argparse.Namespace(config=None, socket=None)) == 2
    assert "unsafe state directory" in capsys.readouterr().err
    assert not built
