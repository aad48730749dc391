"""Prometheus scrape endpoint: the latest value of every series the agent exported.

A pull exporter. ``export()`` only records, per (metric, label set), the newest value of the
:class:`~infersight.telemetry.MetricItem` points it receives; a custom prometheus-client
collector renders them when Prometheus scrapes ``/metrics``. ``export()`` never raises, so
nothing is spooled for this sink: a scrape always sees the present, not a replayed past.

OTel -> Prometheus translation (the same rules as
:func:`infersight.metricspec.prometheus_name`, i.e. the Collector's translator):

- metric names: dots (and anything else outside ``[a-zA-Z0-9_:]``) become ``_``; a UCUM unit
  becomes a suffix (``s`` -> ``_seconds``, ``By`` -> ``_bytes``, ``MHz`` -> ``_megahertz``...);
  unit ``1`` adds ``_ratio`` on gauges only; ``{...}`` units add nothing;
- gauges and non-monotonic sums are gauges; monotonic (cumulative) sums are counters exposed
  as ``<name>_total``; histograms are ``<name>_bucket{le=...}``, ``<name>_sum``, ``<name>_count``
  (OTel bucket counts are made cumulative, the ``+Inf`` bucket is the point's count);
- attribute keys: the same dot-to-underscore treatment (a leading digit gets ``key_``, a
  leading ``__`` gets ``key``; keys that collide after sanitising join their values with ``;``);
  values are strings (booleans ``true``/``false``, lists as JSON);
- resource attributes ``host.name``, ``service.name``, ``service.instance.id`` and
  ``process.user.id`` become the labels ``host_name``, ``service_name``, ``service_instance_id``,
  ``process_user_id`` on every series that has them (a point
  attribute of the same name never overrides them: it becomes ``exported_<label>``); all
  resource attributes are also on one ``target_info`` gauge per resource (value 1), to join on when needed.

Bounds: at most ``max_series`` series (``target_info`` included). A point that would open a
series past the bound is dropped and counted in ``infersight_prometheus_points_dropped_total``
(also ``state()["points_dropped"]``). A series that no export refreshed for ``series_ttl_s``
(default 300 s, the Collector's ``metric_expiration``) disappears, so a lost device or an
exited model server does not linger forever; 0 keeps series until shutdown.

The endpoint binds ``127.0.0.1:9464`` unless configured otherwise; it never binds all
interfaces unless ``host`` says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from infersight.exporters.base import OWNER_ATTR, ExportError
from infersight.metricspec import MetricSpec, declare, prometheus_name
from infersight.settings import Config, Key, parse_listen_host, parse_listen_port, section_settings, strip_host
from infersight.settings import parse_bool as _p_bool
from infersight.settings import parse_int as _p_int
from infersight.telemetry import (
    AttrValue,
    ColdStartProgress,
    HistogramPoint,
    Item,
    MetricItem,
    NumberPoint,
    Resource,
    RoutingHint,
)

log = logging.getLogger("infersight.exporters.prometheus")
MAX_CONFLICTS_SAID_PER_UID = 16  # type clashes logged per refused uid (each name once while it lives)
MAX_CONFLICT_UIDS = 1024  # uids whose clashes are remembered


def _whose(uid: int | None) -> str:
    return "the agent (or a producer of unknown uid)" if uid is None else "uid %d" % uid

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9464
DEFAULT_MAX_SERIES = 10_000
UID_SHARE = 4  # by default one uid may hold a quarter of the series bound
DEFAULT_SERIES_TTL_S = 300.0
REBIND_INTERVAL_S = 10.0

RESOURCE_LABELS: tuple[tuple[str, str], ...] = (
    ("host.name", "host_name"),
    ("service.name", "service_name"),
    ("service.instance.id", "service_instance_id"),
    # The kernel's uid of the producer (absent on the agent's own series): another user's runs under the
    # same service name are series of their own, never added into this user's.
    ("process.user.id", "process_user_id"),
)
TARGET_INFO = "target_info"
# The series the endpoint renders itself (no OTel item carries them), declared as the others
# are; their Prometheus names are what the registry translates these to.
POINTS_DROPPED, SERIES_HELD, COLDSTART_ETA, COLDSTART_PROGRESS, ROUTING_WEIGHT, INSTANCE_SETTLED = declare(
    MetricSpec("infersight.prometheus.points_dropped", "sum", "{point}",
               "Points the Prometheus endpoint refused: series bound reached", monotonic=True),
    MetricSpec("infersight.prometheus.series", "gauge", "{series}", "Series the Prometheus endpoint holds"),
    MetricSpec("infersight.coldstart.eta", "gauge", "s", "Predicted seconds left in the service's cold start"),
    MetricSpec("infersight.coldstart.progress", "gauge", "1", "Share of the service's cold start done (0-1)"),
    MetricSpec("infersight.routing.weight", "gauge", "1",
               "Routing weight of the serving instance (0-1: agent-check percent / 100)"),
    MetricSpec("infersight.instance.settled", "gauge", "",
               "1 once the serving instance has settled after readiness, else 0"),
)
DROPPED_METRIC = prometheus_name(POINTS_DROPPED).removesuffix("_total")  # a counter: its sample has _total
SERIES_METRIC = prometheus_name(SERIES_HELD)

PromType = Literal["gauge", "counter", "histogram"]
Labels = tuple[tuple[str, str], ...]


def exposition_names(name: str, typ: PromType) -> tuple[str, ...]:
    """Every name a family of Prometheus name ``name`` (``_total`` included for a counter) and type ``typ``
    takes in an exposition: its family name and its samples' names. No two families may share one: a
    producer's gauge ``process_cpu_time_seconds`` beside the agent's counter of that family had made two
    families of one name, and the OpenMetrics parser refused the whole scrape ("Received metadata after
    samples"); a gauge ``x_count`` beside a histogram ``x``, "Clashing name"."""
    if typ == "counter":
        base = name.removesuffix("_total")
        return base, base + "_total", base + "_created"
    if typ == "histogram":
        return name, name + "_bucket", name + "_count", name + "_sum", name + "_created"
    return (name,)


# The names the endpoint renders itself (no item may take them), and ``target_info`` (made for resources).
OWN_NAMES = frozenset(n for name, typ in (
    (DROPPED_METRIC + "_total", "counter"), (SERIES_METRIC, "gauge"), (TARGET_INFO, "gauge"),
    *((prometheus_name(spec), "gauge") for spec in (COLDSTART_ETA, COLDSTART_PROGRESS, ROUTING_WEIGHT,
                                                    INSTANCE_SETTLED)),
) for n in exposition_names(name, typ))  # type: ignore[arg-type]

_LABEL_BAD = re.compile(r"[^a-zA-Z0-9_]")


# -- translation (pure) -----------------------------------------------------------------------


def metric_name(item: MetricItem) -> str:
    """The Prometheus name of ``item``, ``_total`` included for monotonic sums."""
    spec = MetricSpec(item.name, item.kind, item.unit, item.description, monotonic=item.monotonic)
    name: str = prometheus_name(spec)
    if name.endswith("_total_total"):
        name = name[: -len("_total")]
    if not name or name[0].isdigit():
        name = "_" + name
    return name


def prom_type(item: MetricItem) -> PromType:
    if item.kind == "histogram":
        return "histogram"
    if item.kind == "sum" and item.monotonic:
        return "counter"
    return "gauge"


def label_name(key: str) -> str:
    """An attribute key as a Prometheus label name."""
    name = _LABEL_BAD.sub("_", key)
    if not name:
        return "key_"
    if name[0].isdigit():
        return "key_" + name
    if name.startswith("__"):
        return "key" + name
    return name


def label_value(v: AttrValue) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return json.dumps(list(v), separators=(",", ":"))
    return str(v)


def labels_of(attrs: Mapping[str, AttrValue] | Iterable[tuple[str, AttrValue]]) -> dict[str, str]:
    """Sanitised labels; keys that collide after sanitising join their values (sorted by key)."""
    pairs = attrs.items() if isinstance(attrs, Mapping) else attrs
    grouped: dict[str, list[tuple[str, str]]] = {}
    for k, v in pairs:
        grouped.setdefault(label_name(k), []).append((k, label_value(v)))
    return {name: ";".join(v for _, v in sorted(vals)) for name, vals in grouped.items()}


RESERVED_LABELS = frozenset(label for _, label in RESOURCE_LABELS)


def point_labels(attrs: Mapping[str, AttrValue]) -> dict[str, str]:
    """A point's labels: a point attribute never overrides a resource label (a producer must not
    pass its series off as another service's or host's); it keeps its value as ``exported_<name>``,
    as Prometheus does for a target label that a scrape also carries."""
    labels = labels_of(attrs)
    for name in RESERVED_LABELS.intersection(labels):
        labels["exported_" + name] = labels.pop(name)
    return labels


def resource_labels(resource: Resource) -> dict[str, str]:
    """The identifying resource attributes as labels (absent ones are left out)."""
    out: dict[str, str] = {}
    for key, label in RESOURCE_LABELS:
        v = resource.get(key)
        if v is not None and v != "":
            out[label] = label_value(v)
    return out


def cumulative_buckets(p: HistogramPoint) -> list[tuple[str, float]] | None:
    """OTel per-bucket counts -> Prometheus ``(le, cumulative count)``; None when malformed."""
    if len(p.bucket_counts) != len(p.bounds) + 1 or any(c < 0 for c in p.bucket_counts):
        return None
    if any(not b < c for b, c in zip(p.bounds, p.bounds[1:], strict=False)) or any(math.isnan(b) for b in p.bounds):
        return None
    out: list[tuple[str, float]] = []
    running = 0
    for bound, c in zip(p.bounds, p.bucket_counts, strict=False):
        running += c
        if math.isinf(bound):
            continue
        out.append((str(floatToGoString(bound)), float(running)))  # type: ignore[no-untyped-call]
    out.append(("+Inf", float(max(p.count, running + p.bucket_counts[-1]))))
    return out


# -- the store ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Family:
    type: PromType
    doc: str


@dataclass(slots=True)
class _Series:
    value: float
    buckets: list[tuple[str, float]] | None  # histograms only; value is then the sum
    count: float
    seen: float  # time.monotonic() of the last update


SeriesKey = tuple[str, Labels]


class SeriesStore:
    """Latest value per (family, label set), bounded, with expiry. Thread safe."""

    def __init__(
        self,
        max_series: int = DEFAULT_MAX_SERIES,
        series_ttl_s: float = DEFAULT_SERIES_TTL_S,
        target_info: bool = True,
        max_series_per_uid: int = 0,
    ) -> None:
        self.max_series = max_series
        # Each producer uid's budget of series (0: a quarter of ``max_series``), so that one
        # user's processes cannot take the whole bound from everyone else's. Series without a
        # uid (the agent's own) count only against ``max_series``.
        self.max_series_per_uid = max_series_per_uid or max(1, max_series // UID_SHARE)
        self._owner_of: dict[SeriesKey, int] = {}
        self.series_of_uid: dict[int, int] = {}
        self.points_refused_uid_budget = 0  # points refused because their uid's budget was full
        self.series_ttl_s = series_ttl_s
        self.target_info = target_info
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        self._series: dict[SeriesKey, _Series] = {}
        self.points_dropped = 0  # refused by the series bound
        self.type_conflicts = 0  # same Prometheus name, different type (or a name another family has): the first wins
        self.name_conflicts = 0  # of them, a name another family's samples have (counter x and gauge x_total...)
        self._claims: dict[str, str] = {}  # each family's exposition names -> that family's name
        self.type_conflicts_between_uids = 0  # of them, points of a uid that holds no series of the name
        self._holders: dict[str, dict[int | None, int]] = {}  # name -> uid (None: no uid) -> its series of it
        self._conflicts_said: dict[int | None, set[str]] = {}  # refused uid -> the clashing names said for it
        self.malformed = 0  # histogram points with inconsistent buckets
        self.expired = 0

    def __len__(self) -> int:
        return len(self._series)

    def add(self, items: Iterable[Item], now: float | None = None) -> int:
        """Record the points of every :class:`MetricItem` in ``items``; returns points kept."""
        now = time.monotonic() if now is None else now
        kept = 0
        with self._lock:
            for it in items:
                if isinstance(it, MetricItem):
                    kept += self._add_item(it, now)
        return kept

    def _clash(self, name: str, typ: PromType) -> str | None:
        """The family (or the endpoint's own name) that holds a name a family ``name`` of ``typ`` would take
        in the exposition (:func:`exposition_names`); None when there is none."""
        for n in exposition_names(name, typ):
            if n in OWN_NAMES:
                return ""
            other = self._claims.get(n)
            if other is not None and other != name:
                return other
        return None

    def _family(self, name: str, typ: PromType, doc: str, owner: int | None = None, own: bool = False) -> bool:
        """Whether points of ``name`` as ``typ`` may be kept: a name has one type, the first kept, and one family
        in the exposition (no other family's samples, nor the endpoint's own families: :func:`exposition_names`).
        ``own``: the endpoint's own ``target_info``. A refusal is counted, and said once per name and pair of uids
        (another uid holding the name is a clash an operator must see: that user's series of the name are what
        the scrape has)."""
        fam = self._families.get(name)
        holder: str | None = name
        if fam is None or fam.type == typ:
            holder = None if own else self._clash(name, typ)
            if holder is None:
                return True
            self.name_conflicts += 1
        self.type_conflicts += 1
        holders = self._holders.get(holder, {}) if holder else {}
        mine = owner in holders
        self.type_conflicts_between_uids += not mine
        said = self._conflicts_said.get(owner)
        if said is None and len(self._conflicts_said) < MAX_CONFLICT_UIDS:
            said = self._conflicts_said[owner] = set()
        if said is not None and name not in said and len(said) < MAX_CONFLICTS_SAID_PER_UID:
            said.add(name)
            whose = "its own" if mine else " and ".join(
                "%s's" % _whose(u) for u in sorted(holders, key=lambda u: -1 if u is None else u)[:3])
            if holder == name and fam is not None:
                log.warning("Prometheus: %s's %s %s is not exported: %s %s holds that name (a name has one type; "
                            "rename one of them)", _whose(owner), typ, name, whose, fam.type)
            elif holder:
                log.warning("Prometheus: %s's %s %s is not exported: %s %s %s has a name it would take (a name is "
                            "one family's; rename one of them)", _whose(owner), typ, name, whose,
                            self._families[holder].type, holder)
            else:
                log.warning("Prometheus: %s's %s %s is not exported: the endpoint's own series have that name",
                            _whose(owner), typ, name)
        return False

    def _kept(self, name: str, typ: PromType, doc: str) -> None:
        """A series of ``name`` was kept: its family exists from now on. (A family made before any series
        was, one per distinct name refused by the series budget, had grown the agent by 150 MiB.)"""
        if name not in self._families:
            self._families[name] = _Family(typ, doc)
            for n in exposition_names(name, typ):
                self._claims.setdefault(n, name)

    def _put(self, key: SeriesKey, series: _Series, owner: int | None = None) -> bool:
        if key not in self._series:
            if len(self._series) >= self.max_series:
                self.points_dropped += 1
                return False
            if owner is not None:
                held = self.series_of_uid.get(owner, 0)
                if held >= self.max_series_per_uid:
                    self.points_dropped += 1
                    self.points_refused_uid_budget += 1
                    return False
                self.series_of_uid[owner] = held + 1
                self._owner_of[key] = owner
            holders = self._holders.setdefault(key[0], {})
            holders[owner] = holders.get(owner, 0) + 1
        self._series[key] = series
        return True

    def _forget(self, key: SeriesKey) -> None:
        del self._series[key]
        owner = self._owner_of.pop(key, None)
        if owner is not None:
            n = self.series_of_uid.get(owner, 1) - 1
            if n > 0:
                self.series_of_uid[owner] = n
            else:
                self.series_of_uid.pop(owner, None)
        holders = self._holders.get(key[0])
        if holders is not None:
            left = holders.get(owner, 1) - 1
            if left > 0:
                holders[owner] = left
            else:
                holders.pop(owner, None)
                if not holders:
                    del self._holders[key[0]]

    def _add_item(self, m: MetricItem, now: float) -> int:
        name, typ = metric_name(m), prom_type(m)
        uid = m.resource.get(OWNER_ATTR)
        owner = uid if type(uid) is int else None
        if not m.points or not self._family(name, typ, m.description or m.name, owner):
            return 0
        base = resource_labels(m.resource)
        if self.target_info and self._family(TARGET_INFO, "gauge", "Target metadata", own=True):
            info = {**labels_of(m.resource.as_dict()), **base}
            if self._put((TARGET_INFO, tuple(sorted(info.items()))), _Series(1.0, None, 0.0, now), owner):
                self._kept(TARGET_INFO, "gauge", "Target metadata")
        kept = 0
        for p in m.points:
            labels = {**point_labels(p.attributes), **base}
            if isinstance(p, HistogramPoint):
                if typ != "histogram":
                    continue
                if "le" in labels:
                    labels["key_le"] = labels.pop("le")
                buckets = cumulative_buckets(p)
                if buckets is None:
                    self.malformed += 1
                    continue
                series = _Series(float(p.sum), buckets, buckets[-1][1], now)
            elif isinstance(p, NumberPoint) and typ != "histogram":
                series = _Series(float(p.value), None, 0.0, now)
            else:
                continue
            kept += self._put((name, tuple(sorted(labels.items()))), series, owner)
        if kept:
            self._kept(name, typ, m.description or m.name)
        return kept

    def expire(self, now: float | None = None) -> None:
        if self.series_ttl_s <= 0:
            return
        horizon = (time.monotonic() if now is None else now) - self.series_ttl_s
        with self._lock:
            old = [k for k, s in self._series.items() if s.seen < horizon]
            for k in old:
                self._forget(k)
            self.expired += len(old)
            if old:
                live = {k[0] for k in self._series}
                for name in [n for n in self._families if n not in live]:
                    fam = self._families.pop(name)
                    for n in exposition_names(name, fam.type):
                        if self._claims.get(n) == name:
                            del self._claims[n]
                    for said in self._conflicts_said.values():  # a name free again may clash anew: said again
                        said.discard(name)

    def families(self) -> list[Metric]:
        """prometheus-client metric families for one scrape, names sorted."""
        with self._lock:
            by_name: dict[str, list[tuple[Labels, _Series]]] = {}
            for (name, labels), s in self._series.items():
                by_name.setdefault(name, []).append((labels, s))
            fams = {n: self._families[n] for n in by_name}
            dropped, count = self.points_dropped, len(self._series)
        out: list[Metric] = []
        for name in sorted(by_name):
            fam = fams[name]
            rows = sorted(by_name[name], key=lambda r: r[0])
            if fam.type == "counter":
                base = name[: -len("_total")] if name.endswith("_total") else name
                metric = Metric(base, fam.doc, "counter")
                for labels, s in rows:
                    metric.add_sample(base + "_total", dict(labels), s.value)
            elif fam.type == "histogram":
                metric = Metric(name, fam.doc, "histogram")
                for labels, s in rows:
                    d = dict(labels)
                    for le, c in s.buckets or ():
                        metric.add_sample(name + "_bucket", {**d, "le": le}, c)
                    metric.add_sample(name + "_count", d, s.count)
                    metric.add_sample(name + "_sum", d, s.value)
            else:
                metric = Metric(name, fam.doc, "gauge")
                for labels, s in rows:
                    metric.add_sample(name, dict(labels), s.value)
            out.append(metric)
        own = Metric(DROPPED_METRIC, POINTS_DROPPED.description, "counter")
        own.add_sample(DROPPED_METRIC + "_total", {}, float(dropped))
        out.append(own)
        gauge = Metric(SERIES_METRIC, SERIES_HELD.description, "gauge")
        gauge.add_sample(SERIES_METRIC, {}, float(count))
        out.append(gauge)
        return out


IDLE_TIMEOUT_S = 10.0  # a scrape connection that sends nothing this long is closed (its thread freed)
MAX_SCRAPE_CONNECTIONS = 32  # served at once; past it the longest idle one gives way, else it is refused (counted)
EVICT_IDLE_S = 0.5  # a connection idle this long (no request under way) gives way to a new one when all are taken
EVICT_WAIT_S = 0.5  # how long the new one then waits for the evicted one's thread to end
TCP_TABLE_BYTES = 4 << 20  # of a kernel TCP table read at most (a host with very many sockets)
MAX_CONNECTIONS_PER_UID = 8  # a local peer's uid (the kernel's socket table) may hold this many of them at once


def _table_key(host: str, port: int) -> tuple[str, str] | None:
    """(table, local address as the kernel's TCP table writes it) of a loopback peer; None for a remote one."""
    if ":" in host:  # an IPv6 peer: only ::1 and v4-mapped loopback are local
        packed = socket.inet_pton(socket.AF_INET6, host)
        if packed != socket.inet_pton(socket.AF_INET6, "::1") and not host.startswith("::ffff:127."):
            return None
        return "tcp6", "%08X%08X%08X%08X:%04X" % (*struct.unpack("=4I", packed), port)
    if not host.startswith("127."):
        return None
    return "tcp", "%08X:%04X" % (struct.unpack("=I", socket.inet_aton(host))[0], port)


def loopback_peer_uids(peers: Iterable[tuple[str, int]], net: str = "/proc/self/net") -> dict[tuple[str, int], int]:
    """The uid owning each local socket ``(host, port)`` that connected to us (its line in this network namespace's
    TCP tables, where the kernel writes each socket's owner; one read of each table); remote peers and ones not
    found are left out."""
    keys: dict[tuple[str, str], tuple[str, int]] = {}
    for host, port in peers:
        try:
            key = _table_key(host, port)
        except (OSError, ValueError, struct.error):
            continue
        if key is not None:
            keys[key] = (host, port)
    out: dict[tuple[str, int], int] = {}
    for table in {t for t, _local in keys}:
        try:
            with open(os.path.join(net, table), "rb") as f:
                text = f.read(TCP_TABLE_BYTES).decode("ascii", "replace")
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            fields = line.split()
            peer = keys.get((table, fields[1])) if len(fields) > 7 else None
            if peer is not None:
                try:
                    out[peer] = int(fields[7])
                except ValueError:
                    pass
    return out


def guard_connections(server: Any, counts: Any) -> None:
    """prometheus_client's server serves each connection on a thread of its own and waits for a request
    without limit: 150 idle clients held 154 threads, and enough of them would have taken the agent's threads
    or descriptors. Each connection now gets IDLE_TIMEOUT_S, and at most MAX_SCRAPE_CONNECTIONS are served at
    once. When all are taken, the connection idle longest (past EVICT_IDLE_S, with no request under way) is
    closed for the new one (``counts.scrape_connections_evicted``): any local user could otherwise hold every
    slot with idle connections, renewed within IDLE_TIMEOUT_S, and no scrape got through (a review's attack).
    ``counts.scrape_connections_refused`` counts the connections turned away."""
    # id(socket) -> [socket, idle since (monotonic) or None while serving, peer (host, port), its uid once known]
    conns: dict[int, list[Any]] = {}
    lock = threading.Lock()

    def mark(request: Any, idle: bool) -> None:
        with lock:
            entry = conns.get(id(request))
            if entry is not None:
                entry[1] = time.monotonic() if idle else None

    class TimedHandler(server.RequestHandlerClass):  # type: ignore[misc,name-defined]
        timeout = IDLE_TIMEOUT_S

        def parse_request(self) -> bool:
            # (wsgiref's handler reads one request a connection: its request line, then this reads the headers)
            ok: bool = super().parse_request()
            if ok:  # read whole: under way, never evicted; one that dribbles its headers is idle, and may give way
                mark(self.request, False)
            return ok

    server.RequestHandlerClass = TimedHandler
    active = threading.BoundedSemaphore(MAX_SCRAPE_CONNECTIONS)
    spawn, serve_one = server.process_request, server.process_request_thread

    def evict_idlest() -> bool:
        cutoff = time.monotonic() - EVICT_IDLE_S
        with lock:
            idle = [(e[1], e[0]) for e in conns.values() if e[1] is not None and e[1] <= cutoff]
        if not idle:
            return False
        try:
            min(idle, key=lambda x: x[0])[1].shutdown(socket.SHUT_RDWR)  # its thread reads EOF and ends
        except OSError:
            pass
        return True

    def uid_full(peer: tuple[str, int]) -> bool:
        """Whether the peer's uid (a local one) holds its share of the connections already. The kernel's table is
        read only once that many are open at all (a scrape of a quiet endpoint reads none), for the new peer and
        the open ones whose uid is not known yet."""
        with lock:
            if len(conns) < MAX_CONNECTIONS_PER_UID:
                return False
            unknown = [e[2] for e in conns.values() if e[3] is None]
        uids = loopback_peer_uids([peer, *unknown])
        uid = uids.get(peer)
        with lock:
            for e in conns.values():
                if e[3] is None and e[2] in uids:
                    e[3] = uids[e[2]]
            return uid is not None and sum(1 for e in conns.values() if e[3] == uid) >= MAX_CONNECTIONS_PER_UID

    def process_request(request: Any, client_address: Any) -> None:
        try:
            peer = (str(client_address[0]), int(client_address[1]))
        except (IndexError, TypeError, ValueError):
            peer = ("", 0)
        # one local user's connections cannot take every slot, idle or writing to a reader that never reads
        if uid_full(peer):
            counts.scrape_connections_refused += 1
            counts.scrape_connections_over_uid += 1
            server.shutdown_request(request)
            return
        if not active.acquire(blocking=False):
            if not (evict_idlest() and active.acquire(timeout=EVICT_WAIT_S)):
                counts.scrape_connections_refused += 1
                server.shutdown_request(request)
                return
            counts.scrape_connections_evicted += 1
        with lock:
            conns[id(request)] = [request, time.monotonic(), peer, None]
        try:
            spawn(request, client_address)
        except BaseException:
            with lock:
                conns.pop(id(request), None)
            active.release()
            raise

    def process_request_thread(request: Any, client_address: Any) -> None:
        try:
            serve_one(request, client_address)
        finally:
            with lock:
                conns.pop(id(request), None)
            active.release()

    server.process_request = process_request
    server.process_request_thread = process_request_thread
    say_error = server.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):  # an idle or gone client: no traceback
            return
        say_error(request, client_address)

    server.handle_error = handle_error


class WarmingGauges:
    """``infersight_coldstart_eta_seconds`` and ``..._progress_ratio``, only while a cold start runs.

    Labelled by service. The agent's update for a service describes its least advanced
    warming process (workers: the service is ready when the last one is).
    """

    ETA = prometheus_name(COLDSTART_ETA)
    PROGRESS = prometheus_name(COLDSTART_PROGRESS)

    def __init__(self) -> None:
        self.states: dict[str, dict[str, Any]] = {}

    def add(self, items: Iterable[Item]) -> None:
        for it in items:
            if isinstance(it, ColdStartProgress):
                if it.state is None:
                    self.states.pop(it.service, None)
                else:
                    self.states[it.service] = it.state

    def families(self) -> list[Metric]:
        out = []
        for name, field, doc in ((self.ETA, "eta_s", COLDSTART_ETA.description),
                                 (self.PROGRESS, "progress", COLDSTART_PROGRESS.description)):
            rows = [(svc, st[field]) for svc, st in sorted(self.states.items())
                    if isinstance(st.get(field), (int, float))]
            if rows:
                m = Metric(name, doc, "gauge")
                for service, v in rows:
                    m.add_sample(name, {"service": service}, float(v))
                out.append(m)
        return out


class RoutingGauges:
    """``infersight_routing_weight_ratio`` (0-1) and ``infersight_instance_settled`` (0/1) per
    serving instance, labelled ``service`` and ``port`` (its listening TCP port); gone with it."""

    WEIGHT = prometheus_name(ROUTING_WEIGHT)
    SETTLED = prometheus_name(INSTANCE_SETTLED)

    def __init__(self) -> None:
        self.states: dict[tuple[str, int], dict[str, Any]] = {}

    def add(self, items: Iterable[Item]) -> None:
        for it in items:
            if isinstance(it, RoutingHint):
                if it.state is None:
                    self.states.pop((it.service, it.port), None)
                else:
                    self.states[(it.service, it.port)] = it.state

    def families(self) -> list[Metric]:
        out = []
        for name, field, doc in ((self.WEIGHT, "weight_ratio", ROUTING_WEIGHT.description),
                                 (self.SETTLED, "settled", INSTANCE_SETTLED.description)):
            rows = [(key, st[field]) for key, st in sorted(self.states.items())
                    if isinstance(st.get(field), (int, float))]
            if rows:
                m = Metric(name, doc, "gauge")
                for (service, port), v in rows:
                    m.add_sample(name, {"service": service, "port": str(port)}, float(v))
                out.append(m)
        return out


class _Collector:
    """The prometheus-client collector: renders the store on every scrape."""

    def __init__(self, exporter: PrometheusExporter) -> None:
        self._exporter = exporter

    def describe(self) -> list[Metric]:
        return []  # dynamic names: no registration-time collision checks

    def collect(self) -> Iterable[Metric]:
        self._exporter.scrapes += 1
        self._exporter.store.expire()
        return [*self._exporter.store.families(), *self._exporter.progress.families(),
                *self._exporter.routing.families()]


# -- the exporter ------------------------------------------------------------------------------


class PrometheusExporter:
    """A ``/metrics`` endpoint (prometheus-client's threaded WSGI server) over a :class:`SeriesStore`."""

    live = True  # serves the current value: gets every device sample (see exporters.base.is_live)

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        max_series: int = DEFAULT_MAX_SERIES,
        series_ttl_s: float = DEFAULT_SERIES_TTL_S,
        target_info: bool = True,
        max_series_per_uid: int = 0,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError("port %d outside 0..65535" % port)
        if max_series < 1:
            raise ValueError("max_series must be at least 1")
        self.name = "prometheus"
        self.host = strip_host(host) or DEFAULT_HOST
        self.port = port
        self.store = SeriesStore(max_series, series_ttl_s, target_info, max_series_per_uid)
        self.progress = WarmingGauges()
        self.routing = RoutingGauges()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self.scrapes = 0
        self.scrape_connections_refused = 0  # past MAX_SCRAPE_CONNECTIONS served at once (guard_connections)
        self.scrape_connections_evicted = 0  # idle ones closed for a new one when all were taken
        self.scrape_connections_over_uid = 0  # refused: their local uid held MAX_CONNECTIONS_PER_UID already
        self.last_error = ""
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._last_bind_try = -math.inf
        self._closed = False

    # -- address ----------------------------------------------------------------------------

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def bound_port(self) -> int | None:
        """The port actually bound (useful with ``port=0``); None while not listening."""
        return None if self._server is None else int(self._server.server_address[1])

    @property
    def url(self) -> str | None:
        if self.bound_port is None:
            return None
        host = "[%s]" % self.host if ":" in self.host else self.host
        return "http://%s:%d/metrics" % (host, self.bound_port)

    def _bind(self) -> None:
        self._last_bind_try = time.monotonic()
        try:
            server, thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as exc:
            self.last_error = "cannot listen on %s:%d: %s" % (self.host, self.port, exc)
            raise
        thread.name = "infersight-prometheus"
        guard_connections(server, self)
        self._server, self._thread = server, thread
        self.last_error = ""
        log.info("prometheus endpoint on %s", self.url)

    # -- Exporter protocol ------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the endpoint. A bind failure raises :class:`ExportError`; later exports retry it."""
        if self._server is not None or self._closed:
            return
        try:
            self._bind()
        except OSError:
            raise ExportError("prometheus: " + self.last_error, retryable=True) from None

    async def export(self, batch: Sequence[Item]) -> None:
        """Record the batch's metric points. Never raises: a pull endpoint has nothing to retry."""
        self.store.add(batch)
        self.progress.add(batch)
        self.routing.add(batch)
        if self._server is None and not self._closed and time.monotonic() - self._last_bind_try >= REBIND_INTERVAL_S:
            try:
                self._bind()
            except OSError:
                pass

    def problem(self) -> str:
        """Why the endpoint serves nothing now ("" while it listens): its exports never fail,
        so the agent's health asks this (a port in use makes the agent unhealthy)."""
        if self._server is None and not self._closed:
            return self.last_error or "not listening on %s:%d" % (self.host, self.port)
        return ""

    async def force_flush(self, timeout_s: float) -> bool:
        return True

    async def shutdown(self) -> None:
        self._closed = True
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        await asyncio.to_thread(server.shutdown)
        server.server_close()
        if thread is not None:
            await asyncio.to_thread(thread.join, 2.0)

    def state(self) -> dict[str, int | float | str]:
        return {
            "listening": int(self.listening),
            "address": "%s:%d" % (self.host, self.bound_port if self.bound_port is not None else self.port),
            "series": len(self.store),
            "points_dropped": self.store.points_dropped,
            "points_refused_uid_budget": self.store.points_refused_uid_budget,
            "type_conflicts": self.store.type_conflicts,
            "type_conflicts_between_uids": self.store.type_conflicts_between_uids,
            "name_conflicts": self.store.name_conflicts,
            "malformed_points": self.store.malformed,
            "series_expired": self.store.expired,
            "scrapes": self.scrapes,
            "scrape_connections_refused": self.scrape_connections_refused,
            "scrape_connections_evicted": self.scrape_connections_evicted,
            "scrape_connections_over_uid": self.scrape_connections_over_uid,
            "last_error": self.last_error,
        }


def shipped_rule_files() -> list[Path]:
    """The Prometheus rule files shipped as package data: ``alerts.yml``, ``coldstart.yml``, ``recording.yml``."""
    return sorted((Path(__file__).resolve().parent / "prometheus").glob("*.yml"))


# -- configuration -----------------------------------------------------------------------------


def _p_max_series(v: Any) -> int:
    n = _p_int(v)
    if n < 1:
        raise ValueError("expected a positive integer")
    return n


def _p_nonneg(v: Any) -> int:
    n = _p_int(v)
    if n < 0:
        raise ValueError("expected a non-negative integer")
    return n


def _p_ttl(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError("expected a number of seconds")
    x = float(v)
    if not (x >= 0 and math.isfinite(x)):
        raise ValueError("expected a non-negative number of seconds (0: never expire)")
    return x


_K = "exporters.prometheus."
PROMETHEUS_KEYS: tuple[Key, ...] = (
    Key(_K + "enabled", _p_bool, lambda: False, "INFERSIGHT_PROMETHEUS", "serve /metrics for Prometheus to scrape"),
    Key(_K + "host", parse_listen_host, lambda: DEFAULT_HOST, "INFERSIGHT_PROMETHEUS_HOST",
        "address the endpoint binds (0.0.0.0 or :: exposes it on every interface)"),
    Key(_K + "port", parse_listen_port, lambda: DEFAULT_PORT, "INFERSIGHT_PROMETHEUS_PORT", "port of the endpoint"),
    Key(_K + "max_series", _p_max_series, lambda: DEFAULT_MAX_SERIES, "INFERSIGHT_PROMETHEUS_MAX_SERIES",
        "series held at most; points past it are dropped and counted"),
    Key(_K + "max_series_per_uid", _p_nonneg, lambda: 0, "INFERSIGHT_PROMETHEUS_MAX_SERIES_PER_UID",
        "series one producer uid may hold (0: a quarter of max_series); past it its points are dropped and counted"),
    Key(_K + "series_ttl_s", _p_ttl, lambda: DEFAULT_SERIES_TTL_S, "INFERSIGHT_PROMETHEUS_SERIES_TTL_S",
        "drop a series no export refreshed for this long (0: never)"),
    Key(_K + "target_info", _p_bool, lambda: True, "INFERSIGHT_PROMETHEUS_TARGET_INFO",
        "expose all resource attributes on a target_info series"),
)  # fmt: skip


def from_config(config: Config, *, env: Mapping[str, str] | None = None) -> PrometheusExporter | None:
    """The exporter a configuration asks for, or None unless ``exporters.prometheus.enabled``.

    Raises :class:`ConfigError` naming the key (and ``file:line``) for a bad or unknown key.
    """
    env = os.environ if env is None else env
    v = section_settings(config, _K, PROMETHEUS_KEYS, env)
    if not v["enabled"]:
        return None
    if v["host"] in ("0.0.0.0", "::"):
        log.warning("prometheus endpoint configured on all interfaces (%s)", v["host"])
    return PrometheusExporter(
        v["host"],
        v["port"],
        max_series=v["max_series"],
        series_ttl_s=v["series_ttl_s"],
        target_info=v["target_info"],
        max_series_per_uid=v["max_series_per_uid"],
    )


__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "PROMETHEUS_KEYS",
    "PrometheusExporter",
    "SeriesStore",
    "from_config",
    "label_name",
    "metric_name",
    "shipped_rule_files",
]
