"""Requests timed with no device (the ASGI/WSGI middleware's HTTP requests: class http, ``infersight.device``
``unknown``) are no device in the agent's own verdicts either: however slow they are beside the same uid's GPU
requests, ``unknown`` gets no coefficient, no slow verdict and no degraded state (the fleet rules, the report and
the dashboard keyed them as a device; the agent never did, and this holds it)."""

from __future__ import annotations

from types import SimpleNamespace

from infersight.agent.devices.job import DeviceJob
from infersight.agent.devices.settings import load_thresholds
from infersight.agent.requests.kind import RequestStats, parse_req
from infersight.telemetry import MetricItem, NumberPoint, Resource

A = "GPU-fa4e0000-0000-4000-8000-000000000000"  # FAKE GPUs
B = "GPU-fa4e0000-0000-4000-8000-000000000001"
NOW = 1_900_000_000.0
SERVER = Resource.of({"service.name": "llm", "process.pid": 10, "process.user.id": 1000})


def test_http_requests_with_no_device_are_no_device() -> None:
    stats = RequestStats()
    for i in range(300):
        t = NOW - 300 + i
        for dev in (A, B):
            ev = parse_req({"s": int((t - 0.05) * 1e9), "dur": 0.05, "m": "llama", "h": dev, "hn": "FAKE H100"})
            stats.record("p", SERVER, ev, int(t * 1e9), 10)
        for dur in (0.06, 3.0):  # the HTTP requests around them, one in two slow
            stats.record("p", SERVER, parse_req({"s": int((t - dur) * 1e9), "dur": dur, "c": "http"}), int(t * 1e9), 10)
    job = DeviceJob(requests=stats, thresholds=load_thresholds(None), nvml=None, enabled=False)
    job._agent = SimpleNamespace(resource=Resource.of({}))
    metrics = []
    for k in range(4):
        metrics += job.evaluate(int((NOW + k) * 1e9))[0]
    by_device = {v.key.device: v for v in job.verdicts.values()}
    assert by_device["unknown"].verdict == "no_peers" and by_device["unknown"].coefficient is None
    assert {by_device[A].verdict, by_device[B].verdict} == {"ok"}
    assert job.slow_devices() == {} and job.states == {}
    published = [p for m in metrics if isinstance(m, MetricItem) for p in m.points if isinstance(p, NumberPoint)]
    assert published and all(p.attributes.get("hw.id") in (A, B) for p in published)
    assert job.health()["slow_devices"] == []
