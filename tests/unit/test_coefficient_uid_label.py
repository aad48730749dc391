"""The coefficient gauge names whose requests it judges with the point attribute ``process.user.id``. On the
Prometheus scrape that is ``exported_process_user_id``, not ``process_user_id`` (the endpoint never lets a point
attribute set a resource label, whether or not the resource has it; the agent's own resource has no uid), and
docs/requests.md's table sent queries to a label that is not there."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from infersight.agent.devices.job import DeviceJob
from infersight.agent.devices.settings import load_thresholds
from infersight.agent.requests.kind import RequestStats, parse_req
from infersight.exporters.prometheus_endpoint import SeriesStore
from infersight.telemetry import Resource

ROOT = Path(__file__).resolve().parents[2]
A, B = "GPU-fa4e0000-0000-4000-8000-000000000000", "GPU-fa4e0000-0000-4000-8000-000000000001"  # FAKE GPUs
NOW = 1_900_000_000.0


def test_the_coefficients_uid_label_on_the_scrape_is_the_one_the_docs_name() -> None:
    stats = RequestStats()
    server = Resource.of({"service.name": "llm", "process.pid": 10, "process.user.id": 1000})
    for i in range(200):
        t = NOW - 200 + i
        for dev in (A, B):
            ev = parse_req({"s": int((t - 0.05) * 1e9), "dur": 0.05, "m": "llama", "h": dev, "hn": "FAKE H100"})
            stats.record("p", server, ev, int(t * 1e9), 10)
    job = DeviceJob(requests=stats, thresholds=load_thresholds(None), nvml=None, enabled=False)
    job._agent = SimpleNamespace(resource=Resource.of({"host.name": "h", "service.name": "infersight-agent"}))
    metrics, _ = job.evaluate(int(NOW * 1e9))
    store = SeriesStore()
    assert store.add(metrics) == 2
    (family,) = [f for f in store.families() if f.name == "infersight_device_coefficient_ratio"]
    labels = [s.labels for s in family.samples]
    assert all(lb.get("exported_process_user_id") == "1000" and "process_user_id" not in lb for lb in labels)
    row = next(line for line in (ROOT / "docs" / "requests.md").read_text().splitlines()
               if line.startswith("| `infersight.device.coefficient`"))
    assert "exported_process_user_id" in row
