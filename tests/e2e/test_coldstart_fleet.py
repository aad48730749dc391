"""Cold-start metrics end to end: ``infersight launch`` and a daemon serving several producers."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from capture_exporter import CaptureExporter
from conftest import attr, free_port, hook_env, read_otlp_lines, spans, wait_for
from prometheus_client.parser import text_string_to_metric_families

CLI = [sys.executable, "-m", "infersight"]

# Known stages: weights_load twice (they add up), graph_compile nested in warmup, a custom stage.
WORKLOAD = """
import time
from infersight import hooks
with hooks.stage("weights_load"):
    time.sleep(0.05)
with hooks.stage("weights_load"):
    time.sleep(0.03)
with hooks.stage("warmup"):
    time.sleep(0.02)
    with hooks.stage("graph_compile"):
        time.sleep(0.02)
with hooks.stage("my_stage"):
    time.sleep(0.01)
hooks.mark_ready()
time.sleep(0.01)
hooks.first_response()
"""


def metrics(lines: list[dict[str, Any]], name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(resource attributes, metric) for every metric ``name`` in the file, in file order."""
    out = []
    for req in lines:
        for rm in req.get("resourceMetrics", []):
            res = {kv["key"]: next(iter(kv["value"].values())) for kv in rm["resource"]["attributes"]}
            for sm in rm["scopeMetrics"]:
                out += [(res, m) for m in sm["metrics"] if m["name"] == name]
    return out


def by_attr(metric: dict[str, Any], key: str) -> dict[str, dict[str, Any]]:
    data = metric.get("histogram") or metric.get("sum")
    assert data is not None
    return {attr(p, key): p for p in data["dataPoints"]}


def span_s(s: dict[str, Any]) -> float:
    return (int(s["endTimeUnixNano"]) - int(s["startTimeUnixNano"])) / 1e9


def test_launch_records_one_histogram_set_matching_the_spans(tmp_path: Path) -> None:
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    out = tmp_path / "out.otlp.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env["OTEL_SERVICE_NAME"] = "fleet-demo"
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(out), "--", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    lines = read_otlp_lines(out)
    durations = metrics(lines, "infersight.coldstart.duration")
    assert len(durations) == 1, "exactly one data-point set"
    res, m = durations[0]
    assert res["service.name"] == "fleet-demo" and "process.pid" not in res
    assert m["unit"] == "s" and m["histogram"]["aggregationTemporality"] == 2
    points = by_attr(m, "infersight.stage")
    assert all(int(p["count"]) == 1 for p in points.values())

    all_spans = spans(lines)
    (root,) = [s for s in all_spans if s["name"] == "coldstart"]
    stage_spans: dict[str, list[dict[str, Any]]] = {}
    for s in all_spans:
        if s["name"].startswith("coldstart.") and attr(s, "infersight.stage") != "unattributed":
            stage_spans.setdefault(attr(s, "infersight.stage"), []).append(s)
    assert len(stage_spans["weights_load"]) == 2
    assert {"weights_load", "warmup", "graph_compile", "my_stage", "first_request"} <= set(stage_spans)
    assert set(points) == set(stage_spans) | {"unattributed", "total"}
    for stage, ss in stage_spans.items():  # these spans of one stage do not overlap: their sum
        assert abs(points[stage]["sum"] - sum(span_s(s) for s in ss)) < 1e-3, stage
    assert points["weights_load"]["sum"] > 0.079
    assert abs(points["total"]["sum"] - span_s(root)) < 1e-3
    assert abs(points["unattributed"]["sum"] - attr(root, "infersight.coldstart.unattributed_s")) < 1e-3
    ((_, count),) = metrics(lines, "infersight.coldstart.count")
    assert {k: int(p["asInt"]) for k, p in by_attr(count, "infersight.coldstart.ended_by").items()} == {
        "ready": 1}  # the workload listens: its cold start ends at readiness


