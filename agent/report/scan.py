"""A bounded first pass over OTLP records (pure): what ``report`` and ``show`` keep while they read.

The files are read one line at a time (``parse.iter_lines``) and each line's records are folded
into a :class:`Scan`, which keeps, whatever the size of the files:

- per cold start (a ``coldstart`` root span), a compact :class:`RootInfo` (ids, times, ready,
  the process's label), under 1 KB with its ranking;
- per span, 8 bytes (a hash of its trace and span id and its producer's uid, to count distinct
  spans), and 8 more for a ``coldstart.*`` stage (its parent's hash, to tell which process started
  a nested cold start: a process nests under another of its own user's, or under root's, never
  under another user's: ``views.adopts``);
- the metric points and log records the memory and device views use (the others are counted);
  a memory line (allocator, NVML used, NVML limit) is thinned while it is read: past
  2 x :data:`SERIES_POINTS` points, pairs of neighbours become their maximum (the first and last
  stay), as the chart keeps each dropped run's maximum;
- the OOMs the page shows: the first :data:`MAX_OOMS` in time, overall and per device, with a
  count of all of them; the first :data:`MAX_MEM_EVENTS` large allocations per device;
- the first :data:`MAX_SKIPPED` skip notes and a count of the rest.

Nothing else of a span is kept: the spans of the cold starts that are drawn are read again in a
second pass (``page.collect``), a few traces at a time.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from infersight.agent.report.gpu import (
    ALLOCATOR,
    DURATION,
    MEM_EVENTS,
    NVML_LIMIT,
    NVML_PROC,
    NVML_USED,
    dev_key,
    used_sample,
)
from infersight.agent.report.parse import HistSample, Sample, Telemetry
from infersight.agent.report.views import (
    ROOT,
    Family,
    is_oom,
    num,
    offset_ns,
    process_label,
    span_key,
    waterfalls,
)
from infersight.hooks import _contract
from infersight.telemetry import LogItem, SpanItem
from infersight.weights_files import CeilingOf

MAX_OOMS = 200  # OOMs kept overall and per device: the page lists and marks this many
MAX_MEM_EVENTS = 200  # large allocations kept per device: the page marks this many
MAX_SKIPPED = 100  # skip notes kept (the page lists 20, stderr 5); the rest are counted
SERIES_POINTS = 3000  # points of one memory line kept: twice what the chart draws (svg.MAX_POINTS)
MAX_NESTING = 16  # process nesting drawn under a family's top process (as views.waterfalls)

# Records by line: called with None for every record, or with a set of trace ids for a pass that
# needs only the spans of those traces (a file source skips the lines that hold none of them).
Source = Callable[[set[str] | None], Iterable[Telemetry]]


@dataclass(slots=True)
class RootInfo:
    """One cold start's root span, without its attributes and events."""

    trace: str
    span_id: str
    parent: str | None
    start_ns: int
    end_ns: int
    ready_s: float | None
    label: str  # "service (pid N)"
    uid: int | None = None  # its producer's (process.user.id, the kernel's word)

    @property
    def total_s(self) -> float:
        return max(self.end_ns - self.start_ns, 1) / 1e9


@dataclass(slots=True)
class ColdStartRow:
    """One family of processes (a top cold start and those started under it), in numbers."""

    top: RootInfo
    t0_ns: int
    processes: int
    flat: list[RootInfo]  # its processes, top first (depth first, as views.waterfalls)

    @property
    def traces(self) -> set[str]:
        return {r.trace for r in self.flat}


@dataclass(slots=True)
class _Line:
    """One memory line while it is read: its first point (for its attributes) and (time, value) pairs."""

    first: Sample
    points: list[tuple[int, float]]

    def add(self, t: int, v: float) -> None:
        self.points.append((t, v))
        if len(self.points) > 2 * SERIES_POINTS:
            pts = sorted(dict(self.points).items())  # one value per time: the last, as gpu.memory
            mid = pts[1:-1]
            self.points = [pts[0], *(max(mid[i:i + 2], key=lambda p: p[1]) for i in range(0, len(mid), 2)),
                           pts[-1]]

    def samples(self) -> list[Sample]:
        f = self.first
        return [Sample(f.resource, f.name, f.kind, f.unit, t, v, f.attributes) for t, v in self.points]


