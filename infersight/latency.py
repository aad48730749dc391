"""Request latency windows: what the requests and devices features share.

The requests feature fills a :class:`LatencyWindow` per producer uid, device, model and
request class (:class:`SeriesKey`) from the ``req`` events; the devices feature reads it for
its slow-device verdicts, tells it which devices NVML lists (:class:`NvmlDevice`) and
publishes its histograms with each interval's device samples, all through
:class:`RequestWindows`. Both read the window's length from one key, :data:`WINDOW_KEY`
(``devices.window_s``).

Percentiles are **nearest-rank**: the value at rank ``ceil(p/100 * n)`` of the sorted
values, so every percentile is an observed latency; with fewer than 100 values P99 is the
maximum. :func:`p99_lower_bound` is the one-sided 95% lower confidence bound of the P99
(distribution-free, from the binomial law of the ranks), which the verdicts judge on.

Budgets (:class:`UidShare`): one uid (a producer's kernel uid; root and the agent's own
in-process producers aside) holds at most a quarter of the window's series and samples, and
of the request histograms' series; what is refused is counted per uid.

Neutral: plain values, pure functions and a protocol over them, so neither feature imports
the other.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from infersight.settings import Key, seconds_in
from infersight.telemetry import MetricItem, Resource

MAX_WINDOW_SERIES = 1024  # verdict-window series in all ((uid, device, model, class, kind))
MAX_WINDOW_SAMPLES = 1 << 19  # latencies in the window in all (about 60 MiB)
MAX_HISTOGRAM_SERIES = 4096  # the requests feature's histogram series in all
UID_SHARE = 4  # one uid holds at most a quarter of each table
MAX_SERIES_PIDS = 64  # producer PIDs remembered per series; past it the series' processes are not all known
UNKNOWN_PID = -1  # a request whose producer's process the agent cannot name (spool, another PID namespace)
Z95 = 1.6449  # one-sided 95% normal quantile


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending sequence; ``p`` in (0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 < p <= 100.0:
        raise ValueError(f"percentile {p} outside (0, 100]")
    rank = math.ceil(round(p * len(sorted_values) / 100.0, 9))
    return sorted_values[max(rank, 1) - 1]


_Entry = TypeVar("_Entry", bound=tuple[Any, ...])


def drop_ended_before(window: deque[_Entry], horizon: float) -> int:
    """Take the entries (end s first) that ended before ``horizon`` off the front of ``window``; how many."""
    n = 0
    while window and window[0][0] < horizon:
        window.popleft()
        n += 1
    return n


def p99_lower_bound(sorted_values: Sequence[float]) -> float:
    """One-sided ~95% lower confidence bound of the P99 of an ascending sequence: the order
    statistic at rank ``floor(0.99 n - 1.645 sqrt(0.99 * 0.01 n))`` (normal approximation of
    the binomial count of values below the true P99), at least rank 1."""
    n = len(sorted_values)
    if not n:
        raise ValueError("percentile of an empty sequence")
    rank = math.floor(0.99 * n - Z95 * math.sqrt(0.0099 * n))
    return sorted_values[min(max(rank, 1), n) - 1]


def owner(resource: Resource | Mapping[str, object]) -> int | None:
    """The producer's kernel uid (``process.user.id``), None when the agent has none."""
    uid = resource.get("process.user.id")
    return uid if type(uid) is int else None


@dataclass(frozen=True, slots=True)
class SeriesKey:
    device: str  # hw.id (GPU-<uuid>), or "cpu" / "cuda:N" for the baseline
    model: str
    request_class: str
    device_kind: str = ""  # e.g. the product name; "" compares across kinds
    uid: int | None = None  # the producers' uid: verdicts compare one uid's series only


@dataclass(frozen=True, slots=True)
class SeriesStats:
    key: SeriesKey
    count: int
    p50_s: float
    p99_s: float
    p99_low_s: float | None = None  # lower confidence bound of p99_s; None: p99_s itself


