"""Agent side of the ``req`` event kind: request latency per device.

Each ``req`` event (see ``infersight.hooks._request``) is validated (a bad one raises
:class:`~infersight.agent.daemon.assemble.Malformed`, which the assembler counts), then

- feeds the in-agent :class:`~infersight.latency.LatencyWindow`, keyed by device
  (``hw.id`` when known), model and request class, for the slow-device verdicts; failed
  requests are left out of the window (a fast failure is not a fast device);
- updates two cumulative histograms per producer and attribute set,
  ``infersight.request.duration`` and ``gen_ai.server.time_to_first_token`` (unit ``s``).

Nothing is exported per request: :meth:`RequestStats.collect` returns the histograms that
changed (or all of them) for the device job to publish periodically.

Per serving instance (producer) it also keeps the latencies of the window, for
:meth:`RequestStats.instance_latency` (P50/P99, the P50 of the last 20 requests: routing
hints) and the gauges ``infersight.instance.request.p50``/``.p99``. An instance's figures are
those of its HTTP requests (class ``http``, timed by the ASGI middleware: the whole request as
clients see it) when it has any, else of all its requests (``hooks.request``). Those windows hold
at most ``MAX_INSTANCE_SAMPLES`` requests in all, a quarter per uid (``UidShare``, refusals in
``status`` as ``refused.instance_samples``), and an instance's figures are computed again only
when its window changed.

Device resolution, in order: the ``hw.id`` the hook found through torch (``h``); else
``cuda:N`` mapped through the producer's ``CUDA_VISIBLE_DEVICES`` (``vis``: indices or UUID
prefixes) to an NVML device; else ``cuda:N`` as NVML index N. MIG instances and devices NVML
does not list stay unresolved: their series carry ``infersight.device`` only.
"""

from __future__ import annotations

import bisect
import math
import re
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from infersight.agent.daemon.assemble import HEX16, Malformed, Producer
from infersight.instances import RECENT_REQUESTS, InstanceLatency
from infersight.latency import (
    DEFAULT_WINDOW_S,
    MAX_HISTOGRAM_SERIES,
    MAX_WINDOW_SAMPLES,
    LatencyWindow,
    NvmlDevice,
    SeriesKey,
    UidShare,
    drop_ended_before,
    owner,
    percentile,
)
from infersight.metricspec import MetricSpec, declare
from infersight.telemetry import Attributes, HistogramPoint, Item, MetricItem, NumberPoint, Origin, Resource

