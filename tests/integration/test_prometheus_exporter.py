"""The Prometheus endpoint: OTel -> Prometheus translation, bounds, binding, and a live scrape
by a real Prometheus server (Debian's `prometheus` package)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from infersight.agent.daemon.config import load
from infersight.agent.daemon.health import Counters, health_metrics
from infersight.agent.devices.metrics import METRICS, device_metrics
from infersight.agent.devices.nvml import DeviceSample
from infersight.exporters.base import Exporter, ExportError
from infersight.exporters.prometheus_endpoint import (
    PROMETHEUS_KEYS,
    PrometheusExporter,
    SeriesStore,
    from_config,
    label_name,
    metric_name,
    shipped_rule_files,
)
from infersight.metricspec import prometheus_name
from infersight.settings import ConfigError
from infersight.telemetry import HistogramPoint, MetricItem, NumberPoint, Resource, SpanItem

PROMETHEUS = shutil.which("prometheus")
RES = Resource.of(
    {"host.name": "node-1", "service.name": "llm-server", "service.instance.id": "p-42", "process.pid": 42}
)


def item(name: str, kind: str, unit: str, points: list, monotonic: bool = True, res: Resource = RES) -> MetricItem:
    return MetricItem(res, name, kind, unit, "desc of " + name, 2_000, 1_000, points, monotonic)  # type: ignore[arg-type]


def latency(counts: list[int], total: float, **attrs: object) -> HistogramPoint:
    a = {
        "hw.id": "GPU-1111",
        "hw.name": "NVIDIA H100",
        "infersight.model": "llama",
        "infersight.request.class": "chat",
        **attrs,
    }
    return HistogramPoint([0.05, 0.1, 0.25], counts, sum(counts), total, None, None, a)  # type: ignore[arg-type]


def scrape(store: SeriesStore) -> dict[str, dict]:
    """Render the store as Prometheus text and parse it back: {family: {(sample, labels): value}}."""
    from prometheus_client import CollectorRegistry, generate_latest

    class C:
        def collect(self):  # noqa: ANN202
            return store.families()

    reg = CollectorRegistry(auto_describe=False)
    reg.register(C())  # type: ignore[arg-type]
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        d = out.setdefault(fam.name, {"type": fam.type, "samples": {}})
        for s in fam.samples:
            d["samples"][(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# -- translation -------------------------------------------------------------------------------


def test_names_match_the_device_reference_table() -> None:
    for spec in METRICS:
        m = item(spec.name, spec.kind, spec.unit, [NumberPoint(1)], spec.monotonic)
        assert metric_name(m) == prometheus_name(spec)


@pytest.mark.parametrize(
    ("name", "kind", "unit", "monotonic", "expected"),
    [
        ("infersight.request.duration", "histogram", "s", True, "infersight_request_duration_seconds"),
        ("gen_ai.server.time_to_first_token", "histogram", "s", True, "gen_ai_server_time_to_first_token_seconds"),
        ("hw.gpu.memory.usage", "sum", "By", False, "hw_gpu_memory_usage_bytes"),
        ("hw.gpu.utilization", "gauge", "1", True, "hw_gpu_utilization_ratio"),
        ("infersight.device.coefficient", "gauge", "1", True, "infersight_device_coefficient_ratio"),
        ("hw.status", "sum", "1", False, "hw_status"),
        ("infersight.events.lost", "sum", "{event}", False, "infersight_events_lost"),
        ("infersight.oom.count", "sum", "{oom}", True, "infersight_oom_count_total"),
        ("process.cpu.time", "sum", "s", True, "process_cpu_time_seconds_total"),
        ("already.total", "sum", "", True, "already_total"),
    ],
)
def test_metric_name(name: str, kind: str, unit: str, monotonic: bool, expected: str) -> None:
    assert metric_name(item(name, kind, unit, [], monotonic)) == expected


def test_label_names() -> None:
    assert label_name("hw.id") == "hw_id"
    assert label_name("infersight.oom.class") == "infersight_oom_class"
    assert label_name("9lives") == "key_9lives"
    assert label_name("__reserved") == "key__reserved"
    assert label_name("a-b/c") == "a_b_c"


def test_gauges_counters_labels_and_resource() -> None:
    store = SeriesStore()
    store.add(
        [
            item(
                "hw.status",
                "sum",
                "1",
                [
                    NumberPoint(1, {"hw.id": "GPU-1", "hw.state": "failed"}),
                    NumberPoint(0, {"hw.id": "GPU-1", "hw.state": "ok"}),
                ],
                monotonic=False,
            ),
            item("infersight.oom.count", "sum", "{oom}", [NumberPoint(3, {"infersight.oom.class": "fragmentation"})]),
            item(
                "hw.gpu.utilization", "gauge", "1", [NumberPoint(0.75, {"hw.id": "GPU-1", "flag": True, "ids": [1, 2]})]
            ),
        ]
    )
    out = scrape(store)
    base = (("host_name", "node-1"), ("service_instance_id", "p-42"), ("service_name", "llm-server"))
    assert out["hw_status"]["type"] == "gauge"
    key = ("hw_status", tuple(sorted((*base, ("hw_id", "GPU-1"), ("hw_state", "failed")))))
    assert out["hw_status"]["samples"][key] == 1.0
    assert out["infersight_oom_count"]["type"] == "counter"
    key = ("infersight_oom_count_total", tuple(sorted((*base, ("infersight_oom_class", "fragmentation")))))
    assert out["infersight_oom_count"]["samples"][key] == 3.0
    (labels,) = [dict(k[1]) for k in out["hw_gpu_utilization_ratio"]["samples"]]
    assert labels["flag"] == "true"
    assert labels["ids"] == "[1,2]"
    # target_info: one series per resource with every resource attribute
    (info,) = [dict(k[1]) for k in out["target_info"]["samples"]]
    assert info == {**dict(base), "process_pid": "42"}


def test_histogram_rendered_cumulative() -> None:
    store = SeriesStore()
    store.add([item("infersight.request.duration", "histogram", "s", [latency([5, 3, 1, 1], 0.9)])])
    fam = scrape(store)["infersight_request_duration_seconds"]
    assert fam["type"] == "histogram"
    buckets = {dict(k[1])["le"]: v for k, v in fam["samples"].items() if k[0].endswith("_bucket")}
    assert buckets == {"0.05": 5.0, "0.1": 8.0, "0.25": 9.0, "+Inf": 10.0}
    count = [v for k, v in fam["samples"].items() if k[0].endswith("_count")]
    total = [v for k, v in fam["samples"].items() if k[0].endswith("_sum")]
    assert count == [10.0]
    assert total == [0.9]
    labels = dict(next(iter(fam["samples"]))[1])
    assert labels["hw_id"] == "GPU-1111"
    assert labels["infersight_model"] == "llama"
    assert labels["infersight_request_class"] == "chat"
    assert labels["host_name"] == "node-1"


def test_latest_value_wins_and_other_items_are_ignored() -> None:
    store = SeriesStore()
    span = SpanItem(RES, "0" * 32, "0" * 16, None, "coldstart", 1, 2)
    store.add([span, item("hw.gpu.utilization", "gauge", "1", [NumberPoint(0.1)])])
    store.add([item("hw.gpu.utilization", "gauge", "1", [NumberPoint(0.9)])])
    samples = scrape(store)["hw_gpu_utilization_ratio"]["samples"]
    assert list(samples.values()) == [0.9]


def test_series_bound_drops_and_counts() -> None:
    store = SeriesStore(max_series=5, target_info=False)
    pts = [NumberPoint(i, {"hw.id": "GPU-%d" % i}) for i in range(8)]
    store.add([item("hw.gpu.utilization", "gauge", "1", pts)])
    assert len(store) == 5
    assert store.points_dropped == 3
    store.add([item("hw.gpu.utilization", "gauge", "1", [NumberPoint(7, {"hw.id": "GPU-0"})])])  # update: kept
    assert store.points_dropped == 3
    out = scrape(store)
    assert (
        out["infersight_prometheus_points_dropped"]["samples"][("infersight_prometheus_points_dropped_total", ())] == 3
    )
    assert out["infersight_prometheus_series"]["samples"][("infersight_prometheus_series", ())] == 5


def test_series_expire() -> None:
    store = SeriesStore(series_ttl_s=60)
    store.add([item("hw.gpu.utilization", "gauge", "1", [NumberPoint(0.5)])], now=1000.0)
    store.add([item("hw.status", "sum", "1", [NumberPoint(1)], monotonic=False)], now=1050.0)
    store.expire(now=1070.0)
    assert set(scrape(store)) >= {"hw_status", "target_info"}
    assert "hw_gpu_utilization_ratio" not in scrape(store)
    assert store.expired == 1


def test_type_conflict_and_malformed_histogram() -> None:
    store = SeriesStore()
    store.add([item("x.y", "gauge", "", [NumberPoint(1)])])
    store.add([item("x.y", "sum", "", [NumberPoint(2)], monotonic=False)])  # gauge again: fine
    store.add([item("x.y", "histogram", "", [HistogramPoint([1.0], [1, 1], 2, 1.0, None, None)])])
    assert store.type_conflicts == 1
    store.add([item("h", "histogram", "", [HistogramPoint([1.0, 2.0], [1, 1], 2, 1.0, None, None)])])
    assert store.malformed == 1


def test_a_name_held_by_another_uids_type_is_said_with_both_uids(caplog: pytest.LogCaptureFixture) -> None:
    """One user's gauge and another's histogram of one name: Prometheus has one type per name, so the second
    user's series are not exported. That was counted only; it is now said (once per name and refused uid while
    the name lives), naming the uids whose series hold the name now, and counted apart from a user's clash with
    itself."""
    caplog.set_level("WARNING", logger="infersight.exporters.prometheus")
    res = {u: Resource.of({"service.name": "s", "process.user.id": u}) for u in (1001, 1002, 1003, 1004)}
    store = SeriesStore(series_ttl_s=60)
    hist = [HistogramPoint([1.0], [1, 1], 2, 1.0, None, None)]
    store.add([item("vllm.queue", "gauge", "", [NumberPoint(1)], res=res[1001])], now=1000.0)
    for _ in range(3):
        store.add([item("vllm.queue", "histogram", "", hist, res=res[1002])], now=1000.0)
    store.add([item("vllm.queue", "histogram", "", hist, res=res[1001])], now=1000.0)  # the holder's own other type
    assert (store.type_conflicts, store.type_conflicts_between_uids) == (4, 3)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "Prometheus: uid 1002's histogram vllm_queue is not exported: uid 1001's gauge holds that name (a name "
        "has one type; rename one of them)",
        "Prometheus: uid 1001's histogram vllm_queue is not exported: its own gauge holds that name (a name has "
        "one type; rename one of them)"], said
    # 1003 keeps a gauge of the name alive; 1001's expires: the holder named is who holds it now
    store.add([item("vllm.queue", "gauge", "", [NumberPoint(2)], res=res[1003])], now=1050.0)
    store.expire(now=1070.0)
    caplog.clear()
    store.add([item("vllm.queue", "histogram", "", hist, res=res[1004])], now=1070.0)
    assert [r.getMessage() for r in caplog.records] == [
        "Prometheus: uid 1004's histogram vllm_queue is not exported: uid 1003's gauge holds that name (a name "
        "has one type; rename one of them)"]  # (1001, the first holder, holds none of it any more)
    assert store.type_conflicts_between_uids == 4


def test_one_uids_own_clashes_do_not_use_up_what_is_said_of_others(caplog: pytest.LogCaptureFixture) -> None:
    from infersight.exporters.prometheus_endpoint import MAX_CONFLICTS_SAID_PER_UID

    caplog.set_level("WARNING", logger="infersight.exporters.prometheus")
    a, b = (Resource.of({"service.name": "s", "process.user.id": u}) for u in (1001, 1002))
    store = SeriesStore()
    hist = [HistogramPoint([1.0], [1, 1], 2, 1.0, None, None)]
    for n in range(3 * MAX_CONFLICTS_SAID_PER_UID):  # 1001 clashes with itself on many names
        store.add([item("own.%d" % n, "gauge", "", [NumberPoint(1)], res=a)])
        store.add([item("own.%d" % n, "histogram", "", hist, res=a)])
    store.add([item("shared", "gauge", "", [NumberPoint(1)], res=a)])
    store.add([item("shared", "histogram", "", hist, res=b)])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == MAX_CONFLICTS_SAID_PER_UID + 1
    assert said[-1].startswith("Prometheus: uid 1002's histogram shared is not exported: uid 1001's gauge")


def test_real_agent_items_render() -> None:
    """Everything device_metrics() and health_metrics() produce renders and parses."""
    agent_res = Resource.of({"host.name": "node-1", "service.name": "infersight-agent"})
    sample = DeviceSample(
        time_ns=1,
        index=0,
        uuid="GPU-abcd",
        name="NVIDIA H100",
        utilization_gpu_pct=80,
        memory_used_bytes=1 << 30,
        memory_total_bytes=80 << 30,
        throttle_mask=0x20,
        throttle_reasons=("sw_thermal_slowdown",),
        pcie_link_gen=3,
        pcie_link_gen_max=5,
        pcie_link_width=16,
        pcie_link_width_max=16,
        ecc_corrected_volatile=0,
        ecc_uncorrected_volatile=0,
    )
    items = device_metrics([sample], resource=agent_res, start_ns=0, states={"GPU-abcd": "degraded"})
    items += health_metrics(
        agent_res,
        0,
        Counters(events_in=7),
        2,
        0,
        [
            {
                "name": "prometheus",
                "queue_depth": 0,
                "export_errors": 0,
                "retries": 0,
                "dropped_items": 0,
                "exported_items": 9,
            }
        ],
        1.5,
        1000,
    )
    store = SeriesStore()
    store.add(items)
    out = scrape(store)
    assert store.type_conflicts == 0
    degraded = [v for k, v in out["hw_status"]["samples"].items() if ("hw_state", "degraded") in k[1]]
    assert degraded == [1.0]
    thermal = [
        v
        for k, v in out["infersight_device_throttle"]["samples"].items()
        if ("infersight_device_throttle_reason", "sw_thermal_slowdown") in k[1]
    ]
    assert thermal == [1.0]
    assert (
        out["infersight_events_lost"]["samples"][
            ("infersight_events_lost", (("host_name", "node-1"), ("service_name", "infersight-agent")))
        ]
        == 2.0
    )
    assert "infersight_device_pcie_link_generation_max" in out


# -- the exporter: protocol, binding, configuration ---------------------------------------------


def test_is_an_exporter_and_defaults_to_loopback() -> None:
    e = PrometheusExporter()
    assert isinstance(e, Exporter)
    assert (e.host, e.port) == ("127.0.0.1", 9464)
    assert not e.listening


async def test_binds_127_0_0_1_by_default_and_serves_metrics() -> None:
    e = PrometheusExporter(port=0)
    await e.start()
    try:
        assert e._server is not None
        assert e._server.server_address[0] == "127.0.0.1"
        await e.export([item("hw.gpu.utilization", "gauge", "1", [NumberPoint(0.5, {"hw.id": "GPU-1"})])])
        assert e.url is not None
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(e.url, timeout=5).read().decode())
        assert 'hw_gpu_utilization_ratio{host_name="node-1",hw_id="GPU-1"' in body
        assert e.state()["scrapes"] == 1
        assert e.state()["listening"] == 1
    finally:
        await e.shutdown()
    assert not e.listening
    await e.shutdown()  # idempotent


async def test_shutdown_releases_the_port_and_bind_failure_is_reported() -> None:
    e = PrometheusExporter(port=0)
    await e.start()
    port = e.bound_port
    assert port
    busy = PrometheusExporter(port=port)
    with pytest.raises(ExportError):
        await busy.start()
    assert "cannot listen" in str(busy.state()["last_error"])
    await busy.export([item("hw.gpu.utilization", "gauge", "1", [NumberPoint(1)])])  # never raises
    assert busy.state()["series"] == 2
    await e.shutdown()
    again = PrometheusExporter(port=port)
    await again.start()
    assert again.bound_port == port
    await again.shutdown()


async def test_idle_scrape_connections_are_closed_and_capped(monkeypatch: pytest.MonkeyPatch,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    """Each scrape connection took a thread and waited for its request without limit (150 idle clients held
    154 threads): past MAX_SCRAPE_CONNECTIONS at once a connection is now closed at once, counted, and an idle
    one is closed after IDLE_TIMEOUT_S, with no traceback on stderr; a scrape still gets through."""
    import socket
    import urllib.request

    from infersight.exporters import prometheus_endpoint as pe

    async def idle_clients(e: PrometheusExporter, n: int) -> list[socket.socket]:
        return [await asyncio.to_thread(socket.create_connection, ("127.0.0.1", e.bound_port), 5) for _ in range(n)]

    monkeypatch.setattr(pe, "IDLE_TIMEOUT_S", 30.0)
    monkeypatch.setattr(pe, "MAX_SCRAPE_CONNECTIONS", 4)
    monkeypatch.setattr(pe, "EVICT_IDLE_S", 60.0)  # (none is idle long enough to give way here: below)
    capped = PrometheusExporter(port=0)
    await capped.start()
    idle = await idle_clients(capped, 8)
    try:
        deadline = time.monotonic() + 30  # the server accepts them one by one
        while int(capped.state()["scrape_connections_refused"]) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert capped.state()["scrape_connections_refused"] == 4
    finally:
        for c in idle:
            c.close()
        await capped.shutdown()

    monkeypatch.setattr(pe, "IDLE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(pe, "MAX_SCRAPE_CONNECTIONS", 32)
    e = PrometheusExporter(port=0)
    await e.start()
    idle = await idle_clients(e, 3)
    try:
        for c in idle:  # closed by the server once idle that long (they sent nothing: nothing to answer)
            c.settimeout(5)
            assert await asyncio.to_thread(c.recv, 1) == b""
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(e.url, timeout=5).read())
        assert b"infersight_prometheus_series" in body
        assert e.state()["scrape_connections_refused"] == 0
    finally:
        for c in idle:
            c.close()
        await e.shutdown()
    assert "Traceback" not in capfd.readouterr().err


def test_from_config_off_by_default() -> None:
    assert from_config(load(None, env={}), env={}) is None


def test_from_config_env_and_file(tmp_path: Path) -> None:
    e = from_config(load(None, env={}), env={"INFERSIGHT_PROMETHEUS": "1"})
    assert e is not None
    assert (e.host, e.port) == ("127.0.0.1", 9464)
    cfg = tmp_path / "infersight.toml"
    cfg.write_text('[exporters.prometheus]\nenabled = true\nhost = "0.0.0.0"\nport = 9555\nmax_series = 50\n')
    e = from_config(load(str(cfg), env={}), env={})
    assert e is not None
    assert (e.host, e.port, e.store.max_series) == ("0.0.0.0", 9555, 50)
    # env beats file; with the keys registered in config.load too
    c = load(str(cfg), env={"INFERSIGHT_PROMETHEUS_PORT": "9600"}, extra_keys=PROMETHEUS_KEYS)
    e = from_config(c, env={"INFERSIGHT_PROMETHEUS_PORT": "9600"})
    assert e is not None
    assert e.port == 9600


def test_from_config_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "infersight.toml"
    cfg.write_text("[exporters.prometheus]\nenabled = true\nport = 70000\n")
    with pytest.raises(ConfigError, match=r"exporters\.prometheus\.port"):
        from_config(load(str(cfg), env={}), env={})
    cfg.write_text("[exporters.prometheus]\nenabled = true\nprot = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'exporters\.prometheus\.prot'"):
        from_config(load(str(cfg), env={}), env={})
    with pytest.raises(ConfigError, match="INFERSIGHT_PROMETHEUS"):
        from_config(load(None, env={}), env={"INFERSIGHT_PROMETHEUS": "maybe"})


def test_keys_are_well_formed() -> None:
    names = [k.name for k in PROMETHEUS_KEYS]
    assert names[:3] == ["exporters.prometheus.enabled", "exporters.prometheus.host", "exporters.prometheus.port"]
    assert all(k.env and k.env.startswith("INFERSIGHT_PROMETHEUS") and k.help for k in PROMETHEUS_KEYS)
    assert PROMETHEUS_KEYS[0].default() is False


def test_module_and_rule_folder_do_not_clash() -> None:
    import importlib

    mod = importlib.import_module("infersight.exporters.prometheus_endpoint")
    assert mod.PrometheusExporter is PrometheusExporter
    assert [p.name for p in shipped_rule_files()] == ["alerts.yml", "coldstart.yml", "recording.yml"]


# -- live: a real Prometheus scrapes the endpoint ----------------------------------------------


@contextlib.contextmanager
def _prometheus(tmp: Path, target_port: int) -> Iterator[str]:
    assert PROMETHEUS is not None
    port = free_port()
    rules = "\n".join("  - %s" % p for p in shipped_rule_files())
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "rule_files:\n%s\n"
        "scrape_configs:\n  - job_name: infersight\n    static_configs:\n"
        "      - targets: ['127.0.0.1:%d']\n" % (rules, target_port)
    )
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            "--config.file=%s" % (tmp / "prometheus.yml"),
            "--storage.tsdb.path=%s" % (tmp / "data"),
            "--web.listen-address=127.0.0.1:%d" % port,
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield "http://127.0.0.1:%d" % port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def _query(base: str, q: str) -> list[dict]:
    d = _get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": q}))
    return d["data"]["result"] if d and d.get("status") == "success" else []


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")
async def test_live_scrape_by_prometheus(tmp_path: Path) -> None:
    exporter = PrometheusExporter(port=free_port())
    await exporter.start()
    assert exporter._server is not None
    assert exporter._server.server_address[0] == "127.0.0.1"
    agent_res = Resource.of({"host.name": "node-1", "service.name": "infersight-agent"})
    sample = DeviceSample(
        time_ns=1,
        index=0,
        uuid="GPU-live",
        name="NVIDIA H100",
        utilization_gpu_pct=80,
        pcie_link_gen=4,
        pcie_link_gen_max=5,
    )
    n = 0

    async def feed() -> None:
        nonlocal n
        n += 1
        await exporter.export(device_metrics([sample], resource=agent_res, start_ns=0))
        await exporter.export(
            [item("infersight.request.duration", "histogram", "s", [latency([10 * n, 5 * n, n, 0], 1.0 * n)])]
        )

    await feed()
    try:
        assert exporter.bound_port is not None
        with _prometheus(tmp_path, exporter.bound_port) as base:
            deadline = time.monotonic() + 30
            util: list[dict] = []
            while time.monotonic() < deadline:
                util = await asyncio.to_thread(_query, base, 'hw_gpu_utilization_ratio{hw_id="GPU-live"}')
                if util:
                    break
                await feed()
                await asyncio.sleep(0.5)
            assert util, (tmp_path / "prometheus.log").read_text()[-2000:]
            (series,) = util
            assert float(series["value"][1]) == 0.8
            assert series["metric"]["host_name"] == "node-1"
            assert series["metric"]["job"] == "infersight"
            assert series["metric"]["instance"] == "127.0.0.1:%d" % exporter.bound_port
            up = await asyncio.to_thread(_query, base, 'up{job="infersight"}')
            assert [float(r["value"][1]) for r in up] == [1.0]
            buckets = await asyncio.to_thread(_query, base, "infersight_request_duration_seconds_bucket")
            les = {r["metric"]["le"] for r in buckets}
            assert les == {"0.05", "0.1", "0.25", "+Inf"}
            assert {r["metric"]["infersight_model"] for r in buckets} == {"llama"}
            link = await asyncio.to_thread(_query, base, "infersight_device_pcie_link_generation_max")
            assert [float(r["value"][1]) for r in link] == [5.0]
            # The shipped rules load and evaluate against the scraped series.
            groups: list[dict] = []
            while time.monotonic() < deadline:
                d = await asyncio.to_thread(_get, base + "/api/v1/rules")
                groups = d["data"]["groups"] if d else []
                rules = [r for g in groups for r in g["rules"]]
                if rules and all(r["health"] == "ok" for r in rules):
                    break
                await feed()
                await asyncio.sleep(0.5)
            rules = [r for g in groups for r in g["rules"]]
            assert len(rules) >= 15
            assert all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
    finally:
        await exporter.shutdown()


def test_shipped_example_config(tmp_path: Path) -> None:
    """systemd/infersight.toml's prometheus section, uncommented, is valid and stays on loopback."""
    import re

    text = (Path(__file__).resolve().parents[2] / "systemd" / "infersight.toml").read_text()
    section = text.split("[exporters.prometheus]", 1)[1].split("\n[", 1)[0]
    body = re.sub(r"^# ([a-z_]+ = )", r"\1", section, flags=re.M)
    cfg = tmp_path / "infersight.toml"
    cfg.write_text("[exporters.prometheus]" + body)
    assert from_config(load(str(cfg), env={}), env={}) is None  # enabled = false
    cfg.write_text("[exporters.prometheus]" + body.replace("enabled = false", "enabled = true"))
    e = from_config(load(str(cfg), env={}), env={})
    assert e is not None
    assert (e.host, e.port) == ("127.0.0.1", 9464)


