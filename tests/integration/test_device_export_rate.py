"""Device samples go to the recorded outputs (file, OTLP, MQTT) at a coarse interval or when a
state changes, while Prometheus keeps the live value of every sample (issue 13)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from conftest import read_otlp_lines
from devices_agent_runner import metric_points, value
from test_prometheus_exporter import scrape

from infersight.agent.daemon.broadcast import Broadcaster, ExporterWorker
from infersight.agent.devices.job import DeviceJob
from infersight.agent.devices.metrics import RecordedSamples, device_metrics
from infersight.agent.devices.nvml import DeviceSample, NvmlStatus
from infersight.exporters.file import FileExporter
from infersight.exporters.prometheus_endpoint import PrometheusExporter
from infersight.telemetry import Resource

RES = Resource.of({"host.name": "node-1", "service.name": "infersight-agent"})
S = 1_000_000_000


def sample(t: int, util: int, gen: int = 5) -> DeviceSample:
    return DeviceSample(time_ns=t, index=0, uuid="GPU-1", name="H100", utilization_gpu_pct=util,
                        memory_used_bytes=1 << 30, memory_total_bytes=80 << 30, pcie_link_gen=gen,
                        pcie_link_gen_max=5, temperature_c=60 + util % 7)


def names(items: list[Any]) -> set[str]:
    return {i.name for i in items}


def test_recorded_samples_full_at_the_interval_changes_between() -> None:
    r = RecordedSamples(10.0)
    first = device_metrics([sample(0, 50)], resource=RES, start_ns=0)
    assert names(r.select(first, 0)) == names(first), "the first sample goes out whole"
    same = device_metrics([sample(S, 50)], resource=RES, start_ns=0)
    assert r.select(same, S) == [], "nothing changed: nothing recorded"
    busier = device_metrics([sample(2 * S, 90)], resource=RES, start_ns=0)
    assert r.select(busier, 2 * S) == [], "a drifting gauge waits for the interval"
    downtrained = device_metrics([sample(3 * S, 90, gen=3)], resource=RES, start_ns=0)
    out = r.select(downtrained, 3 * S)
    assert names(out) == {"infersight.device.pcie.link.generation"}, "a changed state goes out at once"
    assert [p.value for p in out[0].points] == [3]
    assert r.select(downtrained, 4 * S) == [], "and only once"
    at_interval = r.select(device_metrics([sample(10 * S, 70, gen=3)], resource=RES, start_ns=0), 10 * S)
    util = [p.value for it in at_interval if it.name == "hw.gpu.utilization" for p in it.points]
    assert util == [0.7], "at the interval, the drifting gauges with their latest value"
    assert "hw.gpu.memory.limit" not in names(at_interval), "an unchanged state waits for the heartbeat"
    beats = [r.select(device_metrics([sample(t * S, 70, gen=3)], resource=RES, start_ns=0), t * S)
             for t in range(20, 70, 10)]
    assert ["hw.gpu.memory.limit" in names(b) for b in beats] == [False, False, False, False, True]


def test_interval_zero_records_every_sample() -> None:
    r = RecordedSamples(0.0)
    for t in range(3):
        items = device_metrics([sample(t, 50)], resource=RES, start_ns=0)
        assert r.select(items, t) == items


class FakeNvml:
    """FAKE NVML (no GPU here): returns the samples the test sets."""

    def __init__(self) -> None:
        self.util = 10

    def sample_all(self) -> list[DeviceSample]:
        return [sample(1, self.util)]

    def pop_events(self) -> list[Any]:
        return []


class _Agent:
    def __init__(self, broadcaster: Broadcaster) -> None:
        self.broadcaster = broadcaster
        self.resource = RES


async def test_file_gets_unchanged_samples_once_prometheus_the_live_value(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    file_exp, prom = FileExporter(str(out)), PrometheusExporter(port=0)
    await file_exp.start()
    workers = [ExporterWorker(file_exp), ExporterWorker(prom)]
    for w in workers:
        w.start()
    nvml = FakeNvml()
    job = DeviceJob(nvml=nvml, export_interval_s=3600)  # type: ignore[arg-type]
    job.status = NvmlStatus(True, device_count=1)
    job._agent = _Agent(Broadcaster(workers))
    for i in range(20):
        nvml.util = 10 + i  # a busy GPU: the utilization moves every sample
        await job.tick()
        await asyncio.sleep(0)
    for w in workers:
        assert await w.drain(10)
    await file_exp.shutdown()
    await prom.shutdown()
    lines = read_otlp_lines(out)
    util = metric_points(lines, "hw.gpu.utilization")
    assert [value(p) for p in util] == [0.1], "the file got the first sample only, not 20"
    assert metric_points(lines, "hw.gpu.memory.limit") and len(metric_points(lines, "hw.gpu.memory.limit")) == 1
    live = scrape(prom.store)["hw_gpu_utilization_ratio"]["samples"]
    assert [v for (_n, _labels), v in live.items()] == [0.29], "Prometheus has the latest sample"
