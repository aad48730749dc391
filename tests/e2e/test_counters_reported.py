"""Counters the agent keeps are reported: in ``status --json`` and as its own metrics."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from conftest import wait_for

from infersight.agent.daemon.broadcast import ExporterWorker
from infersight.agent.daemon.health import Counters, health_metrics
from infersight.agent.daemon.sequence import MAX_GAPS
from infersight.agent.daemon.spool import REC, DiskSpool
from infersight.agent.requests import kind as requests_kind
from infersight.agent.requests.kind import ReqEvent, RequestStats
from infersight.exporters.file import FileExporter
from infersight.hooks import _wire
from infersight.telemetry import LogItem, Resource

RES = Resource.of({"service.name": "counters"})


def metric_value(items, name: str) -> float:  # type: ignore[no-untyped-def]
    (m,) = [m for m in items if m.name == name]
    return sum(p.value for p in m.points)


def test_gaps_forgotten_reach_status_and_metrics(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(agent.sock))
        # its own pid, as a hook's: a non-root agent takes another pid only if it is a live process of this uid
        s.sendall(_wire.encode_frame({"t": "hello", "schema": 1, "producer": {
            "id": "gappy", "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}}))
        events = [[2 * i, 5, "log", {"body": "x"}] for i in range(1, MAX_GAPS + 10)]  # a gap before each
        for k in range(0, len(events), _wire.MAX_BATCH_EVENTS):  # in batches as a hook sends them
            s.sendall(_wire.encode_frame({"t": "b", "e": events[k:k + _wire.MAX_BATCH_EVENTS]}))
        assert wait_for(lambda: agent.status()["assembler"]["gaps_forgotten"] >= 9, 20)
    st = agent.status()
    assert st["lost"] >= MAX_GAPS
    assert st["requests"]["dropped_series"] == 0, "the request series counter is in status too"


def test_spool_corrupt_records_are_reported(tmp_path: Path) -> None:
    spool = DiskSpool(str(tmp_path / "spool"))
    spool.append([LogItem(RES, 1, 9, "INFO", "a")])
    spool.append([LogItem(RES, 2, 9, "INFO", "b")])
    seg = next((tmp_path / "spool").glob("*.seg"))
    data = bytearray(seg.read_bytes())
    size, _count = REC.unpack(data[: REC.size])
    data[REC.size : REC.size + size] = b"!" * size  # the first record's payload is garbage now
    seg.write_bytes(bytes(data))
    batch, records = spool.peek_many(10)
    assert records == 1 and [it.body for it in batch] == ["b"]  # type: ignore[union-attr]
    worker = ExporterWorker(FileExporter(str(tmp_path / "out")), spool)
    st = {"name": "file", **worker.state()}
    assert st["spool_corrupt_records"] == 1
    items = health_metrics(RES, 0, Counters(), 0, 0, [st], 0.0, 0)
    assert metric_value(items, "infersight.exporter.spool.corrupt") == 1


def test_requests_beyond_the_series_limit_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(requests_kind, "MAX_SERIES", 2)
    stats = RequestStats()
    for model in ("a", "b", "c", "d"):
        ev = ReqEvent("cpu", model, None, None, time.time_ns(), 0.01, None, None, None, None, None, None)
        stats.record("p", RES, ev)
    counts = {k: v for k, v in stats.stats().items() if k not in ("instances", "refused")}
    assert counts == {"requests": 4, "series": 2, "dropped_series": 2}
    assert metric_value(stats.self_metrics(RES, 0, 1), "infersight.requests.dropped") == 2


def test_assembler_counters_become_agent_metrics() -> None:
    stats = {"gaps_forgotten": 3, "pending_stages_dropped": 4, "pending_bytes": 5,
             "coldstart_roots_closed_for_lost": 6, "producers": 1}
    items = health_metrics(RES, 0, Counters(over_capacity=7, idle_closed=8, accept_errors=9), 0, 0, [], 0.0, 0, stats)
    assert metric_value(items, "infersight.events.gaps_forgotten") == 3
    assert metric_value(items, "infersight.coldstart.pending.dropped") == 4
    assert metric_value(items, "infersight.coldstart.pending.bytes") == 5
    assert metric_value(items, "infersight.coldstart.roots_closed") == 6
    assert metric_value(items, "infersight.agent.connections.closed") == 15
    assert metric_value(items, "infersight.agent.accept.errors") == 9