async def test_idle_connections_holding_every_slot_give_way_to_a_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any local user could hold every scrape slot with idle connections renewed within the idle timeout, and
    no scrape got through (a review's attack, 32 connections). When all are taken, the one idle longest gives
    way to the new connection; one with a request under way never does."""
    import socket
    import urllib.request

    from infersight.exporters import prometheus_endpoint as pe

    monkeypatch.setattr(pe, "IDLE_TIMEOUT_S", 30.0)
    monkeypatch.setattr(pe, "MAX_SCRAPE_CONNECTIONS", 4)
    monkeypatch.setattr(pe, "EVICT_IDLE_S", 0.2)
    e = PrometheusExporter(port=0)
    await e.start()
    hold = [await asyncio.to_thread(socket.create_connection, ("127.0.0.1", e.bound_port), 5) for _ in range(4)]
    hold[0].sendall(b"GET /metrics HTTP/1.1\r\n")  # and one dribbles its headers: no less idle
    try:
        await asyncio.sleep(0.5)  # they hold every slot, idle
        for i in range(3):  # scrape after scrape gets through; the holder renews what it lost
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(e.url, timeout=5).read())
            assert b"infersight_prometheus_series" in body
            closed = []
            for c in hold:
                c.settimeout(0.05)
                try:
                    if c.recv(1) == b"":
                        closed.append(c)
                except (TimeoutError, OSError):
                    pass
            assert len(closed) == 1, i  # the idlest one gave way; the others hold on
            for c in closed:
                hold.remove(c)
                c.close()
                hold.append(await asyncio.to_thread(socket.create_connection, ("127.0.0.1", e.bound_port), 5))
            await asyncio.sleep(0.3)
        state = e.state()
        assert state["scrape_connections_evicted"] == 3 and state["scrape_connections_refused"] == 0, state
    finally:
        for c in hold:
            c.close()
        await e.shutdown()


async def test_a_scrape_under_way_never_gives_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an idle connection gives way: a slow scrape in progress (its collector takes a while) is the oldest
    connection, yet it completes, and the new connection is refused instead (a review found the guard never ran:
    wsgiref's handler reads one request without the methods first used to mark it)."""
    import socket
    import urllib.request

    from infersight.exporters import prometheus_endpoint as pe

    monkeypatch.setattr(pe, "IDLE_TIMEOUT_S", 30.0)
    monkeypatch.setattr(pe, "MAX_SCRAPE_CONNECTIONS", 2)
    monkeypatch.setattr(pe, "EVICT_IDLE_S", 0.1)
    real = pe._Collector.collect

    def slow(self: Any) -> Any:
        time.sleep(1.5)
        return real(self)

    monkeypatch.setattr(pe._Collector, "collect", slow)
    e = PrometheusExporter(port=0)
    await e.start()
    try:
        scrape = asyncio.create_task(asyncio.to_thread(lambda: urllib.request.urlopen(e.url, timeout=10).read()))
        await asyncio.sleep(0.3)  # the scrape is in its collector
        other = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", e.bound_port), 5)
        await asyncio.sleep(0.3)  # both slots taken: the scrape (busy) and this one (idle)
        late = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", e.bound_port), 5)
        assert b"infersight_prometheus_series" in await scrape  # never evicted
        late.settimeout(5)
        other.settimeout(5)
        assert await asyncio.to_thread(other.recv, 1) == b""  # the idle one gave way to the late one
        state = e.state()
        assert state["scrape_connections_evicted"] == 1, state
        other.close()
        late.close()
    finally:
        await e.shutdown()


HOLDER = """
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), 5))
    except OSError:
        pass
print(len(held), flush=True)
time.sleep(30)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: connections of another uid")
async def test_one_local_uid_holds_at_most_its_share_of_the_scrape_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends a whole request and never reads a large answer keeps its slot busy (not evictable)
    for the socket's timeout, and reconnects: 32 of them locked every scrape out (a re-review's attack). One
    local uid (the kernel's socket table says whose each connection is) holds at most MAX_CONNECTIONS_PER_UID."""
    from fleet_env import system_python

    from infersight.exporters import prometheus_endpoint as pe

    monkeypatch.setattr(pe, "EVICT_IDLE_S", 60.0)  # (none gives way here: the cap alone keeps room)
    e = PrometheusExporter(port=0)
    await e.start()
    holder = subprocess.Popen([system_python(), "-c", HOLDER, str(e.bound_port), "20"], stdout=subprocess.PIPE,
                              text=True, user=65534)
    try:
        assert holder.stdout is not None
        await asyncio.to_thread(holder.stdout.readline)
        deadline = time.monotonic() + 10
        over = 20 - pe.MAX_CONNECTIONS_PER_UID
        while int(e.state()["scrape_connections_over_uid"]) < over and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        state = e.state()
        assert state["scrape_connections_over_uid"] == over, state
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(e.url, timeout=5).read())
        assert b"infersight_prometheus_series" in body  # root's scrape: room left
    finally:
        holder.kill()
        holder.wait(10)
        await e.shutdown()
