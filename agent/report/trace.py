"""Telemetry -> Chrome trace-event JSON and the waterfall as JSON (pure), for ``infersight show``.

Chrome trace (Perfetto UI, ``chrome://tracing``): one ``ph:"X"`` complete event per span in
microseconds since the earliest record, ``pid`` = the process's ``process.pid``, ``tid`` = the
span's ``thread.id`` when recorded, else the process's lane (``tid == pid`` for the main lane;
spans that overlap without nesting go to extra lanes, because the format needs each thread's
events to nest). ``process_name`` metadata names each process; instant events mark readiness,
first response, the launcher's probe, OOMs and span events.
"""

from __future__ import annotations

import heapq
import json
import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from infersight.agent.report.scan import Scan, Source, batches, collect, repeats
from infersight.agent.report.views import Family, is_oom, process_label, stage_name, weights_note
from infersight.coldstart_stages import workers_counts
from infersight.telemetry import AttrValue, LogItem, SpanItem

LANE_TID_BASE = 1 << 30  # extra lanes: above any real Linux tid (pid_max <= 2^22)
SYNTHETIC_PID_BASE = 1 << 22  # processes without process.pid: above any real pid (PID_MAX_LIMIT), within int32


class _Pids:
    """process.pid where it is one (0 to Linux's PID_MAX_LIMIT); a stable synthetic id per resource
    otherwise (a file's pid of 2**63 would not fit the trace's 64-bit arrays, nor Chrome's int32)."""

    def __init__(self) -> None:
        self.synthetic: dict[str, int] = {}

    def of(self, x: Any) -> int:
        pid = x.resource.get("process.pid")
        if isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < SYNTHETIC_PID_BASE:
            return pid
        key = str(x.resource.get("service.instance.id") or x.resource.attributes)
        return self.synthetic.setdefault(key, SYNTHETIC_PID_BASE + len(self.synthetic))


def _lanes(spans: list[SpanItem]) -> dict[str, int]:
    """Lane per span id, so that every lane's spans nest properly. O(N log N) (:func:`lane_numbers`)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start_ns, -spans[i].end_ns))
    return {spans[i].span_id: lane for i, lane in zip(order, lane_numbers(
        [spans[i].start_ns for i in order], [spans[i].end_ns for i in order]), strict=True)}


def lane_numbers(starts: Sequence[int], ends: Sequence[int]) -> Iterator[int]:
    """The lane of each span, given in start order (ties: the longer first), so that every
    lane's spans nest properly. O(N log N).

    Each lane is a stack of the end times of its open spans (nested, so the innermost ends
    first). Spans go in start order; a span joins lane 0 if it nests there, else the lane of
    the span placed before it if it nests there, else the lowest lane with nothing open, else
    a new lane. A heap of lane tops closes ended spans once each, and a heap of free lanes
    gives the lowest one, so no span looks at every lane (20k spans that all overlap made that
    quadratic)."""
    stacks: list[list[int]] = []
    tops: list[tuple[int, int]] = []  # (end of a lane's top span, lane): may hold stale entries
    free: list[int] = []  # lanes with nothing open
    last = 0

    def close_until(t: int) -> None:
        while tops and tops[0][0] <= t:
            end, lane = heapq.heappop(tops)
            st = stacks[lane]
            if not st or st[-1] != end:
                continue  # stale: that top was closed already, or a newer span sits on it
            while st and st[-1] <= t:
                st.pop()
            if st:
                heapq.heappush(tops, (st[-1], lane))
            else:
                heapq.heappush(free, lane)

    def fits(lane: int, end: int) -> bool:
        st = stacks[lane]
        return not st or end <= st[-1]

    for start, end in zip(starts, ends, strict=True):
        close_until(start)
        if stacks and fits(0, end):
            lane = 0
        elif stacks and fits(last, end):
            lane = last
        else:
            while free and stacks[free[0]]:
                heapq.heappop(free)  # taken meanwhile by nesting (lane 0 or ``last``)
            if free:
                lane = heapq.heappop(free)
            else:
                stacks.append([])
                lane = len(stacks) - 1
        stacks[lane].append(end)
        heapq.heappush(tops, (end, lane))
        last = lane
        yield lane


def _clean(v: Any) -> Any:
    """JSON that JSON.parse accepts: NaN and infinities become strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def _args(attrs: dict[str, AttrValue], **extra: Any) -> dict[str, Any]:
    a: dict[str, Any] = {k: _clean(v) for k, v in attrs.items()}
    a.update({k: v for k, v in extra.items() if v is not None})
    return a


