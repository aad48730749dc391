"""The sock_diag socket behind readiness from the kernel's tables (``hooks/_listening.py``) is
kept between polls (four system calls fewer each, on the sampler thread), re-made in a forked
child (the inherited one is the parent's: their dumps would mix), and dropped after a failure."""

from __future__ import annotations

import os
import socket

import pytest

from infersight.hooks import _listening

nl = _listening._netlink


def _netlink_or_skip() -> None:
    try:
        _listening.netlink_listening()
    except OSError:
        pytest.skip("sock_diag refused here")


def test_polls_share_one_socket() -> None:
    _netlink_or_skip()
    made = nl.made
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        inode = os.fstat(s.fileno()).st_ino
        for _ in range(5):
            assert _listening.netlink_listening()[inode] == ("tcp", s.getsockname()[1])
        assert nl.made == made  # the socket of the first call, five times
        assert nl.sock is not None and nl.pid == os.getpid()
    finally:
        s.close()


def test_a_forked_child_makes_its_own_and_the_parents_still_works() -> None:
    _netlink_or_skip()
    parent_sock = nl.sock
    made = nl.made
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    inode = os.fstat(s.fileno()).st_ino
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        ok = False
        try:
            found = _listening.netlink_listening()
            ok = found.get(inode) == ("tcp", s.getsockname()[1]) and nl.made == made + 1 and nl.sock is not parent_sock
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"  # the child found it through a socket of its own
        os.waitpid(child, 0)
        assert nl.sock is parent_sock and nl.made == made  # the parent's is untouched ...
        assert _listening.netlink_listening()[inode] == ("tcp", s.getsockname()[1])  # ... and still answers
    finally:
        os.close(r)
        s.close()


def test_a_failed_dump_drops_the_socket(monkeypatch) -> None:
    _netlink_or_skip()
    made = nl.made

    def refused(*_a: object) -> list[bytes]:
        raise OSError("refused")

    monkeypatch.setattr(_listening, "_dump", refused)
    with pytest.raises(OSError):
        _listening.netlink_listening()
    assert nl.sock is None
    monkeypatch.undo()
    _listening.netlink_listening()
    assert nl.made == made + 1


def test_close_then_a_poll_makes_a_new_one() -> None:
    _netlink_or_skip()
    _listening.close_netlink()
    assert nl.sock is None
    made = nl.made
    _listening.netlink_listening()
    assert nl.made == made + 1 and nl.sock is not None


def test_a_child_forked_while_the_sampler_dumps_can_still_poll() -> None:
    """The parent's sampler thread held the socket's lock at the fork (mid-dump): that thread
    does not exist in the child, so the child must not wait for it forever."""
    import threading

    _netlink_or_skip()
    held, release = threading.Event(), threading.Event()

    def dumping() -> None:
        with nl.lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=dumping)
    t.start()
    assert held.wait(5)
    r, w = os.pipe()
    try:
        child = os.fork()
        if child == 0:
            ok = b"0"
            try:
                done = threading.Event()

                def poll() -> None:
                    try:
                        _listening.netlink_listening()
                    except OSError:
                        pass
                    done.set()

                threading.Thread(target=poll, daemon=True).start()
                ok = b"1" if done.wait(30) else b"0"  # at once, or never (a lock held forever)
            finally:
                os.write(w, ok)
                os._exit(0)
        os.close(w)
        w = -1
        assert os.read(r, 1) == b"1"  # the child's poll returned
        os.waitpid(child, 0)
    finally:
        release.set()
        t.join()
        os.close(r)
        if w >= 0:
            os.close(w)
