"""Per-device latency figures, peer coefficients and slow-device verdicts (pure).

Method, stated once:

- **Percentiles** (P50, P99 of one device's window) are **nearest-rank**
  (:func:`infersight.latency.percentile`): every percentile is an observed latency. With
  fewer than 100 requests P99 is the maximum, hence ``min_requests`` (default 100).
- **Series are per uid**: a series' key holds its producers' uid, and its **peers** are the
  same uid's series on other devices with the same ``model``, ``request_class`` and
  ``device_kind`` that have at least ``min_requests`` requests in the window. One uid's
  requests never weigh in another uid's verdicts.
- **Coefficient** = the device's P99 / the median of its peers' P99 (``statistics.median``: the
  mean of the two middle values for an even count), at most :data:`MAX_COEFFICIENT`. No peer:
  ``no_peers``, coefficient None.
- **Verdict**: judged on the P99's lower confidence bound
  (:func:`infersight.latency.p99_lower_bound`) over the same median: ``slow`` when it exceeds
  ``slow_coefficient``, else ``ok``; ``insufficient_data`` below ``min_requests``. With the
  previous evaluation's verdicts (``before``, the device job) there is hysteresis: a series
  turns slow after ``slow_evaluations`` evaluations in a row over ``slow_coefficient`` and
  stays slow while the judged coefficient stays above ``recover_coefficient``. A slow
  verdict's cause is the first of :data:`~infersight.rules.device_rules.CAUSES` that the
  device's NVML window supports; throttling and link and clock shares are of busy samples.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infersight.agent.devices.nvml import DeviceSample
from infersight.latency import SeriesKey, SeriesStats
from infersight.rules.device_rules import DeviceExample, DeviceThresholds


@dataclass(frozen=True, slots=True)
class WindowState:
    """What NVML said about one device over the window (counts of samples)."""

    samples: int = 0
    busy_samples: int = 0  # GPU utilization >= busy_utilization_pct (or unknown)
    thermal_samples: int = 0  # busy, a thermal reason active
    power_samples: int = 0  # busy, a power reason active
    pcie_below_max_samples: int = 0  # busy, link generation or width below max
    clocks_below_max_samples: int = 0  # busy, SM clock < clock_ratio * max, no reason at all
    ecc_errors: int = 0  # rise of volatile ECC errors (corrected + uncorrected) in the window
    lost: bool = False
    pcie_detail: str | None = None  # e.g. "Gen3 x8 of Gen5 x16", from the last degraded sample


def _link_text(gen: int | None, width: int | None, gmax: int | None, wmax: int | None) -> str:
    """``Gen3 x8 of Gen5 x16``, with only the parts NVML gave (never ``xNone``)."""
    def part(g: int | None, w: int | None) -> str:
        return " ".join(x for x in ("" if g is None else f"Gen{g}", "" if w is None else f"x{w}") if x)
    return f"{part(gen, width) or '?'} of {part(gmax, wmax) or '?'}"


class _Rise:
    """The rise of one volatile counter over the window: the increases between its successive
    readings. A reading NVML did not give (None) is skipped, not taken for 0; a fall (the
    driver reloaded) starts again from the new value."""

    __slots__ = ("last", "total")

    def __init__(self) -> None:
        self.last: int | None = None
        self.total = 0

    def add(self, value: int | None) -> None:
        if value is None:
            return
        if self.last is not None and value > self.last:
            self.total += value - self.last
        self.last = value


def summarize_samples(samples: Sequence[DeviceSample], th: DeviceThresholds) -> WindowState:
    """Fold one device's samples of the window (oldest first) into a :class:`WindowState`."""
    thermal = set(th.thermal_reasons)
    power = set(th.power_reasons)
    busy = therm = pwr = pcie = clocks = 0
    detail: str | None = None
    ecc = _Rise(), _Rise()  # corrected, uncorrected
    lost = False
    for s in samples:
        if s.lost:
            lost = True
            continue
        ecc[0].add(s.ecc_corrected_volatile)
        ecc[1].add(s.ecc_uncorrected_volatile)
        if s.utilization_gpu_pct is not None and s.utilization_gpu_pct < th.busy_utilization_pct:
            continue
        busy += 1
        reasons = set(s.throttle_reasons)
        therm += bool(reasons & thermal)
        pwr += bool(reasons & power)
        gen, gmax, width, wmax = (
            s.pcie_link_gen, s.pcie_link_gen_max, s.pcie_link_width, s.pcie_link_width_max
        )  # fmt: skip
        if (gen is not None and gmax is not None and gen < gmax) or (
            width is not None and wmax is not None and width < wmax
        ):
            pcie += 1
            detail = _link_text(gen, width, gmax, wmax)
        sm, sm_max = s.clock_sm_mhz, s.clock_sm_max_mhz
        # "no throttle reason" needs the reasons read: an unknown mask is no evidence of none
        if sm is not None and sm_max and sm < th.clock_ratio * sm_max and s.throttle_mask == 0:
            clocks += 1
    return WindowState(
        samples=sum(1 for s in samples if not s.lost),
        busy_samples=busy,
        thermal_samples=therm,
        power_samples=pwr,
        pcie_below_max_samples=pcie,
        clocks_below_max_samples=clocks,
        ecc_errors=ecc[0].total + ecc[1].total,
        lost=lost,
        pcie_detail=detail,
    )


