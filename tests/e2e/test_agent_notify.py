"""The daemon talks to systemd (issue 10, item 8): a real NOTIFY_SOCKET datagram socket.

The real ``infersight agent`` process gets NOTIFY_SOCKET and WATCHDOG_USEC as systemd
sets them for ``Type=notify`` with ``WatchdogSec=``. The socket here is what systemd's
is: an AF_UNIX datagram socket, by path or in the abstract namespace (``@name``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.lifecycle import Agent

WATCHDOG_USEC = 200_000  # pings every 0.1 s


class Notifications:
    """The receiving end: every datagram, parsed as systemd parses it (KEY=VALUE lines)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.got: list[dict[str, str]] = []

    def drain(self) -> list[dict[str, str]]:
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(65536).decode()
                out.append(dict(line.split("=", 1) for line in data.split("\n") if line))
        except BlockingIOError:
            pass
        self.got += out
        return out

    def wait(self, key: str, timeout: float = 15.0) -> dict[str, str]:
        """The next message carrying ``key`` (earlier ones are kept in ``got``)."""
        deadline = time.monotonic() + timeout
        self.sock.setblocking(True)
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536).decode()
            except TimeoutError:
                break
            msg = dict(line.split("=", 1) for line in data.split("\n") if line)
            self.got.append(msg)
            if key in msg:
                return msg
        raise AssertionError(f"no {key} within {timeout} s; got {self.got[-5:]}")


@pytest.fixture
def notify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Notifications]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        path = tmp_path / "notify.sock"
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        yield Notifications(sock)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_ready_watchdog_reload_stopping(agent_factory, notify: Notifications) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start(wait=False)
    ready = notify.wait("READY")
    # READY=1 only once the socket listens: the agent answers status right away.
    assert agent.sock.exists() and agent.status()["healthy"] is True
    assert ready["STATUS"].startswith("healthy: 0 producer(s) (0 connected), 0 events in")
    assert not any("WATCHDOG" in m for m in notify.got[:-1]), "no ping before READY=1"
    # Pings keep coming from the event loop.
    for _ in range(3):
        notify.wait("WATCHDOG")

    # SIGHUP: RELOADING=1 with CLOCK_MONOTONIC in microseconds, then READY=1 again.
    notify.drain()
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    agent.proc.send_signal(signal.SIGHUP)
    reloading = notify.wait("RELOADING")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert reloading["RELOADING"] == "1"
    assert before <= int(reloading["MONOTONIC_USEC"]) <= after
    again = notify.wait("READY")
    assert again["READY"] == "1" and "healthy" in again["STATUS"]
    assert wait_for(lambda: agent.status()["counters"]["reloads"] == 1, 10)

    # A failed reload says so in STATUS=, and still ends with READY=1.
    agent.config.write_text(agent.config.read_text().replace("health_interval_s = 0.5", 'health_interval_s = "x"'))
    agent.proc.send_signal(signal.SIGHUP)
    notify.wait("RELOADING")
    assert "last reload failed" in notify.wait("READY")["STATUS"]

    # SIGTERM: STOPPING=1 first, then a clean exit.
    agent.proc.send_signal(signal.SIGTERM)
    stopping = notify.wait("STOPPING")
    assert stopping["STOPPING"] == "1"
    assert agent.proc.wait(20) == 0


