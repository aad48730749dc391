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
- **Other processes** (``other_process``) are judged per series: a GPU process is the series'
  own when it, or one of its parents, is a process whose requests the series holds (``own``:
  PIDs as the agent sees them); it is *other* when NVML's PID was mapped and its parent chain
  read and none of them is the series', or when it is a live producer of the same uid that times
  another model's requests and none of this one's (``apart``: another server), or descends from
  one: even under a parent that makes the rest of the tree the series' own (two servers started by
  one hooked supervisor, or one server started by another, share a GPU as strangers would). Up
  its parent chain, the nearest of the two decides. A process it cannot place counts for neither
  side.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from infersight.agent.devices.nvml import DeviceSample, GpuProcess
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
    # busy, per-process use read, other processes' SM (summed) >= other_process_sm_pct
    other_process_samples: int = 0
    # busy, another compute process present, and no sample of the window had per-process use read
    other_present_samples: int = 0
    lost: bool = False
    lost_detail: str | None = None  # what NVML said when it lost the GPU
    pcie_detail: str | None = None  # e.g. "Gen3 x8 of Gen5 x16", from the last degraded sample
    other_detail: str | None = None  # the other processes seen most, e.g. "pid 4242 (uid 1001, python3) ..."


MAX_TRACKED_PIDS = 64  # other processes followed per window summary (a neighbour may start thousands)
MAX_NAMED_PIDS = 3  # of which a detail names at most this many
_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-+:@/")


def _is_other(g: GpuProcess, own: Collection[int], apart: Collection[int] = ()) -> bool | None:
    """Whether ``g`` is another process than ``own`` and their children; None when it cannot be placed
    (NVML's PID not mapped, or its parents not read). ``apart``: another server's processes (another
    model's, same uid), other with their children wherever they hang: of ``g`` and its parents, the
    nearest in ``own`` or ``apart`` decides."""
    if g.pid is None or g.ancestors is None:
        return False if g.pid in own else True if g.pid in apart else None
    for pid in (g.pid, *g.ancestors):
        if pid in own:
            return False
        if pid in apart:
            return True
    return True


def _label(g: GpuProcess) -> str:
    """``pid 4242 (uid 1001, python3)``: the name cut to 16 characters of a safe set (a process names
    itself: no newline, no forged words of ours)."""
    name = "".join(c if c in _NAME_OK else "_" for c in (g.name or "")[:16])
    who = ", ".join(x for x in ("" if g.uid is None else f"uid {g.uid}", name) if x)
    return f"pid {g.pid}" + (f" ({who})" if who else "")


class _Others:
    """Per other PID over the window: busy samples seen computing (or present), and SM % summed."""

    def __init__(self) -> None:
        self.seen: dict[int, list[Any]] = {}  # pid -> [label, samples, SM % summed]
        self.untracked = 0  # other PIDs past MAX_TRACKED_PIDS

    def add(self, g: GpuProcess, sm: int) -> None:
        assert g.pid is not None
        entry = self.seen.get(g.pid)
        if entry is None:
            if len(self.seen) >= MAX_TRACKED_PIDS:
                self.untracked += 1
                return
            entry = self.seen[g.pid] = [_label(g), 0, 0]
        entry[1] += 1
        entry[2] += sm

    def detail(self, busy: int, measured: bool) -> str | None:
        if not self.seen:
            return None
        ranked = sorted(self.seen.values(), key=lambda e: (-e[2], -e[1], e[0]))
        parts = []
        for label, n, total in ranked[:MAX_NAMED_PIDS]:
            share = f"{n / busy:.0%} of busy samples"
            parts.append(f"{label} used {total // n}% SM in {share}" if measured else f"{label} in {share}")
        more = max(0, len(ranked) - MAX_NAMED_PIDS)
        if more or self.untracked:  # "+61+ more": past MAX_TRACKED_PIDS others were not followed
            return ", ".join(parts) + f", +{more}{'+' if self.untracked else ''} more"
        return ", ".join(parts)


def _neighbours(samples: Sequence[DeviceSample], th: DeviceThresholds, own: Collection[int],
                apart: Collection[int] = ()) -> tuple[int, int, str | None]:
    """(busy samples where other processes used >= other_process_sm_pct SM, busy samples with another
    compute process present where no per-process use was read, the detail) over one device's window."""
    measured, present, busy, read = 0, 0, 0, False
    used, seen = _Others(), _Others()
    for s in samples:
        if s.lost or (s.utilization_gpu_pct is not None and s.utilization_gpu_pct < th.busy_utilization_pct):
            continue
        busy += 1
        others = [g for g in s.processes or () if _is_other(g, own, apart)]
        if s.process_util_read:
            read = True
            computing = [g for g in others if g.sm_pct]
            measured += sum(g.sm_pct or 0 for g in computing) >= th.other_process_sm_pct
            for g in computing:
                used.add(g, g.sm_pct or 0)
        elif others:
            present += 1
            for g in others:
                seen.add(g, 0)
    if read:  # measured use outranks presence: an idle neighbour is no evidence
        return measured, 0, used.detail(busy, True)
    return 0, present, seen.detail(busy, False)


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


