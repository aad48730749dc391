"""Cold starts as fleet metrics: the pure accumulator and what every exporter makes of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from capture_exporter import CaptureExporter
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from infersight.agent.coldstart import storage_ceiling
from infersight.agent.coldstart.metrics import (
    CEILING,
    CEILING_RATIO,
    CEILING_RATIO_BOUNDS,
    COUNT,
    DEVICE,
    DURATION,
    DURATION_BOUNDS_S,
    MAX_RESOURCES_PER_UID,
    METRICS,
    OTHER,
    THROUGHPUT,
    THROUGHPUT_BOUNDS,
    ColdStartMetrics,
    ceiling_item,
    ceiling_ratio,
    render_reference_markdown,
    weights_throughput,
)
from infersight.coldstart_stages import ended_by, stage_durations
from infersight.exporters.mqtt_payload import Topics, decode, encode_batch
from infersight.exporters.otlp_json import encode_lines
from infersight.exporters.prometheus_endpoint import SeriesStore, metric_name
from infersight.telemetry import ColdStart, HistogramPoint, MetricItem, NumberPoint, Resource, SpanEvent, SpanItem

ROOT = Path(__file__).resolve().parents[2]
S = 1_000_000_000
T0 = 1_700_000_000 * S


def res(service: str = "svc", pid: int = 1, host: str = "gpu-01") -> Resource:
    return Resource.of({"service.name": service, "host.name": host, "process.pid": pid,
                        "service.instance.id": "producer-%d" % pid, "telemetry.sdk.name": "infersight"})


def stage(r: Resource, name: str, start_s: float, end_s: float, **attrs: object) -> SpanItem:
    a = {"infersight.stage": name, **attrs}
    return SpanItem(r, "a" * 32, os.urandom(8).hex(), "b" * 16, "coldstart." + name,
                    T0 + int(start_s * S), T0 + int(end_s * S), a)  # type: ignore[arg-type]


def cold_start(r: Resource, end_s: float, stages: list[SpanItem], **root_attrs: object) -> ColdStart:
    root = SpanItem(r, "a" * 32, "b" * 16, None, "coldstart", T0, T0 + int(end_s * S),
                    {"faas.coldstart": True, **root_attrs})  # type: ignore[arg-type]
    return ColdStart(root, stages)


def points(items: list[MetricItem], name: str) -> dict[str, HistogramPoint | NumberPoint]:
    (m,) = [m for m in items if m.name == name]
    return {str(next(iter(p.attributes.values()))): p for p in m.points}


def test_stage_durations_union_per_stage_clip_and_unattributed() -> None:
    r = res()
    cs = cold_start(r, 10.0, [
        stage(r, "weights_load", 1.0, 3.0),
        stage(r, "weights_load", 2.0, 4.0),  # a second shard on another thread: overlaps, counts once
        stage(r, "weights_load", 5.0, 6.0),  # sequential: adds
        stage(r, "warmup", 6.0, 9.0),
        stage(r, "graph_compile", 7.0, 8.5),  # nested in warmup: its own value
        stage(r, "first_request", 9.5, 11.0),  # runs past the root: clipped
        stage(r, "unattributed", 4.0, 5.0),  # the sampler's explanation: not counted again
    ], **{"infersight.coldstart.unattributed_s": 1.5, "infersight.coldstart.ended_by": "first_request"})
    d = stage_durations(cs)
    assert d == pytest.approx({"weights_load": 4.0, "warmup": 3.0, "graph_compile": 1.5, "first_request": 0.5,
                               "unattributed": 1.5, "total": 10.0})
    assert ended_by(cs) == "first_request"
    # Without the root attribute: the time no stage covers.
    del cs.root.attributes["infersight.coldstart.unattributed_s"]
    assert stage_durations(cs)["unattributed"] == pytest.approx(10.0 - 4.0 - 3.0 - 0.5)


def test_stage_durations_of_a_root_that_ended_at_readiness() -> None:
    """The first request came 4 s after readiness: its service time counts as first_request (and
    what nests in it as its own stage), the wait for traffic in no stage and not in the total."""
    r = res()
    cs = cold_start(r, 2.0, [
        stage(r, "weights_load", 0.5, 1.5),
        stage(r, "ready_wait", 1.5, 2.0),
        stage(r, "first_request", 6.0, 6.75),
        stage(r, "graph_compile", 6.1, 6.5),  # a recompile inside the first request
    ], **{"infersight.coldstart.unattributed_s": 0.5, "infersight.coldstart.ended_by": "ready"})
    d = stage_durations(cs)
    assert d == pytest.approx({"weights_load": 1.0, "ready_wait": 0.5, "first_request": 0.75, "graph_compile": 0.4,
                               "unattributed": 0.5, "total": 2.0})
    assert ended_by(cs) == "ready"


def test_accumulates_across_producers_of_one_service() -> None:
    acc = ColdStartMetrics()
    for pid, secs in ((10, 3.0), (11, 40.0), (12, 0.05)):  # three processes, one service, one host
        r = res(pid=pid)
        items = acc.observe(cold_start(r, secs, [stage(r, "weights_load", 0.0, secs / 2)],
                                       **{"infersight.coldstart.ended_by": "exit"}), T0 + pid * S)
    assert len(acc) == 1
    assert {m.name for m in items} == {DURATION, COUNT}  # no weights reads with a page-cache ratio
    (m,) = [m for m in items if m.name == DURATION]
    assert m.resource.as_dict() == {"service.name": "svc", "host.name": "gpu-01", "service.instance.id": "gpu-01",
                                    "telemetry.sdk.name": "infersight"}  # no pid: one series, not one per process
    assert (m.kind, m.unit, m.start_ns, m.time_ns) == ("histogram", "s", T0, T0 + 40 * S)
    total = points(items, DURATION)["total"]
    assert isinstance(total, HistogramPoint)
    assert (total.count, total.sum, total.min, total.max) == (3, pytest.approx(43.05), 0.05, 40.0)
    assert total.bounds == list(DURATION_BOUNDS_S) and len(total.bucket_counts) == len(total.bounds) + 1
    # 0.05 sits on a bound: bucket (.., 0.05]; 3.0 in (2, 5]; 40 in (30, 60]
    b = total.bounds
    assert total.bucket_counts[b.index(0.05)] == 1
    assert total.bucket_counts[b.index(5.0)] == 1
    assert total.bucket_counts[b.index(60.0)] == 1
    assert sum(total.bucket_counts) == 3
    count = points(items, COUNT)["exit"]
    assert isinstance(count, NumberPoint) and count.value == 3
    (c,) = [m for m in items if m.name == COUNT]
    assert c.kind == "sum" and c.monotonic


def test_services_helpers_time_order_and_refresh() -> None:
    acc = ColdStartMetrics()
    a, b = res("a"), res("b")
    acc.observe(cold_start(a, 1.0, []), T0 + 5 * S)
    out = acc.observe(cold_start(b, 1.0, []), T0 + 2 * S)  # an older event (a spool replay)
    assert {m.resource.get("service.name") for m in out} == {"b"}  # only the service that changed
    assert all(m.time_ns == T0 + 5 * S for m in out)  # cumulative time never goes back
    helper = cold_start(a, 1.0, [], **{"infersight.process.role": "helper"})
    assert acc.observe(helper, T0 + 6 * S) == [] and acc.helpers_skipped == 1
    assert len(acc.snapshot(T0 + 7 * S)) == 4  # duration + count per service
    assert acc.due(T0 + 7 * S + 1, 10 * S) == []  # just published
    assert {m.resource.get("service.name") for m in acc.due(T0 + 20 * S, 10 * S)} == {"a", "b"}


def test_list_valued_resource_attribute_does_not_break_the_key() -> None:
    r = Resource.of({"service.name": "x", "service.namespace": ["a", "b"], "host.name": "h"})
    (m, _) = ColdStartMetrics().observe(cold_start(r, 1.0, []), T0)
    assert m.resource.get("service.namespace") == "['a', 'b']"


def test_bounds_on_stages_and_services() -> None:
    acc = ColdStartMetrics(max_resources=2, max_stages=2)
    r = res()
    items = acc.observe(cold_start(r, 5.0, [stage(r, "s%d" % i, i, i + 0.5) for i in range(4)]), T0)
    assert set(points(items, DURATION)) == {"s0", "s1", OTHER, "unattributed", "total"}
    assert points(items, DURATION)[OTHER].count == 2  # type: ignore[union-attr]
    for name in ("x", "y"):
        acc.observe(cold_start(res(name), 1.0, []), T0)
    assert len(acc) == 2 and acc.services_forgotten == 1  # the least recently observed went


def test_weights_throughput_classes_and_absent_ratio() -> None:
    r = res()
    gib = 2**30

    def load(ratio: float | None, nbytes: int, rate: float, at: float) -> SpanItem:
        a: dict[str, object] = {"infersight.weights.bytes": nbytes, "infersight.weights.bytes_per_s": rate}
        if ratio is not None:
            a["infersight.weights.page_cache_ratio"] = ratio
        return stage(r, "weights_load", at, at + 1, **a)

    # No page_cache_ratio (an older hook): no observation, nothing invented.
    assert weights_throughput(cold_start(r, 5, [load(None, gib, 1e9, 0)])) is None
    # 3 GiB cold at 1 GB/s + 1 GiB warm at 10 GB/s: byte-weighted ratio 0.25 -> cold, 4 GiB over 3.3 s.
    cs = cold_start(r, 5, [load(0.0, 3 * gib, 1e9, 0), load(1.0, gib, 10e9, 2)])
    cache, rate = weights_throughput(cs)  # type: ignore[misc]
    assert cache == "cold"
    assert rate == pytest.approx(4 * gib / (3 * gib / 1e9 + gib / 10e9))
    acc = ColdStartMetrics()
    acc.observe(cs, T0)
    items = acc.observe(cold_start(r, 5, [load(0.9, gib, 12e9, 0)]), T0 + S)
    th = points(items, THROUGHPUT)
    assert set(th) == {"cold", "warm"}
    warm = th["warm"]
    assert isinstance(warm, HistogramPoint) and warm.count == 1 and warm.bounds == list(THROUGHPUT_BOUNDS)
    assert warm.bucket_counts[warm.bounds.index(16e9)] == 1


def test_launcher_root_ended_by() -> None:
    r = res()
    bare = cold_start(r, 1.0, [], **{"infersight.coldstart.source": "launcher"})
    assert ended_by(bare) == "exit"
    ready = cold_start(r, 1.0, [stage(r, "ready_wait", 0, 1)], **{"infersight.coldstart.source": "launcher"})
    assert ended_by(ready) == "ready"
    probed = cold_start(r, 0.5, [stage(r, "ready_wait", 0, 0.5), stage(r, "first_request", 0.5, 1)],
                        **{"infersight.coldstart.source": "launcher"})
    assert ended_by(probed) == "ready"  # the probe came after readiness: the root ended there
    only_probe = cold_start(r, 1.0, [stage(r, "first_request", 0.5, 1)], **{"infersight.coldstart.source": "launcher"})
    assert ended_by(only_probe) == "first_request"  # no readiness signal: the first response ends it


def _items() -> tuple[ColdStart, list[MetricItem]]:
    r = res()
    cs = cold_start(r, 12.0, [stage(r, "weights_load", 1.0, 7.0, **{
        "infersight.weights.bytes": 6 * 10**9, "infersight.weights.bytes_per_s": 1e9,
        "infersight.weights.page_cache_ratio": 0.0})], **{"infersight.coldstart.ended_by": "first_request",
                                                         "infersight.coldstart.unattributed_s": 6.0})
    return cs, ColdStartMetrics().observe(cs, T0 + 12 * S)


def test_prometheus_names_labels_and_buckets() -> None:
    _, items = _items()
    assert {metric_name(m) for m in items} == {
        "infersight_coldstart_duration_seconds",
        "infersight_coldstart_weights_throughput_bytes_per_second",  # By/s, as the Collector names it
        "infersight_coldstart_count_total",
    }
    store = SeriesStore(target_info=False)
    assert store.add(items) == 5  # weights_load, unattributed, total, cold, first_request
    got = _scrape(store)
    base = {"host_name": "gpu-01", "service_instance_id": "gpu-01", "service_name": "svc"}
    stage = {**base, "infersight_stage": "weights_load"}
    hist = "infersight_coldstart_duration_seconds"
    assert got[(hist + "_bucket", _key(stage, le="5.0"))] == 0
    assert got[(hist + "_bucket", _key(stage, le="10.0"))] == 1
    assert got[(hist + "_bucket", _key(stage, le="+Inf"))] == 1
    assert got[(hist + "_count", _key(stage))] == 1
    assert got[(hist + "_sum", _key(stage))] == 6.0
    assert got[(hist + "_sum", _key({**base, "infersight_stage": "total"}))] == 12.0
    cold = {**base, "infersight_weights_cache": "cold"}
    assert got[("infersight_coldstart_weights_throughput_bytes_per_second_bucket", _key(cold, le="1e+09"))] == 1
    assert got[("infersight_coldstart_weights_throughput_bytes_per_second_bucket", _key(cold, le="5e+08"))] == 0
    ended = {**base, "infersight_coldstart_ended_by": "first_request"}
    assert got[("infersight_coldstart_count_total", _key(ended))] == 1


def test_rate_units_are_named_as_the_collector_names_them() -> None:
    from infersight.metricspec import MetricSpec, prometheus_name

    assert prometheus_name(MetricSpec("disk.read", "gauge", "By/s", "")) == "disk_read_bytes_per_second"
    assert prometheus_name(MetricSpec("load.bytes.rate", "gauge", "By/s", "")) == "load_bytes_rate_per_second"
    assert prometheus_name(MetricSpec("served", "sum", "{request}/s", "", monotonic=True)) == "served_per_second_total"
    assert prometheus_name(MetricSpec("x.per.second", "gauge", "1/s", "")) == "x_per_second"


def _key(labels: dict[str, str], **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({**labels, **more}.items()))


def _scrape(store: SeriesStore) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, _key(s.labels)): s.value
            for fam in text_string_to_metric_families(_render(store)) for s in fam.samples}


def _render(store: SeriesStore) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    class C:
        def collect(self):  # noqa: ANN202
            return store.families()

    reg = CollectorRegistry(auto_describe=False)
    reg.register(C())  # type: ignore[arg-type]
    return generate_latest(reg).decode()


def test_otlp_json_line_parses_as_a_cumulative_histogram() -> None:
    _, items = _items()
    (line,) = encode_lines(items)
    msg = ExportMetricsServiceRequest()
    json_format.Parse(line, msg)
    ms = {m.name: m for m in msg.resource_metrics[0].scope_metrics[0].metrics}
    h = ms[DURATION].histogram
    assert h.aggregation_temporality == 2  # cumulative
    dp = {p.attributes[0].value.string_value: p for p in h.data_points}
    assert set(dp) == {"weights_load", "unattributed", "total"}
    assert (dp["total"].count, dp["total"].sum, dp["total"].min, dp["total"].max) == (1, 12.0, 12.0, 12.0)
    assert list(dp["total"].explicit_bounds) == list(DURATION_BOUNDS_S)
    assert ms[COUNT].sum.is_monotonic and ms[COUNT].sum.data_points[0].as_int == 1
    assert ms[THROUGHPUT].unit == "By/s"


async def test_otlp_exporter_sends_the_histograms() -> None:
    from otlp_receiver import OtlpReceiver, attrs

    from infersight.exporters.otlp import OtlpExporter

    _, items = _items()
    rx = OtlpReceiver().start()
    try:
        for endpoint, protocol in ((rx.http_endpoint, "http/protobuf"), (rx.grpc_endpoint, "grpc")):
            exp = OtlpExporter(endpoint, protocol, timeout_s=5, env={})
            await exp.start()
            await exp.export(items)
            await exp.shutdown()
        got = rx.metrics()
        for transport in ("http", "grpc"):
            ms = {m.name: (r, m) for r, _, m in rx.metrics(transport)}
            r, m = ms[DURATION]
            assert r["service.name"] == "svc" and "process.pid" not in r
            dp = {attrs(p.attributes)["infersight.stage"]: p for p in m.histogram.data_points}
            assert dp["weights_load"].sum == 6.0 and list(dp["weights_load"].bucket_counts)[7] == 1  # (5, 10]
            assert ms[THROUGHPUT][1].histogram.data_points[0].count == 1
        assert len(got) == 6
    finally:
        rx.stop()


def test_mqtt_coldstart_message_carries_stage_durations() -> None:
    cs, _ = _items()
    msgs, _ = encode_batch([cs.root, *cs.stages, cs], Topics.of("infersight", "gpu-01"))
    (msg,) = msgs
    assert msg.topic == "infersight/gpu-01/coldstart"
    d = decode(msg.payload)
    assert d["stage_durations_s"] == {"weights_load": 6.0, "unattributed": 6.0, "total": 12.0}
    assert d["stage_durations_s"] == stage_durations(cs)
    assert d["ended_by"] == "first_request"


def test_reference_table_in_docs_is_current() -> None:
    table = render_reference_markdown()
    assert table in (ROOT / "docs" / "telemetry.md").read_text()
    assert [m.name for m in METRICS] == [DURATION, THROUGHPUT, CEILING_RATIO, COUNT, CEILING]


def test_module_prints_the_table() -> None:
    out: list[str] = []
    from infersight.agent.coldstart import metrics as coldstart_metrics

    coldstart_metrics._main(out.append)
    assert out == [render_reference_markdown().rstrip("\n")]


def test_items_survive_the_exporter_spool_codec() -> None:
    """An exporter whose peer is away spools these items; they must come back equal."""
    from infersight.agent.daemon import itemcodec

    _, items = _items()
    back = [itemcodec.from_dict(json.loads(json.dumps(itemcodec.to_dict(m)))) for m in items]
    assert back == items


# -- against the storage ceiling --------------------------------------------------------------


def weights_file(path: str, rate: float, read_s: float, cached: float, ratio: float | None) -> SpanEvent:
    a: dict[str, object] = {"path": path, "bytes": int(rate * read_s), "read_s": read_s, "bytes_per_s": rate,
                            "page_cache_ratio": cached}
    if ratio is not None:
        a["storage_ceiling_bytes_per_s"] = rate / ratio
        a["ceiling_ratio"] = ratio
    return SpanEvent("weights_file", T0, a)  # type: ignore[arg-type]


def test_ceiling_ratio_weighs_files_by_what_their_ceiling_would_have_read() -> None:
    r = res()
    cs = cold_start(r, 5, [])
    cs.root.events.extend([
        weights_file("/nvme/a", 1e8, 2.0, 0.0, 0.5),  # ceiling 2e8: could have read 4e8 in 2 s
        weights_file("/nvme/b", 3e8, 1.0, 0.1, 0.75),  # ceiling 4e8: 4e8 in 1 s
        weights_file("/warm", 9e9, 1.0, 0.9, 45.0),  # warm: says nothing about the disk
        weights_file("/unknown", 1e8, 1.0, 0.0, None),  # cold, no ceiling known
        weights_file("/nan", 1e8, 1.0, 0.0, float("nan")),
    ])
    assert ceiling_ratio(cs) == pytest.approx((2e8 + 3e8) / (4e8 + 4e8))
    acc = ColdStartMetrics()
    acc.observe(cs, T0)
    items = acc.observe(cs, T0 + S)
    (m,) = [m for m in items if m.name == CEILING_RATIO]
    (p,) = m.points
    assert isinstance(p, HistogramPoint) and p.attributes == {} and m.unit == "1"
    assert p.count == 2 and p.bounds == list(CEILING_RATIO_BOUNDS)
    assert p.bucket_counts[CEILING_RATIO_BOUNDS.index(0.7)] == 2  # (0.6, 0.7]
    store = SeriesStore(target_info=False)
    store.add([m])
    got = _scrape(store)
    base = {"host_name": "gpu-01", "service_instance_id": "gpu-01", "service_name": "svc"}
    assert got[("infersight_coldstart_weights_ceiling_ratio_bucket", _key(base, le="0.6"))] == 0
    assert got[("infersight_coldstart_weights_ceiling_ratio_bucket", _key(base, le="0.7"))] == 2


def test_no_ceiling_ratio_without_a_cold_file_with_a_ceiling() -> None:
    r = res()
    warm = cold_start(r, 5, [])
    warm.root.events.append(weights_file("/warm", 9e9, 1.0, 1.0, 4.5))
    unknown = cold_start(r, 5, [])
    unknown.root.events.append(weights_file("/cold", 1e8, 1.0, 0.0, None))
    _, spans_only = _items()  # an older root: spans with a ratio but no summaries
    acc = ColdStartMetrics()
    for cs in (warm, unknown):
        assert ceiling_ratio(cs) is None
        assert CEILING_RATIO not in {m.name for m in acc.observe(cs, T0)}
    assert CEILING_RATIO not in {m.name for m in spans_only}


def test_ceiling_gauge_names_and_labels() -> None:
    agent = Resource.of({"service.name": "infersight-agent", "host.name": "gpu-01", "process.pid": 7,
                         "infersight.agent.mode": "daemon"})
    assert ceiling_item(agent, {}, T0, T0) is None  # no ceiling known: no series
    item = ceiling_item(agent, {"vda": 2.2e9, "0:52": 5e8}, T0 + S, T0)
    assert item is not None and item.kind == "gauge" and item.unit == "By/s" and item.name == CEILING
    assert [(p.attributes[DEVICE], p.value) for p in item.points] == [("0:52", 5e8), ("vda", 2.2e9)]  # type: ignore[union-attr]
    assert metric_name(item) == "infersight_storage_ceiling_bytes_per_second"
    store = SeriesStore(target_info=False)
    store.add([item])
    base = {"host_name": "gpu-01", "service_name": "infersight-agent"}
    got = _scrape(store)
    assert got[("infersight_storage_ceiling_bytes_per_second", _key(base, infersight_storage_device="vda"))] == 2.2e9
    (msg,), _ = encode_batch([item], Topics.of("infersight", "gpu-01"))
    assert msg.topic == "infersight/gpu-01/agent"  # the agent's own metrics topic


def _seed(cache: Path, devices: dict[str, object]) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"schema": 1, "devices": devices}))


def test_known_ceilings_label_by_block_device_and_skip_what_is_no_measurement(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    for key, uevent in (("259:1", "MAJOR=259\nMINOR=1\nDEVNAME=nvme0n1p1\nDEVTYPE=partition\n"),
                        ("8:1", "MAJOR=8\nMINOR=1\nDEVNAME=sd\x1b[31ma\n")):  # not a plain name
        d = sys_root / "dev" / "block" / key
        d.mkdir(parents=True)
        (d / "uevent").write_text(uevent)
    cache = tmp_path / "cache" / "infersight" / "storage_ceiling.json"
    _seed(cache, {
        "259:1": {"bytes_per_s": 3e9}, "8:1": {"bytes_per_s": 2e8}, "0:52": {"bytes_per_s": 5e8},
        "evil\u001b[2J": {"bytes_per_s": 1e9}, "7:0": {"bytes_per_s": "fast"}, "7:1": {"bytes_per_s": -1},
        "7:2": {"bytes_per_s": True}, "7:3": {}, "7:4": "not an entry", "7:5": {"bytes_per_s": 0.5},
        "7:6": {"bytes_per_s": 0.25},
    })
    # Infinity and NaN, which Python's json reads back: no measurement either.
    cache.write_text(cache.read_text().replace("0.5}", "Infinity}").replace("0.25}", "NaN}"))
    assert storage_ceiling.known_ceilings(str(cache), str(sys_root)) == {
        "nvme0n1p1": 3e9, "8:1": 2e8, "0:52": 5e8}  # no sysfs entry (overlay, tmpfs): major:minor
    assert storage_ceiling.known_ceilings(str(tmp_path / "none.json"), str(sys_root)) == {}
    cache.write_text("{not json")
    assert storage_ceiling.known_ceilings(str(cache), str(sys_root)) == {}


async def test_agent_exports_the_cached_ceilings_and_their_changes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A real agent with the cold-start extension: the ceilings its cache holds go out as the
    gauge on the agent's resource, a device added later (``launch`` measured one) too."""
    import asyncio

    from infersight.agent.coldstart.extension import ColdStartExtension
    from infersight.agent.daemon import config as cfg
    from infersight.agent.daemon.lifecycle import Agent

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("INFERSIGHT_MEASURE_STORAGE", "0")  # only what the cache holds
    cache = Path(storage_ceiling.cache_path())
    _seed(cache, {"0:4242": {"bytes_per_s": 1.5e9}})
    conf = cfg.load(None, env={}, flags={
        "agent.socket": str(tmp_path / "agent.sock"), "agent.spool_dir": str(tmp_path / "spool"),
        "agent.health_interval_s": 0.05, "agent.state_dir": str(tmp_path / "state"),
    })  # fmt: skip
    sink = CaptureExporter()
    coldstart = ColdStartExtension(conf)
    coldstart.ceiling_poll_s = 0.05
    agent = Agent(conf, [sink], [coldstart], exporter_spool_root=str(tmp_path / "xspool"))

    def gauges() -> list[MetricItem]:
        return [i for i in sink.items if isinstance(i, MetricItem) and i.name == CEILING]

    async def until(pred: object) -> bool:
        deadline = time.monotonic() + 30  # the cache is read on a thread: late on a loaded machine
        while time.monotonic() < deadline:
            if pred():  # type: ignore[operator]
                return True
            await asyncio.sleep(0.02)
        return bool(pred())  # type: ignore[operator]

    await agent.start()
    try:
        assert await until(gauges)
        first = gauges()[0]
        assert first.resource.get("service.name") == "infersight-agent" and first.resource.get("host.name")
        assert [(p.attributes, p.value) for p in first.points] == [({DEVICE: "0:4242"}, 1.5e9)]  # type: ignore[union-attr]
        assert coldstart.health()["storage_ceilings"] == {"0:4242": 1.5e9}
        _seed(cache, {"0:4242": {"bytes_per_s": 1.5e9}, "0:4243": {"bytes_per_s": 4e8}})
        assert await until(lambda: len(gauges()[-1].points) == 2)
        assert {p.attributes[DEVICE]: p.value for p in gauges()[-1].points} == {  # type: ignore[union-attr]
            "0:4242": 1.5e9, "0:4243": 4e8}
        sent = len(gauges())
        await asyncio.sleep(0.3)  # several polls with nothing new: not re-sent before a minute
        assert len(gauges()) == sent
    finally:
        await agent.shutdown(5)