def _thread_id(s: SpanItem) -> int | None:
    tid = s.attributes.get("thread.id")
    return tid if isinstance(tid, int) and not isinstance(tid, bool) else None


@dataclass(slots=True)
class TracePlan:
    """What a first pass over the records learns for the Chrome trace: per span 37 bytes (its pid,
    times, lane and whether it repeats an earlier one), per process its name, the OOM logs, and
    the cold starts (``report.scan``) for their marks."""

    scan: Scan
    pids: _Pids
    names: dict[int, str]
    t0: int
    spans: int
    dup: bytearray  # 1 for a span that repeats an earlier (trace, span id): not written twice
    lanes: array[int]
    used: dict[int, set[int]]  # pid -> lanes used
    oom_logs: list[LogItem]

    def empty(self) -> bool:
        return not (self.spans or self.oom_logs)


def plan_trace(source: Source) -> TracePlan:
    sc, pids = Scan(), _Pids()
    names: dict[int, str] = {}
    pid_of, starts, ends = array("q"), array("q"), array("q")
    threaded = bytearray()
    oom_logs: list[LogItem] = []
    for chunk in source(None):
        sc.add(chunk)
        for s in chunk.spans:
            pid = pids.of(s)
            pid_of.append(pid)
            starts.append(s.start_ns)
            ends.append(s.end_ns)
            threaded.append(_thread_id(s) is not None)
            if s.name == "coldstart" or pid not in names:
                names[pid] = process_label(s)
        oom_logs += (x for x in chunk.logs if is_oom(x))
    n = len(pid_of)
    dup = repeats(sc.span_keys)
    times = [min(starts)] if n else []
    times += [x.time_ns for x in oom_logs]
    lanes = array("i", bytes(4 * n))
    used: dict[int, set[int]] = {}
    by_pid: dict[int, array[int]] = {}
    for i in range(n):
        if not dup[i]:
            used.setdefault(pid_of[i], set())
            if not threaded[i]:
                by_pid.setdefault(pid_of[i], array("q")).append(i)
    for pid, idx in by_pid.items():
        ordered = sorted(idx, key=ends.__getitem__, reverse=True)  # ties in start: the longer first
        ordered.sort(key=starts.__getitem__)
        for i, lane in zip(ordered, lane_numbers([starts[i] for i in ordered], [ends[i] for i in ordered]),
                           strict=True):
            lanes[i] = lane
            used[pid].add(lane)
    return TracePlan(sc, pids, names, min(times) if times else 0, n, dup, lanes, used, oom_logs)