def test_a_stopped_agent_sends_no_pings(agent_factory, notify: Notifications) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP freezes the agent: no ping may arrive while it is stopped (systemd would
    then kill it), and pings resume after SIGCONT. The event-loop case: the next test."""
    agent = agent_factory().start(wait=False)
    notify.wait("READY")
    notify.wait("WATCHDOG")
    agent.proc.send_signal(signal.SIGSTOP)
    assert wait_for(lambda: stopped(agent.proc.pid), 5)
    notify.drain()  # what was sent before the stop took effect
    time.sleep(10 * WATCHDOG_USEC / 2e6)  # ten ping intervals
    assert notify.drain() == []
    agent.proc.send_signal(signal.SIGCONT)
    notify.wait("WATCHDOG")
    assert agent.stop() == 0


def test_a_blocked_event_loop_stops_the_pings(tmp_path: Path, notify: Notifications) -> None:
    """The pings come from the event loop, not a thread: while a callback blocks the loop,
    none is sent. Checked without timing: the blocking callback itself empties the socket,
    blocks for ten ping intervals, then reads it; a thread pinger would have sent ~10."""
    conf = cfg.load(None, env={"INFERSIGHT_SOCKET": str(tmp_path / "a.sock"),
                               "INFERSIGHT_SPOOL_DIR": str(tmp_path / "spool")})

    async def main() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        agent = Agent(conf, [], exporter_spool_root=str(tmp_path / "exp"))
        await agent.start()
        await asyncio.to_thread(notify.wait, "WATCHDOG")
        during: list[dict[str, str]] = []

        def block() -> None:
            notify.drain()
            time.sleep(10 * WATCHDOG_USEC / 2e6)
            during.extend(notify.drain())

        asyncio.get_running_loop().call_soon(block)
        await asyncio.sleep(0)
        after = await asyncio.to_thread(notify.wait, "WATCHDOG")
        await agent.shutdown(2)
        return during, [after]

    during, after = asyncio.run(main())
    assert during == [], "a ping was sent while the event loop was blocked"
    assert after[0]["WATCHDOG"] == "1", "pings resume when the loop runs again"


def test_pings_survive_running_out_of_file_descriptors(tmp_path: Path, notify: Notifications) -> None:
    """At EMFILE (a flood of producers, say) the agent still pings: its notify socket was
    opened at start, not per message."""
    conf = cfg.load(None, env={"INFERSIGHT_SOCKET": str(tmp_path / "a.sock"),
                               "INFERSIGHT_SPOOL_DIR": str(tmp_path / "spool")})

    async def main() -> dict[str, str]:
        agent = Agent(conf, [], exporter_spool_root=str(tmp_path / "exp"))
        await agent.start()
        await asyncio.to_thread(notify.wait, "WATCHDOG")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fds: list[int] = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
            while len(fds) < 100:
                try:
                    fds.append(os.open("/dev/null", os.O_RDONLY))
                except OSError as exc:
                    assert exc.errno == errno.EMFILE  # noqa: PT017 - not an expected raise
                    break
            with pytest.raises(OSError, match="Too many open files"):
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            notify.drain()
            ping = await asyncio.to_thread(notify.wait, "WATCHDOG", 5)
        finally:
            for fd in fds:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await agent.shutdown(2)
        return ping

    assert asyncio.run(main())["WATCHDOG"] == "1"


def test_watchdog_pid_of_another_process_means_no_pings(
    agent_factory, notify: Notifications, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))  # the test's pid, not the agent's
    agent = agent_factory().start(wait=False)
    notify.wait("READY")
    agent.proc.send_signal(signal.SIGTERM)
    notify.wait("STOPPING")
    assert agent.proc.wait(20) == 0
    assert not any("WATCHDOG" in m for m in notify.got + notify.drain())


def test_abstract_namespace_notify_socket(agent_factory, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    name = f"infersight-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
        agent = agent_factory().start(wait=False)
        n = Notifications(sock)
        assert n.wait("READY")["READY"] == "1"
        agent.proc.send_signal(signal.SIGTERM)
        assert n.wait("STOPPING")["STOPPING"] == "1"
        assert agent.proc.wait(20) == 0
        assert not any("WATCHDOG" in m for m in n.got), "no WATCHDOG_USEC, no pings"


def test_no_notify_socket_no_notifications(agent_factory, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    agent = agent_factory().start()
    assert agent.status()["healthy"] is True
    assert agent.stop() == 0
