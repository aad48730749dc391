"""Hostile peers on the agent's socket: the agent stays up and counts each case."""

from __future__ import annotations

import os
import pwd
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import wait_for

from infersight.hooks import _wire


def connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def test_socket_mode_is_0660_or_stricter(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    mode = stat.S_IMODE(os.stat(agent.sock).st_mode)
    assert mode & 0o007 == 0 and mode <= 0o660


def test_oversized_garbage_and_slow_peers_are_counted(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    # Oversized frame header.
    with connect(agent.sock) as s:
        s.sendall(_wire.HEADER.pack(_wire.MAX_FRAME_BYTES + 1) + b"x" * 16)
        assert s.recv(100) == b""  # the agent hangs up
    # Garbage that is not JSON.
    with connect(agent.sock) as s:
        s.sendall(_wire.HEADER.pack(5) + b"\xff\x00abc")
        assert s.recv(100) == b""
    # Hello, then malformed events inside a valid batch.
    with connect(agent.sock) as s:
        # its own pid, as a hook's: a non-root agent takes another pid only if it is a live process of this uid
        s.sendall(_wire.encode_frame({"t": "hello", "schema": 1, "producer": {
            "id": "hostile", "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}}))
        s.sendall(_wire.encode_frame({"t": "b", "e": [[1, 5, "span", {"n": 3}], "junk", [2, 6, "nope", {}]]}))
        s.sendall(_wire.encode_frame({"t": "b", "e": [[3, 7, "log", {"body": "fine"}]]}))
        time.sleep(0.3)
    # Slow loris: a header, then nothing.
    with connect(agent.sock) as s:
        s.sendall(_wire.HEADER.pack(100))
        assert wait_for(lambda: agent.status()["counters"]["slow_peers"] >= 1, 20)
    c = agent.status()["counters"]
    assert c["oversized_frames"] >= 1
    assert c["malformed_frames"] >= 1
    assert c["malformed_events"] == 3
    assert c["events_in"] == 1
    assert agent.status()["healthy"] is True
    assert agent.proc.poll() is None  # type: ignore[union-attr]


def test_wrong_schema_gets_a_clear_refusal(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    with connect(agent.sock) as s:
        s.sendall(_wire.encode_frame({"t": "hello", "schema": 2, "producer": {}}))
        data = s.recv(4096)
    frames, _r, _b = _wire.split_frames(data)
    msg = _wire.decode_payload(frames[0])
    assert msg is not None and msg["t"] == "refuse" and "schema 1" in msg["error"]
    assert agent.status()["counters"]["refused_schema"] == 1


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another user")
def test_disallowed_uid_is_refused(agent_factory, open_dir: Path) -> None:  # type: ignore[no-untyped-def]
    nobody = pwd.getpwnam("nobody")
    agent = agent_factory(root=open_dir).start()
    os.chmod(agent.sock, 0o666)  # let the other user reach the socket: the uid check must still refuse
    code = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(%r)\n"
        "print(s.recv(4096)[4:].decode())\n" % str(agent.sock)  # a refused peer is told at once
    )
    # The venv's interpreter lives under /root: run the other user's client with a system Python.
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("no system python3 for the unprivileged peer")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=20,
                       user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], cwd="/")
    assert '"refuse"' in r.stdout and "not allowed" in r.stdout, r.stderr
    assert agent.status()["counters"]["refused_peers"] == 1


def vm_kib(pid: int, key: str) -> int:
    with open("/proc/%d/status" % pid, encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def test_frames_announced_large_and_never_finished_hold_a_bounded_share(agent_factory) -> None:  # type: ignore[no-untyped-def]
    """150 connections each announce a 1 MiB frame and send all of it but its last byte. The agent
    used to buffer every one (4 MiB of read-ahead a connection, then the frame): its peak RSS grew by
    more than 150 MiB. Now large frames share 64 MiB (frame_budget), the rest wait without being read
    and are closed after the frame timeout; small frames (another producer's batch) still flow."""
    agent = agent_factory().start()
    pid = agent.proc.pid  # type: ignore[union-attr]
    agent.status()
    base_kib = vm_kib(pid, "VmRSS")
    body = _wire.HEADER.pack(_wire.MAX_FRAME_BYTES) + b" " * (_wire.MAX_FRAME_BYTES - 1)
    floods: dict[socket.socket, int] = {}
    for _ in range(150):
        s = connect(agent.sock)
        s.setblocking(False)
        floods[s] = 0
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and any(sent < len(body) for sent in floods.values()):
            for s, sent in floods.items():
                if sent < len(body):
                    try:
                        floods[s] = sent + s.send(body[sent:sent + (256 << 10)])
                    except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                        pass
            time.sleep(0.01)
        with connect(agent.sock) as victim:  # a producer whose batches are small: read at once
            # its own pid, as a hook's: a non-root agent takes another pid only if it is a live process of this uid
            victim.sendall(_wire.encode_frame({"t": "hello", "schema": 1, "producer": {
                "id": "victim", "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}}))
            victim.sendall(_wire.encode_frame({"t": "b", "e": [[1, 5, "log", {"body": "victim-ok"}]]}))
            assert wait_for(lambda: agent.status()["counters"]["events_in"] == 1, 20)
        assert wait_for(lambda: agent.status()["counters"]["over_frame_budget"] >= 1, 30)
    finally:
        for s in floods:
            s.close()
    peak_mib = (vm_kib(pid, "VmHWM") - base_kib) / 1024
    assert peak_mib < 120, "the agent's peak RSS grew by %.0f MiB" % peak_mib
    c = agent.status()["counters"]
    assert c["frames_waited_budget"] >= 150 - 64  # 64 frames of 1 MiB fill the total
    assert agent.status()["healthy"] is True


def test_a_batch_larger_than_any_hooks_is_refused_whole(agent_factory) -> None:  # type: ignore[no-untyped-def]
    """350,000 empty events fit one 1 MiB frame; refusing them one at a time cost the event loop 0.3 s a frame.
    A batch of more events than a hook ever sends is refused whole, once; the connection goes on."""
    agent = agent_factory().start()
    with connect(agent.sock) as s:
        # its own pid, as a hook's: a non-root agent takes another pid only if it is a live process of this uid
        s.sendall(_wire.encode_frame({"t": "hello", "schema": 1, "producer": {
            "id": "wide", "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}}))
        s.sendall(_wire.encode_frame({"t": "b", "e": [[]] * 300_000}))
        s.sendall(_wire.encode_frame({"t": "b", "e": [[1, 7, "log", {"body": "fine"}]]}))
        assert wait_for(lambda: agent.status()["counters"]["events_in"] == 1, 20)
    c = agent.status()["counters"]
    assert c["malformed_frames"] == 1 and c["malformed_events"] == 0, c