def summarize_samples(samples: Sequence[DeviceSample], th: DeviceThresholds,
                      own: Collection[int] | None = None) -> WindowState:
    """Fold one device's samples of the window (oldest first) into a :class:`WindowState`.
    ``own``: the PIDs whose requests the judged series holds (their children count as theirs);
    None (not known) leaves the other-process fields at 0: nobody can be called other."""
    thermal = set(th.thermal_reasons)
    power = set(th.power_reasons)
    busy = therm = pwr = pcie = clocks = 0
    detail: str | None = None
    ecc = _Rise(), _Rise()  # corrected, uncorrected
    lost = False
    lost_detail: str | None = None
    for s in samples:
        if s.lost:
            lost = True
            lost_detail = s.lost_reason or lost_detail
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
    w = WindowState(
        samples=sum(1 for s in samples if not s.lost),
        busy_samples=busy,
        thermal_samples=therm,
        power_samples=pwr,
        pcie_below_max_samples=pcie,
        clocks_below_max_samples=clocks,
        ecc_errors=ecc[0].total + ecc[1].total,
        lost=lost,
        lost_detail=lost_detail,
        pcie_detail=detail,
    )
    return w if own is None else with_neighbours(w, samples, th, own)


def with_neighbours(w: WindowState, samples: Sequence[DeviceSample], th: DeviceThresholds,
                    own: Collection[int], apart: Collection[int] = ()) -> WindowState:
    """``w`` (the device's window, folded from ``samples``) with its other-process fields as a series whose
    processes are ``own`` sees them (``apart``: another server's, see :func:`_is_other`): only those are
    read again, not the whole window."""
    measured, present, others = _neighbours(samples, th, own, apart)
    return replace(w, other_process_samples=measured, other_present_samples=present, other_detail=others)


def causes(w: WindowState | None, th: DeviceThresholds) -> list[tuple[str, str]]:
    """Every cause the window supports, in priority order, each with a one-line detail.
    ``[("unknown", ...)]`` when none applies. A GPU NVML lost in the window comes first, with what NVML said,
    whether or not it was sampled before (a lost GPU's samples are no samples of it)."""
    out: list[tuple[str, str]] = []
    if w is not None and w.lost:
        out.append(("gpu_lost", f"NVML lost the GPU in the window: {w.lost_detail or 'GPU is lost'} "
                                "(hw.state failed; it needs a GPU reset or a reboot)"))
    if w is None or w.samples == 0:
        return out or [("unknown", "no device samples in the window")]
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
    others = f": {w.other_detail}" if w.other_detail else ""
    measured = busy and w.other_process_samples / busy >= th.other_process_share
    if measured:
        msg = (f"other processes used >= {th.other_process_sm_pct}% SM in "
               f"{w.other_process_samples}/{busy} busy samples{others}")
        out.append(("other_process", msg))
    if busy and w.clocks_below_max_samples / busy >= th.clocks_below_max_share:
        msg = (
            f"SM clock below {th.clock_ratio:.0%} of max with no throttle reason in "
            f"{w.clocks_below_max_samples}/{busy} busy samples"
        )
        out.append(("clocks_below_max", msg))
    if not measured and busy and w.other_present_samples / busy >= th.other_present_share:
        # weaker: NVML measured no per-process use here, so this says only that another process was there
        msg = (f"another compute process present in {w.other_present_samples}/{busy} busy samples "
               f"(per-process utilisation not supported: presence, not measured use){others}")
        out.append(("other_process", msg))
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


WindowOf = Callable[[SeriesKey], "WindowState | None"]


def evaluate(
    series: Sequence[SeriesStats],
    windows: Mapping[str, WindowState] | WindowOf,
    th: DeviceThresholds,
    before: Mapping[SeriesKey, DeviceVerdict] | None = None,
) -> list[DeviceVerdict]:
    """One verdict per series. ``windows`` is keyed by ``SeriesKey.device``, or is a function of
    the series (its window as that series' requests see it: who is another process), asked only
    for a slow verdict's cause. ``before`` (the previous evaluation's verdicts) turns hysteresis
    on; None judges this window alone."""
    window_of: WindowOf = windows if callable(windows) else (lambda k: windows.get(k.device))
    groups: dict[tuple[int | None, str, str, str], list[SeriesStats]] = {}
    for s in series:
        groups.setdefault(_peer_key(s.key), []).append(s)
    out: list[DeviceVerdict] = []
    for s in series:
        peers = [
            o.p99_s for o in groups[_peer_key(s.key)] if o.key.device != s.key.device and o.count >= th.min_requests
        ]
        prev = None if before is None else before.get(s.key)
        out.append(_verdict(s, peers, window_of, th, before is not None, prev))
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


def _verdict(s: SeriesStats, peer_p99s: Sequence[float], window_of: WindowOf, th: DeviceThresholds,
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
    found = causes(window_of(s.key), th)
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
