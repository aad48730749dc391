"""Cold starts as fleet metrics: stage-duration histograms, weights throughput, counts (pure).

One host's trace answers "where did this start go?"; a fleet asks "what is p95 of
``weights_load`` for service X this week?". That is a histogram question, so every finished
cold start also feeds four cumulative OTel metrics, per service:

- ``infersight.coldstart.duration`` (histogram, ``s``): one observation per stage present,
  attribute ``infersight.stage`` (``unattributed`` included, from the root's
  ``infersight.coldstart.unattributed_s``), and one with ``infersight.stage=total`` (the root);
- ``infersight.coldstart.weights.throughput`` (histogram, ``By/s``): one observation per cold
  start that read weights (from the root's ``weights_file`` summaries: lazy loads count too),
  attribute ``infersight.weights.cache`` = ``cold`` or ``warm``;
- ``infersight.coldstart.weights.ceiling_ratio`` (histogram, ``1``): one observation per cold
  start whose cold weights files have a ceiling ratio (from the same summaries): how much of
  the storage ceiling its cold reads reached;
- ``infersight.coldstart.count`` (monotonic sum): attribute ``infersight.coldstart.ended_by``.

:class:`ColdStartMetrics` accumulates across cold starts and producers (the cold-start
extension holds one), so counts add up in one series per service and stage. The metric resource keeps only what
names the service on this host (``service.name``, ``host.name``...; ``service.instance.id`` is
the host), never a pid: a restart loop must not open a new series per process.

Beside them, :func:`ceiling_item` is the agent's gauge ``infersight.storage.ceiling`` (``By/s``):
the measured ceiling of each storage device known, on the agent's own resource, attribute
``infersight.storage.device``: what the throughput is compared with. Fed, as the
assembler's cold-start observer, from the one place where a cold-start root is finished
(:mod:`infersight.agent.daemon.assemble`, and ``launch`` for a launcher-only root);
:data:`METRICS` is the source of the table in docs/telemetry.md (regenerate with
``python -m infersight.agent.coldstart.metrics``).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from infersight import weights_files
from infersight.coldstart_stages import ENDED_BY, STAGE, TOTAL, UNATTRIBUTED, as_number, ended_by, stage_durations
from infersight.hooks import _contract
from infersight.metricspec import MetricSpec, declare, prometheus_name
from infersight.telemetry import (
    Attributes,
    ColdStart,
    HistogramPoint,
    MetricItem,
    NumberPoint,
    Resource,
)

DURATION = "infersight.coldstart.duration"
THROUGHPUT = "infersight.coldstart.weights.throughput"
COUNT = "infersight.coldstart.count"
CEILING_RATIO = "infersight.coldstart.weights.ceiling_ratio"
CEILING = "infersight.storage.ceiling"
CACHE = "infersight.weights.cache"
DEVICE = "infersight.storage.device"
OTHER = "other"  # custom stages past MAX_STAGES fold into this one

# Seconds. Dense (about x2) below 10 s, where imports and small models live; x1.5-2 from 10 s
# to 5 min, where most GPU cold starts land and the p95 alert compares; 10, 20 and 30 min
# catch pathological starts. The rules interpolate within a bucket, so the quantiles they
# report are exact only at these bounds.
DURATION_BOUNDS_S: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 90.0, 120.0, 180.0, 300.0,
    600.0, 1200.0, 1800.0,
)  # fmt: skip
# Bytes per second, x2 apart: network filesystems (10-250 MB/s), SATA/NVMe (0.5-7 GB/s),
# page cache (memcpy speed, 5-30 GB/s).
THROUGHPUT_BOUNDS: tuple[float, ...] = (
    10e6, 25e6, 50e6, 100e6, 250e6, 500e6, 1e9, 2e9, 4e9, 8e9, 16e9, 32e9, 64e9,
)  # fmt: skip
# Share of the storage ceiling a cold start's cold reads reached: tenths from 0 to 1, with 0.05
# (latency-bound reads of small files). Above 1: the ceiling was measured low (a busy disk).
CEILING_RATIO_BOUNDS: tuple[float, ...] = (
    0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25,
)  # fmt: skip
MAX_RESOURCES = 256  # services held; the least recently observed is forgotten past this
# A uid's share of them: one user's many service names forget its own oldest, never another user's
# (300 short runs under distinct names reset a neighbour's cumulative count to 1).
MAX_RESOURCES_PER_UID = MAX_RESOURCES // 4
UID = "process.user.id"
MAX_STAGES = 64  # distinct stages per service; more custom stages count as "other"
MAX_ENDED_BY = 16
# Re-export a service's cumulative snapshot after this long without a cold start, as an OTel
# periodic reader would (its default interval): a Collector (metric_expiration) or our own
# endpoint (series_ttl_s, default 300 s) keeps the series of a service that starts rarely.
REFRESH_NS = 60 * 1_000_000_000
_RESERVED = (UNATTRIBUTED, TOTAL, OTHER)  # always kept; not counted against MAX_STAGES

# Resource attributes that name a service on a host. service.version is left out on purpose:
# the regression alert compares the last hour with the last week across a rollout.
RESOURCE_KEYS = (
    "service.name",
    UID,  # the kernel's (never the hello's): another user's runs under the same name are its own series
    "service.namespace",
    "deployment.environment",
    "deployment.environment.name",
    "host.name",
    "telemetry.sdk.name",
    "telemetry.sdk.language",
    "telemetry.sdk.version",
)

METRICS: tuple[MetricSpec, ...] = declare(
    MetricSpec(DURATION, "histogram", "s",
               "Cold-start time per stage (stages may nest), unattributed time, and the whole (total)",
               attributes=(STAGE,)),
    MetricSpec(THROUGHPUT, "histogram", "By/s",
               "Weights read throughput of one cold start (all its weights files), by page-cache state",
               attributes=(CACHE,)),
    MetricSpec(CEILING_RATIO, "histogram", "1",
               "Cold weights reads of one cold start over the storage ceiling of their devices (1 = at the ceiling)"),
    MetricSpec(COUNT, "sum", "{coldstart}", "Finished cold starts, by what ended them",
               monotonic=True, attributes=(ENDED_BY,)),
    MetricSpec(CEILING, "gauge", "By/s",
               "Sequential cold-read ceiling of a storage device, as measured and cached (the agent's "
               "resource: service_name infersight-agent, host_name)",
               attributes=(DEVICE,)),
)  # fmt: skip
SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}


# -- one cold start -> values -----------------------------------------------------------------


def weights_throughput(cs: ColdStart) -> tuple[str, float] | None:
    """(``cold``|``warm``, bytes/s) over every weights file of the cold start, or None.

    From the root's ``weights_file`` summaries (a file read lazily has one too): the bytes
    each summary's throughput counts over the sum of their reading times. A root without them
    (from an older agent) falls back to its spans that carry ``infersight.weights.bytes``,
    ``.bytes_per_s`` and ``.page_cache_ratio``. The class comes from the byte-weighted
    page-cache ratio (cold below 0.5), so each cold start is one observation.
    """
    nbytes = seconds = resident = 0.0
    summaries = weights_files.events(cs)
    if summaries:
        for e in summaries:
            rate = as_number(e.attributes.get("bytes_per_s"))
            read_s = as_number(e.attributes.get("read_s"))
            ratio = as_number(e.attributes.get("page_cache_ratio"))
            if rate is None or read_s is None or ratio is None or rate <= 0 or read_s <= 0:
                continue
            nbytes += rate * read_s
            seconds += read_s
            resident += rate * read_s * min(1.0, max(0.0, ratio))
    else:
        for s in cs.stages:
            a = s.attributes
            b = as_number(a.get(_contract.WEIGHTS_BYTES))
            rate = as_number(a.get(_contract.WEIGHTS_BYTES_PER_S))
            ratio = as_number(a.get(_contract.WEIGHTS_PAGE_CACHE_RATIO))
            if b is None or rate is None or ratio is None or b <= 0 or rate <= 0:
                continue
            nbytes += b
            seconds += b / rate
            resident += b * min(1.0, max(0.0, ratio))
    if nbytes <= 0 or seconds <= 0:
        return None
    return ("cold" if resident / nbytes < _contract.COLD_BELOW else "warm"), nbytes / seconds


def ceiling_ratio(cs: ColdStart) -> float | None:
    """The share of the storage ceiling the cold start's cold weights reads reached, or None.

    Over the root's ``weights_file`` summaries that have a ``ceiling_ratio`` (cold files whose
    device ceiling was known): the bytes they read over the bytes their devices' ceilings
    would have delivered in the same reading times, so one file gives its own ratio and a
    large file weighs more than a small one. One observation per cold start.
    """
    served = possible = 0.0
    for e in weights_files.events(cs):
        rate, read_s, ratio, cached = (as_number(e.attributes.get(k))
                                       for k in ("bytes_per_s", "read_s", "ceiling_ratio", "page_cache_ratio"))
        if rate is None or read_s is None or ratio is None or cached is None or cached >= _contract.COLD_BELOW \
                or not all(0 < v < math.inf for v in (rate, read_s, ratio)):
            continue  # a warm file, no ceiling known, or a figure that is no measurement
        served += rate * read_s
        possible += rate / ratio * read_s  # the file's device ceiling x its reading time
    return served / possible if possible > 0 else None


def ceiling_item(resource: Resource, ceilings: Mapping[str, float], t_ns: int, start_ns: int) -> MetricItem | None:
    """The ``infersight.storage.ceiling`` gauge: one point per device label, None when none is known."""
    if not ceilings:
        return None
    points = [NumberPoint(rate, {DEVICE: device}) for device, rate in sorted(ceilings.items())]
    return SPECS[CEILING].item(resource, t_ns, start_ns, points)


def is_helper(cs: ColdStart) -> bool:
    """Helper processes (resource tracker, compile workers, probes) are no service cold start."""
    role = cs.root.attributes.get(_contract.PROCESS_ROLE) or cs.root.resource.get(_contract.PROCESS_ROLE)
    return role == _contract.ROLE_HELPER


def metric_resource(r: Resource) -> Resource:
    """The service-on-a-host part of a producer's resource (no pid, no per-process id)."""
    attrs: Attributes = {}
    for k in RESOURCE_KEYS:
        v = r.get(k)
        if v is not None and v != "":
            attrs[k] = v if isinstance(v, (str, bool, int, float)) else str(v)  # hashable: a dict key
    host = attrs.get("host.name")
    if isinstance(host, str) and host:
        attrs["service.instance.id"] = host
    return Resource.of(attrs)