def _line_key(s: Sample) -> tuple[str, str, str] | None:
    """The memory line a point belongs to (as ``gpu.memory`` groups them), or None."""
    pid = str(s.resource.get("process.pid") or "?")
    if s.name in ALLOCATOR:
        return s.name, dev_key(s.attributes, "infersight.device", pid), pid
    hw = s.attributes.get("hw.id")
    if s.name in (NVML_USED, NVML_PROC, NVML_LIMIT) and isinstance(hw, str):
        return s.name, hw, str(s.attributes.get("process.pid") or s.attributes.get(
            "infersight.device.process.host_pid") or "")
    return None


@dataclass(slots=True)
class Scan:
    lines: int = 0
    skipped: list[str] = field(default_factory=list)
    skipped_more: int = 0
    span_keys: array[int] = field(default_factory=lambda: array("q"))
    stage_keys: array[int] = field(default_factory=lambda: array("q"))
    stage_parents: array[int] = field(default_factory=lambda: array("q"))
    roots: dict[tuple[str, str, int | None], RootInfo] = field(default_factory=dict)
    spans_per_trace: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)  # besides the memory lines
    lines_of_memory: dict[tuple[str, str, str], _Line] = field(default_factory=dict)
    histograms: list[HistSample] = field(default_factory=list)
    device_logs: list[LogItem] = field(default_factory=list)
    points: int = 0  # metric points, all of them
    logs: int = 0  # log records, all of them
    t0_ns: int | None = None
    t1_ns: int | None = None
    oom_seen: set[int] = field(default_factory=set)  # hashes of (time, body, pid): OOMs counted once
    oom_first: list[tuple[int, int, LogItem]] = field(default_factory=list)  # max-heap by (-time, -seq)
    oom_per_device: dict[str, list[tuple[int, int, LogItem]]] = field(default_factory=dict)
    mem_spans: list[SpanItem] = field(default_factory=list)  # spans cut down to their memory events
    mem_per_device: dict[str, int] = field(default_factory=dict)
    mem_seen: set[int] = field(default_factory=set)
    _seq: int = 0

    # -- reading -------------------------------------------------------------------------------

    def add(self, chunk: Telemetry) -> None:
        self.lines += chunk.lines
        for note in chunk.skipped:
            if len(self.skipped) < MAX_SKIPPED:
                self.skipped.append(note)
            else:
                self.skipped_more += 1
        for s in chunk.spans:
            self._span(s)
        self.points += len(chunk.samples) + len(chunk.histograms)
        for p in chunk.samples:
            self._time(p.time_ns)
            key = _line_key(p)
            if key is not None:
                line = self.lines_of_memory.get(key)
                if line is None:
                    self.lines_of_memory[key] = _Line(p, [(p.time_ns, p.value)])
                else:
                    line.add(p.time_ns, p.value)
            elif used_sample(p):
                self.samples.append(p)
        for h in chunk.histograms:
            if h.name == DURATION:
                self.histograms.append(h)
        for x in chunk.logs:
            self.logs += 1
            self._time(x.time_ns)
            if is_oom(x):
                self._oom(x)
            if x.event_name == "device" or "infersight.device.event" in x.attributes \
                    or "infersight.device.verdict" in x.attributes:
                self.device_logs.append(x)

    def _time(self, t: int) -> None:
        self.t0_ns = t if self.t0_ns is None else min(self.t0_ns, t)
        self.t1_ns = t if self.t1_ns is None else max(self.t1_ns, t)

    def _span(self, s: SpanItem) -> None:
        ident = span_key(s)
        key = hash(ident)
        self.span_keys.append(key)
        self._time(s.start_ns)
        self._time(s.end_ns)
        self.spans_per_trace[s.trace_id] = self.spans_per_trace.get(s.trace_id, 0) + 1
        if s.name == ROOT:
            if ident not in self.roots:
                ready = num(s.attributes.get(_contract.READY_S))
                self.roots[ident] = RootInfo(
                    s.trace_id, s.span_id, s.parent_span_id, s.start_ns, s.end_ns,
                    ready if offset_ns(ready) is not None else None, process_label(s), ident[2])
        elif s.name.startswith("coldstart."):
            self.stage_keys.append(key)
            # its parent of the same uid: a chain of stages stays within one user's spans
            self.stage_parents.append(hash((s.trace_id, s.parent_span_id, ident[2])) if s.parent_span_id else 0)
        mem = [e for e in s.events if e.name in MEM_EVENTS]
        if mem and key not in self.mem_seen:
            self.mem_seen.add(key)
            pid = str(s.resource.get("process.pid") or "?")
            keep = []
            for e in mem:
                k = dev_key(e.attributes, "infersight.device", pid)
                n = self.mem_per_device.get(k, 0)
                if n < MAX_MEM_EVENTS:
                    self.mem_per_device[k] = n + 1
                    keep.append(e)
            if keep:
                st = s.attributes.get(_contract.STAGE)
                self.mem_spans.append(SpanItem(s.resource, s.trace_id, s.span_id, s.parent_span_id, s.name,
                                               s.start_ns, s.end_ns, {_contract.STAGE: st} if st else {}, keep))

    def _oom(self, x: LogItem) -> None:
        key = hash((x.time_ns, x.body, x.resource.get("process.pid")))
        if key in self.oom_seen:
            return
        self.oom_seen.add(key)
        self._seq += 1
        item = (-x.time_ns, -self._seq, x)
        a = x.attributes
        # The chart an OOM is marked on: its hw.id's, else its device's in that process (gpu.memory).
        devices = {str(a.get("hw.id") or ""), "%s (pid %s)" % (a.get("infersight.oom.device") or "",
                                                              x.resource.get("process.pid") or "?")}
        for heap in (self.oom_first, *(self.oom_per_device.setdefault(d, []) for d in devices)):
            if len(heap) < MAX_OOMS:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)

    # -- results -------------------------------------------------------------------------------

    def kept_samples(self) -> list[Sample]:
        """The metric points the memory and device views read, memory lines thinned."""
        return self.samples + [p for line in self.lines_of_memory.values() for p in line.samples()]

    def span_count(self) -> int:
        """Distinct spans (a file read twice, a path and its rotation, counts once)."""
        return len(self.span_keys) - sum(repeats(self.span_keys))

    def oom_logs(self) -> list[LogItem]:
        """The OOMs kept, in file order (``views.ooms`` sorts and numbers them)."""
        kept = {id(x): (-seq, x) for heap in (self.oom_first, *self.oom_per_device.values()) for _, seq, x in heap}
        return [x for _, x in sorted(kept.values(), key=lambda v: v[0])]

    def oom_count(self) -> int:
        return len(self.oom_seen)

    def empty(self) -> bool:
        return not (self.span_keys or self.points or self.logs)

    def _stage_parents(self, wanted: set[int]) -> dict[int, int]:
        """The parent hash (0: none) of each ``coldstart.*`` stage whose hash is in ``wanted``: one
        look through the stages' arrays, no copy of them (the first of repeated stages counts)."""
        found: dict[int, int] = {}
        if wanted:
            for key, parent in zip(self.stage_keys, self.stage_parents, strict=True):
                if key in wanted and key not in found:
                    found[key] = parent
        return found

    def families(self) -> list[ColdStartRow]:
        """The cold starts as ``views.waterfalls`` groups them, oldest top process first, from the
        compact roots alone: a root whose parent span is another root, or a stage under one (the
        same trace), nests under that root's process when it adopts it (``views.adopts``: the
        same user's, else root's)."""
        roots = sorted(self.roots.values(), key=lambda r: r.start_ns)
        owner = self._owners(roots)
        children: dict[int, list[RootInfo]] = {}
        tops: list[RootInfo] = []
        for r in roots:
            parent = owner.get(id(r))
            if parent is None or parent is r or self._is_under(parent, r, owner):
                tops.append(r)
            else:
                children.setdefault(id(parent), []).append(r)
        out: list[ColdStartRow] = []
        for top in tops:
            flat: list[RootInfo] = []
            todo = [(top, 0)]
            while todo:
                r, depth = todo.pop()
                flat.append(r)
                if depth < MAX_NESTING:
                    todo.extend((c, depth + 1) for c in reversed(children.get(id(r), [])))
            out.append(ColdStartRow(top, min(r.start_ns for r in flat), len(flat), flat))
        return out

    def _owners(self, roots: list[RootInfo]) -> dict[int, RootInfo]:
        """id(root) -> the root whose process its parent span belongs to: the parent span is that
        root, or a stage whose chain of ``coldstart.*`` parents reaches it, all of one user's (as
        ``views`` draws a root's stages): the root's own user's first, else root's (uid 0)."""
        owner = self._walk(roots, {id(r): hash((r.trace, r.parent, r.uid)) for r in roots if r.parent})
        rest = {id(r): hash((r.trace, r.parent, 0)) for r in roots if r.parent and r.uid != 0 and id(r) not in owner}
        owner.update(self._walk(roots, rest))
        return owner

    def _walk(self, roots: list[RootInfo], at: dict[int, int]) -> dict[int, RootInfo]:
        """id(root) -> the root each walk (``at``: id(root) -> where it starts) reaches up its chain
        of stages. The chains are walked up one level per look through the stages, for every root at
        once."""
        by_key = {hash((r.trace, r.span_id, r.uid)): r for r in roots}
        owner: dict[int, RootInfo] = {}
        seen: dict[int, set[int]] = {}
        while at:
            for rid, key in list(at.items()):
                hit = by_key.get(key)
                if hit is not None:
                    owner[rid] = hit
                    del at[rid]
            parents = self._stage_parents(set(at.values()))
            for rid, key in list(at.items()):
                parent = parents.get(key, 0)
                if not parent or parent in seen.setdefault(rid, set()):
                    del at[rid]  # not a stage (or the chain ends, or it loops): no owner
                    continue
                seen[rid].add(key)
                at[rid] = parent
        return owner

    @staticmethod
    def _is_under(parent: RootInfo, r: RootInfo, owner: dict[int, RootInfo]) -> bool:
        """True if ``parent`` already descends from ``r`` (a cycle in bad data)."""
        cur = parent
        for _ in range(64):
            if cur is r:
                return True
            nxt = owner.get(id(cur))
            if nxt is None or nxt is cur:
                return False
            cur = nxt
        return True


