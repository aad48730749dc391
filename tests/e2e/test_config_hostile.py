"""Hostile configuration and state files (issue 22: the small config items, and point 14).

Each case used to end the agent with a traceback, hang it, or be accepted: a table nested
3000 deep, a ``socket`` that is empty, holds a NUL or is too long for ``sun_path``, a reload
to ``socket = ""``, a FIFO as the config file (at start, and on SIGHUP inside the event
loop), and one nested line in ``coldstart-history.jsonl`` (the agent did not start).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for

from infersight.agent.coldstart import history as ch
from infersight.agent.coldstart.eta import Run
from infersight.agent.daemon import config as cfg
from infersight.settings import ConfigError

INFERSIGHT = [sys.executable, "-m", "infersight"]


@pytest.mark.parametrize("text", [
    "[" + ".".join(["a"] * 3000) + "]\n",  # 3000-deep table header
    "[agent]\nx = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n",  # inline tables
    "x = " + "[" * 3000 + "]" * 3000 + "\n",
])
def test_a_deeply_nested_file_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="nested"):
        cfg.load(str(path), env={})


@pytest.mark.parametrize(("value", "why"), [
    ('""', "empty"), ('"/tmp/a\\u0000b"', "NUL"), ('"/tmp/%s.sock"' % ("x" * 120), "at most 107 bytes"),
])
def test_a_bad_socket_path_names_the_key_and_the_line(tmp_path: Path, value: str, why: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text("[agent]\n# comment\nsocket = %s\n" % value)
    with pytest.raises(ConfigError, match=why) as exc:
        cfg.load(str(path), env={})
    assert "agent.socket" in str(exc.value) and "agent.toml:3" in str(exc.value)
    p = subprocess.run([*INFERSIGHT, "agent", "--config", str(path)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "agent.socket" in p.stderr, p.stderr


def test_bad_socket_paths_from_the_environment_and_flags(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="INFERSIGHT_SOCKET"):
        cfg.load(None, env={"INFERSIGHT_SOCKET": "/tmp/" + "y" * 200})
    with pytest.raises(ConfigError, match="agent.socket"):
        cfg.load(None, env={}, flags={"agent.socket": "/tmp/a\0b"})
    with pytest.raises(ConfigError, match="agent.state_dir"):
        cfg.load(None, env={}, flags={"agent.state_dir": ""})


def test_a_fifo_as_the_config_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        cfg.load(str(tmp_path / "dir.toml"), env={})
    p = subprocess.run([*INFERSIGHT, "agent", "--config", str(fifo)], capture_output=True, text=True, timeout=60,
                       check=False)  # the timeout only keeps a hang from stalling the suite
    assert p.returncode == 2 and "not a regular file" in p.stderr, p.stderr


def test_a_reload_to_a_bad_socket_or_a_fifo_keeps_the_agent_running(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    good = agent.config.read_text()
    assert agent.proc is not None

    def failures() -> int:
        return int(agent.status()["counters"]["reload_failures"])

    agent.config.write_text(good.replace('socket = "%s"' % agent.sock, 'socket = ""'))
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: failures() == 1, 15)
    assert agent.status()["counters"]["reloads"] == 0
    # The file is now a FIFO that nobody writes: the reload (inside the event loop) must not block.
    agent.config.unlink()
    os.mkfifo(agent.config)
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: failures() == 2, 15)
    st = agent.status()
    assert st["healthy"] is True and st["socket"] == str(agent.sock)
    assert agent.proc.poll() is None
    agent.config.unlink()
    agent.config.write_text(good)
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: agent.status()["counters"]["reloads"] == 1, 15)
    assert agent.stop() == 0


# -- the cold-start history (point 14) ------------------------------------------------------------


GOOD = ch.run_to_json("svc#abc", Run((("weights_load", 1.0, 1.5),), 2.0, "weights=warm,compile=none", 1.0))
BAD_LINES = [
    '{"key": "svc#abc", "stages": ' + "[" * 3000 + "]" * 3000 + ', "total_s": 1}',  # nested
    json.dumps({**GOOD, "total_s": "x"}).replace('"x"', "Infinity"),
    json.dumps({**GOOD, "total_s": "x"}).replace('"x"', "NaN"),
    json.dumps({**GOOD, "total_s": "x"}).replace('"x"', "1e400"),
    json.dumps({**GOOD, "stages": [["weights_load", "x", 1.0]]}).replace('"x"', "-Infinity"),
    json.dumps({**GOOD, "total_s": 10**400}),  # an integer no float holds
    json.dumps({**GOOD, "ended_at": "x"}).replace('"x"', "Infinity"),
    json.dumps({**GOOD, "stages": {"weights_load": 1}}),
]


def test_bad_history_lines_are_skipped_and_counted() -> None:
    text = "\n".join([json.dumps(GOOD), *BAD_LINES, json.dumps(GOOD)]) + "\n"
    h = ch.parse(text)
    assert h.corrupt_lines == len(BAD_LINES) and h.lines_read == len(BAD_LINES) + 2
    assert [r.total_s for r in h.of("svc#abc")] == [2.0, 2.0]


def test_the_agent_starts_with_a_poisoned_history_and_says_so(agent_factory, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / ch.FILE_NAME).write_text("\n".join([json.dumps(GOOD), *BAD_LINES]) + "\n")
    os.chmod(state / ch.FILE_NAME, 0o600)
    monkeypatch.setenv("INFERSIGHT_STATE_DIR", str(state))
    agent = agent_factory().start()
    st = agent.status()
    assert st["healthy"] is True
    assert st["coldstart_history_lines_skipped"] == len(BAD_LINES)
    assert "skipped %d unreadable line(s)" % len(BAD_LINES) in agent.log.read_text()
    assert agent.stop() == 0
