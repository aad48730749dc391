"""Device samples -> OTel metric items (pure).

Names follow the OTel hardware semantic conventions (``hw.*``) so that the series join with
DCGM's; everything else lives under ``infersight.device.*``. :data:`METRICS` is the single source
of the reference table (``docs/device_metrics.md``, regenerated with
``python -m infersight.agent.devices.metrics``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

from infersight.agent.devices.nvml import HW_STATES, DeviceSample, HwState
from infersight.metricspec import MetricSpec, declare, declared, prometheus_name
from infersight.rules.device_rules import THROTTLE_REASON_NAMES
from infersight.telemetry import Attributes, MetricItem, NumberPoint, Resource

NVML_AVAILABLE = "infersight.nvml.available"

METRICS: tuple[MetricSpec, ...] = declare(
    MetricSpec("hw.gpu.utilization", "gauge", "1", "GPU busy ratio (NVML utilization.gpu)",
               attributes=("hw.gpu.task",)),
    MetricSpec("hw.gpu.memory.usage", "sum", "By", "Device memory in use"),
    MetricSpec("hw.gpu.memory.limit", "sum", "By", "Device memory size"),
    MetricSpec("hw.errors", "sum", "{error}", "Volatile ECC errors since the driver loaded",
               monotonic=True, attributes=("error.type",)),
    MetricSpec("hw.status", "sum", "1", "1 for the current hw.state, 0 for the others",
               attributes=("hw.state",)),
    MetricSpec("infersight.device.memory.utilization", "gauge", "1",
               "Memory controller busy ratio (NVML utilization.memory)"),
    MetricSpec("infersight.device.clock.sm", "gauge", "MHz", "SM clock"),
    MetricSpec("infersight.device.clock.sm.max", "gauge", "MHz", "Maximum SM clock"),
    MetricSpec("infersight.device.clock.memory", "gauge", "MHz", "Memory clock"),
    MetricSpec("infersight.device.clock.memory.max", "gauge", "MHz", "Maximum memory clock"),
    MetricSpec("infersight.device.power", "gauge", "W", "Power draw"),
    MetricSpec("infersight.device.power.limit", "gauge", "W", "Enforced power limit"),
    MetricSpec("infersight.device.temperature", "gauge", "Cel", "GPU core temperature"),
    MetricSpec("infersight.device.throttle", "sum", "1",
               "1 while the clock-event (throttle) reason is active, per reason bit",
               attributes=("infersight.device.throttle.reason",)),
    MetricSpec("infersight.device.pcie.link.generation", "gauge", "{generation}",
               "Current PCIe link generation (idle GPUs downtrain it)"),
    MetricSpec("infersight.device.pcie.link.generation.max", "gauge", "{generation}",
               "Maximum PCIe link generation of device and slot"),
    MetricSpec("infersight.device.pcie.link.width", "gauge", "{lane}", "Current PCIe link width"),
    MetricSpec("infersight.device.pcie.link.width.max", "gauge", "{lane}",
               "Maximum PCIe link width"),
    MetricSpec("infersight.device.pcie.replay", "sum", "{replay}", "PCIe replay counter",
               monotonic=True),
    MetricSpec("infersight.device.ecc.retired_pages", "sum", "{page}",
               "Retired memory pages (pre-Ampere)", attributes=("infersight.device.ecc.cause",)),
    MetricSpec("infersight.device.ecc.remapped_rows", "sum", "{row}",
               "Remapped memory rows (Ampere and later)",
               attributes=("infersight.device.ecc.type",)),
    MetricSpec("infersight.device.ecc.remap_pending", "sum", "1",
               "1 when a row remap waits for a GPU reset"),
    MetricSpec("infersight.device.ecc.remap_failure", "sum", "1", "1 when a row remap failed"),
    MetricSpec("infersight.device.nvlink.state", "sum", "1", "1 per active NVLink, 0 per inactive",
               attributes=("infersight.device.nvlink.link",)),
    MetricSpec("infersight.device.process.memory.usage", "sum", "By",
               "Device memory per compute process (NVML host PID; process.pid when mapped)",
               attributes=("infersight.device.process.host_pid", "process.pid",
                           "process.executable.name", "infersight.device.process.mapped")),
)  # fmt: skip
SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}

def render_reference_markdown() -> str:
    """The metric reference table, one row per metric."""
    lines = [
        "| OTel name | kind | unit | Prometheus name | attributes | description |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in METRICS:
        kind: str = m.kind
        if m.kind == "sum":
            kind = "counter" if m.monotonic else "updowncounter"
        attrs = ", ".join(f"`{a}`" for a in m.attributes) or "-"
        lines.append(f"| `{m.name}` | {kind} | `{m.unit}` | `{prometheus_name(m)}` | {attrs} | {m.description} |")
    return "\n".join(lines) + "\n"


_SEVERITY = {"ok": 0, "degraded": 1, "failed": 2}


def worst(a: HwState, b: HwState) -> HwState:
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def hw_id(s: DeviceSample) -> str:
    """``GPU-<uuid>`` as NVML gives it; ``nvml-index-<n>`` if the UUID could not be read."""
    return s.uuid or f"nvml-index-{s.index}"


def identity(s: DeviceSample) -> Attributes:
    attrs: Attributes = {"hw.type": "gpu", "hw.id": hw_id(s), "hw.vendor": s.vendor}
    if s.name:
        attrs["hw.name"] = s.name
    attrs["infersight.device.index"] = s.index
    return attrs


_Points = dict[str, list[NumberPoint]]


def _scalar(out: _Points, name: str, ident: Attributes, value: float | int | None) -> None:
    if value is not None:
        out.setdefault(name, []).append(NumberPoint(value, dict(ident)))


_Tagged = Iterable[tuple[Attributes, float | int | None]]


def _tagged(out: _Points, name: str, ident: Attributes, pairs: _Tagged) -> None:
    for extra, value in pairs:
        if value is not None:
            out.setdefault(name, []).append(NumberPoint(value, {**ident, **extra}))


def _ratio(pct: int | None) -> float | None:
    return None if pct is None else pct / 100.0


def _flag(v: bool | None) -> int | None:
    return None if v is None else int(v)


def _points(s: DeviceSample, state: HwState, out: _Points) -> None:
    ident = identity(s)
    p = "infersight.device."
    _tagged(out, "hw.status", ident, (({"hw.state": st}, int(st == state)) for st in HW_STATES))
    if s.lost:
        return
    gpu_util = _ratio(s.utilization_gpu_pct)
    _tagged(out, "hw.gpu.utilization", ident, [({"hw.gpu.task": "general"}, gpu_util)])
    _scalar(out, "hw.gpu.memory.usage", ident, s.memory_used_bytes)
    _scalar(out, "hw.gpu.memory.limit", ident, s.memory_total_bytes)
    _tagged(out, "hw.errors", ident, [
        ({"error.type": "ecc_corrected"}, s.ecc_corrected_volatile),
        ({"error.type": "ecc_uncorrected"}, s.ecc_uncorrected_volatile),
    ])  # fmt: skip
    _scalar(out, p + "memory.utilization", ident, _ratio(s.utilization_memory_pct))
    _scalar(out, p + "clock.sm", ident, s.clock_sm_mhz)
    _scalar(out, p + "clock.sm.max", ident, s.clock_sm_max_mhz)
    _scalar(out, p + "clock.memory", ident, s.clock_memory_mhz)
    _scalar(out, p + "clock.memory.max", ident, s.clock_memory_max_mhz)
    _scalar(out, p + "power", ident, s.power_w)
    _scalar(out, p + "power.limit", ident, s.power_limit_w)
    _scalar(out, p + "temperature", ident, s.temperature_c)
    if s.throttle_mask is not None:
        active = set(s.throttle_reasons)
        names = list(THROTTLE_REASON_NAMES) + sorted(active - set(THROTTLE_REASON_NAMES))
        key = p + "throttle.reason"
        _tagged(out, p + "throttle", ident, (({key: n}, int(n in active)) for n in names))
    _scalar(out, p + "pcie.link.generation", ident, s.pcie_link_gen)
    _scalar(out, p + "pcie.link.generation.max", ident, s.pcie_link_gen_max)
    _scalar(out, p + "pcie.link.width", ident, s.pcie_link_width)
    _scalar(out, p + "pcie.link.width.max", ident, s.pcie_link_width_max)
    _scalar(out, p + "pcie.replay", ident, s.pcie_replay)
    _tagged(out, p + "ecc.retired_pages", ident, [
        ({p + "ecc.cause": "single_bit"}, s.retired_pages_sbe),
        ({p + "ecc.cause": "double_bit"}, s.retired_pages_dbe),
    ])  # fmt: skip
    _tagged(out, p + "ecc.remapped_rows", ident, [
        ({p + "ecc.type": "corrected"}, s.remapped_rows_corrected),
        ({p + "ecc.type": "uncorrected"}, s.remapped_rows_uncorrected),
    ])  # fmt: skip
    _scalar(out, p + "ecc.remap_pending", ident, _flag(s.remap_pending))
    _scalar(out, p + "ecc.remap_failure", ident, _flag(s.remap_failure))
    if s.nvlink_active is not None:
        link_key = p + "nvlink.link"
        links: list[tuple[Attributes, int]] = [({link_key: k}, int(a)) for k, a in enumerate(s.nvlink_active)]
        _tagged(out, p + "nvlink.state", ident, links)
    for proc in s.processes or ():
        attrs: Attributes = {
            p + "process.host_pid": proc.host_pid,
            p + "process.mapped": proc.pid is not None,
        }
        if proc.pid is not None:
            attrs["process.pid"] = proc.pid
        if proc.name:
            attrs["process.executable.name"] = proc.name
        _tagged(out, p + "process.memory.usage", ident, [(attrs, proc.used_bytes)])


def device_metrics(
    samples: Sequence[DeviceSample],
    *,
    resource: Resource,
    start_ns: int,
    time_ns: int | None = None,
    states: Mapping[str, HwState] | None = None,
) -> list[MetricItem]:
    """One MetricItem per metric name that has points, in :data:`METRICS` order.

    ``states`` (keyed by hw.id) raises a device's hw.state, e.g. to ``degraded`` for a slow
    verdict; the worse of it and the sampler's own state wins. ``time_ns`` defaults to the
    newest sample's time. Absent readings produce no point.
    """
    out: _Points = {}
    for s in samples:
        state = s.state
        if states and hw_id(s) in states:
            state = worst(state, states[hw_id(s)])
        _points(s, state, out)
    t = time_ns if time_ns is not None else max((s.time_ns for s in samples), default=start_ns)
    return [
        m.item(resource, t, start_ns, out[m.name])
        for m in METRICS
        if m.name in out
    ]


# Metrics whose value drifts with load on every sample (utilization, power, heat, clocks,
# memory in use): the recorded outputs get them at the coarse interval. Every other metric
# is a state or a counter (hw.status, throttle reasons, PCIe link, ECC, NVLink): a change
# there goes out with the next sample, and the value is repeated at the heartbeat.
CONTINUOUS = frozenset({
    "hw.gpu.utilization", "hw.gpu.memory.usage", "infersight.device.memory.utilization",
    "infersight.device.clock.sm", "infersight.device.clock.memory", "infersight.device.power",
    "infersight.device.temperature", "infersight.device.process.memory.usage",
})


NVML_AVAILABLE_SPEC = declared(NVML_AVAILABLE, "gauge", "1", "1 when NVML answers; reason when not")


def nvml_unavailable(resource: Resource, reason: str, start_ns: int, now_ns: int) -> MetricItem:
    """The health metric ``infersight.nvml.available`` of an agent whose device sampling is
    off: value 0, and why in ``infersight.nvml.reason``."""
    return NVML_AVAILABLE_SPEC.item(resource, now_ns, start_ns, [NumberPoint(0, {"infersight.nvml.reason": reason})])


def _series_key(name: str, attrs: Attributes) -> tuple[object, ...]:
    return (name, *sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items()))


class RecordedSamples:
    """Which device metric points go to the recorded outputs (file, OTLP, MQTT); the live
    ones (Prometheus) get every sample.

    - drifting gauges (:data:`CONTINUOUS`: utilization, power, heat, clocks, memory in use)
      go out every ``interval_s``, with their latest value;
    - state and counter points (hw.status, throttle reasons, PCIe link, ECC, limits) go out
      with the first sample after they change;
    - every ``HEARTBEAT_INTERVALS`` intervals (and first) every series goes out, so a reader
      of the file sees each series at least that often.

    ``interval_s`` 0: every sample, whole. Memory: one value per series, renewed at each
    heartbeat."""

    HEARTBEAT_INTERVALS = 6

    def __init__(self, interval_s: float) -> None:
        self.interval_ns = int(interval_s * 1e9)
        self._next_ns: int | None = None
        self._intervals = 0
        self._last: dict[tuple[object, ...], float | int] = {}

    def select(self, items: Sequence[MetricItem], now_ns: int) -> list[MetricItem]:
        due = self._next_ns is None or now_ns >= self._next_ns
        if due:
            self._next_ns = now_ns + self.interval_ns
            self._intervals += 1
            if self.interval_ns <= 0 or self._intervals % self.HEARTBEAT_INTERVALS == 1:
                self._last = {_series_key(it.name, p.attributes): p.value
                              for it in items for p in it.points if isinstance(p, NumberPoint)}
                return list(items)
        out: list[MetricItem] = []
        for it in items:
            if it.name in CONTINUOUS:
                if due:
                    out.append(it)
                continue
            changed: list[NumberPoint] = []
            for p in it.points:
                if not isinstance(p, NumberPoint):
                    continue
                key = _series_key(it.name, p.attributes)
                if self._last.get(key) != p.value:
                    self._last[key] = p.value
                    changed.append(p)
            if changed:
                out.append(dataclasses.replace(it, points=changed))
        return out


def _main(write: Callable[[str], object] = print) -> None:
    write(render_reference_markdown().rstrip("\n"))


if __name__ == "__main__":
    _main()
