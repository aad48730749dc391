"""The kernel's listening sockets are looked at only when the network namespace's socket
counters moved (``hooks/_listening.py``, ``Gate``): two ``pread`` calls instead of a sock_diag
dump's nine system calls per tick while nothing changes. Counted, not timed: the counter files
are fakes the test writes, the listening sockets are real."""

from __future__ import annotations

import os
import socket

import pytest

from infersight.hooks import _listening

SOCKSTAT = "sockets: used %d\nTCP: inuse %d orphan 0 tw %d alloc 3 mem %d\nUDP: inuse 0 mem 0\n"
SOCKSTAT6 = "TCP6: inuse %d\nUDP6: inuse 0\n"


@pytest.fixture
def counters(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    try:
        _listening.netlink_listening()
    except OSError:
        pytest.skip("sock_diag refused here")
    four, six = tmp_path / "sockstat", tmp_path / "sockstat6"

    def write(used: int = 10, tcp: int = 2, tcp6: int = 1, tw: int = 0, mem: int = 1) -> None:
        four.write_text(SOCKSTAT % (used, tcp, tw, mem))
        six.write_text(SOCKSTAT6 % tcp6)

    write()
    monkeypatch.setattr(_listening, "SOCKSTAT", (str(four), str(six)))
    monkeypatch.setattr(_listening, "SETTLE_S", 0.0)
    monkeypatch.setattr(_listening, "FULL_POLL_S", 3600.0)
    dumps = []
    real = _listening.netlink_listening

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        dumps.append(1)
        return real(*a, **k)

    monkeypatch.setattr(_listening, "netlink_listening", counted)
    return write, dumps


def test_no_dump_while_the_counters_stand_still(counters) -> None:  # type: ignore[no-untyped-def]
    write, dumps = counters
    w = _listening.ListenWatch(lambda: ["self"])
    assert w.poll() is None
    assert len(dumps) == 1  # the first look
    for _ in range(20):
        assert w.poll() is None
    assert len(dumps) == 1 and w.gate.skipped == 20
    write(tw=5, mem=9)  # time-wait and memory move all the time: not a socket made or listening
    assert w.poll() is None and len(dumps) == 1


def test_a_tcp_listen_moves_the_counters_and_is_found(counters) -> None:  # type: ignore[no-untyped-def]
    write, dumps = counters
    w = _listening.ListenWatch(lambda: ["self"])
    assert w.poll() is None
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()  # (not through the fake files: the kernel hashes it, TCP inuse + 1)
    try:
        assert w.poll() is None and len(dumps) == 1  # the fake counters did not move: skipped
        write(tcp=3)
        assert w.poll() == ("tcp", s.getsockname()[1])
        assert len(dumps) == 2
    finally:
        s.close()


def test_a_unix_socket_listening_after_it_was_made_is_found_in_the_settle_time(counters, tmp_path,
                                                                               monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A unix socket moves ``sockets: used`` when it is made, nothing when it listens."""
    write, dumps = counters
    monkeypatch.setattr(_listening, "SETTLE_S", 3600.0)
    w = _listening.ListenWatch(lambda: ["self"])
    assert w.poll() is None
    path = str(tmp_path / "u.sock")
    u = socket.socket(socket.AF_UNIX)
    write(used=11)
    try:
        assert w.poll() is None  # made, not listening yet
        u.bind(path)
        u.listen()
        assert w.poll() == ("unix", path)  # the counters stood still, but within the settle time
    finally:
        u.close()


def test_a_look_at_least_every_full_poll(counters, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _write, dumps = counters
    monkeypatch.setattr(_listening, "FULL_POLL_S", 0.0)
    w = _listening.ListenWatch(lambda: ["self"])
    for _ in range(3):
        w.poll()
    assert len(dumps) == 3 and w.gate.skipped == 0


def test_unreadable_counters_mean_a_look_every_time(counters, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _write, dumps = counters
    monkeypatch.setattr(_listening, "SOCKSTAT", (str(tmp_path / "absent"),))
    w = _listening.ListenWatch(lambda: ["self"])
    for _ in range(3):
        w.poll()
    assert len(dumps) == 3


def test_a_forked_child_opens_its_own_counter_files(counters) -> None:  # type: ignore[no-untyped-def]
    w = _listening.ListenWatch(lambda: ["self"])
    w.poll()
    parent_fds = list(w.gate.fds)
    assert parent_fds
    r, wr = os.pipe()
    child = os.fork()
    if child == 0:
        ok = False
        try:
            w.poll()
            ok = w.gate.pid == os.getpid() and len(w.gate.fds) == len(parent_fds)
        finally:
            os.write(wr, b"1" if ok else b"0")
            os._exit(0)
    os.close(wr)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(child, 0)
    assert w.gate.fds == parent_fds and w.gate.pid == os.getpid()
    for fd in parent_fds:
        os.fstat(fd)  # still open in the parent


def test_close_netlink_closes_the_counter_files(counters) -> None:  # type: ignore[no-untyped-def]
    w = _listening.ListenWatch(lambda: ["self"])
    w.poll()
    fds = list(w.gate.fds)
    _listening.close_netlink()
    assert not w.gate.fds
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_watch_of_other_processes_is_not_gated(counters) -> None:  # type: ignore[no-untyped-def]
    """launch watching a non-Python CMD: the counters of its namespace are not ours to read."""
    _write, dumps = counters
    w = _listening.ListenWatch(lambda: [os.getpid()])
    for _ in range(3):
        w.poll()
    assert len(dumps) == 3