def chrome_events(source: Source, plan: TracePlan, batch_spans: int = 20_000) -> Iterator[dict[str, Any]]:
    """The trace's events, one at a time: a span's as it is read again, then each process's
    names, the cold starts' marks (a batch of cold starts per pass) and the OOMs."""
    t0, pids, names = plan.t0, plan.pids, dict(plan.names)

    def us(ns: int) -> float:
        return round((ns - t0) / 1e3, 3)

    i = -1
    for chunk in source(None):
        for s in chunk.spans:
            i += 1
            if i >= plan.spans or plan.dup[i]:
                continue  # a repeat; or a file that grew between the passes
            pid = pids.of(s)
            tid = _thread_id(s)
            if tid is None:
                tid = pid if plan.lanes[i] == 0 else LANE_TID_BASE + plan.lanes[i]
            yield {
                "name": s.name, "cat": "coldstart" if s.name.startswith("coldstart") else "span", "ph": "X",
                "ts": us(s.start_ns), "dur": round((s.end_ns - s.start_ns) / 1e3, 3), "pid": pid, "tid": tid,
                "args": _args(s.attributes, span_id=s.span_id, parent_span_id=s.parent_span_id,
                              trace_id=s.trace_id, error=s.error),
            }
            for e in s.events:
                if e.name == "infersight.oom" and plan.oom_logs:
                    continue  # the OOM log below carries the same verdict
                yield {"name": e.name, "cat": "event", "ph": "i", "s": "t", "ts": us(e.time_ns),
                       "pid": pid, "tid": tid, "args": _args(e.attributes, span_id=s.span_id)}
    for pid, used in sorted(plan.used.items()):
        yield {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": names[pid]}}
        yield from ({"name": "thread_name", "ph": "M", "pid": pid, "tid": pid if lane == 0 else LANE_TID_BASE + lane,
                     "args": {"name": "stages" if lane == 0 else "stages (lane %d)" % lane}} for lane in sorted(used))
    for batch in batches(plan.scan, plan.scan.families(), batch_spans):
        for fam in collect(source, batch):
            for wf in fam.processes:
                pid = pids.of(wf.root)
                yield from ({"name": m.label, "cat": "coldstart", "ph": "i", "s": "p", "ts": us(m.t_ns),
                             "pid": pid, "tid": pid, "args": {"detail": m.title}} for m in wf.marks)
    for x in plan.oom_logs:
        pid = pids.of(x)
        yield {"name": "OOM: %s" % x.attributes.get("infersight.oom.class", "unknown"), "cat": "oom",
               "ph": "i", "s": "p", "ts": us(x.time_ns), "pid": pid, "tid": pid,
               "args": _args(x.attributes, body=x.body)}
        if pid not in names:
            names[pid] = process_label(x)
            yield {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": names[pid]}}


def write_chrome_trace(source: Source, plan: TracePlan, out: TextIO) -> None:
    """The Chrome trace (``traceEvents`` and its metadata) as JSON text, one event at a time."""
    out.write('{"traceEvents": [')
    for n, ev in enumerate(chrome_events(source, plan)):
        out.write((", " if n else "") + dumps(ev))
    out.write('], "displayTimeUnit": "ms", "otherData": %s}' % dumps({"generator": "infersight",
                                                                       "t0_unix_ns": plan.t0}))


def waterfall_json(families: list[Family]) -> dict[str, Any]:
    """The cold starts as the report draws them, for scripts."""
    out: list[dict[str, Any]] = []
    for fam in families:
        for wf in fam.processes:
            r = wf.root
            total = max(r.end_ns - r.start_ns, 1)
            sm = wf.summary
            out.append({
                "service": r.resource.get("service.name"), "pid": r.resource.get("process.pid"),
                "trace_id": r.trace_id, "span_id": r.span_id, "parent_span_id": r.parent_span_id,
                "nested_depth": wf.depth, "parent": wf.parent, "helper": wf.helper,
                "foreign_spans_left_out": wf.foreign,
                "start_unix_ns": r.start_ns, "total_s": sm.total_s, "ready_s": sm.ready_s,
                "unattributed_s": sm.unattributed_s, "unattributed_share": sm.unattributed_share,
                "biggest": [{"stage": n, "duration_s": d} for n, d in sm.biggest],
                "weights_files": sm.weights_files,
                # a supervisor's workers that reported, and those of them ever ready (null: not recorded)
                "workers_reported": workers_counts(r)[0], "workers_ready": workers_counts(r)[1],
                "marks": [{"label": m.label, "at_s": (m.t_ns - r.start_ns) / 1e9, "detail": m.title} for m in wf.marks],
                "gaps": [{"start_s": (a - r.start_ns) / 1e9, "duration_s": (b - a) / 1e9} for a, b in wf.gaps],
                "stages": [{
                    "stage": stage_name(row.span), "name": row.span.name, "kind": row.kind, "depth": row.depth,
                    "span_id": row.span.span_id, "parent_span_id": row.span.parent_span_id,
                    "start_s": (row.span.start_ns - r.start_ns) / 1e9,
                    "duration_s": (row.span.end_ns - row.span.start_ns) / 1e9,
                    "share": (row.span.end_ns - row.span.start_ns) / total,
                    "weights": weights_note(row.span) or None,
                    "attributes": _args(row.span.attributes),
                } for row in wf.rows[1:]],
            })
    return {"coldstarts": out}


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=False, allow_nan=False, default=str)