def causes(w: WindowState | None, th: DeviceThresholds) -> list[tuple[str, str]]:
    """Every cause the window supports, in priority order, each with a one-line detail.
    ``[("unknown", ...)]`` when none applies."""
    if w is None or w.samples == 0:
        return [("unknown", "no device samples in the window")]
    out: list[tuple[str, str]] = []
    busy = w.busy_samples
    if busy and w.thermal_samples / busy >= th.throttle_share:
        out.append(("thermal_throttling", f"thermal throttling in {w.thermal_samples}/{busy} busy samples"))
    if busy and w.power_samples / busy >= th.throttle_share:
        out.append(("power_throttling", f"power throttling in {w.power_samples}/{busy} busy samples"))
    if busy and w.pcie_below_max_samples / busy >= th.pcie_below_max_share:
        link = w.pcie_detail or "link below max"
        msg = f"PCIe {link} in {w.pcie_below_max_samples}/{busy} busy samples"
        out.append(("pcie_link_degraded", msg))
    if w.ecc_errors >= th.ecc_min_errors > 0:
        out.append(("ecc_errors", f"{w.ecc_errors} new volatile ECC errors"))
    if busy and w.clocks_below_max_samples / busy >= th.clocks_below_max_share:
        msg = (
            f"SM clock below {th.clock_ratio:.0%} of max with no throttle reason in "
            f"{w.clocks_below_max_samples}/{busy} busy samples"
        )
        out.append(("clocks_below_max", msg))
    return out or [("unknown", "no NVML signal in the window explains it")]


@dataclass(frozen=True, slots=True)
class DeviceVerdict:
    key: SeriesKey
    count: int
    p50_s: float
    p99_s: float
    coefficient: float | None  # None without peers
    peer_median_p99_s: float | None
    peers: int
    verdict: str  # ok | slow | no_peers | insufficient_data
    cause: str | None  # the first cause, for slow verdicts only
    causes: tuple[str, ...] = ()
    detail: str = ""
    over: int = 0  # evaluations in a row over slow_coefficient (this one included)


MAX_COEFFICIENT = 100.0  # a coefficient past this is published as this (it says "broken", not how much)


def _peer_key(k: SeriesKey) -> tuple[int | None, str, str, str]:
    return (k.uid, k.model, k.request_class, k.device_kind)


