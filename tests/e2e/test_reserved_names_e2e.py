"""A producer cannot pass its series off as the agent's, nor break the scrape with the agent's names.

A real agent with its Prometheus endpoint; a raw peer of the wire protocol (docs/wire.md) says hello as
``service.name=infersight-agent`` and sends a gauge ``process.memory.usage`` of 9e12 and a gauge
``process.cpu.time`` (seconds). Before, the first showed up as
``process_memory_usage_bytes{service_name="infersight-agent",process_user_id=...} 9e12`` beside the agent's
own series, and the second made two families named ``process_cpu_time_seconds``: prometheus_client's
OpenMetrics parser refused the whole scrape. Now both metrics are refused at ingest (counted), the
producer's service name is ``unknown_service:<exe>``, and the scrape parses with the agent's own series.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request

from conftest import free_port, wait_for
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

from infersight.hooks import _wire


def _scrape(port: int) -> str:
    req = urllib.request.Request("http://127.0.0.1:%d/metrics" % port,
                                 headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        return str(r.read().decode())


def test_a_producer_is_not_the_agent_in_prometheus(agent_factory) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    agent = agent_factory(f"[exporters.prometheus]\nenabled = true\nport = {port}\n").start()
    now = time.time_ns()
    hello = {"t": "hello", "schema": 1, "producer": {
        "id": "raw-res-1", "pid": os.getpid(), "start_ns": now - 10**9, "trace_id": "c" * 32,
        "root_span_id": "d" * 16, "exe": "python3", "service_name": "infersight-agent"}}
    batch = {"t": "b", "e": [
        [1, now, "metric", {"n": "process.memory.usage", "v": 9e12, "k": "gauge", "u": "By"}],
        [2, now, "metric", {"n": "process.cpu.time", "v": 9e12, "k": "gauge", "u": "s"}],
        [3, now, "metric", {"n": "queue.depth", "v": 3, "k": "gauge"}],
    ]}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(agent.sock))
        s.sendall(_wire.encode_frame(hello) + _wire.encode_frame(batch))
        assert wait_for(lambda: agent.status()["counters"]["events_in"] >= 1, 15), agent.status()
    assert wait_for(lambda: "queue_depth" in _scrape(port) and "process_cpu_time_seconds_total" in _scrape(port), 20)
    fams = {f.name: f for f in om_parse(_scrape(port))}  # the whole scrape parses (it did not)
    (cpu,) = fams["process_cpu_time_seconds"].samples
    assert fams["process_cpu_time_seconds"].type == "counter" and cpu.value < 1e6
    (mem,) = fams["process_memory_usage_bytes"].samples
    assert mem.value < 9e12 and "process_user_id" not in mem.labels
    (q,) = fams["queue_depth"].samples
    assert q.labels["service_name"] == "unknown_service:python3" and q.labels["process_user_id"] == str(os.getuid())
    claimed = [s for f in fams.values() for s in f.samples
               if s.labels.get("service_name") == "infersight-agent" and "process_user_id" in s.labels]
    assert claimed == []
    st = agent.status()
    assert st["assembler"]["metric_names_reserved"] == 2 and st["assembler"]["service_names_refused"] == 1
    assert st["counters"]["malformed_events"] == 2
