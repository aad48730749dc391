"""The agent's own counters, and their export as OTel metrics (pure apart from /proc and psutil).

An extension's health metrics are its own: it publishes them on the agent's heartbeat
(``AgentContext.on_heartbeat``), after these."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from infersight.hooks import _contract
from infersight.metricspec import MetricSpec, declare
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
    spool_files_refused: int = 0  # spool files not replayed: not a regular file, or an owner not allowed (once each)
    spool_files_unreadable: int = 0  # spool files the agent may not read (made before the hooks let it; once each)
    reloads: int = 0
    reload_failures: int = 0
    over_capacity: int = 0  # connections closed at the connection limit
    over_uid_budget: int = 0  # of those, connections of a uid that held its share (a quarter) already
    # Connections closed because a large frame waited a frame timeout for its uid's (or the total) share of
    # the bytes of frames being read (frame_budget.py); each of those waits is also in frames_waited_budget.
    over_frame_budget: int = 0
    frames_waited_budget: int = 0
    # Frames that waited for their uid's share of the event loop while several uids sent (loop_share.py).
    frames_paced: int = 0
    # Frames not read while their uid's batches filled a quarter of an exporter's queue (broadcast.py).
    frames_waited_queue_share: int = 0
    idle_closed: int = 0  # producer connections closed after the idle timeout
    accept_errors: int = 0  # accept() failures (EMFILE: out of descriptors)
    refused_identity: int = 0  # hellos whose pid or producer id the kernel contradicts
    spool_files_vanished: int = 0  # producers' spool files removed by someone else (their hooks report it)
    # Producers' hook descriptors (socket, spool file) their host closed or reused (os.closerange when it
    # daemonizes): the hooks noticed, left the number to the host and reopened theirs (their hooks report it).
    producer_fds_lost: int = 0
    urgent_wakeups: int = 0  # urgent doorbells (an OOM sent): the read gate opened at once
    # Producers whose pid the agent cannot see (another pid namespace) taken as ended: their last
    # connection closed and they did not connect again within liveness.PIDLESS_GRACE_S.
    producers_lost_unseen: int = 0
    # Watches of departed producers pushed out of a full table (liveness.py): checked at once, else polled
    # each second; and those pushed out of the full poll too while their process lived (not watched any more).
    watches_polled: int = 0
    watches_dropped: int = 0
    # Events whose sequence number jumps further than a producer can (sequence.MAX_MISSING): malformed.
    seq_implausible: int = 0
    # ``drops`` reports claiming more than their producer can have dropped (receive.py): malformed.
    drops_implausible: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# The packages whose files make up the code an agent runs: one folder in a wheel's install, several in an editable
# one (pyproject's package-dir maps each to its own).
CODE_PACKAGES = ("infersight", "infersight.agent", "infersight.hooks", "infersight.exporters", "infersight.rules")


class CodePrint(NamedTuple):
    """The installed code, as found at one moment: where (the ``infersight`` package's folder), a fingerprint of its
    files (each file's path, size and mtime: a reinstall or an edit changes it; byte code is left out, Python
    writes it as it imports) and the newest file's mtime (when it was installed)."""

    path: str
    fingerprint: str
    newest_ns: int

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "fingerprint": self.fingerprint, "installed_ns": self.newest_ns}


def code_print() -> CodePrint:
    """The :class:`CodePrint` of the infersight installed where this process imports it from: a ``stat`` of each of
    its few hundred files (a few ms; the agent takes it once, at start, ``status`` once per call)."""
    roots: list[str] = []
    for name in CODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            roots += [os.path.realpath(p) for p in spec.submodule_search_locations or []]
    roots = [r for r in dict.fromkeys(roots) if not any(r.startswith(o + os.sep) for o in roots)]  # nested: once
    digest = hashlib.sha256()
    newest = 0
    for root in sorted(roots):
        for top, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith((".pyc", ".pyo")):
                    continue
                path = os.path.join(top, f)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                digest.update(b"%s\0%d\0%d\n" % (os.fsencode(path), st.st_size, st.st_mtime_ns))
                newest = max(newest, st.st_mtime_ns)
    return CodePrint(roots[0] if roots else "", digest.hexdigest()[:16], newest)


def code_predates(agent: dict[str, Any] | None, installed: CodePrint) -> str | None:
    """The warning ``status`` adds when the agent that answered runs other code than the infersight installed where
    the CLI runs from (``agent``: the ``code`` of its reply): the same install (its path) with another fingerprint;
    None when they match, differ in path (another install: not this one to judge), or the agent says nothing."""
    if not isinstance(agent, dict) or agent.get("path") != installed.path or not installed.path:
        return None
    if agent.get("fingerprint") == installed.fingerprint:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(installed.newest_ns / 1e9))
    return ("the running agent predates the installed infersight (installed %s): restart it (systemctl restart "
            "infersight)" % when)


