"""The agent's own metric names and its service name are reserved (a review: a hostile member of the socket group).

A producer gauge ``process.memory.usage`` under ``service.name=infersight-agent`` had shown up as
``process_memory_usage_bytes{service_name="infersight-agent",process_user_id="1003"} 9e12`` beside the
agent's own series, and a producer gauge ``process.cpu.time`` had made a second family named
``process_cpu_time_seconds``, so prometheus_client's OpenMetrics parser refused the whole scrape. The
namespace guard covered ``infersight.*`` only. A producer's metric named as one of the agent's own (by its
OTel name, or by any name it would take in Prometheus) is now malformed and counted, and no producer's
resource says ``service.name=infersight-agent``: that name becomes ``unknown_service:<exe>``.
"""

from __future__ import annotations

from typing import Any

import pytest

import infersight.agent.devices.metrics  # noqa: F401 - declares the device metrics, as the agent's extension does
import infersight.agent.requests.kind  # noqa: F401 - and the request metrics
from infersight.agent.daemon.assemble import Assembler
from infersight.telemetry import MetricItem

S = 10**9


def _hello(a: Assembler, n: int, uid: int | None = 1003, **extra: Any):  # type: ignore[no-untyped-def]
    return a.hello({"id": "p%d" % n, "pid": 100 + n, "start_ns": S, "trace_id": "%032x" % (n + 1),
                    "root_span_id": "%016x" % (n + 1), "exe": "python3", **extra}, uid)


def _metric(a: Assembler, p, seq: int, name: str, kind: str = "gauge", unit: str = "") -> list[str]:  # type: ignore[no-untyped-def]
    out = a.events(p, [[seq, 5 * S, "metric", {"n": name, "v": 9e12, "k": kind, "u": unit}]])
    return [m.name for m in out if isinstance(m, MetricItem)]


@pytest.mark.parametrize(("name", "kind", "unit"), [
    ("process.memory.usage", "gauge", "By"),  # the agent's gauge itself
    ("process.memory.usage", "gauge", ""),  # its OTel name, whatever the unit
    ("process.cpu.time", "gauge", "s"),  # a gauge of the agent's counter family process_cpu_time_seconds
    ("process.cpu.time", "sum", "s"),
    ("process_cpu_time_seconds", "gauge", ""),  # that family's name, spelt as Prometheus does
    ("process.cpu.time.seconds", "sum", ""),
    ("process_memory_usage", "gauge", "By"),  # -> process_memory_usage_bytes
    ("Process.Memory.Usage", "gauge", ""),
    ("hw.status", "gauge", ""),  # a device metric of the agent's (hw_status)
    ("hw.errors", "gauge", ""),  # the base of the agent's counter hw_errors_total
    ("gen_ai.server.time_to_first_token_seconds_count", "gauge", ""),  # a sample of the agent's histogram
    ("infersight.request.duration", "gauge", ""),  # the namespace, as before
])
def test_a_producer_metric_named_as_the_agents_own_is_refused(name: str, kind: str, unit: str) -> None:
    a = Assembler("h")
    p = _hello(a, 1)
    assert _metric(a, p, 1, name, kind, unit) == []
    assert a.malformed == 1 and a.stats()["metric_names_reserved"] == 1
    assert _metric(a, p, 2, "vllm.num_requests_running") == ["vllm.num_requests_running"]  # the producer's own


@pytest.mark.parametrize("name", ["process.cpu", "process.memory", "memory.usage", "process.cpu.time.user",
                                  "hw.gpu", "processing.time", "infersightful.queue"])
def test_names_near_the_agents_pass(name: str) -> None:
    a = Assembler("h")
    p = _hello(a, 1)
    assert _metric(a, p, 1, name, "gauge", "s") == [name]
    assert a.stats()["metric_names_reserved"] == 0


@pytest.mark.parametrize("how", [{"service_name": "infersight-agent"},
                                 {"resource_attributes": "service.name=infersight-agent,team=a"},
                                 {"resource_attributes": "service.name=Infersight_Agent"},
                                 {"service_name": "infersight-agent\x00"}])
def test_no_producer_is_the_agent_service(how: dict[str, str]) -> None:
    a = Assembler("h")
    p = _hello(a, 1, **how)
    assert p.resource.get("service.name") == "unknown_service:python3"
    assert a.stats()["service_names_refused"] == 1
    q = _hello(a, 2, service_name="infersight-agent-proxy")  # another name is a producer's to take
    assert q.resource.get("service.name") == "infersight-agent-proxy"
    assert a.stats()["service_names_refused"] == 1


def test_the_agents_own_otel_service_name_is_no_producers_default() -> None:
    """The agent's ``OTEL_SERVICE_NAME`` names a producer that named none: not when it is the agent's own."""
    a = Assembler("h", resource_env={"OTEL_SERVICE_NAME": "infersight-agent"})
    assert _hello(a, 1).resource.get("service.name") == "unknown_service:python3"
    a = Assembler("h", resource_env={"OTEL_SERVICE_NAME": "inference"})
    assert _hello(a, 1).resource.get("service.name") == "inference"