# -- accumulation -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0
    min: float | None = None
    max: float | None = None

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def add(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1  # OTel: bucket i is (b[i-1], b[i]]
        self.count += 1
        self.sum += v
        self.min = v if self.min is None else min(self.min, v)
        self.max = v if self.max is None else max(self.max, v)

    def point(self, attrs: Attributes) -> HistogramPoint:
        return HistogramPoint(list(self.bounds), list(self.counts), self.count, self.sum, self.min, self.max,
                              dict(attrs))


@dataclass(slots=True)
class _Service:
    durations: dict[str, _Histogram] = field(default_factory=dict)
    throughput: dict[str, _Histogram] = field(default_factory=dict)
    ceiling_ratio: _Histogram | None = None
    counts: dict[str, int] = field(default_factory=dict)
    emitted_ns: int = 0  # time of the last snapshot that carried this service


class ColdStartMetrics:
    """Cumulative cold-start metrics per service, across cold starts and producers.

    :meth:`observe` records one finished cold start and returns that service's snapshot (the
    items to publish now); :meth:`due` returns the snapshots not published for a while, so a
    pull endpoint or a Collector does not expire series of services that start rarely.
    Timestamps come from the caller (event time), kept non-decreasing; nothing here reads a clock.
    """

    def __init__(self, max_resources: int = MAX_RESOURCES, max_stages: int = MAX_STAGES,
                 max_per_uid: int = MAX_RESOURCES_PER_UID) -> None:
        self.max_resources = max_resources
        self.max_per_uid = max_per_uid
        self.max_stages = max_stages
        self.start_ns: int | None = None
        self.last_ns = 0
        self._services: OrderedDict[Resource, _Service] = OrderedDict()
        self.observed = 0
        self.helpers_skipped = 0
        self.services_forgotten = 0

    def __len__(self) -> int:
        return len(self._services)

    def _time(self, t_ns: int) -> int:
        self.last_ns = max(self.last_ns, t_ns)
        return self.last_ns

    def observe(self, cs: ColdStart, t_ns: int) -> list[MetricItem]:
        """Record ``cs``; returns the cumulative snapshot of its service (empty for a helper)."""
        if is_helper(cs):
            self.helpers_skipped += 1
            return []
        if self.start_ns is None:
            self.start_ns = min(cs.root.start_ns, t_ns)
        t = self._time(max(t_ns, cs.root.end_ns))
        res = metric_resource(cs.root.resource)
        svc = self._services.get(res)
        if svc is None:
            self._make_room(res.get(UID))
            svc = self._services[res] = _Service()
        else:
            self._services.move_to_end(res)
        for name, seconds in stage_durations(cs).items():
            full = name not in svc.durations and name not in _RESERVED and self._stages(svc) >= self.max_stages
            svc.durations.setdefault(OTHER if full else name, _Histogram(DURATION_BOUNDS_S)).add(seconds)
        w = weights_throughput(cs)
        if w is not None:
            svc.throughput.setdefault(w[0], _Histogram(THROUGHPUT_BOUNDS)).add(w[1])
        c = ceiling_ratio(cs)
        if c is not None:
            if svc.ceiling_ratio is None:
                svc.ceiling_ratio = _Histogram(CEILING_RATIO_BOUNDS)
            svc.ceiling_ratio.add(c)
        end = ended_by(cs)
        if end not in svc.counts and len(svc.counts) >= MAX_ENDED_BY:
            end = OTHER
        svc.counts[end] = svc.counts.get(end, 0) + 1
        self.observed += 1
        return self._items(res, svc, t)

    def _make_room(self, uid: object) -> None:
        """Before a new service of ``uid``: past the uid's share its own least recently observed service
        is forgotten; past the table's bound, that of the uid holding the most."""
        by_uid: dict[object, list[Resource]] = {}
        for r in self._services:  # least recently observed first
            by_uid.setdefault(r.get(UID), []).append(r)
        own = by_uid.get(uid, [])
        if len(own) >= self.max_per_uid:
            victim = own[0]
        elif len(self._services) >= self.max_resources:
            victim = max(by_uid.values(), key=len)[0]
        else:
            return
        del self._services[victim]
        self.services_forgotten += 1

    @staticmethod
    def _stages(svc: _Service) -> int:
        return sum(1 for k in svc.durations if k not in _RESERVED)

    def snapshot(self, t_ns: int) -> list[MetricItem]:
        """Every service's cumulative metrics at ``t_ns``."""
        t = self._time(t_ns)
        return [m for res, svc in self._services.items() for m in self._items(res, svc, t)]

    def due(self, t_ns: int, every_ns: int = REFRESH_NS) -> list[MetricItem]:
        """Snapshots of the services not published in the last ``every_ns``."""
        t = self._time(t_ns)
        return [m for res, svc in self._services.items() if t - svc.emitted_ns >= every_ns
                for m in self._items(res, svc, t)]

    def _items(self, res: Resource, svc: _Service, t: int) -> list[MetricItem]:
        svc.emitted_ns = t
        start = self.start_ns if self.start_ns is not None else t

        def item(spec: MetricSpec, points: list[NumberPoint] | list[HistogramPoint]) -> MetricItem:
            return spec.item(res, t, start, points)

        out = [item(SPECS[DURATION], [h.point({STAGE: s}) for s, h in sorted(svc.durations.items())])]
        if svc.throughput:
            out.append(item(SPECS[THROUGHPUT], [h.point({CACHE: c}) for c, h in sorted(svc.throughput.items())]))
        if svc.ceiling_ratio is not None:
            out.append(item(SPECS[CEILING_RATIO], [svc.ceiling_ratio.point({})]))
        out.append(item(SPECS[COUNT], [NumberPoint(n, {ENDED_BY: e}) for e, n in sorted(svc.counts.items())]))
        return out


# -- reference table --------------------------------------------------------------------------


def _prom_names(spec: MetricSpec) -> str:
    name = prometheus_name(spec)
    if spec.kind == "histogram":
        return "`%s_bucket`, `_sum`, `_count`" % name
    return "`%s`" % name


def render_reference_markdown(specs: Iterable[MetricSpec] = METRICS) -> str:
    """The cold-start metric table of docs/telemetry.md (Prometheus labels: dots become underscores)."""
    lines = [
        "| OTel name | kind | unit | Prometheus name | attributes (Prometheus label) | description |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in specs:
        kind: str = "counter" if m.kind == "sum" and m.monotonic else m.kind
        attrs = ", ".join("`%s` (`%s`)" % (a, a.replace(".", "_")) for a in m.attributes) or "-"
        lines.append(f"| `{m.name}` | {kind} | `{m.unit}` | {_prom_names(m)} | {attrs} | {m.description} |")
    return "\n".join(lines) + "\n"


def _main(write: Callable[[str], object] = print) -> None:
    write(render_reference_markdown().rstrip("\n"))


if __name__ == "__main__":
    _main()