def _uid_res(service: str, uid: int, pid: int) -> Resource:
    return Resource.of({"service.name": service, "host.name": "gpu-01", "process.pid": pid,
                        "service.instance.id": "producer-%d" % pid, "process.user.id": uid})


def _count(items: list[MetricItem]) -> int:
    return sum(int(p.value) for p in points(items, COUNT).values())  # type: ignore[union-attr]


def test_one_users_many_services_forget_its_own_never_anothers() -> None:
    """A member of the socket group ran 300 short processes under distinct service names: the table of
    256 services, shared by every uid, forgot the victim's, whose cumulative count began again at 1."""
    acc = ColdStartMetrics()
    victim = _uid_res("victim-svc", 1002, 1)
    for _ in range(7):
        acc.observe(cold_start(victim, 1.0, []), T0)
    for i in range(300):
        acc.observe(cold_start(_uid_res("flood-%d" % i, 1003, 100 + i), 1.0, []), T0)
    assert _count(acc.observe(cold_start(victim, 1.0, []), T0)) == 8
    assert acc.services_forgotten == 300 - MAX_RESOURCES_PER_UID
    held = [m.resource.get("process.user.id") for m in acc.snapshot(T0) if m.name == COUNT]
    assert held.count(1003) == MAX_RESOURCES_PER_UID and held.count(1002) == 1