def series_stats(key: SeriesKey, latencies_s: Iterable[float]) -> SeriesStats | None:
    values = sorted(latencies_s)
    if not values:
        return None
    return SeriesStats(key, len(values), percentile(values, 50), percentile(values, 99), p99_lower_bound(values))


class UidShare:
    """Entries of one table per uid: at most ``total`` in all and ``total // UID_SHARE`` per
    uid (root, uid 0, and producers without a uid, the agent's own, only within ``total``);
    refusals are counted per uid."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.per_uid = max(1, total // UID_SHARE)
        self.held = 0
        self.counts: dict[int | None, int] = {}
        self.refused: dict[int | None, int] = {}

    def take(self, uid: int | None, n: int = 1) -> bool:
        """Count ``n`` more entries of ``uid``; False (and a refusal) when they do not fit."""
        has = self.counts.get(uid, 0)
        if self.held + n > self.total or (uid not in (None, 0) and has + n > self.per_uid):
            return self.refuse(uid)
        self.counts[uid] = has + n
        self.held += n
        return True

    def refuse(self, uid: int | None) -> bool:
        """Count a refusal of ``uid``'s; False."""
        self.refused[uid] = self.refused.get(uid, 0) + 1
        return False

    def give(self, uid: int | None, n: int = 1) -> None:
        left = self.counts.get(uid, 0) - n
        if left > 0:
            self.counts[uid] = left
        else:
            self.counts.pop(uid, None)
        self.held -= n

    def recount(self, uids: Iterable[int | None]) -> None:
        """Count the table again (one uid per entry), refusals kept."""
        self.counts = {}
        for uid in uids:
            self.counts[uid] = self.counts.get(uid, 0) + 1
        self.held = sum(self.counts.values())

    def refusals(self) -> dict[str, int]:
        """Refusals per uid, for ``status --json`` (``"-"``: producers without a uid)."""
        named = {"-" if uid is None else str(uid): n for uid, n in self.refused.items()}
        return dict(sorted(named.items()))


