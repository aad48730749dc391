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
    fd = sock.fileno()
    os.close(fd)  # the host's closerange
    a, b = socket.socketpair()  # the host's socket; its end `a` takes the freed number, as the lowest free one
    # would (placed there with dup2: another thread of this test process may take a lower free number first)
    if b.fileno() == fd:
        a, b = b, a
    host_fd = a.fileno()
    if host_fd != fd:
        os.dup2(a.fileno(), fd)
        host_fd = fd
    try:
        import threading

        t = threading.Thread(target=_poll, daemon=True)
        t.start()
        t.join(30)  # at once, or never
        assert not t.is_alive()  # not stuck reading the host's socket
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(4096)  # no netlink request written to the host's socket
        _listening.close_netlink()
        os.fstat(host_fd)  # still open
        os.fstat(b.fileno())
        os.write(host_fd, b"x")
        b.setblocking(True)
        assert b.recv(1) == b"x"
    finally:
        if host_fd != a.fileno():
            os.close(host_fd)
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
