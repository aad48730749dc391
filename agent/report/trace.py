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
from typing import Any

from infersight.agent.report.parse import Telemetry
from infersight.agent.report.views import (
    Family,
    dedupe_spans,
    is_oom,
    process_label,
    stage_name,
    waterfalls,
    weights_note,
)
from infersight.telemetry import AttrValue, SpanItem

LANE_TID_BASE = 1 << 30  # extra lanes: above any real Linux tid (pid_max <= 2^22)
SYNTHETIC_PID_BASE = 1 << 22  # processes without process.pid: above any real pid, within int32


class _Pids:
    """process.pid where known; a stable synthetic id per resource otherwise."""

    def __init__(self) -> None:
        self.synthetic: dict[str, int] = {}

    def of(self, x: Any) -> int:
        pid = x.resource.get("process.pid")
        if isinstance(pid, int) and not isinstance(pid, bool):
            return pid
        key = str(x.resource.get("service.instance.id") or x.resource.attributes)
        return self.synthetic.setdefault(key, SYNTHETIC_PID_BASE + len(self.synthetic))


def _lanes(spans: list[SpanItem]) -> dict[str, int]:
    """Lane per span id, so that every lane's spans nest properly. O(N log N).

    Each lane is a stack of the end times of its open spans (nested, so the innermost ends
    first). Spans go in start order; a span joins lane 0 if it nests there, else the lane of
    the span placed before it if it nests there, else the lowest lane with nothing open, else
    a new lane. A heap of lane tops closes ended spans once each, and a heap of free lanes
    gives the lowest one, so no span looks at every lane (20k spans that all overlap made that
    quadratic)."""
    stacks: list[list[int]] = []
    tops: list[tuple[int, int]] = []  # (end of a lane's top span, lane): may hold stale entries
    free: list[int] = []  # lanes with nothing open
    out: dict[str, int] = {}
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

    for s in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        close_until(s.start_ns)
        if stacks and fits(0, s.end_ns):
            lane = 0
        elif stacks and fits(last, s.end_ns):
            lane = last
        else:
            while free and stacks[free[0]]:
                heapq.heappop(free)  # taken meanwhile by nesting (lane 0 or ``last``)
            if free:
                lane = heapq.heappop(free)
            else:
                stacks.append([])
                lane = len(stacks) - 1
        stacks[lane].append(s.end_ns)
        heapq.heappush(tops, (s.end_ns, lane))
        out[s.span_id] = last = lane
    return out


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


def chrome_trace(t: Telemetry) -> dict[str, Any]:
    spans = dedupe_spans(t.spans)
    oom_logs = [x for x in t.logs if is_oom(x)]
    times = [s.start_ns for s in spans] + [x.time_ns for x in oom_logs]
    t0 = min(times) if times else 0

    def us(ns: int) -> float:
        return round((ns - t0) / 1e3, 3)

    pids = _Pids()
    events: list[dict[str, Any]] = []
    by_pid: dict[int, list[SpanItem]] = {}
    names: dict[int, str] = {}
    for s in spans:
        pid = pids.of(s)
        by_pid.setdefault(pid, []).append(s)
        if s.name == "coldstart" or pid not in names:
            names[pid] = process_label(s)
    for pid, ss in sorted(by_pid.items()):
        lanes = _lanes([s for s in ss if not isinstance(s.attributes.get("thread.id"), int)])
        used: set[int] = set()
        for s in ss:
            tid_attr = s.attributes.get("thread.id")
            if isinstance(tid_attr, int) and not isinstance(tid_attr, bool):
                tid = tid_attr
            else:
                lane = lanes.get(s.span_id, 0)
                tid = pid if lane == 0 else LANE_TID_BASE + lane
                used.add(lane)
            events.append({
                "name": s.name, "cat": "coldstart" if s.name.startswith("coldstart") else "span", "ph": "X",
                "ts": us(s.start_ns), "dur": round((s.end_ns - s.start_ns) / 1e3, 3), "pid": pid, "tid": tid,
                "args": _args(s.attributes, span_id=s.span_id, parent_span_id=s.parent_span_id,
                              trace_id=s.trace_id, error=s.error),
            })
            for e in s.events:
                if e.name == "infersight.oom" and oom_logs:
                    continue  # the OOM log below carries the same verdict
                events.append({"name": e.name, "cat": "event", "ph": "i", "s": "t", "ts": us(e.time_ns),
                               "pid": pid, "tid": tid, "args": _args(e.attributes, span_id=s.span_id)})
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": names[pid]}})
        events.extend({"name": "thread_name", "ph": "M", "pid": pid, "tid": pid if lane == 0 else LANE_TID_BASE + lane,
                       "args": {"name": "stages" if lane == 0 else "stages (lane %d)" % lane}} for lane in sorted(used))
    for fam in waterfalls(spans):
        for wf in fam.processes:
            pid = pids.of(wf.root)
            events.extend({"name": m.label, "cat": "coldstart", "ph": "i", "s": "p", "ts": us(m.t_ns),
                           "pid": pid, "tid": pid, "args": {"detail": m.title}} for m in wf.marks)
    for x in oom_logs:
        pid = pids.of(x)
        events.append({"name": "OOM: %s" % x.attributes.get("infersight.oom.class", "unknown"), "cat": "oom",
                       "ph": "i", "s": "p", "ts": us(x.time_ns), "pid": pid, "tid": pid,
                       "args": _args(x.attributes, body=x.body)})
        if pid not in names:
            names[pid] = process_label(x)
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": names[pid]}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "infersight", "t0_unix_ns": t0}}


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
                "start_unix_ns": r.start_ns, "total_s": sm.total_s, "ready_s": sm.ready_s,
                "unattributed_s": sm.unattributed_s, "unattributed_share": sm.unattributed_share,
                "biggest": [{"stage": n, "duration_s": d} for n, d in sm.biggest],
                "weights_files": sm.weights_files,
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

