"""Request latency windows: what the requests and devices features share.

The requests feature fills a :class:`LatencyWindow` per device, model and request class
(:class:`SeriesKey`) from the ``req`` events; the devices feature reads it for its
slow-device verdicts, tells it which devices NVML lists (:class:`NvmlDevice`) and publishes
its histograms with each interval's device samples, all through :class:`RequestWindows`.
Both read the window's length from one key, :data:`WINDOW_KEY` (``devices.window_s``).

Percentiles are **nearest-rank**: the value at rank ``ceil(p/100 * n)`` of the sorted
values, so every percentile is an observed latency; with fewer than 100 values P99 is the
maximum.

Neutral: plain values, pure functions and a protocol over them, so neither feature imports
the other.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from infersight.settings import Key, seconds_in
from infersight.telemetry import MetricItem, Resource


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending sequence; ``p`` in (0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 < p <= 100.0:
        raise ValueError(f"percentile {p} outside (0, 100]")
    rank = math.ceil(round(p * len(sorted_values) / 100.0, 9))
    return sorted_values[max(rank, 1) - 1]


@dataclass(frozen=True, slots=True)
class SeriesKey:
    device: str  # hw.id (GPU-<uuid>), or "cpu" / "cuda:N" for the baseline
    model: str
    request_class: str
    device_kind: str = ""  # e.g. the product name; "" compares across kinds


@dataclass(frozen=True, slots=True)
class SeriesStats:
    key: SeriesKey
    count: int
    p50_s: float
    p99_s: float


def series_stats(key: SeriesKey, latencies_s: Iterable[float]) -> SeriesStats | None:
    values = sorted(latencies_s)
    if not values:
        return None
    return SeriesStats(key, len(values), percentile(values, 50), percentile(values, 99))


class LatencyWindow:
    """Sliding window of request latencies per series: by age (``window_s``) and count."""

    def __init__(self, window_s: float = 300.0, max_per_series: int = 4096) -> None:
        self.window_s = window_s
        self.max_per_series = max_per_series
        self._series: dict[SeriesKey, deque[tuple[float, float]]] = {}

    def add(self, key: SeriesKey, latency_s: float, at_s: float) -> None:
        q = self._series.get(key)
        if q is None:
            q = self._series[key] = deque(maxlen=self.max_per_series)
        q.append((at_s, latency_s))

    def expire(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        for key in list(self._series):
            q = self._series[key]
            while q and q[0][0] < horizon:
                q.popleft()
            if not q:
                del self._series[key]

    def stats(self, now_s: float) -> list[SeriesStats]:
        self.expire(now_s)
        out = []
        for key, q in self._series.items():
            s = series_stats(key, (v for _, v in q))
            if s is not None:
                out.append(s)
        return out


@dataclass(frozen=True, slots=True)
class NvmlDevice:
    """A device as NVML lists it: what maps a request's ``cuda:N`` to its ``hw.id``."""

    index: int
    uuid: str | None
    name: str | None


class RequestWindows(Protocol):
    """What the device job reads from the request statistics, and tells them."""

    window: LatencyWindow  # the successful requests of the window, per series
    names: dict[str, str | None]  # hw.id -> hw.name, as the hooks reported them

    def set_devices(self, devices: list[NvmlDevice]) -> None:
        """The devices NVML lists now (resolves ``cuda:N`` to ``hw.id``)."""

    def collect(self, now_ns: int | None = None, everything: bool = False) -> list[MetricItem]:
        """The histograms that changed since the last call (all of them with ``everything``)."""

    def self_metrics(self, resource: Resource, start_ns: int, now_ns: int) -> list[MetricItem]:
        """The statistics' own counters, as the agent's metrics."""


DEFAULT_WINDOW_S = 300.0
WINDOW_KEY = Key("devices.window_s", seconds_in(1.0, 86400.0), lambda: DEFAULT_WINDOW_S, "INFERSIGHT_DEVICES_WINDOW_S",
                 "sliding window of requests and device samples for verdicts")