KIND = "req"
DURATION = "infersight.request.duration"
TTFT = "gen_ai.server.time_to_first_token"
INSTANCE_P50 = "infersight.instance.request.p50"
INSTANCE_P99 = "infersight.instance.request.p99"
SPECS = {s.name: s for s in declare(
    MetricSpec(DURATION, "histogram", "s", "Request duration per device, model and request class"),
    MetricSpec(TTFT, "histogram", "s", "Time to first token of streamed responses, per device and model"),
    MetricSpec(INSTANCE_P50, "gauge", "s", "Request duration P50 of this serving instance over the window"),
    MetricSpec(INSTANCE_P99, "gauge", "s", "Request duration P99 of this serving instance over the window"),
    MetricSpec("infersight.requests.dropped", "sum", "{request}",
               "Requests not histogrammed because the series limit was reached", monotonic=True),
)}  # fmt: skip
# Seconds: 0.01 * 2^(k/4) to 3 significant digits for k = -12..52 (1.25 ms to 81.92 s), and 1 ms. A superset
# of the gen_ai semantic-convention boundaries (0.01 * 2^k, exact) and of this agent's earlier ones (0.001,
# 0.0025, 0.005), so queries on those `le` values still work. Neighbours differ by 2^(1/4) (1.19x; 1.25x from
# 1 ms to 1.25 ms): the fleet P99 is interpolated within one such bucket, and with the semconv's doubling
# buckets alone a device 1.4x slower than its peers scored 1.04 and one 1.1x slower 1.57 (docs/prometheus.md).
DURATION_BOUNDS: tuple[float, ...] = (
    0.001, 0.00125, 0.00149, 0.00177, 0.0021, 0.0025, 0.00297, 0.00354, 0.0042, 0.005, 0.00595,
    0.00707, 0.00841, 0.01, 0.0119, 0.0141, 0.0168, 0.02, 0.0238, 0.0283, 0.0336, 0.04, 0.0476,
    0.0566, 0.0673, 0.08, 0.0951, 0.113, 0.135, 0.16, 0.19, 0.226, 0.269, 0.32, 0.381, 0.453, 0.538,
    0.64, 0.761, 0.905, 1.08, 1.28, 1.52, 1.81, 2.15, 2.56, 3.04, 3.62, 4.31, 5.12, 6.09, 7.24,
    8.61, 10.24, 12.2, 14.5, 17.2, 20.48, 24.4, 29.0, 34.4, 40.96, 48.7, 57.9, 68.9, 81.92,
)  # fmt: skip
# The gen_ai semantic-convention boundaries, as they are: no verdict or alert reads time to first token (the
# recording rules give fleet P50/P99 per device model only); between its wide bounds (0.1-0.25 s, 1-2.5 s) an
# interpolated P99 may read up to 1.9x the true one (docs/prometheus.md).
TTFT_BOUNDS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
MAX_SERIES = MAX_HISTOGRAM_SERIES  # histogram series in all (producer x attribute set); a quarter per uid
MAX_STR = 256
MAX_SECONDS = 86400.0 * 7
TTFT_SLACK_S = 0.001  # a first token after the request's end by more than clock rounding: impossible
DEFAULT_CLASS = "default"
HTTP_CLASS = "http"  # the ASGI middleware's requests (infersight.hooks.asgi.HTTP_CLASS)
MAX_INSTANCES = 1024
MAX_INSTANCES_PER_UID = MAX_INSTANCES // 4  # one user's many processes never crowd another's out
MAX_INSTANCE_DEVICES = 16
MAX_INSTANCE_SAMPLES = MAX_WINDOW_SAMPLES  # requests in all instances' windows; a quarter per uid
_CUDA = re.compile(r"cuda:(\d+)\Z")


@dataclass(frozen=True, slots=True)
class ReqEvent:
    """One validated ``req`` event."""

    device: str | None
    model: str | None
    input_len: int | None
    request_class: str | None
    start_ns: int
    duration_s: float
    ttft_s: float | None
    span_id: str | None
    error: str | None
    hw_id: str | None
    hw_name: str | None
    visible: str | None


def _opt_str(d: Mapping[str, Any], key: str, limit: int = MAX_STR) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise Malformed("req.%s must be a string or null" % key)
    return v[:limit]


def _seconds(d: Mapping[str, Any], key: str, required: bool) -> float | None:
    v = d.get(key)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 <= v <= MAX_SECONDS:
        raise Malformed("req.%s must be a number of seconds in [0, %g]" % (key, MAX_SECONDS))
    return float(v)


def parse_req(d: Mapping[str, Any]) -> ReqEvent:
    """Validate one ``req`` event's data; :class:`Malformed` names the bad key."""
    n = d.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise Malformed("req.n (input length) must be a non-negative integer or null")
    s = d.get("s")
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
        raise Malformed("req.s (start) must be a non-negative integer of ns")
    sp = d.get("sp")
    if sp is not None and (not isinstance(sp, str) or not HEX16.match(sp)):
        raise Malformed("req.sp must be 16 lowercase hex digits or null")
    dur = _seconds(d, "dur", True)
    assert dur is not None
    ttft = _seconds(d, "ttft", False)
    if ttft is not None and ttft > dur + TTFT_SLACK_S:
        raise Malformed("req.ttft (%g s) is after the request ended (dur %g s)" % (ttft, dur))
    hw_id = _opt_str(d, "h", 128)
    if hw_id is not None and not hw_id.startswith(("GPU-", "MIG-")):
        raise Malformed("req.h must be GPU-<uuid> or MIG-<uuid>")
    return ReqEvent(
        device=_opt_str(d, "d", 64),
        model=_opt_str(d, "m"),
        input_len=n,
        request_class=_opt_str(d, "c"),
        start_ns=s,
        duration_s=dur,
        ttft_s=ttft,
        span_id=sp,
        error=_opt_str(d, "err", 128),
        hw_id=hw_id,
        hw_name=_opt_str(d, "hn") if hw_id is not None else None,
        visible=_opt_str(d, "vis", 1024),
    )