def evaluate(
    series: Sequence[SeriesStats],
    windows: Mapping[str, WindowState],
    th: DeviceThresholds,
    before: Mapping[SeriesKey, DeviceVerdict] | None = None,
) -> list[DeviceVerdict]:
    """One verdict per series. ``windows`` is keyed by ``SeriesKey.device``. ``before`` (the
    previous evaluation's verdicts) turns hysteresis on; None judges this window alone."""
    groups: dict[tuple[int | None, str, str, str], list[SeriesStats]] = {}
    for s in series:
        groups.setdefault(_peer_key(s.key), []).append(s)
    out: list[DeviceVerdict] = []
    for s in series:
        peers = [
            o.p99_s for o in groups[_peer_key(s.key)] if o.key.device != s.key.device and o.count >= th.min_requests
        ]
        prev = None if before is None else before.get(s.key)
        out.append(_verdict(s, peers, windows.get(s.key.device), th, before is not None, prev))
    return out


def _make(
    s: SeriesStats,
    verdict: str,
    *,
    coefficient: float | None = None,
    median: float | None = None,
    peers: int = 0,
    found: Sequence[tuple[str, str]] = (),
    detail: str = "",
    over: int = 0,
) -> DeviceVerdict:
    return DeviceVerdict(
        s.key, s.count, s.p50_s, s.p99_s, coefficient, median, peers, verdict,
        found[0][0] if found else None, tuple(c for c, _ in found), detail, over,
    )  # fmt: skip


def _is_slow(judged: float, over: int, prev: DeviceVerdict | None, th: DeviceThresholds) -> bool:
    """Hysteresis: enter after ``slow_evaluations`` in a row over the threshold, leave at or
    below ``recover_coefficient``."""
    if prev is not None and prev.verdict == "slow" and judged > th.recover_coefficient:
        return True
    return over >= th.slow_evaluations


def _verdict(s: SeriesStats, peer_p99s: Sequence[float], w: WindowState | None, th: DeviceThresholds,
             hysteresis: bool = False, prev: DeviceVerdict | None = None) -> DeviceVerdict:
    n = len(peer_p99s)
    if s.count < th.min_requests:
        msg = f"{s.count} requests < min_requests {th.min_requests}"
        return _make(s, "insufficient_data", peers=n, detail=msg)
    if not peer_p99s:
        msg = "no other device of this kind runs this model and request class"
        return _make(s, "no_peers", detail=msg)
    median = statistics.median(peer_p99s)
    if median <= 0:
        return _make(s, "insufficient_data", median=median, peers=n, detail="peers' P99 is 0")
    coef = min(s.p99_s / median, MAX_COEFFICIENT)
    judged = min((s.p99_s if s.p99_low_s is None else s.p99_low_s) / median, MAX_COEFFICIENT)
    over = judged > th.slow_coefficient
    streak = (prev.over if prev is not None else 0) + 1 if over else 0
    if not (_is_slow(judged, streak, prev, th) if hysteresis else over):
        msg = f"P99 {coef:.2f}x peers, at least {judged:.2f}x (threshold {th.slow_coefficient}"
        msg += f"; over it {streak} of {th.slow_evaluations} evaluations)" if over else ")"
        return _make(s, "ok", coefficient=coef, median=median, peers=n, detail=msg, over=streak)
    found = causes(w, th)
    msg = f"P99 {coef:.2f}x peers: " + "; ".join(d for _, d in found)
    return _make(s, "slow", coefficient=coef, median=median, peers=n, found=found, detail=msg, over=streak)


def run_example(ex: DeviceExample, th: DeviceThresholds) -> DeviceVerdict:
    """Evaluate one rule-file example: the device and one synthetic series per peer P99."""
    dev = SeriesKey("dut", "m", "c")
    series = [SeriesStats(dev, ex.device_requests, ex.device_p99_s, ex.device_p99_s)]
    series += [SeriesStats(SeriesKey(f"peer{i}", "m", "c"), 1000, p, p) for i, p in enumerate(ex.peer_p99_s)]
    fields: dict[str, Any] = dict(ex.window)  # keys validated by the loader against WINDOW_KEYS
    windows = {"dut": WindowState(**fields)} if ex.window else {}
    return evaluate(series, windows, th)[0]
