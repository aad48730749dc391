"""``hooks._connection``: what a failed connect says, and the acks a closed connection still holds.

The end-to-end checks are tests/e2e/test_hook_socket_access.py (another uid, EACCES) and
tests/e2e/test_hook_reconnect_acks.py (an agent restart mid cold start); these pin the parts.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest
from conftest import wait_for

from infersight.hooks import _wire
from infersight.hooks._connection import Connection, connect_failure


def _ack(seq: int) -> bytes:
    payload = b'{"t":"ack","seq":%d}' % seq
    return _wire.HEADER.pack(len(payload)) + payload


@pytest.mark.parametrize("code", [errno.ENOENT, errno.ECONNREFUSED])
def test_no_agent_listening_is_quiet(code: int) -> None:
    assert connect_failure("/x/agent.sock", OSError(code, os.strerror(code))) is None


def test_a_permission_error_names_the_socket_the_error_and_the_group(tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    try:
        gid = 42931 if os.geteuid() == 0 else os.getegid()
        if os.geteuid() == 0:
            os.chown(sock, -1, gid)
        why = connect_failure(str(sock), PermissionError(errno.EACCES, "Permission denied"))
    finally:
        s.close()
    assert why is not None and "\n" not in why
    assert str(sock) in why and "Permission denied (EACCES)" in why
    if os.geteuid() == 0:  # root is in no group 42931: the hint says which to join
        assert "uid 0" in why and "group 42931" in why and "usermod -aG 42931" in why, why
    else:
        assert "in the socket's group" in why, why


def test_a_socket_of_group_root_gets_no_hint_to_join_group_root(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent run as root outside its service binds its socket as group root: joining root's group to
    reach it would give the user far more; the hint says to run the agent as its service instead."""
    sock = tmp_path / "agent.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    try:
        if sock.stat().st_gid != 0:
            if os.geteuid() != 0:
                pytest.skip("needs a socket of group root")
            os.chown(sock, -1, 0)
        monkeypatch.setattr(os, "getegid", lambda: 42931)  # a user in no group of root's
        monkeypatch.setattr(os, "getgroups", lambda: [42931])
        why = connect_failure(str(sock), PermissionError(errno.EACCES, "Permission denied"))
    finally:
        s.close()
    assert why is not None and "group root" in why and "usermod -aG root" not in why, why
    assert "systemctl start infersight" in why, why


def test_another_error_is_said_without_a_hint() -> None:
    why = connect_failure("/x/agent.sock", OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    assert why == "cannot connect to /x/agent.sock: %s (ENOTDIR)" % os.strerror(errno.ENOTDIR)


def _connected(outbox: int) -> tuple[Connection, socket.socket]:
    ours, agent = socket.socketpair()
    ours.settimeout(0.0)
    conn = Connection("/nonexistent", {"id": "t"})
    conn.sock = ours
    for seq in range(1, outbox + 1):
        conn.outbox.append((seq, 1, b"f%d" % seq))
        conn.outbox_bytes += 2
    return conn, agent


@pytest.mark.parametrize("unread", [False, True], ids=["eof", "econnreset"])
def test_a_failed_send_takes_the_acks_the_dead_agent_left(unread: bool) -> None:
    conn, agent = _connected(3)
    agent.sendall(_ack(1) + _ack(2)[:5])  # the second ack cut in two reads
    agent.sendall(_ack(2)[5:])
    if unread:
        conn.sock.send(b"never read")  # type: ignore[union-attr]  # the agent dies with it unread: ECONNRESET
    agent.close()
    conn.send(4, 1, b"f4")  # EPIPE: disconnects
    assert not conn.up
    assert conn.acked == 2 and [f[0] for f in conn.outbox] == [3, 4]  # only those are resent



def test_a_timeout_is_quiet_and_a_path_python_refuses_is_said() -> None:
    assert connect_failure("/x/agent.sock", TimeoutError("timed out")) is None
    long_path = "/tmp/" + "x" * 200 + "/agent.sock"
    conn = Connection(long_path, {"id": "t"})
    said: list[str] = []
    conn._warn = said.append  # type: ignore[method-assign]
    assert conn.connect() is False
    assert len(said) == 1 and long_path in said[0] and "too long" in said[0], said


def _slow_agent(path: Path, read_after_s: float, got: list[int]) -> socket.socket:
    """An agent that welcomes at once, then reads nothing for ``read_after_s`` (busy), then everything."""
    import threading
    import time

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            c.recv(65536)  # the hello
            c.sendall(_wire.welcome_frame())
            time.sleep(read_after_s)
            while True:
                chunk = c.recv(1 << 20)
                if not chunk:
                    return
                got[0] += len(chunk)

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_a_reconnect_replays_a_large_backlog_to_an_agent_that_reads_a_moment_later(tmp_path: Path) -> None:
    """The frames not acked before a reconnect go again right after the welcome; an agent busy for half a second
    must not make the producer give the connection up (each frame waits up to SEND_TIMEOUT_S for room, as
    before the welcome's wait was cut into slices: it was left at 0.1 s, and 2 MiB then failed every time)."""
    got = [0]
    srv = _slow_agent(tmp_path / "a.sock", 0.5, got)
    conn = Connection(str(tmp_path / "a.sock"), {"id": "t"})
    for seq in range(1, 5):
        conn.outbox.append((seq, 1, b"x" * (512 << 10)))
    try:
        assert conn.connect() is True and conn.up
        assert wait_for(lambda: got[0] >= 4 * (512 << 10), 30)  # the whole backlog arrived
    finally:
        conn.disconnect()
        srv.close()


class _NoRoomSocket:
    """FAKE socket of an agent that reads nothing (every send times out) or takes ``take`` bytes a send (one
    that trickles, so that no send ever times out); counts the sends."""

    def __init__(self, take: int = 0) -> None:
        self.take, self.sends, self.timeout = take, 0, None

    def settimeout(self, t: float) -> None:
        self.timeout = t

    def send(self, view: memoryview) -> int:
        self.sends += 1
        if not self.take:
            raise TimeoutError("timed out")
        return min(self.take, len(view))


@pytest.mark.parametrize("take", [0, 4096], ids=["no-room", "trickle"])
def test_an_abandoned_wait_on_the_agent_ends_after_one_slice(take: int) -> None:
    """At exit (``abandoned``), a send to an agent that takes nothing, or a little at a time (each send moving a
    few bytes, so that no wait ever times out), stops after one send instead of going on to SEND_TIMEOUT_S (no
    room: about 20 slices) or for ever (a trickle: 8 MiB in 4 KiB sends)."""
    from infersight.hooks._connection import WAIT_SLICE_S

    conn = Connection("/nonexistent", {"id": "t"})
    conn.abandoned = True
    sock = _NoRoomSocket(take)
    with pytest.raises(OSError):
        conn._send_sliced(sock, memoryview(b"x" * (8 << 20)))
    assert sock.sends == 1 and sock.timeout == WAIT_SLICE_S
    # not abandoned, a trickle goes on: every byte is sent
    conn.abandoned = False
    sock = _NoRoomSocket(1 << 20)
    conn._send_sliced(sock, memoryview(b"x" * (8 << 20)))
    assert sock.sends == 8
