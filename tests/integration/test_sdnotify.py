"""sd_notify client against a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from infersight.agent.daemon import sdnotify


def _recv(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n"))


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def test_ready_status_watchdog(notify_socket: socket.socket) -> None:
    assert sdnotify.ready("listening on /run/infersight/agent.sock")
    assert _recv(notify_socket) == {
        "READY": "1",
        "STATUS": "listening on /run/infersight/agent.sock",
    }
    assert sdnotify.status("events in=3 out=3")
    assert _recv(notify_socket) == {"STATUS": "events in=3 out=3"}
    assert sdnotify.watchdog()
    assert _recv(notify_socket) == {"WATCHDOG": "1"}
    assert sdnotify.stopping()
    assert _recv(notify_socket) == {"STOPPING": "1"}


def test_reloading_carries_monotonic_usec(notify_socket: socket.socket) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.reloading()
    msg = _recv(notify_socket)
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert msg["RELOADING"] == "1"
    assert before <= int(msg["MONOTONIC_USEC"]) <= after


def test_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"infersight-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("READY=1")
        assert _recv(sock) == {"READY": "1"}


def test_no_notify_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False
    assert sdnotify.watchdog() is False


@pytest.mark.parametrize("value", ["/nonexistent/dir/notify.sock", "relative.sock", "@", "/"])
def test_bad_notify_socket_never_raises(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.ready("x") is False


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert sdnotify.watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert sdnotify.watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sdnotify.watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    for bad in ("0", "-5", "abc", ""):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert sdnotify.watchdog_interval_s() is None
