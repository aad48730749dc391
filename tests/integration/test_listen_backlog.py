"""The agent's listen backlog: a socket unit's Backlog=512 (systemd/infersight.socket) must survive the
agent taking the socket over (asyncio listens again on it, with 100 unless told otherwise), and a socket the
agent binds itself gets the same room. Read back from the kernel with ``ss`` (a listening socket's Send-Q is
its backlog)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.ingest_server import LISTEN_BACKLOG, Listener
from infersight.agent.daemon.receive import RateLimitedLog

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "infersight.socket"


def unit_backlog() -> int:
    return int(next(line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith("Backlog=")))


def kernel_backlog(path: Path) -> int:
    out = subprocess.run(["ss", "-xlnH"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        cols = line.split()
        if str(path) in cols:
            return int(cols[3])  # Netid State Recv-Q Send-Q Local ...: Send-Q is the backlog
    raise AssertionError("%s is not listening: %s" % (path, out))


async def _noop(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.close()


async def _listen(path: Path, sock: socket.socket | None) -> int:
    listener = Listener(_noop, Counters(), RateLimitedLog(), lambda: 0)
    await listener.start(str(path), 0o660, sock=sock)
    try:
        return kernel_backlog(path)
    finally:
        listener.stop()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_an_inherited_socket_keeps_the_unit_backlog(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(unit_backlog())  # what systemd did
    assert kernel_backlog(path) == unit_backlog()
    got = asyncio.run(_listen(path, sock))
    assert got >= unit_backlog(), "the agent shrank the socket unit's backlog to %d" % got


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_a_socket_the_agent_binds_gets_the_same_backlog(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir(mode=0o750)
    path = d / "agent.sock"
    got = asyncio.run(_listen(path, None))
    assert got >= unit_backlog() and got == min(LISTEN_BACKLOG, int(Path("/proc/sys/net/core/somaxconn").read_text()))