class ProcessStats:
    """CPU seconds and RSS of the agent process: ``os.times`` and ``/proc/self/statm``
    (psutil, imported at the first sample, where there is no /proc: ~25 ms of imports that
    the agent of ``launch`` does not spend while CMD starts)."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._statm = os.path.exists("/proc/self/statm")
        self._page = os.sysconf("SC_PAGE_SIZE") if self._statm else 0

    def sample(self) -> tuple[float, int]:
        t = os.times()
        return t.user + t.system, self._rss()

    def _rss(self) -> int:
        if self._statm:
            try:
                with open("/proc/self/statm", "rb") as f:
                    return int(f.read().split()[1]) * self._page
            except (OSError, ValueError, IndexError):
                self._statm = False
        try:
            if self._proc is None:
                import psutil

                self._proc = psutil.Process(os.getpid())
            return int(self._proc.memory_info().rss)
        except Exception:
            return 0


def _attr(key: str, value: str) -> Attributes:
    return {key: value}


def _reject(reason: str) -> Attributes:
    return _attr("infersight.reject", reason)


def _counter(name: str, unit: str, description: str) -> MetricSpec:
    return MetricSpec(name, "sum", unit, description, monotonic=True)


# The agent's own metrics, declared once (NVML's health metric is the devices extension's).
SPECS = {s.name: s for s in declare(
    _counter("infersight.events.received", "{event}", "Valid events accepted from producers"),
    _counter("infersight.events.exported", "{item}", "Items handed to exporters"),
    # An up-down counter: it falls when a gap is filled late (a resend, a spool replay).
    MetricSpec("infersight.events.lost", "sum", "{event}",
               "Events missing from producers' sequence numbers (gaps), not yet recovered"),
    _counter("infersight.events.dropped", "{event}", "Events producers dropped on full buffers"),
    _counter("infersight.events.malformed", "{event}", "Events and frames rejected by validation"),
    _counter("infersight.events.duplicates", "{event}", "Resent events dropped as duplicates"),
    _counter("infersight.agent.reloads", "{reload}", "Config and rule reloads"),
    _counter("infersight.agent.connections.closed", "{connection}",
             "Connections the agent closed: at the connection limit, over a uid's share, idle producers"),
    _counter("infersight.agent.accept.errors", "{error}", "accept() failures (EMFILE: out of descriptors)"),
    _counter("infersight.agent.producers.evicted", "{producer}",
             "Producers evicted from the producer table: a uid at its share, the table full, or (protected) "
             "connected or in a cold start when nothing else could go"),
    _counter("infersight.agent.producers.refused", "{producer}",
             "Hellos refused: the uid held its share of the producer table and none of it could go"),
    _counter("process.cpu.time", "s", "Agent CPU time"),
    MetricSpec("process.memory.usage", "gauge", "By", "Agent resident memory"),
    _counter("infersight.events.gaps_forgotten", "{range}",
             "Gap ranges merged away to bound memory (a late event there counts as a duplicate)"),
    _counter("infersight.coldstart.pending.dropped", "{span}",
             "Stage spans not kept for their root's summary (per-producer byte bound, or no root came)"),
    MetricSpec("infersight.coldstart.pending.bytes", "gauge", "By", "Memory held by stage spans awaiting their root"),
    _counter("infersight.coldstart.roots_closed", "{span}",
             "Cold-start roots the agent closed for a producer that died first"),
    MetricSpec("infersight.exporter.queue.depth", "gauge", "{batch}", "Batches waiting per exporter"),
    _counter("infersight.exporter.errors", "{error}", "Failed export attempts"),
    _counter("infersight.exporter.retries", "{retry}", "Export retries"),
    _counter("infersight.exporter.dropped", "{item}", "Items an exporter dropped (full spool)"),
    _counter("infersight.exporter.exported", "{item}", "Items an exporter took: delivered, or left out by design (MQTT "
             "publishes some kinds only; its status tells delivered_items from skipped_items)"),
    _counter("infersight.exporter.rejected", "{item}",
             "Items dropped because the peer refused them (for good, or agent.exporter_max_attempts times)"),
    _counter("infersight.exporter.internal_errors", "{error}",
             "Failures of the exporter worker itself (spool I/O, exporter bugs)"),
    _counter("infersight.exporter.spool.corrupt", "{record}", "Spool records skipped as unreadable"),
)}  # fmt: skip


def health_metrics(
    resource: Resource,
    start_ns: int,
    counters: Counters,
    lost: int,
    dropped_by_producers: int,
    workers: list[dict[str, Any]],
    cpu_s: float,
    rss: int,
    assembler: dict[str, int] | None = None,
) -> list[MetricItem]:
    now = time.time_ns()

    def m(name: str, points: list[NumberPoint]) -> MetricItem:
        return SPECS[name].item(resource, now, start_ns, points)

    c = counters
    out = [
        m("infersight.events.received", [NumberPoint(c.events_in)]),
        m("infersight.events.exported", [NumberPoint(c.items_out)]),
        m("infersight.events.lost", [NumberPoint(lost)]),
        m("infersight.events.dropped", [NumberPoint(dropped_by_producers)]),
        m("infersight.events.malformed",
          [NumberPoint(c.malformed_events, _reject("event")),
           NumberPoint(c.malformed_frames, _reject("frame")),
           NumberPoint(c.oversized_frames, _reject("oversized")),
           NumberPoint(c.slow_peers, _reject("slow_peer")),
           NumberPoint(c.refused_peers, _reject("peer_uid")),
           NumberPoint(c.refused_schema, _reject("schema"))]),
        m("infersight.events.duplicates", [NumberPoint(c.duplicates)]),
        m("infersight.agent.reloads",
          [NumberPoint(c.reloads, _attr("infersight.result", "ok")),
           NumberPoint(c.reload_failures, _attr("infersight.result", "failed"))]),
        m("infersight.agent.connections.closed",
          [NumberPoint(c.over_capacity - c.over_uid_budget, _attr("infersight.reason", "over_capacity")),
           NumberPoint(c.over_uid_budget, _attr("infersight.reason", "over_uid_budget")),
           NumberPoint(c.idle_closed, _attr("infersight.reason", "idle")),
           NumberPoint(c.over_frame_budget, _attr("infersight.reason", "over_frame_budget"))]),
        m("infersight.agent.accept.errors", [NumberPoint(c.accept_errors)]),
        m("process.cpu.time", [NumberPoint(cpu_s)]),
        m("process.memory.usage", [NumberPoint(rss)]),
    ]
    if assembler is not None:
        evicted = int(assembler.get("producers_evicted", 0))
        evicted_uid = int(assembler.get("producers_evicted_uid_budget", 0))
        evicted_protected = int(assembler.get("producers_evicted_protected", 0))
        out += [
            m("infersight.events.gaps_forgotten", [NumberPoint(int(assembler.get("gaps_forgotten", 0)))]),
            m("infersight.coldstart.pending.dropped", [NumberPoint(int(assembler.get("pending_stages_dropped", 0)))]),
            m("infersight.coldstart.pending.bytes", [NumberPoint(int(assembler.get("pending_bytes", 0)))]),
            m("infersight.agent.producers.evicted",
              [NumberPoint(evicted_uid, _attr("infersight.reason", "uid_budget")),
               NumberPoint(evicted_protected, _attr("infersight.reason", "protected")),
               NumberPoint(max(0, evicted - evicted_uid - evicted_protected),
                           _attr("infersight.reason", "table_full"))]),
            m("infersight.agent.producers.refused", [NumberPoint(int(assembler.get("over_uid_producers", 0)))]),
            m("infersight.coldstart.roots_closed",
              [NumberPoint(int(assembler.get("coldstart_roots_closed_for_lost", 0)),
                           _attr(_contract.ENDED_BY, _contract.ENDED_BY_PRODUCER_LOST))]),
        ]
    for w in workers:
        attrs = _attr("infersight.exporter", str(w["name"]))
        out += [
            m("infersight.exporter.queue.depth", [NumberPoint(int(w["queue_depth"]), attrs)]),
            m("infersight.exporter.errors", [NumberPoint(int(w["export_errors"]), attrs)]),
            m("infersight.exporter.retries", [NumberPoint(int(w["retries"]), attrs)]),
            m("infersight.exporter.dropped", [NumberPoint(int(w["dropped_items"]), attrs)]),
            m("infersight.exporter.exported", [NumberPoint(int(w["exported_items"]), attrs)]),
            m("infersight.exporter.rejected", [NumberPoint(int(w.get("rejected_items", 0)), attrs)]),
            m("infersight.exporter.internal_errors", [NumberPoint(int(w.get("internal_errors", 0)), attrs)]),
            m("infersight.exporter.spool.corrupt", [NumberPoint(int(w.get("spool_corrupt_records", 0)), attrs)]),
        ]
    return out
