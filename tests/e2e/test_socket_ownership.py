"""Two agents and one socket path: neither takes or removes the other's socket.

Before, an agent starting on a path where another agent listened unlinked that live socket and bound
its own (the first agent went on running, unreachable), and an agent stopping unlinked the path
whoever's socket it held by then (a restarted agent's, leaving it unreachable: ENOENT for every hook).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import wait_for


@pytest.fixture(autouse=True)
def _restore_state_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSIGHT_STATE_DIR", os.environ.get("INFERSIGHT_STATE_DIR", ""))


def _own_state(agent, state: Path, socket: Path | None = None) -> None:  # type: ignore[no-untyped-def]
    """Its own state directory (two agents never share one: the second would refuse for that) through
    the environment, which beats the file, as the tests' own fixture sets it; and ``socket``."""
    os.environ["INFERSIGHT_STATE_DIR"] = str(state)
    text = agent.config.read_text()
    if socket is not None:
        text = text.replace('socket = "%s"' % agent.sock, 'socket = "%s"' % socket, 1)
        agent.sock = socket
    agent.config.write_text(text)


def test_an_agent_does_not_take_a_live_socket(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    first = agent_factory()
    _own_state(first, tmp_path / "state-first")
    first.start()
    second = agent_factory()
    _own_state(second, tmp_path / "state-second", socket=first.sock)
    second.start(wait=False)
    assert second.proc is not None
    assert wait_for(lambda: second.proc.poll() is not None, 30), second.log.read_text()
    assert second.proc.returncode != 0
    assert "another agent is listening on %s" % first.sock in second.log.read_text()
    assert first.status()["healthy"] is True  # still reachable
    assert first.stop() == 0


def test_a_stopping_agent_leaves_a_newer_agents_socket(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    old = agent_factory()
    _own_state(old, tmp_path / "state-old")
    old.start()
    old.sock.unlink()  # its socket file went (an operator, a cleanup job); it still runs
    new = agent_factory()
    _own_state(new, tmp_path / "state-new", socket=old.sock)
    new.start()
    assert old.stop() == 0
    assert new.sock.exists() and new.status()["healthy"] is True, "the old agent removed the new one's socket"
    assert new.stop() == 0
    assert not new.sock.exists(), "an agent removes its own socket when it stops"


def test_a_stale_socket_file_is_replaced(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    gone = agent_factory()
    _own_state(gone, tmp_path / "state-gone")
    gone.start()
    gone.kill()  # SIGKILL: its socket file stays, nobody listens
    assert gone.sock.exists()
    again = agent_factory()
    _own_state(again, tmp_path / "state-again", socket=gone.sock)
    again.start()
    assert again.status()["healthy"] is True
    assert again.stop() == 0


def test_a_live_agent_with_a_full_backlog_is_not_taken_for_a_stale_socket(tmp_path: Path) -> None:
    """A listener whose backlog is full (an agent backing off accept at EMFILE, a reconnect storm)
    does not take connects at once: that is not a stale file, and its socket is not removed."""
    import socket as socket_

    from infersight.agent.daemon.ingest_server import answers

    path = tmp_path / "busy.sock"
    busy = socket_.socket(socket_.AF_UNIX, socket_.SOCK_STREAM)
    busy.bind(str(path))
    busy.listen(0)
    waiting = []
    try:
        for _ in range(4):  # fill the backlog: nobody accepts
            c = socket_.socket(socket_.AF_UNIX, socket_.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(str(path))
            except BlockingIOError:
                pass
            waiting.append(c)
        assert answers(str(path)) is True
    finally:
        for c in waiting:
            c.close()
        busy.close()
    assert answers(str(path)) is False, "nobody listens now: a stale file"