@dataclass(slots=True)
class _Hist:
    bounds: tuple[float, ...]
    counts: list[int]
    count: int = 0
    sum: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    @staticmethod
    def new(bounds: tuple[float, ...]) -> _Hist:
        return _Hist(bounds, [0] * (len(bounds) + 1))

    def add(self, v: float) -> None:
        # OTel explicit buckets: bucket i holds (bounds[i-1], bounds[i]].
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.count += 1
        self.sum += v
        self.min = min(self.min, v)
        self.max = max(self.max, v)

    def point(self, attrs: Attributes) -> HistogramPoint:
        return HistogramPoint(
            list(self.bounds), list(self.counts), self.count, self.sum,
            self.min if self.count else None, self.max if self.count else None, dict(attrs),
        )  # fmt: skip


@dataclass(slots=True)
class _ProducerHists:
    resource: Resource
    start_ns: int
    last_update_s: float
    # (metric name, frozen attributes) -> (attributes, histogram)
    series: dict[tuple[str, tuple[tuple[str, Any], ...]], tuple[Attributes, _Hist]] = field(default_factory=dict)
    dirty: set[tuple[str, tuple[tuple[str, Any], ...]]] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _WindowFigures:
    """An instance window's figures (:class:`InstanceLatency` but the process and its devices)."""

    count: int  # successful requests
    p50_s: float
    p99_s: float
    recent_p50_s: float | None
    failed: int


def window_figures(window: deque[tuple[float, float, bool]]) -> _WindowFigures:
    """The figures of one instance's window: a sort of all its requests (kept until the window changes)."""
    ok = [d for _e, d, failed in window if not failed]
    durs = sorted(ok)
    last = ok[-RECENT_REQUESTS:]
    recent = sorted(last) if len(last) >= RECENT_REQUESTS else None
    return _WindowFigures(len(durs), percentile(durs, 50) if durs else 0.0, percentile(durs, 99) if durs else 0.0,
                          percentile(recent, 50) if recent else None, len(window) - len(durs))


@dataclass(slots=True)
class _Instance:
    """One serving process's requests in the window: (end s, duration s, failed)."""

    service: str
    pid: int
    resource: Resource
    uid: int | None  # the kernel's (process.user.id)
    http: bool = False  # it has HTTP requests: only those count
    window: deque[tuple[float, float, bool]] = field(default_factory=deque)
    # Devices any of its requests ran on (an HTTP request names none): device -> last end s.
    devices: dict[str, float] = field(default_factory=dict)
    dirty: bool = False
    # The window's figures until it changes: every device tick, routing refresh and status reads
    # every instance, and sorting all their requests each time kept an idle agent busy.
    figures: _WindowFigures | None = None


