"""Telemetry -> what the report draws (pure): cold-start waterfalls, memory, devices, OOMs.

Each view is built only from what the file holds; an empty list means "no such section".
Attribute names are the ones the agent exports (README metric tables, docs/coldstart.md);
attributes this module does not know are carried along for the hover text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from infersight.agent.model import AttrValue, LogItem, SpanEvent, SpanItem
from infersight.agent.report_parse import HistSample, Sample, Telemetry

GAP_MIN_SHARE = 0.005  # computed unattributed gaps shorter than this share of the root are not drawn
UNATTRIBUTED = "unattributed"
ROOT = "coldstart"
PROBE = "infersight.probe"
OOM_NUMBERS = ("R", "T", "F", "A", "P", "U", "O", "L")


def num(v: AttrValue | None) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def stage_name(s: SpanItem) -> str:
    st = s.attributes.get("infersight.stage")
    if isinstance(st, str) and st:
        return st
    return s.name[len("coldstart."):] if s.name.startswith("coldstart.") else s.name


def process_label(s: SpanItem | LogItem) -> str:
    r = s.resource
    svc, pid = r.get("service.name"), r.get("process.pid")
    return "%s (pid %s)" % (svc or "?", pid if pid is not None else "?")


# -- cold start ---------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    span: SpanItem
    depth: int  # 0 for the root, 1 for a top-level stage, ...
    label: str
    kind: str  # root | stage | unattributed | custom


@dataclass(slots=True)
class Mark:
    t_ns: int
    label: str
    title: str


@dataclass(slots=True)
class Summary:
    total_s: float
    ready_s: float | None
    biggest: list[tuple[str, float]]
    unattributed_s: float
    unattributed_share: float


@dataclass(slots=True)
class ProcessWaterfall:
    root: SpanItem
    rows: list[Row]  # root first, then stages in start order (parents before children)
    gaps: list[tuple[int, int]]  # stretches no stage covers, drawn on the root row
    marks: list[Mark]
    summary: Summary
    depth: int = 0  # process nesting: 0 for a family's top process
    parent: str | None = None  # "pid N, during <stage>" for a nested process
    helper: bool = False
    children: list[ProcessWaterfall] = field(default_factory=list)


@dataclass(slots=True)
class Family:
    """The processes of one cold start (a root and every process started under it), on one axis."""

    processes: list[ProcessWaterfall]  # depth-first: parents before their children
    t0_ns: int
    t1_ns: int


def dedupe_spans(spans: Iterable[SpanItem]) -> list[SpanItem]:
    """The same file read twice (a path and its rotation) must not double a waterfall."""
    seen: set[tuple[str, str]] = set()
    out: list[SpanItem] = []
    for s in spans:
        k = (s.trace_id, s.span_id)
        if k not in seen:
            seen.add(k)
            out.append(s)
    return out


def _stages_of(root: SpanItem, by_parent: dict[str, list[SpanItem]]) -> list[SpanItem]:
    out: list[SpanItem] = []
    todo, seen = [root.span_id], {root.span_id}
    while todo:
        for child in by_parent.get(todo.pop(), []):
            if child.span_id not in seen and child.name.startswith("coldstart.") and child.trace_id == root.trace_id:
                seen.add(child.span_id)
                out.append(child)
                todo.append(child.span_id)
    return out


def _ordered_rows(root: SpanItem, stages: list[SpanItem]) -> list[Row]:
    kids: dict[str, list[SpanItem]] = {}
    for s in stages:
        kids.setdefault(s.parent_span_id or "", []).append(s)
    rows = [Row(root, 0, ROOT, "root")]

    def walk(parent_id: str, depth: int) -> None:
        for s in sorted(kids.get(parent_id, []), key=lambda x: (x.start_ns, -x.end_ns)):
            name = stage_name(s)
            kind = "unattributed" if name == UNATTRIBUTED else (
                "custom" if s.attributes.get("infersight.stage.custom") is True else "stage")
            rows.append(Row(s, depth, name, kind))
            if depth < 32:
                walk(s.span_id, depth + 1)

    walk(root.span_id, 1)
    return rows


def uncovered(lo: int, hi: int, intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [lo, hi] that no interval covers."""
    out: list[tuple[int, int]] = []
    cur = lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if s > cur:
            out.append((cur, s))
        cur = max(cur, e)
    if cur < hi:
        out.append((cur, hi))
    return out


