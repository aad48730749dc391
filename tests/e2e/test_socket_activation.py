"""listen_fds() with a real inherited listening socket at fd 3, as systemd passes it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from infersight.agent.daemon import socket_activation

CHILD = r"""
import os, sys
from infersight.agent.daemon.socket_activation import listen_fds_with_names
pairs = listen_fds_with_names()
leftover = [k for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES") if k in os.environ]
assert not leftover, leftover
assert len(pairs) == 1, pairs
name, sock = pairs[0]
assert sock.fileno() == 3 and not os.get_inheritable(3)
print(f"{name} {sock.family.name} {sock.type.name}", flush=True)
conn, _ = sock.accept()
with conn:
    conn.sendall(b"pong:" + conn.recv(64))
"""


def test_child_accepts_on_inherited_fd(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    fd = listener.fileno()
    # As systemd does between fork and exec: move the socket to fd 3 and set
    # LISTEN_PID to the pid that exec keeps.
    shim = (
        f"import os, sys; fd = {fd}\n"
        "if fd != 3: os.dup2(fd, 3); os.close(fd)\n"
        "os.environ['LISTEN_PID'] = str(os.getpid()); "
        "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1]])"
    )
    env = {**os.environ, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "hooks"}
    env.pop("LISTEN_PID", None)
    with subprocess.Popen(
        [sys.executable, "-c", shim, CHILD],
        pass_fds=(fd,),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        listener.close()  # only the child holds the listening socket now
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        assert line == "hooks AF_UNIX SOCK_STREAM", child.stderr.read() if child.stderr else ""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(10)
            client.connect(str(path))
            client.sendall(b"ping")
            assert client.recv(64) == b"pong:ping"
        assert child.wait(timeout=30) == 0


def test_not_activated(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        monkeypatch.delenv(k, raising=False)
    assert socket_activation.listen_fds() == []


def test_other_pid_is_ignored_and_env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "1")
    monkeypatch.setenv("LISTEN_FDNAMES", "hooks")
    assert socket_activation.listen_fds() == []
    assert "LISTEN_FDS" not in os.environ
    assert "LISTEN_PID" not in os.environ


def test_keep_environment_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LISTEN_PID", "garbage")
    monkeypatch.setenv("LISTEN_FDS", "1")
    assert socket_activation.listen_fds(unset_environment=False) == []
    assert os.environ["LISTEN_FDS"] == "1"
