"""Connections under pressure, against a real agent: a flood beyond the connection limit
still gets ``status`` answered, silent producers are closed after the idle timeout, and
running out of descriptors (EMFILE) is logged once with a counter, without a busy loop."""

from __future__ import annotations

import os
import resource
import socket
from pathlib import Path

from conftest import wait_for

from infersight.hooks import _wire


def agent_with(agent_factory, **keys: object):  # type: ignore[no-untyped-def]
    agent = agent_factory()
    lines = "".join("%s = %s\n" % (k, v) for k, v in keys.items())
    agent.config.write_text(agent.config.read_text().replace("[agent]\n", "[agent]\n" + lines, 1))
    return agent.start()


def connect(path: Path, timeout: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


def hello(i: int) -> bytes:
    # its own pid, as a hook's: a non-root agent takes another pid only if it is a live process of this uid
    return _wire.encode_frame({"t": "hello", "schema": 1, "producer": {
        "id": "flood-%d" % i, "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}})


def test_status_is_answered_beyond_the_connection_limit(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_with(agent_factory, max_connections=10)
    flood = []
    try:
        for i in range(40):
            s = connect(agent.sock)
            s.sendall(hello(i))
            flood.append(s)
        assert wait_for(lambda: agent.status()["counters"]["over_capacity"] >= 20, 20)
        st = agent.status()
        assert st["healthy"] is True
        assert st["producers"] <= 12, "producers beyond the limit were turned away"
    finally:
        for s in flood:
            s.close()


def test_silent_producer_is_closed_after_the_idle_timeout(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_with(agent_factory, idle_timeout_s=0.5)
    with connect(agent.sock) as s:
        s.sendall(hello(1))
        data = b""
        while True:
            chunk = s.recv(4096)  # welcome, then EOF when the agent hangs up
            if not chunk:
                break
            data += chunk
    frames, _rest, _bad = _wire.split_frames(data)
    assert _wire.decode_payload(frames[0]) == {"t": "welcome", "schema": 1}
    assert agent.status()["counters"]["idle_closed"] == 1


def open_fds(pid: int) -> int:
    return len(os.listdir("/proc/%d/fd" % pid))


def test_out_of_descriptors_logs_once_and_backs_off(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_with(agent_factory)
    assert agent.proc is not None
    pid = agent.proc.pid
    # Once the agent has settled (the device job has looked for NVML), take descriptors away.
    def settled() -> bool:
        nvml = agent.status().get("nvml", {})
        return bool(nvml.get("available") or nvml.get("reason"))

    assert wait_for(settled, 20)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    limit = open_fds(pid) + 6
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))  # fewer than the agent planned for
    flood = []
    try:
        for _ in range(60):  # silent peers: each holds a descriptor until the frame timeout (2 s)
            try:
                flood.append(connect(agent.sock, timeout=0.5))
            except OSError:
                break
        assert wait_for(lambda: "Too many open files" in agent.log.read_text(), 20)
        for s in flood:
            s.close()

        def status_ok() -> bool:
            try:
                return bool(agent.status()["healthy"])
            except OSError:
                return False

        assert wait_for(status_ok, 30), "the agent answers again once descriptors are free"
        c = agent.status()["counters"]
        assert c["accept_errors"] >= 1
        assert c["accept_errors"] < 100, "accepting backs off instead of spinning"
        text = agent.log.read_text()
        assert "Traceback" not in text
        assert text.count("Too many open files") <= 10
        assert agent.proc.poll() is None
    finally:
        for s in flood:
            s.close()
        if agent.proc.poll() is None:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