def _marks(root: SpanItem, stages: list[SpanItem], probes: list[SpanItem]) -> list[Mark]:
    marks: list[Mark] = []
    ready = num(root.attributes.get("infersight.coldstart.ready_s"))
    if ready is not None:
        marks.append(Mark(root.start_ns + int(ready * 1e9), "ready", "ready after %.3f s (%s)" % (
            ready, root.attributes.get("infersight.ready.source") or "?")))
    for s in stages:
        if stage_name(s) == "first_request":
            ttfb = num(s.attributes.get("infersight.first_request.ttfb_s"))
            t = s.start_ns + int(ttfb * 1e9) if ttfb is not None else s.end_ns
            marks.append(Mark(t, "first response", "first response at %.3f s%s" % (
                (t - root.start_ns) / 1e9, " (first byte %.3f s after the request)" % ttfb if ttfb is not None else "")))
            break
    for p in probes:
        marks.append(Mark(p.end_ns, "probe", "probe GET %s: HTTP %s, first byte %.3f s after sending" % (
            p.attributes.get("url.full"), p.attributes.get("http.response.status_code"), (p.end_ns - p.start_ns) / 1e9)))
    return marks


def _summary(root: SpanItem, stages: list[SpanItem], gaps: list[tuple[int, int]]) -> Summary:
    total = max(root.end_ns - root.start_ns, 1)
    top = sorted((s for s in stages if s.parent_span_id == root.span_id and stage_name(s) != UNATTRIBUTED),
                 key=lambda s: s.end_ns - s.start_ns, reverse=True)[:3]
    un = num(root.attributes.get("infersight.coldstart.unattributed_s"))
    if un is None:
        un = sum(e - s for s, e in gaps) / 1e9
    return Summary(total / 1e9, num(root.attributes.get("infersight.coldstart.ready_s")),
                   [(stage_name(s), (s.end_ns - s.start_ns) / 1e9) for s in top], un, un * 1e9 / total)


def waterfalls(spans: list[SpanItem]) -> list[Family]:
    """One family per top-level cold start; a root whose parent span lies in another root's
    cold start (a worker, a rank) nests under that process."""
    spans = dedupe_spans(spans)
    by_parent: dict[str, list[SpanItem]] = {}
    for s in spans:
        if s.parent_span_id:
            by_parent.setdefault(s.parent_span_id, []).append(s)
    roots = sorted((s for s in spans if s.name == ROOT), key=lambda s: s.start_ns)
    owner: dict[tuple[str, str], ProcessWaterfall] = {}  # (trace, span id) -> the process it belongs to
    procs: list[ProcessWaterfall] = []
    for root in roots:
        stages = _stages_of(root, by_parent)
        covered = [(s.start_ns, s.end_ns) for s in stages if stage_name(s) != UNATTRIBUTED]
        total = max(root.end_ns - root.start_ns, 1)
        gaps = [g for g in uncovered(root.start_ns, root.end_ns, covered) if g[1] - g[0] >= GAP_MIN_SHARE * total]
        probes = [p for p in by_parent.get(root.span_id, []) if p.name == PROBE and p.trace_id == root.trace_id]
        wf = ProcessWaterfall(root, _ordered_rows(root, stages), gaps, _marks(root, stages, probes),
                              _summary(root, stages, gaps),
                              helper=root.resource.get("infersight.process.role") == "helper"
                              or root.attributes.get("infersight.process.role") == "helper")
        procs.append(wf)
        for s in (root, *stages):
            owner.setdefault((root.trace_id, s.span_id), wf)
    tops: list[ProcessWaterfall] = []
    for wf in procs:
        r = wf.root
        parent = owner.get((r.trace_id, r.parent_span_id or ""))
        if parent is None or parent is wf or _is_under(parent, wf, owner):
            tops.append(wf)
            continue
        during = next((row.label for row in parent.rows if row.span.span_id == r.parent_span_id), ROOT)
        wf.parent = "started by pid %s during %s" % (parent.root.resource.get("process.pid") or "?", during)
        parent.children.append(wf)
    families: list[Family] = []
    for top in tops:
        flat: list[ProcessWaterfall] = []

        def walk(wf: ProcessWaterfall, depth: int) -> None:
            wf.depth = depth
            flat.append(wf)
            for c in sorted(wf.children, key=lambda c: c.root.start_ns):
                if depth < 16:
                    walk(c, depth + 1)

        walk(top, 0)
        t0 = min(w.root.start_ns for w in flat)
        t1 = max(max([w.root.end_ns] + [m.t_ns for m in w.marks]) for w in flat)
        families.append(Family(flat, t0, max(t1, t0 + 1)))
    return families


