"""The agent's own counters, and their export as OTel metrics (pure apart from psutil)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from infersight.hooks import _contract
from infersight.telemetry import Attributes, MetricItem, NumberPoint, Resource


@dataclass(slots=True)
class Counters:
    connections: int = 0
    events_in: int = 0  # valid events accepted from producers
    items_out: int = 0  # items handed to the exporters
    malformed_events: int = 0
    malformed_frames: int = 0
    oversized_frames: int = 0
    slow_peers: int = 0
    refused_peers: int = 0
    refused_schema: int = 0
    duplicates: int = 0
    spool_files_replayed: int = 0
    spool_files_refused: int = 0
    reloads: int = 0
    reload_failures: int = 0
    over_capacity: int = 0  # connections closed at the connection limit
    over_uid_budget: int = 0  # of those, connections of a uid that held its share (a quarter) already
    idle_closed: int = 0  # producer connections closed after the idle timeout
    accept_errors: int = 0  # accept() failures (EMFILE: out of descriptors)
    refused_identity: int = 0  # hellos whose pid or producer id the kernel contradicts
    spool_files_vanished: int = 0  # producers' spool files removed by someone else (their hooks report it)
    urgent_wakeups: int = 0  # urgent doorbells (an OOM sent): the read gate opened at once

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ProcessStats:
    """CPU seconds and RSS of the agent process (psutil when present)."""

    def __init__(self) -> None:
        try:
            import psutil

            self._proc: Any = psutil.Process(os.getpid())
        except Exception:
            self._proc = None

    def sample(self) -> tuple[float, int]:
        if self._proc is not None:
            try:
                t = self._proc.cpu_times()
                return float(t.user + t.system), int(self._proc.memory_info().rss)
            except Exception:
                pass
        t2 = os.times()
        return t2.user + t2.system, 0


def _attr(key: str, value: str) -> Attributes:
    return {key: value}


def _reject(reason: str) -> Attributes:
    return _attr("infersight.reject", reason)


def health_metrics(
    resource: Resource,
    start_ns: int,
    counters: Counters,
    lost: int,
    dropped_by_producers: int,
    workers: list[dict[str, Any]],
    cpu_s: float,
    rss: int,
    nvml_reason: str | None = None,
    assembler: dict[str, int] | None = None,
) -> list[MetricItem]:
    now = time.time_ns()

    def m(name: str, kind: str, unit: str, desc: str, points: list[NumberPoint], monotonic: bool = True) -> MetricItem:
        return MetricItem(resource, name, kind, unit, desc, now, start_ns, points, monotonic)  # type: ignore[arg-type]

    c = counters
    out = [
        m("infersight.events.received", "sum", "{event}", "Valid events accepted from producers",
          [NumberPoint(c.events_in)]),
        m("infersight.events.exported", "sum", "{item}", "Items handed to exporters",
          [NumberPoint(c.items_out)]),
        # An up-down counter: it falls when a gap is filled late (a resend, a spool replay).
        m("infersight.events.lost", "sum", "{event}",
          "Events missing from producers' sequence numbers (gaps), not yet recovered",
          [NumberPoint(lost)], monotonic=False),
        m("infersight.events.dropped", "sum", "{event}", "Events producers dropped on full buffers",
          [NumberPoint(dropped_by_producers)]),
        m("infersight.events.malformed", "sum", "{event}", "Events and frames rejected by validation",
          [NumberPoint(c.malformed_events, _reject("event")),
           NumberPoint(c.malformed_frames, _reject("frame")),
           NumberPoint(c.oversized_frames, _reject("oversized")),
           NumberPoint(c.slow_peers, _reject("slow_peer")),
           NumberPoint(c.refused_peers, _reject("peer_uid")),
           NumberPoint(c.refused_schema, _reject("schema"))]),
        m("infersight.events.duplicates", "sum", "{event}", "Resent events dropped as duplicates",
          [NumberPoint(c.duplicates)]),
        m("infersight.agent.reloads", "sum", "{reload}", "Config and rule reloads",
          [NumberPoint(c.reloads, _attr("infersight.result", "ok")),
           NumberPoint(c.reload_failures, _attr("infersight.result", "failed"))]),
        m("infersight.agent.connections.closed", "sum", "{connection}",
          "Connections the agent closed: at the connection limit, over a uid's share, idle producers",
          [NumberPoint(c.over_capacity - c.over_uid_budget, _attr("infersight.reason", "over_capacity")),
           NumberPoint(c.over_uid_budget, _attr("infersight.reason", "over_uid_budget")),
           NumberPoint(c.idle_closed, _attr("infersight.reason", "idle"))]),
        m("infersight.agent.accept.errors", "sum", "{error}", "accept() failures (EMFILE: out of descriptors)",
          [NumberPoint(c.accept_errors)]),
        m("process.cpu.time", "sum", "s", "Agent CPU time", [NumberPoint(cpu_s)]),
        m("process.memory.usage", "gauge", "By", "Agent resident memory", [NumberPoint(rss)]),
    ]
    if assembler is not None:
        out += [
            m("infersight.events.gaps_forgotten", "sum", "{range}",
              "Gap ranges merged away to bound memory (a late event there counts as a duplicate)",
              [NumberPoint(int(assembler.get("gaps_forgotten", 0)))]),
            m("infersight.coldstart.pending.dropped", "sum", "{span}",
              "Stage spans not kept for their root's summary (per-producer byte bound, or no root came)",
              [NumberPoint(int(assembler.get("pending_stages_dropped", 0)))]),
            m("infersight.coldstart.pending.bytes", "gauge", "By", "Memory held by stage spans awaiting their root",
              [NumberPoint(int(assembler.get("pending_bytes", 0)))]),
            m("infersight.coldstart.roots_closed", "sum", "{span}",
              "Cold-start roots the agent closed for a producer that died first",
              [NumberPoint(int(assembler.get("coldstart_roots_closed_for_lost", 0)),
                           _attr(_contract.ENDED_BY, _contract.ENDED_BY_PRODUCER_LOST))]),
        ]
    for w in workers:
        attrs = _attr("infersight.exporter", str(w["name"]))
        out += [
            m("infersight.exporter.queue.depth", "gauge", "{batch}", "Batches waiting per exporter",
              [NumberPoint(int(w["queue_depth"]), attrs)]),
            m("infersight.exporter.errors", "sum", "{error}", "Failed export attempts",
              [NumberPoint(int(w["export_errors"]), attrs)]),
            m("infersight.exporter.retries", "sum", "{retry}", "Export retries",
              [NumberPoint(int(w["retries"]), attrs)]),
            m("infersight.exporter.dropped", "sum", "{item}", "Items an exporter dropped (full spool)",
              [NumberPoint(int(w["dropped_items"]), attrs)]),
            m("infersight.exporter.exported", "sum", "{item}", "Items an exporter delivered",
              [NumberPoint(int(w["exported_items"]), attrs)]),
            m("infersight.exporter.rejected", "sum", "{item}",
              "Items dropped because the peer refused them (for good, or agent.exporter_max_attempts times)",
              [NumberPoint(int(w.get("rejected_items", 0)), attrs)]),
            m("infersight.exporter.internal_errors", "sum", "{error}",
              "Failures of the exporter worker itself (spool I/O, exporter bugs)",
              [NumberPoint(int(w.get("internal_errors", 0)), attrs)]),
            m("infersight.exporter.spool.corrupt", "sum", "{record}", "Spool records skipped as unreadable",
              [NumberPoint(int(w.get("spool_corrupt_records", 0)), attrs)]),
        ]
    if nvml_reason is not None:
        out.append(
            m("infersight.nvml.available", "gauge", "1", "1 when NVML answers; reason when not",
              [NumberPoint(0, _attr("infersight.nvml.reason", nvml_reason))])
        )
    return out
