"""Wake-up coalescing across quiet producers (the ingest's read gate, issue 13): after a
small frame, quiet producers are read together once per window instead of once per frame;
busy producers and a lone producer are never held, and nothing is lost."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path

from conftest import log_records, read_otlp_lines

from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.assemble import Assembler
from infersight.agent.daemon.broadcast import Broadcaster
from infersight.agent.daemon.framing import QUIET_FRAME_BYTES, ReadDeadline, ReadGate
from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.ingest import Ingest
from infersight.agent.daemon.lifecycle import Agent
from infersight.exporters.file import FileExporter
from infersight.telemetry import Item


class FakeTransport:
    def __init__(self) -> None:
        self.reading = True
        self.closing = False
        self.pauses = 0

    def is_reading(self) -> bool:
        return self.reading and not self.closing

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.pauses += 1
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def abort(self) -> None:
        self.closing = True


def gate_of(window_s: float, n: int) -> tuple[ReadGate, list[FakeTransport]]:
    gate = ReadGate(window_s)
    ts = [FakeTransport() for _ in range(n)]
    for t in ts:
        gate.join(t)  # type: ignore[arg-type]
    return gate, ts


async def test_a_small_frame_holds_every_quiet_producer_for_the_window() -> None:
    gate, ts = gate_of(0.05, 3)
    gate.frame(ts[0], 100, 0.0)  # type: ignore[arg-type]
    assert gate.closed and not any(t.is_reading() for t in ts)
    gate.frame(ts[1], 100, 0.0)  # type: ignore[arg-type]  # frames already buffered: no second hold
    assert sum(t.pauses for t in ts) == 3
    await asyncio.sleep(0.15)
    assert not gate.closed and all(t.is_reading() for t in ts)


async def test_a_producer_that_joins_while_the_gate_is_closed_waits_for_the_opening() -> None:
    """The agent processes hellos as they come: on a loaded host a producer's hello can be read
    after the gate closed. Its first frame holds it too (before, it was read frame by frame
    for the whole window: one export per frame, what a loaded CI run saw)."""
    gate, (a, b) = gate_of(0.05, 2)
    gate.frame(a, 100, 0.0)  # type: ignore[arg-type]
    assert gate.closed and not a.is_reading() and not b.is_reading()
    late = FakeTransport()
    gate.join(late)  # type: ignore[arg-type]
    assert late.is_reading(), "joining holds nothing: its hello is read"
    gate.frame(late, 100, 0.01)  # type: ignore[arg-type]
    assert not late.is_reading() and gate.holds(late)  # type: ignore[arg-type]
    gate.frame(late, 100, 0.01)  # type: ignore[arg-type]  # buffered already: no second pause
    assert late.pauses == 1
    gate.open()
    assert all(t.is_reading() for t in (a, b, late))


async def test_busy_and_lone_producers_are_never_held() -> None:
    gate, (quiet, busy) = gate_of(0.05, 2)
    gate.frame(busy, QUIET_FRAME_BYTES, 0.0)  # type: ignore[arg-type]
    assert busy.is_reading() and not gate.closed
    gate.frame(quiet, 100, 0.0)  # type: ignore[arg-type]
    assert not gate.closed, "one quiet producer: nothing to coalesce, no hold"
    gate.frame(busy, 100, 1.0)  # type: ignore[arg-type]  # a window later it went quiet: two quiet producers
    assert gate.closed and not quiet.is_reading() and not busy.is_reading()
    gate.open()
    assert quiet.is_reading() and busy.is_reading()


async def test_a_backlog_of_small_frames_is_busy_not_held() -> None:
    gate, (quiet, backlog) = gate_of(0.05, 2)
    for _ in range(QUIET_FRAME_BYTES // 1000 + 1):  # small frames, but 16 KiB within one window
        gate.frame(backlog, 1000, 0.01)  # type: ignore[arg-type]
        gate.open()
    assert backlog in gate.busy
    gate.frame(quiet, 100, 0.02)  # type: ignore[arg-type]
    assert not gate.closed, "the backlogged producer is not held, and one quiet producer has nothing to join"


async def test_the_gate_resumes_only_what_it_paused() -> None:
    gate, (a, b, c) = gate_of(0.05, 3)
    c.reading = False  # its StreamReader paused it (a full buffer): that is the reader's to undo
    gate.frame(a, 100, 0.0)  # type: ignore[arg-type]
    gate.leave(b)  # type: ignore[arg-type]  # it hung up meanwhile
    gate.open()
    assert a.is_reading() and not b.is_reading() and not c.is_reading()


async def test_time_held_by_the_gate_is_not_the_peers_delay() -> None:
    """A frame timeout shorter than the window: a producer held mid-frame is not cut as slow
    while held, and is once it is read again and still has not sent its frame."""
    ingest = Ingest(Assembler("h"), Broadcaster([]), Counters(), {0}, {0}, dict, frame_timeout_s=0.02,
                    gate_s=0.2)
    a, b = FakeTransport(), FakeTransport()
    for t in (a, b):
        ingest.gate.join(t)  # type: ignore[arg-type]
    deadline = ReadDeadline(ingest.connections, a, None)  # type: ignore[arg-type]
    deadline.phase, deadline.since = ReadDeadline.FRAME, deadline.loop.time()  # a header read, its payload due
    ingest.gate.frame(b, 100, deadline.since)  # type: ignore[arg-type]
    assert ingest.gate.holds(a)
    await asyncio.sleep(0.1)
    assert not a.closing and ingest.counters.slow_peers == 0
    ingest.gate.open()
    await asyncio.sleep(0.1)
    deadline.cancel()
    assert a.closing and ingest.counters.slow_peers == 1


class CountingFileExporter(FileExporter):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.calls = 0

    async def export(self, batch: Sequence[Item]) -> None:
        self.calls += 1
        await super().export(batch)


def frame(obj: object) -> bytes:
    b = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack("!I", len(b)) + b


async def test_quiet_producers_are_read_together_and_nothing_is_lost(tmp_path: Path) -> None:
    """Eight producers send five-event frames at staggered times: every event arrives once,
    every frame is acked, and the agent exports once per window, not once per frame."""
    out = tmp_path / "o.jsonl"
    conf = cfg.load(None, env={}, flags={"agent.socket": str(tmp_path / "a.sock"),
                                         "agent.spool_dir": str(tmp_path / "spool"),
                                         "agent.health_interval_s": 3600, "agent.frame_timeout_s": 0.5})
    exporter = CountingFileExporter(str(out))
    agent = Agent(conf, [exporter], embedded=True)
    # A window far longer than the whole send loop takes even on a loaded machine: what is
    # counted is coalescing, not the machine's speed.
    agent.ingest.gate.window_s = 0.5
    await agent.start()
    loop = asyncio.get_running_loop()
    producers, frames_each, per = 8, 12, 5
    socks = []
    for p in range(producers):
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        await loop.sock_connect(s, conf["agent.socket"])
        await loop.sock_sendall(s, frame({"t": "hello", "schema": 1, "producer": {
            "id": "quiet-%d" % p, "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32,
            "root_span_id": "b" * 16}}))
        socks.append(s)
    calls_before = exporter.calls
    for k in range(frames_each):
        for p, s in enumerate(socks):
            first = k * per
            await loop.sock_sendall(s, frame({"t": "b", "e": [
                [first + j + 1, 1, "log", {"body": "x", "a": {"p": p, "i": first + j}}] for j in range(per)]}))
            await asyncio.sleep(0.003)  # each at its own time, as independent processes send
    last = b'"seq":%d}' % (frames_each * per)
    for s in socks:
        buf = b""
        while last not in buf:
            chunk = await asyncio.wait_for(loop.sock_recv(s, 65536), 30)
            assert chunk, "the agent closed the connection"
            buf += chunk
        s.close()
    exports = exporter.calls - calls_before
    await agent.shutdown(10)
    got = sorted((int(r["attributes"][0]["value"]["intValue"]), int(r["attributes"][1]["value"]["intValue"]))
                 for r in log_records(read_otlp_lines(out)) if r["attributes"] and r["attributes"][0]["key"] == "p")
    assert got == [(p, i) for p in range(producers) for i in range(frames_each * per)], "each event once"
    assert agent.counters.slow_peers == 0 and agent.counters.idle_closed == 0
    frames = producers * frames_each
    assert exports <= frames // 3, "%d exports for %d frames: quiet producers were not read together" % (
        exports, frames)


def test_the_ack_frame_is_the_encoded_ack() -> None:
    from infersight.hooks import _wire

    for seq in (0, 1, 512, 2**63 - 1):
        assert _wire.ack_frame(seq) == _wire.encode_frame({"t": "ack", "seq": seq})


async def test_an_urgent_event_is_read_at_once_while_the_gate_holds_its_producer(tmp_path: Path) -> None:
    """Issue 22.10: two quiet peers talk, the gate holds every quiet producer, and a third one
    (the real hook client) reports an OOM-like urgent event. Its doorbell opens the gate: the
    event arrives although the window is an hour long (before the fix it waited the window)."""
    from infersight.hooks._client import Client

    conf = cfg.load(None, env={}, flags={"agent.socket": str(tmp_path / "a.sock"),
                                         "agent.spool_dir": str(tmp_path / "spool"),
                                         "agent.health_interval_s": 3600})
    agent = Agent(conf, [], embedded=True)
    agent.ingest.gate.window_s = 3600.0
    seen: list[Item] = []
    agent.broadcaster.taps.append(seen.extend)
    await agent.start()
    loop = asyncio.get_running_loop()
    client = Client(conf["agent.socket"], str(tmp_path / "hook-spool"), {
        "id": "oom-reporter", "pid": os.getpid(), "start_ns": 1, "trace_id": "c" * 32, "root_span_id": "d" * 16})
    try:
        client.emit("log", {"body": "hello"})
        assert await loop.run_in_executor(None, client.flush, 20.0), "the hook client connects and is acked"
        quiet = []
        for p in range(2):
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            await loop.sock_connect(s, conf["agent.socket"])
            await loop.sock_sendall(s, frame({"t": "hello", "schema": 1, "producer": {
                "id": "quiet-%d" % p, "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32,
                "root_span_id": "b" * 16}}))
            quiet.append(s)
        deadline = time.monotonic() + 30  # both quiet producers joined the gate
        while len(agent.ingest.gate.members) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(agent.ingest.gate.members) == 3, "both quiet producers' hellos were read"
        await loop.sock_sendall(quiet[0], frame({"t": "b", "e": [[1, 1, "log", {"body": "q"}]]}))
        for _ in range(2000):
            if agent.ingest.gate.closed:
                break
            await asyncio.sleep(0.01)
        assert agent.ingest.gate.closed and len(agent.ingest.gate._held) == 3, "every quiet producer is held"

        client.emit("log", {"body": "urgent-oom"})
        client.urgent()
        for _ in range(3000):  # 30 s at most, against a window of an hour
            if any(getattr(i, "body", None) == "urgent-oom" for i in seen):
                break
            await asyncio.sleep(0.01)
        assert any(getattr(i, "body", None) == "urgent-oom" for i in seen), "the urgent event waited for the gate"
        assert agent.counters.urgent_wakeups == 1 and client.urgent_rings == 1
        for s in quiet:
            s.close()
    finally:
        client.close(2.0)
        await agent.shutdown(10)
