"""The descriptors the listening watch keeps open between polls (the sock_diag socket, the
socket counter files) can be closed under it by the host (a daemonizing ``closerange``) and
their numbers given to the host's own files and sockets: the watch must then neither write
to, read from nor close what is the host's now."""

from __future__ import annotations

import os
import socket

import pytest

from infersight.hooks import _listening

nl = _listening._netlink


def _poll() -> None:
    try:
        _listening.netlink_listening()  # polls again
    except OSError:
        pass


def test_a_reused_netlink_number_is_not_sent_on_nor_closed() -> None:
    try:
        _listening.netlink_listening()
    except OSError:
        pytest.skip("sock_diag refused here")
    sock = nl.sock
    assert sock is not None
    os.close(sock.fileno())  # the host's closerange
    a, b = socket.socketpair()  # the host's: one end takes the freed number
    try:
        assert sock.fileno() in (a.fileno(), b.fileno())
        import threading

        t = threading.Thread(target=_poll, daemon=True)
        t.start()
        t.join(3)
        assert not t.is_alive()  # not stuck reading the host's socket
        mine = b if a.fileno() == sock.fileno() else a
        mine.setblocking(False)
        with pytest.raises(BlockingIOError):
            mine.recv(4096)  # no netlink request written to the host's socket
        _listening.close_netlink()
        os.fstat(a.fileno())  # both ends still open
        os.fstat(b.fileno())
        a.sendall(b"x")
        assert b.recv(1) == b"x"
    finally:
        a.close()
        b.close()


def test_a_reused_counter_file_number_is_not_closed() -> None:
    gate = _listening.Gate()
    gate.changed()
    if not gate.fds:
        pytest.skip("no /proc/self/net/sockstat here")
    theirs = list(gate.fds)
    for fd in theirs:
        os.close(fd)  # the host's closerange
    pipes = [os.pipe() for _ in theirs]  # the host's: they take the freed numbers
    try:
        held = {fd for p in pipes for fd in p}
        assert set(theirs) <= held
        gate.changed()  # a pipe is not seekable: the read fails, the files are opened again
        gate.changed()
        gate.close()
        _listening.close_netlink()
        for fd in held:
            os.fstat(fd)  # still the host's, open
    finally:
        for p in pipes:
            for fd in p:
                try:
                    os.close(fd)
                except OSError:
                    pass