def repeats(keys: array[int], buckets: int = 16) -> bytearray:
    """1 for each key equal to an earlier one. The keys are looked at a sixteenth at a time (by
    their low bits), so the set that finds repeats holds a sixteenth of them."""
    out = bytearray(len(keys))
    for b in range(buckets):
        seen: set[int] = set()
        for i, k in enumerate(keys):
            if k % buckets == b:
                if k in seen:
                    out[i] = 1
                else:
                    seen.add(k)
    return out


def slowest_first(rows: list[ColdStartRow]) -> list[ColdStartRow]:
    return sorted(rows, key=lambda f: (-f.top.total_s, f.t0_ns))


def memory_source(t: Telemetry) -> Source:
    """Records already in memory, as a source (tests and callers that parsed the lines)."""
    return lambda _traces: (t,)


def collect(source: Source, rows: list[ColdStartRow], ceiling_of: CeilingOf | None = None) -> list[Family]:
    """The waterfalls of ``rows``, oldest first: a second pass that keeps the spans of their traces only.
    ``ceiling_of`` fills in a cold weights file's missing ceiling ratio (``views.waterfalls``)."""
    if not rows:
        return []
    traces = set().union(*(r.traces for r in rows))
    spans = [s for chunk in source(traces) for s in chunk.spans if s.trace_id in traces]
    tops = {(r.top.trace, r.top.span_id, r.top.uid) for r in rows}
    return [f for f in waterfalls(spans, ceiling_of) if span_key(f.processes[0].root) in tops]


def batches(sc: Scan, rows: list[ColdStartRow], max_spans: int) -> Iterator[list[ColdStartRow]]:
    """``rows`` in order, cut into runs whose traces hold about ``max_spans`` spans (one pass each)."""
    batch: list[ColdStartRow] = []
    traces: set[str] = set()
    spans = 0
    for row in rows:
        new = row.traces - traces
        more = sum(sc.spans_per_trace.get(t, 0) for t in new)
        if batch and spans + more > max_spans:
            yield batch
            batch, traces, spans = [], set(), 0
            new, more = row.traces, sum(sc.spans_per_trace.get(t, 0) for t in row.traces)
        batch.append(row)
        traces |= new
        spans += more
    if batch:
        yield batch