def _is_under(parent: ProcessWaterfall, wf: ProcessWaterfall, owner: dict[tuple[str, str], ProcessWaterfall]) -> bool:
    """True if ``parent`` already descends from ``wf`` (a cycle in bad data)."""
    cur = parent
    for _ in range(64):
        if cur is wf:
            return True
        nxt = owner.get((cur.root.trace_id, cur.root.parent_span_id or ""))
        if nxt is None or nxt is cur:
            return False
        cur = nxt
    return True


def weights_note(s: SpanItem) -> str:
    """``128.0 MiB @ 1.4 GiB/s, cold`` for weights stages; '' otherwise."""
    a = s.attributes
    nbytes = num(a.get("infersight.weights.bytes"))
    if nbytes is None:
        return ""
    out = human_bytes(nbytes)
    rate = num(a.get("infersight.weights.bytes_per_s"))
    if rate is not None:
        out += " @ %s/s" % human_bytes(rate)
    pcr = num(a.get("infersight.weights.page_cache_ratio"))
    if pcr is not None:
        out += ", warm (page cache %.0f%%)" % (100 * pcr) if pcr >= 0.5 else ", cold (page cache %.0f%%)" % (100 * pcr)
    elif num(a.get("infersight.weights.ceiling_ratio")) is not None:
        out += ", cold"
    ceiling = num(a.get("infersight.weights.ceiling_ratio"))
    if ceiling is not None:
        out += ", %.0f%% of storage ceiling" % (100 * ceiling)
    if a.get("infersight.weights.lazy") is True:
        out += ", lazy (mapped)"
    return out