class LatencyWindow:
    """Sliding window of request latencies per series: by age (``window_s``) and count
    (``max_per_series``), within :class:`UidShare` budgets of series and samples. Each
    series' statistics are computed again only when it changed."""

    def __init__(self, window_s: float = 300.0, max_per_series: int = 4096, max_series: int = MAX_WINDOW_SERIES,
                 max_samples: int = MAX_WINDOW_SAMPLES) -> None:
        self.window_s = window_s
        self.max_per_series = max_per_series
        self._series: dict[SeriesKey, deque[tuple[float, float]]] = {}
        self._stats: dict[SeriesKey, SeriesStats] = {}  # the unchanged series' statistics
        # Per series, the kernel's PIDs of the processes whose requests it holds -> their last request's end.
        self._pids: dict[SeriesKey, dict[int, float]] = {}
        self.series = UidShare(max_series)
        self.samples = UidShare(max_samples)
        # The request histograms' series (kept by the requests feature, counted here so that
        # both request tables' refusals are read in one place).
        self.histograms = UidShare(MAX_HISTOGRAM_SERIES)

    def add(self, key: SeriesKey, latency_s: float, at_s: float, pid: int | None = None) -> bool:
        """Window one latency; False when the uid's (or the window's) budget refuses it. ``pid``:
        the kernel's PID (in the agent's namespace) of the process that timed it; None or 0: unknown."""
        q = self._series.get(key)
        if q is None:
            if not self.series.take(key.uid):
                return False
            q = self._series[key] = deque(maxlen=self.max_per_series)
        if len(q) == q.maxlen:
            q.popleft()  # the oldest goes: the uid's sample count is unchanged
        elif not self.samples.take(key.uid):
            if not q:
                self._drop(key)
            return False
        q.append((at_s, latency_s))
        self._stats.pop(key, None)
        pids = self._pids.setdefault(key, {})
        who = pid if pid is not None and pid > 0 else UNKNOWN_PID
        if who not in pids and len(pids) >= MAX_SERIES_PIDS:
            who = UNKNOWN_PID  # too many to name: the series' processes are not all known
        pids[who] = max(pids.get(who, at_s), at_s)
        return True

    def pids(self, key: SeriesKey, now_s: float) -> frozenset[int] | None:
        """The PIDs of the processes whose requests the series holds in the window (the kernel's, as
        the agent sees them); None when one of them is unknown, or the series has none."""
        pids = self._pids.get(key)
        if not pids:
            return None
        horizon = now_s - self.window_s
        for pid in [p for p, t in pids.items() if t < horizon]:
            del pids[pid]
        return None if not pids or UNKNOWN_PID in pids else frozenset(pids)

    def other_model_pids(self, key: SeriesKey, now_s: float) -> frozenset[int]:
        """The known PIDs timing requests of another model for the same uid in the window, less those that
        time the series' model too (in any request class, on any device): the uid's other servers."""
        horizon = now_s - self.window_s
        other: set[int] = set()
        same: set[int] = set()
        for k, pids in self._pids.items():
            if k.uid == key.uid:
                (same if k.model == key.model else other).update(
                    pid for pid, t in pids.items() if t >= horizon and pid != UNKNOWN_PID)
        return frozenset(other - same)

    def timing_pids(self) -> frozenset[int]:
        """Every known PID that times requests in the window (any series, any uid)."""
        return frozenset(pid for pids in self._pids.values() for pid in pids if pid != UNKNOWN_PID)

    def _drop(self, key: SeriesKey) -> None:
        del self._series[key]
        self._stats.pop(key, None)
        self._pids.pop(key, None)
        self.series.give(key.uid)

    def expire(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        for key in list(self._series):
            q = self._series[key]
            n = drop_ended_before(q, horizon)
            if n:
                self.samples.give(key.uid, n)
                self._stats.pop(key, None)
            if not q:
                self._drop(key)

    def stats(self, now_s: float) -> list[SeriesStats]:
        self.expire(now_s)
        out = []
        for key, q in self._series.items():
            s = self._stats.get(key)
            if s is None:
                s = series_stats(key, (v for _, v in q))
                if s is None:
                    continue
                self._stats[key] = s
            out.append(s)
        return out

    def refusals(self) -> dict[str, dict[str, int]]:
        """Per table, the refusals per uid (``status --json``)."""
        return {"window_series": self.series.refusals(), "window_samples": self.samples.refusals(),
                "histogram_series": self.histograms.refusals()}


@dataclass(frozen=True, slots=True)
class NvmlDevice:
    """A device as NVML lists it: what maps a request's ``cuda:N`` to its ``hw.id``."""

    index: int
    uuid: str | None
    name: str | None


class RequestWindows(Protocol):
    """What the device job reads from the request statistics, and tells them."""

    window: LatencyWindow  # the successful requests of the window, per series
    def name_of(self, uid: int | None, hw_id: str) -> str | None:
        """The name of device ``hw_id`` in ``uid``'s series: NVML's, else what that uid's hooks said."""

    def set_devices(self, devices: list[NvmlDevice]) -> None:
        """The devices NVML lists now (resolves ``cuda:N`` to ``hw.id``)."""

    def collect(self, now_ns: int | None = None, everything: bool = False) -> list[MetricItem]:
        """The histograms that changed since the last call (all of them with ``everything``)."""

    def self_metrics(self, resource: Resource, start_ns: int, now_ns: int) -> list[MetricItem]:
        """The statistics' own counters, as the agent's metrics."""


DEFAULT_WINDOW_S = 300.0
WINDOW_KEY = Key("devices.window_s", seconds_in(1.0, 86400.0), lambda: DEFAULT_WINDOW_S, "INFERSIGHT_DEVICES_WINDOW_S",
                 "sliding window of requests and device samples for verdicts")
