"""Backpressure instead of spilling: a healthy but slow exporter makes the agent stop reading
from producers (their events wait in the hooks, unacked) rather than spill to disk; only an
unreachable destination spills. Spilled records come back sharing one Resource."""

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
from infersight.agent.daemon.broadcast import Broadcaster, ExporterWorker
from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.daemon.spool import DiskSpool
from infersight.exporters.file import FileExporter
from infersight.exporters.otlp_json import encode_lines
from infersight.telemetry import Item, LogItem, Origin, Resource

RES = Resource.of({"service.name": "t", "process.pid": 7})


class SlowFileExporter(FileExporter):
    """The real file exporter behind a slow link: each batch takes ``delay_s`` (healthy, never fails)."""

    def __init__(self, path: str, delay_s: float) -> None:
        super().__init__(path)
        self.delay_s = delay_s
        self.max_queue_seen = 0
        self.worker: ExporterWorker | None = None

    async def export(self, batch: Sequence[Item]) -> None:
        if self.worker is not None:
            self.max_queue_seen = max(self.max_queue_seen, self.worker.queue_items)
        await asyncio.sleep(self.delay_s)
        await super().export(batch)


def logs(first: int, n: int) -> list[Item]:
    return [LogItem(RES, 1, 9, "INFO", "x", {"i": i}, origin=Origin("p", i + 1)) for i in range(first, first + n)]


