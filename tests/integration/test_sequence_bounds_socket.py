"""A hostile neighbour's frames over the agent's socket cannot blow up the fleet's loss counters:
seq 10**18 after seq 1 is malformed (not lost, not acked), a ``drops`` report claiming 10**15 is
malformed (not counted); the honest events around them still count, gaps included."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from conftest import wait_for

from infersight.hooks import _wire


def send(s: socket.socket, obj: dict[str, Any]) -> None:
    s.sendall(_wire.encode_frame(obj))


def acks_until(s: socket.socket, want: int, timeout: float = 30.0) -> list[int]:
    """Every ack the agent sends until one reaches ``want`` (or the time is up)."""
    buf, seen = b"", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (seen and max(seen) >= want):
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        buf += chunk
        frames, buf, bad = _wire.split_frames(buf)
        assert not bad
        for payload in frames:
            msg = _wire.decode_reply(payload)
            if msg and msg.get("t") == "ack":
                seen.append(int(msg["seq"]))
    return seen


def log(seq: int) -> list[Any]:
    return [seq, time.time_ns(), "log", {"body": "x"}]


def test_far_jumps_and_huge_drops_reports_are_malformed_not_counted(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(agent.sock))
        # its own pid, as a hook's: a non-root agent takes another pid only if it is a live process of this uid
        send(s, {"t": "hello", "schema": 1, "producer": {
            "id": "neighbour", "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}})
        send(s, {"t": "b", "e": [log(1)]})
        assert 1 in acks_until(s, 1)
        send(s, {"t": "b", "e": [log(10**18)]})
        send(s, {"t": "b", "e": [[2, time.time_ns(), "drops", {"buffer": 10**15, "spool": 10**15}]]})
        send(s, {"t": "b", "e": [[3, time.time_ns(), "drops", {"texts": 10**15}]]})
        send(s, {"t": "b", "e": [log(4), log(8)]})  # an honest gap: 5, 6, 7
        seen = acks_until(s, 8)
        assert seen and max(seen) == 8, "acked up to the honest 8, never 10**18: %r" % seen
        assert wait_for(lambda: agent.status()["counters"]["drops_implausible"] >= 2, 20)
    st = agent.status()
    assert st["lost"] == 3, "the honest gap only"
    assert st["dropped_by_producers"] == 0
    c = st["counters"]
    assert c["seq_implausible"] == 1 and c["drops_implausible"] == 2
    assert c["malformed_events"] >= 3
    assert agent.stop() == 0