def test_another_users_runs_under_the_same_name_are_series_of_their_own() -> None:
    """The same service name from another uid went into the victim's series (3 runs made its count 6):
    the metric resource holds the kernel's uid, and the Prometheus series carry it as a label."""
    acc = ColdStartMetrics()
    for pid in (1, 2, 3):
        acc.observe(cold_start(_uid_res("victim-svc", 1002, pid), 1.0, []), T0)
    for pid in (4, 5, 6):
        mine = acc.observe(cold_start(_uid_res("victim-svc", 1003, pid), 1.0, []), T0)
    assert _count(mine) == 3
    store = SeriesStore(target_info=False)
    store.add(acc.snapshot(T0))
    got = _scrape(store)
    counts = {dict(k[1]).get("process_user_id"): v for k, v in got.items()
              if k[0] == "infersight_coldstart_count_total"}
    assert counts == {"1002": 3, "1003": 3}, got


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/check installs it)")
def test_the_cold_start_families_pass_promtools_lint() -> None:
    """`promtool check metrics` exits 0 on the scrape, lint included: the throughput histogram's earlier name
    (`..._bytes_per_s_per_second`) failed it ("should not contain abbreviated units"), a common CI gate."""
    _, items = _items()
    store = SeriesStore(target_info=False)
    store.add(items)
    r = subprocess.run(["promtool", "check", "metrics"], input=_render(store), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