async def test_a_full_queue_with_a_healthy_exporter_pushes_back_and_spills_nothing(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    exporter = SlowFileExporter(str(out), 0.01)
    await exporter.start()
    worker = ExporterWorker(exporter, DiskSpool(str(tmp_path / "spool")), queue_max_items=1000, max_batch_items=300)
    exporter.worker = worker
    broadcaster = Broadcaster([worker])
    worker.start()
    done = 0

    def one() -> None:
        nonlocal done
        done += 1

    congested_seen = False
    for b in range(40):  # a producer loop that honours the push-back, as the ingest does
        if broadcaster.congested:
            congested_seen = True
            await broadcaster.wait_ready()
        broadcaster.publish(logs(b * 100, 100), one)
    assert await worker.drain(30)
    await exporter.shutdown()
    assert congested_seen and worker.pushbacks > 0, "the queue filled: the test exercises push-back"
    assert worker.spilled_items == 0 and worker.dropped_items == 0, "healthy exporter: nothing spilled"
    assert done == 40
    got = [int(r["attributes"][0]["value"]["intValue"]) for r in log_records(read_otlp_lines(out))]
    assert got == list(range(4000)), "every item once, in order"
    assert exporter.max_queue_seen <= 1000 + 100, "the queue stays within its bound (plus one batch)"


async def test_an_unreachable_exporter_still_spills_when_full(tmp_path: Path) -> None:
    exporter = FileExporter("/dev/full")  # every write fails with ENOSPC: the destination is away
    await exporter.start()
    worker = ExporterWorker(exporter, DiskSpool(str(tmp_path / "spool")), queue_max_items=500, max_batch_items=100)
    broadcaster = Broadcaster([worker])
    worker.start()
    for b in range(20):
        broadcaster.publish(logs(b * 100, 100))
        await asyncio.sleep(0)
    deadline = time.monotonic() + 30  # the worker's tries and spills, late on a loaded machine
    while worker.queue and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not broadcaster.congested, "an unreachable exporter does not hold producers back"
    assert worker.spilled_items == 2000 - worker.exported_items and worker.spilled_items > 0
    await worker.drain(0.5)


def frame(obj: object) -> bytes:
    b = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack("!I", len(b)) + b


async def test_the_agent_stops_reading_from_producers_instead_of_spilling(tmp_path: Path) -> None:
    """Through the real socket: a burst far bigger than the exporter's queue arrives whole,
    without touching the exporter's disk spool, and the producer's acks lag behind."""
    out = tmp_path / "o.jsonl"
    conf = cfg.load(None, env={}, flags={"agent.socket": str(tmp_path / "a.sock"),
                                         "agent.spool_dir": str(tmp_path / "spool"),
                                         "agent.health_interval_s": 3600, "agent.frame_timeout_s": 0.2})
    exporter = SlowFileExporter(str(out), 0.3)  # each hold outlasts the frame timeout
    agent = Agent(conf, [exporter], embedded=True)
    worker = agent.workers[0]
    worker.queue_max_items = 2000
    exporter.worker = worker
    await agent.start()
    n, per = 20_000, 500
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    await loop.sock_connect(s, conf["agent.socket"])
    await loop.sock_sendall(s, frame({"t": "hello", "schema": 1, "producer": {
        "id": "burst", "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}}))
    for i in range(0, n, per):
        await loop.sock_sendall(s, frame({"t": "b", "e": [[j + 1, 1, "log", {"body": "x", "a": {"i": j}}]
                                                          for j in range(i, i + per)]}))
    buf = b""
    while b'"seq":%d}' % n not in buf:
        chunk = await asyncio.wait_for(loop.sock_recv(s, 65536), 60)
        assert chunk, "the agent closed the connection"
        buf += chunk
    s.close()
    await agent.shutdown(30)
    assert worker.pushbacks > 0, "the burst filled the queue: push-back was exercised"
    assert agent.counters.slow_peers == 0, "a connection held back by the agent is not a slow peer"
    assert worker.spilled_items == 0, "a reachable exporter is never spilled to"
    assert exporter.max_queue_seen <= 2000 + per, "the agent stopped reading while the queue was full"
    got = sorted(int(r["attributes"][0]["value"]["intValue"]) for r in log_records(read_otlp_lines(out))
                 if r["attributes"] and r["attributes"][0]["key"] == "i")
    assert got == list(range(n)), "nothing lost, nothing duplicated"


def test_spilled_records_come_back_sharing_one_resource(tmp_path: Path) -> None:
    spool = DiskSpool(str(tmp_path / "spool"))
    other = Resource.of({"service.name": "u", "process.pid": 8})
    for b in range(10):
        spool.append(logs(b * 50, 50))
        spool.append([LogItem(other, 1, 9, "INFO", "y", {}, origin=Origin("q", b + 1))])
    items, _records = spool.peek_many(10_000)
    assert len(items) == 510
    by_value: dict[Resource, set[int]] = {}
    for it in items:
        by_value.setdefault(it.resource, set()).add(id(it.resource))
    assert {len(ids) for ids in by_value.values()} == {1}, "one Resource object per distinct attribute set"
    lines = encode_lines(items)
    assert len(lines) == 1 and json.loads(lines[0])["resourceLogs"].__len__() == 2


def test_the_encoder_writes_equal_resources_once_even_as_distinct_objects() -> None:
    a = [LogItem(Resource.of({"service.name": "t", "process.pid": 7}), 1, 9, "INFO", "x", {"i": i}) for i in range(20)]
    doc = json.loads(encode_lines(a)[0])
    assert len(doc["resourceLogs"]) == 1
    assert len(doc["resourceLogs"][0]["scopeLogs"][0]["logRecords"]) == 20


async def test_a_batch_in_flight_at_the_drain_deadline_is_spooled_not_lost(tmp_path: Path) -> None:
    """drain() cancels a worker whose export outlives its deadline (a down collector's SDK retries: 10 s
    by default, as long as the agent's whole shutdown): the batch was marked done, neither spooled nor
    counted, and with the sequence state carried across a restart its producer's resend is a duplicate
    there. It goes to the spool now."""
    exporter = SlowFileExporter(str(tmp_path / "o.jsonl"), 3600.0)  # an export that never ends in time
    await exporter.start()
    spool = DiskSpool(str(tmp_path / "spool"))
    worker = ExporterWorker(exporter, spool)
    broadcaster = Broadcaster([worker])
    worker.start()
    broadcaster.publish(logs(0, 3))
    await asyncio.sleep(0.05)  # taken from the queue: in flight
    assert not worker.queue
    assert await worker.drain(0.1) is False
    assert spool.items == 3 and worker.dropped_items == 0