class RequestStats:
    """Latency windows and cumulative histograms of every producer's requests (the
    :class:`~infersight.latency.RequestWindows` the device job reads)."""

    def __init__(
        self, window_s: float = DEFAULT_WINDOW_S, max_per_series: int = 4096, idle_forget_s: float = 900.0
    ) -> None:
        self.window = LatencyWindow(window_s, max_per_series)
        self.idle_forget_s = idle_forget_s
        self._producers: dict[str, _ProducerHists] = {}
        self._nseries = 0
        self.dropped_series = 0  # requests not histogrammed because MAX_SERIES was reached
        self.requests = 0
        # Set by the device job from NVML: index -> device, and hw.id -> name.
        self._by_index: dict[int, NvmlDevice] = {}
        self.names: dict[str, str | None] = {}  # NVML's word
        # Without NVML, the name a hook gave with its hw.id, per uid: another uid's claim never names your device.
        self.claimed_names: dict[tuple[int | None, str], str] = {}
        self._claims_of_uid: dict[int | None, int] = {}
        self.window_s = window_s
        self.max_per_instance = max_per_series
        self._instances: dict[str, _Instance] = {}
        self.instance_samples = UidShare(MAX_INSTANCE_SAMPLES)  # the requests in the instances' windows

    # -- NVML view ---------------------------------------------------------------------

    def set_devices(self, devices: list[NvmlDevice]) -> None:
        self._by_index = {d.index: d for d in devices}
        for d in devices:
            if d.uuid:
                self.names[d.uuid] = d.name

    def name_of(self, uid: int | None, hw_id: str) -> str | None:
        """The name of device ``hw_id`` for ``uid``'s series: NVML's, else what that uid's hooks said."""
        return self.names.get(hw_id) or self.claimed_names.get((uid, hw_id))

    def resolve(self, ev: ReqEvent, uid: int | None = None) -> tuple[str | None, str | None]:
        """(hw.id, hw.name) of the request's device (of ``uid``'s producer); (None, None) when unknown."""
        if ev.hw_id is not None:
            if not self._by_index:  # no NVML view: the hook's word is all there is
                return ev.hw_id, ev.hw_name or self.name_of(uid, ev.hw_id)
            listed = [d for d in self._by_index.values() if d.uuid == ev.hw_id]
            # NVML's name, not the hook's; a hw.id NVML does not list is not believed (MIG, or a claim).
            return (listed[0].uuid, listed[0].name) if listed else (None, None)
        m = _CUDA.match(ev.device or "")
        if m is None:
            return None, None
        ordinal = int(m.group(1))
        index = ordinal
        if ev.visible is not None:
            entries = [e.strip() for e in ev.visible.split(",") if e.strip()]
            if ordinal >= len(entries):
                return None, None
            entry = entries[ordinal]
            if entry.startswith("GPU-"):
                matches = [d for d in self._by_index.values() if d.uuid and d.uuid.startswith(entry)]
                return (matches[0].uuid, matches[0].name) if len(matches) == 1 else (None, None)
            if not entry.isdigit():
                return None, None  # MIG-..., or a form NVML's index cannot answer
            index = int(entry)
        dev = self._by_index.get(index)
        if dev is None or dev.uuid is None:
            return None, None
        return dev.uuid, dev.name

    # -- the kind handler --------------------------------------------------------------

    def handle(self, p: Producer, origin: Origin, t_ns: int, data: dict[str, Any], out: list[Item]) -> None:
        """``KindHandler`` for ``req``: validate, window, histogram. Emits nothing itself."""
        ev = parse_req(data)
        self.record(p.id, p.resource, ev, t_ns, p.peer_pid)

    def record(self, producer_id: str, resource: Resource, ev: ReqEvent, t_ns: int | None = None,
               pid: int | None = None) -> None:
        """``pid``: the kernel's PID of the producer's process (SO_PEERCRED), None when unknown: the
        device verdicts tell its GPU work from other processes' by it."""
        uid = owner(resource)
        hw_id, hw_name = self.resolve(ev, uid)
        if ev.hw_id is not None and ev.hw_name and (uid, ev.hw_id) not in self.claimed_names:
            held = self._claims_of_uid.get(uid, 0)
            if held < MAX_SERIES // 4 and len(self.claimed_names) < MAX_SERIES:
                self.claimed_names[(uid, ev.hw_id)] = ev.hw_name
                self._claims_of_uid[uid] = held + 1
        model = ev.model or ""
        klass = ev.request_class or DEFAULT_CLASS
        device = ev.device or "unknown"
        end_s = (t_ns if t_ns is not None else ev.start_ns) / 1e9
        if ev.error is None:
            kind = hw_name or (device.split(":", 1)[0] if hw_id is None else "gpu")
            self.window.add(SeriesKey(hw_id or device, model, klass, kind, uid), ev.duration_s, end_s, pid)
        # A failed request is no latency sample, but its instance's share of failures weighs it (routing).
        self._instance_add(producer_id, resource, klass == HTTP_CLASS, end_s, ev.duration_s, hw_id or device,
                           ev.error is not None)
        attrs: Attributes = {"infersight.device": device}
        if hw_id is not None:
            attrs["hw.type"] = "gpu"
            attrs["hw.id"] = hw_id
            if hw_name:
                attrs["hw.name"] = hw_name
        if model:
            attrs["infersight.model"] = model
            attrs["gen_ai.request.model"] = model
        attrs["infersight.request.class"] = klass
        if ev.error is not None:
            attrs["error.type"] = ev.error
        self.requests += 1
        now = time.monotonic()
        ph = self._producers.get(producer_id)
        if ph is None:
            ph = self._producers[producer_id] = _ProducerHists(resource, time.time_ns(), now)
        ph.last_update_s = now
        self._observe(ph, DURATION, DURATION_BOUNDS, attrs, ev.duration_s)
        if ev.ttft_s is not None:
            self._observe(ph, TTFT, TTFT_BOUNDS, attrs, ev.ttft_s)

    def _observe(self, ph: _ProducerHists, name: str, bounds: tuple[float, ...], attrs: Attributes, v: float) -> None:
        key = (name, tuple(sorted(attrs.items())))
        entry = ph.series.get(key)
        if entry is None:
            share = self.window.histograms  # a quarter of MAX_SERIES per uid; refusals per uid
            if share.held != self._nseries:  # producers were forgotten (collect): count again
                share.recount(owner(p.resource) for p in self._producers.values() for _ in p.series)
            uid = owner(ph.resource)
            if not (share.take(uid) if self._nseries < MAX_SERIES else share.refuse(uid)):
                self.dropped_series += 1
                return
            entry = ph.series[key] = (attrs, _Hist.new(bounds))
            self._nseries += 1
        entry[1].add(v)
        ph.dirty.add(key)

    # -- per instance ------------------------------------------------------------------

    def _instance_add(self, producer_id: str, resource: Resource, http: bool, end_s: float, dur: float,
                      device: str, failed: bool = False) -> None:
        inst = self._instances.get(producer_id)
        if inst is None:
            uid = resource.get("process.user.id")
            if len(self._instances) >= MAX_INSTANCES or (type(uid) is int and sum(
                    1 for i in self._instances.values() if i.uid == uid) >= MAX_INSTANCES_PER_UID):
                return
            pid = resource.get("process.pid")
            inst = self._instances[producer_id] = _Instance(
                str(resource.get("service.name") or "unknown_service"), pid if isinstance(pid, int) else 0, resource,
                uid if type(uid) is int else None)
        if device != "unknown" and (device in inst.devices or len(inst.devices) < MAX_INSTANCE_DEVICES):
            inst.devices[device] = end_s
        if http and not inst.http:  # from now on only the HTTP requests count
            inst.http = True
            self._instance_expire(inst, math.inf)
        elif inst.http and not http:
            return
        if len(inst.window) >= self.max_per_instance:
            inst.window.popleft()  # the oldest goes: the uid's count is unchanged
        elif not self.instance_samples.take(inst.uid):  # refused: counted per uid
            if not inst.window:
                del self._instances[producer_id]
            return
        inst.window.append((end_s, dur, failed))
        inst.figures = None
        inst.dirty = True

    def _instance_expire(self, inst: _Instance, horizon: float) -> None:
        """Take the requests that ended before ``horizon`` out of ``inst``'s window and its uid's budget."""
        n = drop_ended_before(inst.window, horizon)
        if n:
            self.instance_samples.give(inst.uid, n)
            inst.figures = None

    def instance_latency(self, now_s: float | None = None) -> list[InstanceLatency]:
        """Every instance with requests in the window: P50/P99, and the P50 of its last 20."""
        now_s = time.time() if now_s is None else now_s
        out: list[InstanceLatency] = []
        horizon = now_s - self.window_s
        for producer_id, inst in list(self._instances.items()):
            self._instance_expire(inst, horizon)
            w = inst.window
            if not w:
                del self._instances[producer_id]
                continue
            for dev in [d for d, t in inst.devices.items() if t < horizon]:
                del inst.devices[dev]
            if inst.figures is None:  # changed since the last call: sort again
                inst.figures = window_figures(w)
            f = inst.figures
            out.append(InstanceLatency(producer_id, inst.service, inst.pid, f.count, f.p50_s, f.p99_s,
                                       f.recent_p50_s, tuple(sorted(inst.devices)), f.failed))
        return out

    def instance_metrics(self, now_ns: int | None = None, everything: bool = False) -> list[MetricItem]:
        """P50/P99 gauges of the instances whose window changed (or all of them)."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        out: list[MetricItem] = []
        for lat in self.instance_latency(now_ns / 1e9):
            inst = self._instances[lat.producer]
            if not (inst.dirty or everything) or not lat.count:  # (only failures: no latency to say)
                continue
            inst.dirty = False
            # no point attributes: a request count there would be a label that opens a Prometheus series per update
            for name, v in ((INSTANCE_P50, lat.p50_s), (INSTANCE_P99, lat.p99_s)):
                out.append(SPECS[name].item(inst.resource, now_ns, now_ns, [NumberPoint(v, {})]))
        return out

    # -- export ------------------------------------------------------------------------

    def collect(self, now_ns: int | None = None, everything: bool = False) -> list[MetricItem]:
        """Cumulative histogram items: the series that changed since the last call, or all
        of them with ``everything``. Producers idle past ``idle_forget_s`` are published a
        last time when they changed, then forgotten."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        mono = time.monotonic()
        out: list[MetricItem] = []
        for pid in list(self._producers):
            ph = self._producers[pid]
            keys = list(ph.series) if everything else [k for k in ph.series if k in ph.dirty]
            ph.dirty.clear()
            by_name: dict[str, list[HistogramPoint]] = {}
            for key in keys:
                attrs, hist = ph.series[key]
                by_name.setdefault(key[0], []).append(hist.point(attrs))
            out.extend(
                SPECS[name].item(ph.resource, now_ns, ph.start_ns, by_name[name])
                for name in (DURATION, TTFT)
                if name in by_name
            )
            if mono - ph.last_update_s > self.idle_forget_s:
                self._nseries -= len(ph.series)
                del self._producers[pid]
        out.extend(self.instance_metrics(now_ns, everything))
        return out

    def stats(self) -> dict[str, Any]:
        """For ``infersight status --json``: counts, and each instance's P50/P99."""
        return {"requests": self.requests, "series": self._nseries, "dropped_series": self.dropped_series,
                # what the per-uid budgets of the request tables refused, per table and uid ("-": none)
                "refused": {**self.window.refusals(), "instance_samples": self.instance_samples.refusals()},
                "instances": [{"service": i.service, "pid": i.pid, "count": i.count, "failed": i.failed,
                               "p50_s": round(i.p50_s, 6), "p99_s": round(i.p99_s, 6)}
                              for i in self.instance_latency()]}

    def self_metrics(self, resource: Resource, start_ns: int, now_ns: int) -> list[MetricItem]:
        """The agent's own count of requests left out of the histograms (series cap reached)."""
        return [SPECS["infersight.requests.dropped"].item(
            resource, now_ns, start_ns, [NumberPoint(self.dropped_series, {"infersight.reason": "series_limit"})])]