def test_launch_of_a_non_python_command_records_the_launcher_root(tmp_path: Path) -> None:
    out = tmp_path / "out.otlp.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env["OTEL_SERVICE_NAME"] = "shell"
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(out), "--", "sleep", "0.1"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    lines = read_otlp_lines(out)
    ((_, m),) = metrics(lines, "infersight.coldstart.duration")
    (root,) = [s for s in spans(lines) if s["name"] == "coldstart"]
    assert abs(by_attr(m, "infersight.stage")["total"]["sum"] - span_s(root)) < 1e-3
    ((_, count),) = metrics(lines, "infersight.coldstart.count")
    assert list(by_attr(count, "infersight.coldstart.ended_by")) == ["exit"]


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback test endpoint
        text = resp.read().decode()
    # One host and one uid here: leave them out of the keys (process_user_id: tested on its own, in
    # tests/integration/test_coldstart_metrics.py, where two uids share a service name).
    host = ("host_name", "service_instance_id", "process_user_id")
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in host))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_daemon_accumulates_producers_and_serves_buckets(agent_factory: Any) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    agent = agent_factory(f"[exporters.prometheus]\nenabled = true\nport = {port}\n").start()
    script = agent.root / "workload.py"
    script.write_text(WORKLOAD)
    for service in ("svc-a", "svc-a", "svc-b", "svc-a"):  # separate processes: one producer each
        env = hook_env(agent.sock, agent.spool, OTEL_SERVICE_NAME=service)
        assert subprocess.run([sys.executable, str(script)], env=env, timeout=60).returncode == 0

    def counts() -> dict[str, int]:
        last: dict[str, int] = {}
        for res, m in metrics(read_otlp_lines(agent.out), "infersight.coldstart.count"):
            last[res["service.name"]] = int(by_attr(m, "infersight.coldstart.ended_by")["ready"]["asInt"])
        return last

    assert wait_for(lambda: counts() == {"svc-a": 3, "svc-b": 1}, 20), counts()
    lines = read_otlp_lines(agent.out)
    roots = {s["spanId"]: s for s in spans(lines) if s["name"] == "coldstart"}
    assert len(roots) == 4
    last = [m for res, m in metrics(lines, "infersight.coldstart.duration") if res["service.name"] == "svc-a"][-1]
    total = by_attr(last, "infersight.stage")["total"]
    assert int(total["count"]) == 3
    a_sum = sum(span_s(s) for s in spans_of(lines, "svc-a"))
    assert abs(total["sum"] - a_sum) < 3e-3

    def scraped() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return _scrape("http://127.0.0.1:%d/metrics" % port)

    assert wait_for(lambda: scraped().get(("infersight_coldstart_count_total", (
        ("infersight_coldstart_ended_by", "ready"), ("service_name", "svc-a")))) == 3, 10)
    got = scraped()
    h = "infersight_coldstart_duration_seconds"
    a_total = (("infersight_stage", "total"), ("service_name", "svc-a"))
    assert got[(h + "_count", a_total)] == 3
    assert got[(h + "_bucket", (("infersight_stage", "total"), ("le", "+Inf"), ("service_name", "svc-a")))] == 3
    assert got[(h + "_bucket", (("infersight_stage", "total"), ("le", "1800.0"), ("service_name", "svc-a")))] == 3
    assert got[(h + "_bucket", (("infersight_stage", "weights_load"), ("le", "0.05"), ("service_name", "svc-a")))] == 0
    assert got[(h + "_bucket", (("infersight_stage", "weights_load"), ("le", "+Inf"), ("service_name", "svc-b")))] == 1
    les = {dict(k[1])["le"] for k in got if k[0] == h + "_bucket"}
    assert les == {"0.05", "0.1", "0.25", "0.5", "1.0", "2.0", "5.0", "10.0", "15.0", "30.0", "60.0", "90.0",
                   "120.0", "180.0", "300.0", "600.0", "1200.0", "1800.0", "+Inf"}
    assert agent.stop() == 0


def spans_of(lines: list[dict[str, Any]], service: str) -> list[dict[str, Any]]:
    """Root spans of ``service`` (the service name is on the resource)."""
    out = []
    for req in lines:
        for rs in req.get("resourceSpans", []):
            res = {kv["key"]: next(iter(kv["value"].values())) for kv in rs["resource"]["attributes"]}
            if res.get("service.name") == service:
                out += [s for ss in rs["scopeSpans"] for s in ss["spans"] if s["name"] == "coldstart"]
    return out


async def test_agent_republishes_a_quiet_service(tmp_path: Path) -> None:
    """A service with no cold start for a minute is exported again (its series stay live)."""
    import asyncio
    import time

    from infersight.agent.coldstart.extension import ColdStartExtension
    from infersight.agent.daemon import config as cfg
    from infersight.agent.daemon.lifecycle import Agent
    from infersight.telemetry import ColdStart, Resource, SpanItem

    conf = cfg.load(None, env={}, flags={
        "agent.socket": str(tmp_path / "agent.sock"), "agent.spool_dir": str(tmp_path / "spool"),
        "agent.health_interval_s": 0.05, "agent.state_dir": str(tmp_path / "state"),
    })  # fmt: skip
    sink = CaptureExporter()
    coldstart = ColdStartExtension(conf)
    agent = Agent(conf, [sink], [coldstart], exporter_spool_root=str(tmp_path / "xspool"))
    long_ago = time.time_ns() - 120 * 10**9
    root = SpanItem(Resource.of({"service.name": "quiet", "host.name": "h"}), "a" * 32, "b" * 16, None,
                    "coldstart", long_ago - 10**9, long_ago, {"infersight.coldstart.ended_by": "first_request"})
    coldstart.metrics.observe(ColdStart(root, []), long_ago)
    await agent.start()
    try:
        deadline = time.monotonic() + 30  # the next health tick, late on a loaded machine
        while time.monotonic() < deadline:
            if any(getattr(i, "name", "") == "infersight.coldstart.duration" for i in sink.items):
                break
            await asyncio.sleep(0.02)
        refreshed = [i for i in sink.items if getattr(i, "name", "") == "infersight.coldstart.duration"]
        assert refreshed, "no refresh"
        assert refreshed[0].time_ns > long_ago + 60 * 10**9 and refreshed[0].points[0].count == 1
        await asyncio.sleep(0.3)  # several health ticks: not re-sent before another minute
        assert len([i for i in sink.items if getattr(i, "name", "") == "infersight.coldstart.duration"]) == 1
    finally:
        await agent.shutdown(5)