def human_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return sign + (("%.0f %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit)))
        n /= 1024
    return sign + str(n)


# -- OOMs ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Oom:
    log: LogItem
    cls: str
    rule: str
    remedy: str
    note: str
    device: str  # cuda:N or ""
    hw_id: str
    numbers: dict[str, float | None]

    @property
    def pid(self) -> AttrValue | None:
        return self.log.resource.get("process.pid")


def is_oom(x: LogItem) -> bool:
    return x.event_name == "oom" or "infersight.oom.class" in x.attributes


def ooms(logs: list[LogItem]) -> list[Oom]:
    out: list[Oom] = []
    seen: set[tuple[int, str, AttrValue | None]] = set()
    for x in sorted((x for x in logs if is_oom(x)), key=lambda x: x.time_ns):
        key = (x.time_ns, x.body, x.resource.get("process.pid"))
        if key in seen:
            continue
        seen.add(key)
        a = x.attributes
        out.append(Oom(
            x, str(a.get("infersight.oom.class") or "unknown"), str(a.get("infersight.oom.rule") or ""),
            str(a.get("infersight.oom.remedy") or ""), str(a.get("infersight.oom.note") or ""),
            str(a.get("infersight.oom.device") or ""), str(a.get("hw.id") or ""),
            {k: num(a.get("infersight.oom.%s_bytes" % k)) for k in OOM_NUMBERS},
        ))
    return out


# -- memory -------------------------------------------------------------------------------

ALLOCATOR = {"infersight.memory.allocated": "allocated", "infersight.memory.reserved": "reserved"}
NVML_USED = "hw.gpu.memory.usage"
NVML_LIMIT = "hw.gpu.memory.limit"
NVML_PROC = "infersight.device.process.memory.usage"
MEM_EVENTS = {"infersight.memory.large_alloc": "large allocation", "infersight.memory.alloc_retry": "allocator retry"}


@dataclass(slots=True)
class Series:
    label: str
    role: str  # allocated | reserved | nvml | nvml_proc
    points: list[tuple[int, float]]


@dataclass(slots=True)
class EventMark:
    t_ns: int
    label: str
    title: str


@dataclass(slots=True)
class MemoryChart:
    key: str
    title: str
    series: list[Series]
    limit: float | None
    ooms: list[Oom]
    events: list[EventMark]

    def span_ns(self) -> tuple[int, int]:
        times = [t for s in self.series for t, _ in s.points] + [o.log.time_ns for o in self.ooms] + \
            [e.t_ns for e in self.events]
        return min(times), max(times)


def _pid_of(x: Sample | SpanItem | LogItem) -> str:
    return str(x.resource.get("process.pid") or "?")


def _dev_key(attrs: dict[str, AttrValue], device_attr: str, pid: str) -> str:
    hw = attrs.get("hw.id")
    if isinstance(hw, str) and hw:
        return hw
    return "%s (pid %s)" % (attrs.get(device_attr) or "device ?", pid)


def _points(samples: list[Sample]) -> list[tuple[int, float]]:
    pts: dict[int, float] = {}
    for s in samples:
        pts[s.time_ns] = s.value
    return sorted(pts.items())


def memory(t: Telemetry, spans: list[SpanItem], oom_list: list[Oom]) -> list[MemoryChart]:
    groups: dict[str, dict[tuple[str, str], list[Sample]]] = {}
    limits: dict[str, float] = {}
    names: dict[str, str] = {}
    for s in t.samples:
        if s.name in ALLOCATOR:
            key = _dev_key(s.attributes, "infersight.device", _pid_of(s))
            groups.setdefault(key, {}).setdefault((ALLOCATOR[s.name], _pid_of(s)), []).append(s)
            dev = s.attributes.get("infersight.device")
            if isinstance(dev, str):
                names.setdefault(key, dev)
        elif s.name in (NVML_USED, NVML_PROC) and isinstance(s.attributes.get("hw.id"), str):
            key = str(s.attributes["hw.id"])
            role = "nvml" if s.name == NVML_USED else "nvml_proc"
            who = str(s.attributes.get("process.pid") or s.attributes.get("infersight.device.process.host_pid") or "")
            groups.setdefault(key, {}).setdefault((role, who), []).append(s)
            if isinstance(s.attributes.get("hw.name"), str):
                names[key] = str(s.attributes["hw.name"])
        elif s.name == NVML_LIMIT and isinstance(s.attributes.get("hw.id"), str):
            limits[str(s.attributes["hw.id"])] = s.value
    if not groups:
        return []
    charts: list[MemoryChart] = []
    for key in sorted(groups):
        g = groups[key]
        pids = {pid for (role, pid) in g if role in ("allocated", "reserved")}
        series: list[Series] = []
        order = {"allocated": 0, "reserved": 1, "nvml": 2, "nvml_proc": 3}
        for (role, who), samples in sorted(g.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
            label = {"allocated": "allocated", "reserved": "reserved", "nvml": "NVML used (device)",
                     "nvml_proc": "NVML used by pid %s" % who}[role]
            if role in ("allocated", "reserved") and len(pids) > 1:
                label += " (pid %s)" % who
            series.append(Series(label, role, _points(samples)))
        charts.append(MemoryChart(key, "%s %s" % (names.get(key, ""), key) if key in names else key,
                                  series, limits.get(key), [], []))
    by_key = {c.key: c for c in charts}
    for o in oom_list:
        c = by_key.get(o.hw_id) or by_key.get("%s (pid %s)" % (o.device, _pid_of(o.log)))
        if c is not None:
            c.ooms.append(o)
    for sp in spans:
        for ev in sp.events:
            if ev.name in MEM_EVENTS:
                c = by_key.get(_dev_key(ev.attributes, "infersight.device", _pid_of(sp)))
                if c is not None:
                    c.events.append(_mem_event(ev, sp))
    return charts


def _mem_event(ev: SpanEvent, sp: SpanItem) -> EventMark:
    nbytes = num(ev.attributes.get("infersight.memory.bytes")) or 0.0
    count = ev.attributes.get("infersight.memory.count")
    label = MEM_EVENTS[ev.name]
    return EventMark(ev.time_ns, label, "%s: %s x%s during %s%s" % (
        label, human_bytes(nbytes), count, stage_name(sp),
        " (approximate: growth between two samples)" if ev.attributes.get("infersight.memory.approx") else ""))


# -- devices ------------------------------------------------------------------------------

DURATION = "infersight.request.duration"
COEFFICIENT = "infersight.device.coefficient"
BENIGN_THROTTLE = ("gpu_idle",)


@dataclass(slots=True)
class DeviceRow:
    device: str  # hw.id or infersight.device
    name: str
    model: str
    request_class: str
    count: int | None
    p50_s: float | None
    p99_s: float | None
    source: str  # "verdict" (the agent's window) or "histogram" (estimated from buckets)
    coefficient: float | None
    verdict: str
    cause: str
    detail: str


@dataclass(slots=True)
class Interval:
    start_ns: int
    end_ns: int
    title: str


@dataclass(slots=True)
class Track:
    label: str
    intervals: list[Interval] = field(default_factory=list)
    events: list[EventMark] = field(default_factory=list)


@dataclass(slots=True)
class DeviceTimeline:
    key: str
    title: str
    tracks: list[Track]
    t0_ns: int = 0  # the device's first and last record
    t1_ns: int = 0


@dataclass(slots=True)
class Devices:
    rows: list[DeviceRow]
    timelines: list[DeviceTimeline]


def hist_quantile(bounds: list[float], counts: list[int], q: float, lo: float | None, hi: float | None) -> float | None:
    """Quantile estimate by linear interpolation inside the bucket (as Prometheus does)."""
    total = sum(counts)
    if total <= 0 or len(counts) != len(bounds) + 1:
        return None
    rank, acc = q * total, 0
    for i, c in enumerate(counts):
        if c and acc + c >= rank:
            left = bounds[i - 1] if i > 0 else (lo if lo is not None else 0.0)
            right = bounds[i] if i < len(bounds) else (hi if hi is not None else left)
            if lo is not None:
                left = max(left, lo)
            if hi is not None:
                right = min(right, hi)
            return left + (right - left) * (rank - acc) / c
        acc += c
    return hi


def _series_key(a: dict[str, AttrValue]) -> tuple[str, str, str]:
    dev = a.get("hw.id") or a.get("infersight.device") or "?"
    return (str(dev), str(a.get("infersight.model") or a.get("gen_ai.request.model") or "-"),
            str(a.get("infersight.request.class") or "default"))


def devices(t: Telemetry) -> Devices:
    names: dict[str, str] = {}
    for s in t.samples:
        hw, nm = s.attributes.get("hw.id"), s.attributes.get("hw.name")
        if isinstance(hw, str) and isinstance(nm, str):
            names[hw] = nm
    rows = _device_rows(t, names)
    timelines = _timelines(t, names)
    return Devices(rows, timelines)


def _latest(hs: list[HistSample]) -> dict[tuple[str, str, str, str], HistSample]:
    out: dict[tuple[str, str, str, str], HistSample] = {}
    for h in hs:
        k = (*_series_key(h.point.attributes), _pid_of_res(h))
        if k not in out or out[k].time_ns <= h.time_ns:
            out[k] = h
    return out


def _pid_of_res(h: HistSample) -> str:
    return str(h.resource.get("service.instance.id") or h.resource.get("process.pid") or "")


def _device_rows(t: Telemetry, names: dict[str, str]) -> list[DeviceRow]:
    rows: dict[tuple[str, str, str], DeviceRow] = {}
    # Histograms: cumulative per producer; add the latest of each producer per series.
    merged: dict[tuple[str, str, str], tuple[list[float], list[int], int, float | None, float | None]] = {}
    for (dev, model, rc, _), h in _latest([h for h in t.histograms if h.name == DURATION]).items():
        p = h.point
        k = (dev, model, rc)
        if k in merged and merged[k][0] == p.bounds:
            b, c, n, lo, hi = merged[k]
            merged[k] = (b, [x + y for x, y in zip(c, p.bucket_counts)], n + p.count,
                         min(x for x in (lo, p.min) if x is not None) if lo is not None or p.min is not None else None,
                         max(x for x in (hi, p.max) if x is not None) if hi is not None or p.max is not None else None)
        elif k not in merged:
            merged[k] = (list(p.bounds), list(p.bucket_counts), p.count, p.min, p.max)
    for k, (b, c, n, lo, hi) in merged.items():
        rows[k] = DeviceRow(k[0], names.get(k[0], ""), k[1], k[2], n, hist_quantile(b, c, 0.5, lo, hi),
                            hist_quantile(b, c, 0.99, lo, hi), "histogram", None, "", "", "")
    coef: dict[tuple[str, str, str], tuple[int, float]] = {}
    for s in t.samples:
        if s.name == COEFFICIENT:
            k = _series_key(s.attributes)
            if k not in coef or coef[k][0] <= s.time_ns:
                coef[k] = (s.time_ns, s.value)
    for k, (_, v) in coef.items():
        row = rows.setdefault(k, DeviceRow(k[0], names.get(k[0], ""), k[1], k[2], None, None, None, "", None, "", "",
                                           ""))
        row.coefficient = v
        row.verdict = row.verdict or "ok"
        row.detail = row.detail or "coefficient published, no slow verdict logged"
    verdict_logs = sorted((x for x in t.logs if "infersight.device.verdict" in x.attributes), key=lambda x: x.time_ns)
    for x in verdict_logs:
        a = x.attributes
        k = _series_key(a)
        row = rows.setdefault(k, DeviceRow(k[0], str(a.get("hw.name") or names.get(k[0], "")), k[1], k[2], None,
                                           None, None, "", None, "", "", ""))
        row.verdict = str(a.get("infersight.device.verdict"))
        row.cause = str(a.get("infersight.device.cause") or "") if row.verdict == "slow" else ""
        row.detail = x.body
        p50, p99 = num(a.get("infersight.request.p50_s")), num(a.get("infersight.request.p99_s"))
        if p50 is not None and p99 is not None:
            row.p50_s, row.p99_s, row.source = p50, p99, "verdict"
            cnt = num(a.get("infersight.request.count"))
            row.count = int(cnt) if cnt is not None else row.count
        c = num(a.get("infersight.device.coefficient"))
        row.coefficient = c if c is not None else row.coefficient
    for row in rows.values():
        if not row.verdict:
            row.verdict = "no_peers" if row.count else ""
    return sorted(rows.values(), key=lambda r: (r.device, r.model, r.request_class))


def _timelines(t: Telemetry, names: dict[str, str]) -> list[DeviceTimeline]:
    per: dict[str, dict[str, list[Sample]]] = {}
    for s in t.samples:
        hw = s.attributes.get("hw.id")
        if isinstance(hw, str) and (s.name.startswith("infersight.device.") or s.name.startswith("hw.")) \
                and s.name != COEFFICIENT:
            per.setdefault(hw, {}).setdefault(s.name, []).append(s)
    dev_logs: dict[str, list[LogItem]] = {}
    for x in t.logs:
        if x.event_name == "device" or "infersight.device.event" in x.attributes \
                or "infersight.device.verdict" in x.attributes:
            hw = x.attributes.get("hw.id") or x.attributes.get("infersight.device") or (
                "nvml-index-%s" % x.attributes["infersight.device.index"]
                if "infersight.device.index" in x.attributes else "host")
            dev_logs.setdefault(str(hw), []).append(x)
    out: list[DeviceTimeline] = []
    for key in sorted(set(per) | set(dev_logs)):
        m = per.get(key, {})
        tracks: list[Track] = []
        tracks += _flag_tracks(m.get("infersight.device.throttle", []), "infersight.device.throttle.reason",
                               "throttle: ", lambda v: v == 1, skip=BENIGN_THROTTLE)
        tracks += _flag_tracks([s for s in m.get("hw.status", []) if s.attributes.get("hw.state") != "ok"],
                               "hw.state", "state: ", lambda v: v == 1)
        pcie = _pcie_track(m)
        if pcie.intervals:
            tracks.append(pcie)
        ecc = _ecc_track(m)
        if ecc.events or ecc.intervals:
            tracks.append(ecc)
        logs = dev_logs.get(key, [])
        if logs:
            tracks.append(Track("events", [], [EventMark(x.time_ns, str(
                x.attributes.get("infersight.device.event") or x.attributes.get("infersight.device.verdict") or
                x.severity_text), "%s %s" % (x.severity_text, x.body)) for x in logs]))
        if not tracks and not m:
            continue
        title = ("%s %s" % (names[key], key)) if key in names else key
        times = [x.time_ns for ss in m.values() for x in ss] + [x.time_ns for x in logs]
        out.append(DeviceTimeline(key, title, tracks, min(times), max(times)))
    return out


def _runs(points: list[tuple[int, bool]], title: str) -> list[Interval]:
    """Intervals where the flag holds, from sample to the next sample."""
    out: list[Interval] = []
    start: int | None = None
    pts = sorted(points)
    for i, (tns, on) in enumerate(pts):
        if on and start is None:
            start = tns
        if not on and start is not None:
            out.append(Interval(start, tns, title))
            start = None
        if on and i == len(pts) - 1 and start is not None:
            out.append(Interval(start, max(tns, start + 1), title))
    return out


def _flag_tracks(samples: list[Sample], attr: str, prefix: str, on: object, skip: tuple[str, ...] = ()) -> list[Track]:
    by: dict[str, list[tuple[int, bool]]] = {}
    for s in samples:
        label = str(s.attributes.get(attr) or "?")
        if label not in skip:
            by.setdefault(label, []).append((s.time_ns, bool(on(s.value))))  # type: ignore[operator]
    out = []
    for label, pts in sorted(by.items()):
        runs = _runs(pts, prefix + label)
        if runs:
            out.append(Track(prefix + label, runs))
    return out


def _by_time(samples: list[Sample]) -> dict[int, float]:
    return {s.time_ns: s.value for s in samples}


def _pcie_track(m: dict[str, list[Sample]]) -> Track:
    gen, gmax = _by_time(m.get("infersight.device.pcie.link.generation", [])), \
        _by_time(m.get("infersight.device.pcie.link.generation.max", []))
    width, wmax = _by_time(m.get("infersight.device.pcie.link.width", [])), \
        _by_time(m.get("infersight.device.pcie.link.width.max", []))
    pts: list[tuple[int, bool]] = []
    for tns in sorted(set(gen) | set(width)):
        low = (tns in gen and tns in gmax and gen[tns] < gmax[tns]) or \
            (tns in width and tns in wmax and width[tns] < wmax[tns])
        pts.append((tns, low))
    title = "PCIe link below its maximum (gen %s/%s, x%s/x%s; idle GPUs downtrain the generation)" % (
        _last(gen), _last(gmax), _last(width), _last(wmax))
    return Track("PCIe below max", _runs(pts, title))


def _last(d: dict[int, float]) -> str:
    return "%g" % d[max(d)] if d else "?"


def _ecc_track(m: dict[str, list[Sample]]) -> Track:
    tr = Track("ECC")
    for name, attr in (("hw.errors", "error.type"), ("infersight.device.ecc.retired_pages", "infersight.device.ecc.cause"),
                       ("infersight.device.ecc.remapped_rows", "infersight.device.ecc.type"),
                       ("infersight.device.pcie.replay", "")):
        by: dict[str, list[Sample]] = {}
        for s in m.get(name, []):
            by.setdefault(str(s.attributes.get(attr) or "") if attr else "", []).append(s)
        for label, ss in by.items():
            prev: float | None = None
            for s in sorted(ss, key=lambda s: s.time_ns):
                if (prev is None and s.value > 0) or (prev is not None and s.value > prev):
                    what = "%s %s".strip() % (name, label)
                    tr.events.append(EventMark(s.time_ns, "ECC" if "replay" not in name else "PCIe replay",
                                               "%s: %g (was %s)" % (what.strip(), s.value,
                                                                    "%g" % prev if prev is not None else "-")))
                prev = s.value
    pending = [(s.time_ns, s.value == 1) for s in m.get("infersight.device.ecc.remap_pending", [])]
    tr.intervals += _runs(pending, "row remap pending a GPU reset")
    return tr


# -- the whole page -----------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    families: list[Family]
    memory: list[MemoryChart]
    devices: Devices
    ooms: list[Oom]
    t0_ns: int
    t1_ns: int
    counts: dict[str, int]
    skipped: list[str]


def build(t: Telemetry) -> Report:
    spans = dedupe_spans(t.spans)
    oom_list = ooms(t.logs)
    times = [s.start_ns for s in spans] + [s.end_ns for s in spans] + [s.time_ns for s in t.samples] + \
        [x.time_ns for x in t.logs]
    t0 = min(times) if times else 0
    t1 = max(times) if times else 1
    counts = {"spans": len(spans), "metric points": len(t.samples) + len(t.histograms), "log records": len(t.logs),
              "lines": t.lines}
    return Report(waterfalls(spans), memory(t, spans, oom_list), devices(t), oom_list, t0, max(t1, t0 + 1),
                  counts, list(t.skipped))
