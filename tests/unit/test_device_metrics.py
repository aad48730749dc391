"""Metric names, their Prometheus forms, and the reference table in docs/."""

from __future__ import annotations

from pathlib import Path

from infersight.agent.devices.metrics import (
    METRICS,
    SPECS,
    device_metrics,
    prometheus_name,
    render_reference_markdown,
)
from infersight.agent.devices.nvml import DeviceSample
from infersight.telemetry import Resource

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_prometheus_names() -> None:
    assert prometheus_name(SPECS["hw.gpu.utilization"]) == "hw_gpu_utilization_ratio"
    assert prometheus_name(SPECS["hw.gpu.memory.usage"]) == "hw_gpu_memory_usage_bytes"
    assert prometheus_name(SPECS["hw.errors"]) == "hw_errors_total"
    assert prometheus_name(SPECS["hw.status"]) == "hw_status"  # unit 1 on a sum: no _ratio
    assert prometheus_name(SPECS["infersight.device.clock.sm"]) == "infersight_device_clock_sm_megahertz"
    assert prometheus_name(SPECS["infersight.device.temperature"]) == "infersight_device_temperature_celsius"
    assert prometheus_name(SPECS["infersight.device.pcie.replay"]) == "infersight_device_pcie_replay_total"
    assert len({prometheus_name(m) for m in METRICS}) == len(METRICS)


def test_hw_names_and_namespaces() -> None:
    for m in METRICS:
        assert m.name.startswith(("hw.", "infersight.device.")), m.name


def test_reference_table_in_docs_is_current() -> None:
    table = render_reference_markdown()
    assert table in (DOCS / "device_metrics.md").read_text()
    assert table in (DOCS / "devices.md").read_text()


def test_state_override_and_points() -> None:
    s = DeviceSample(
        time_ns=5, index=0, uuid="GPU-a", name="n", utilization_gpu_pct=40, memory_used_bytes=1, memory_total_bytes=2
    )
    items = device_metrics([s], resource=Resource.of({}), start_ns=1, states={"GPU-a": "degraded"})
    by = {m.name: m for m in items}
    assert set(by) == {"hw.status", "hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit"}
    status = {p.attributes["hw.state"]: p.value for p in by["hw.status"].points}
    assert status == {"ok": 0, "degraded": 1, "failed": 0}
    assert by["hw.gpu.utilization"].points[0].value == 0.4
    assert by["hw.gpu.utilization"].time_ns == 5
    assert by["hw.gpu.utilization"].start_ns == 1
    assert by["hw.gpu.memory.usage"].kind == "sum"
    assert by["hw.gpu.memory.usage"].monotonic is False
    # a better override never hides a worse sampler state
    failed = DeviceSample(time_ns=5, index=0, uuid="GPU-a", name="n", lost=True, state="failed")
    items = device_metrics([failed], resource=Resource.of({}), start_ns=1, states={"GPU-a": "ok"})
    assert [p.value for p in items[0].points] == [0, 0, 1]
