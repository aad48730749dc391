"""Telemetry -> the report's memory and device views (pure).

Memory: allocator ``infersight.memory.allocated``/``reserved`` per device and process, NVML
``hw.gpu.memory.usage`` per device, OOM logs and large-allocation span events on the same
device (``hw.id``, else ``cuda:N`` of that process). Devices: P50/P99 per request series (from
the agent's verdict logs, else estimated from ``infersight.request.duration`` buckets), the
coefficient against peers, the verdict and its cause, and throttle, PCIe, ECC and device-event
tracks from the ``hw.*``/``infersight.device.*`` metrics and ``device`` logs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from infersight.agent.report.parse import HistSample, Sample, Telemetry
from infersight.agent.report.views import Mark, Oom, num, stage_name
from infersight.bytesize import human_bytes
from infersight.telemetry import AttrValue, HistogramPoint, LogItem, SpanEvent, SpanItem

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
class MemoryChart:
    key: str
    title: str
    series: list[Series]
    limit: float | None
    ooms: list[Oom]
    events: list[Mark]

    def span_ns(self) -> tuple[int, int]:
        times = [t for s in self.series for t, _ in s.points] + [o.log.time_ns for o in self.ooms] + \
            [e.t_ns for e in self.events]
        return min(times), max(times)


def _pid_of(x: Sample | SpanItem | LogItem) -> str:
    return str(x.resource.get("process.pid") or "?")


def dev_key(attrs: dict[str, AttrValue], device_attr: str, pid: str) -> str:
    hw = attrs.get("hw.id")
    if isinstance(hw, str) and hw:
        return hw
    return "%s (pid %s)" % (attrs.get(device_attr) or "device ?", pid)


def used_sample(s: Sample) -> bool:
    """Whether the memory or device views read this metric point (a streaming reader keeps no other)."""
    if s.name in ALLOCATOR or s.name.startswith(("hw.", "infersight.device.")):
        return True
    return isinstance(s.attributes.get("hw.id"), str) and isinstance(s.attributes.get("hw.name"), str)


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
            key = dev_key(s.attributes, "infersight.device", _pid_of(s))
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
                c = by_key.get(dev_key(ev.attributes, "infersight.device", _pid_of(sp)))
                if c is not None:
                    c.events.append(_mem_event(ev, sp))
    return charts


def _mem_event(ev: SpanEvent, sp: SpanItem) -> Mark:
    nbytes = num(ev.attributes.get("infersight.memory.bytes")) or 0.0
    count = ev.attributes.get("infersight.memory.count")
    label = MEM_EVENTS[ev.name]
    return Mark(ev.time_ns, label, "%s: %s x%s during %s%s" % (
        label, human_bytes(nbytes), count, stage_name(sp),
        " (approximate: growth between two samples)" if ev.attributes.get("infersight.memory.approx") else ""))


# -- devices ------------------------------------------------------------------------------

DURATION = "infersight.request.duration"
COEFFICIENT = "infersight.device.coefficient"
BENIGN_THROTTLE = ("gpu_idle",)
# A series with latencies but neither a coefficient nor a verdict log: it may have had peers with
# too few requests in the window (min_requests), or no evaluation ran while it was recorded.
NO_VERDICT = ("no verdict in these records: the agent publishes a coefficient for a device with "
              "min_requests requests in its window and a peer of the same kind")


@dataclass(slots=True)
class DeviceRow:
    device: str  # hw.id or infersight.device
    name: str
    model: str
    request_class: str
    user: str  # whose requests (process.user.id; "" when the records carry none): the agent's verdicts are per uid
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
    events: list[Mark] = field(default_factory=list)


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


SeriesKey = tuple[str, str, str, str]  # device, model, request class, user


def _series_key(a: dict[str, AttrValue], uid: object = None) -> SeriesKey:
    """A series as the agent keys its verdicts: device, model, request class and uid (``process.user.id`` of
    the point, else ``uid``: a histogram's producer's resource). Two users of one GPU are two rows."""
    dev = a.get("hw.id") or a.get("infersight.device") or "?"
    user = a.get("process.user.id", uid)
    return (str(dev), str(a.get("infersight.model") or a.get("gen_ai.request.model") or "-"),
            str(a.get("infersight.request.class") or "default"), "" if user is None else str(user))


def devices(t: Telemetry) -> Devices:
    names: dict[str, str] = {}
    for s in t.samples:
        hw, nm = s.attributes.get("hw.id"), s.attributes.get("hw.name")
        if isinstance(hw, str) and isinstance(nm, str):
            names[hw] = nm
    rows = _device_rows(t, names)
    timelines = _timelines(t, names)
    return Devices(rows, timelines)


def _latest(hs: list[HistSample]) -> dict[tuple[SeriesKey, str], HistSample]:
    out: dict[tuple[SeriesKey, str], HistSample] = {}
    for h in hs:
        k = (_series_key(h.point.attributes, h.resource.get("process.user.id")), _pid_of_res(h))
        if k not in out or out[k].time_ns <= h.time_ns:
            out[k] = h
    return out


def _pid_of_res(h: HistSample) -> str:
    return str(h.resource.get("service.instance.id") or h.resource.get("process.pid") or "")


def _opt(f: Callable[..., float], a: float | None, b: float | None) -> float | None:
    vals = [x for x in (a, b) if x is not None]
    return f(vals) if vals else None


def collapse(bounds: list[float], counts: list[int], onto: list[float]) -> list[int]:
    """Per-bucket ``counts`` over ``bounds`` added up onto the buckets of ``onto``, a subset of ``bounds``
    (every edge of ``onto`` is one of ``bounds``: each bucket falls within one of ``onto``'s)."""
    out = [0] * (len(onto) + 1)
    j = 0
    for i, c in enumerate(counts):
        upper = bounds[i] if i < len(bounds) else math.inf
        while j < len(onto) and onto[j] < upper:
            j += 1
        out[j] += c
    return out


def _add_point(m: HistogramPoint, p: HistogramPoint) -> None:
    """Add ``p`` into ``m`` (one series, two producers). Points of other bounds (an agent before and after an
    upgrade: the request-duration bounds were refined, the earlier ones kept) are added on the edges both have."""
    if len(p.bucket_counts) != len(p.bounds) + 1:
        return
    if m.bounds == p.bounds:
        m.bucket_counts = [x + y for x, y in zip(m.bucket_counts, p.bucket_counts, strict=True)]
    else:
        common = sorted(set(m.bounds) & set(p.bounds))
        m.bucket_counts = [x + y for x, y in zip(collapse(m.bounds, m.bucket_counts, common),
                                                 collapse(list(p.bounds), list(p.bucket_counts), common), strict=True)]
        m.bounds = common
    m.count, m.sum = m.count + p.count, m.sum + p.sum
    m.min, m.max = _opt(min, m.min, p.min), _opt(max, m.max, p.max)


def _is_device(k: SeriesKey) -> bool:
    """Whether a series is a device's: requests timed with no device (the ASGI/WSGI middleware's HTTP requests,
    a ``hooks.request()`` that names none) are ``unknown``, and no device row."""
    return k[0] not in ("unknown", "?", "")


def _device_rows(t: Telemetry, names: dict[str, str]) -> list[DeviceRow]:
    rows: dict[SeriesKey, DeviceRow] = {}
    # Histograms are cumulative per producer: add up the latest point of each producer per series.
    merged: dict[SeriesKey, HistogramPoint] = {}
    for (k, _), h in _latest([h for h in t.histograms if h.name == DURATION]).items():
        p = h.point
        m = merged.get(k)
        if not _is_device(k) or len(p.bucket_counts) != len(p.bounds) + 1:
            continue
        if m is None:
            merged[k] = HistogramPoint(list(p.bounds), list(p.bucket_counts), p.count, p.sum, p.min, p.max)
        else:
            _add_point(m, p)
    for k, m in merged.items():
        rows[k] = DeviceRow(k[0], names.get(k[0], ""), k[1], k[2], k[3], m.count,
                            hist_quantile(m.bounds, m.bucket_counts, 0.5, m.min, m.max),
                            hist_quantile(m.bounds, m.bucket_counts, 0.99, m.min, m.max), "histogram", None, "", "", "")
    coef: dict[SeriesKey, tuple[int, float]] = {}
    for s in t.samples:
        if s.name == COEFFICIENT:
            k = _series_key(s.attributes)
            if _is_device(k) and (k not in coef or coef[k][0] <= s.time_ns):
                coef[k] = (s.time_ns, s.value)
    for k, (_, v) in coef.items():
        row = rows.setdefault(k, DeviceRow(k[0], names.get(k[0], ""), k[1], k[2], k[3], None, None, None, "", None, "",
                                           "", ""))
        row.coefficient = v
        row.verdict = row.verdict or "ok"
        row.detail = row.detail or "coefficient published, no slow verdict logged"
    # The agent logs a verdict when it changes (turns slow, changes cause, leaves slow) and publishes the
    # coefficient at every evaluation: the newest of the two says the figures. A log's P50/P99/count/coefficient
    # are of its own window; a coefficient published after it is newer (its histogram, too), and a verdict
    # that is no longer slow with a coefficient after it has become ok (the agent logs no ok after a non-slow one).
    verdict_logs = sorted((x for x in t.logs if "infersight.device.verdict" in x.attributes), key=lambda x: x.time_ns)
    for x in verdict_logs:
        a = x.attributes
        k = _series_key(a)
        if not _is_device(k):
            continue
        row = rows.setdefault(k, DeviceRow(k[0], str(a.get("hw.name") or names.get(k[0], "")), k[1], k[2], k[3],
                                           None, None, None, "", None, "", "", ""))
        row.verdict = str(a.get("infersight.device.verdict"))
        row.cause = str(a.get("infersight.device.cause") or "") if row.verdict == "slow" else ""
        row.detail = x.body
        if k in coef and coef[k][0] > x.time_ns:  # a newer coefficient (and histogram) hold the figures
            if row.verdict != "slow":
                row.verdict, row.detail = "ok", "coefficient published after: %s" % x.body
            continue
        p50, p99 = num(a.get("infersight.request.p50_s")), num(a.get("infersight.request.p99_s"))
        if p50 is not None and p99 is not None:
            row.p50_s, row.p99_s, row.source = p50, p99, "verdict"
            cnt = num(a.get("infersight.request.count"))
            row.count = int(cnt) if cnt is not None else row.count
        row.coefficient = num(a.get("infersight.device.coefficient"))  # none with insufficient_data: none now
    for row in rows.values():
        if not row.verdict and row.count:  # the agent logs no no_peers verdict: none is known, not "no peer"
            row.detail = NO_VERDICT
    return sorted(rows.values(), key=lambda r: (r.device, r.model, r.request_class, r.user))


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
                               "throttle: ", skip=BENIGN_THROTTLE)
        tracks += _flag_tracks([s for s in m.get("hw.status", []) if s.attributes.get("hw.state") != "ok"],
                               "hw.state", "state: ")
        pcie = _pcie_track(m)
        if pcie.intervals:
            tracks.append(pcie)
        ecc = _ecc_track(m)
        if ecc.events or ecc.intervals:
            tracks.append(ecc)
        logs = dev_logs.get(key, [])
        if logs:
            tracks.append(Track("events", [], [Mark(x.time_ns, str(
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


def _flag_tracks(samples: list[Sample], attr: str, prefix: str, skip: tuple[str, ...] = ()) -> list[Track]:
    """One track per value of ``attr`` (a throttle reason, a hw.state): on while the sample is 1."""
    by: dict[str, list[tuple[int, bool]]] = {}
    for s in samples:
        label = str(s.attributes.get(attr) or "?")
        if label not in skip:
            by.setdefault(label, []).append((s.time_ns, s.value == 1))
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
    counters = (("hw.errors", "error.type"), ("infersight.device.ecc.retired_pages", "infersight.device.ecc.cause"),
                ("infersight.device.ecc.remapped_rows", "infersight.device.ecc.type"),
                ("infersight.device.pcie.replay", ""))
    for name, attr in counters:
        by: dict[str, list[Sample]] = {}
        for s in m.get(name, []):
            by.setdefault(str(s.attributes.get(attr) or "") if attr else "", []).append(s)
        for label, ss in by.items():
            prev: float | None = None
            for s in sorted(ss, key=lambda s: s.time_ns):
                if (prev is None and s.value > 0) or (prev is not None and s.value > prev):
                    what = "%s %s".strip() % (name, label)
                    tr.events.append(Mark(s.time_ns, "ECC" if "replay" not in name else "PCIe replay",
                                               "%s: %g (was %s)" % (what.strip(), s.value,
                                                                    "%g" % prev if prev is not None else "-")))
                prev = s.value
    pending = [(s.time_ns, s.value == 1) for s in m.get("infersight.device.ecc.remap_pending", [])]
    tr.intervals += _runs(pending, "row remap pending a GPU reset")
    return tr


