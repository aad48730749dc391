"""OtlpExporter against a real OTLP receiver (gRPC and HTTP, opentelemetry-proto servicers)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from otlp_receiver import OtlpReceiver, attrs, free_port
from otlp_samples import RES, T0, make_logs, make_metrics, make_spans

from infersight.agent.daemon.broadcast import Completion, ExporterWorker
from infersight.agent.daemon.spool import DiskSpool
from infersight.exporters.base import Exporter, ExportError
from infersight.exporters.otlp import (
    OtlpConfigError,
    OtlpExporter,
    otlp_requested,
    resolve_endpoint,
    safe_url,
)
from infersight.telemetry import (
    ColdStart,
    HistogramPoint,
    MetricItem,
    Resource,
)

PROTOCOLS = ["http/protobuf", "grpc"]


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)


@pytest.fixture
def rx():
    r = OtlpReceiver().start()
    yield r
    r.stop()


def endpoint_for(rx: OtlpReceiver, protocol: str) -> str:
    return rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint


def transport(protocol: str) -> str:
    return "grpc" if protocol == "grpc" else "http"


async def test_protocol_conformance(rx):
    exp = OtlpExporter(rx.http_endpoint, timeout_s=2)
    assert isinstance(exp, Exporter)
    assert exp.name == "otlp"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_roundtrip_all_signals(rx, protocol):
    exp = OtlpExporter(endpoint_for(rx, protocol), protocol=protocol, timeout_s=5)
    await exp.start()
    spans, logs, metrics = make_spans(), make_logs(), make_metrics()
    cold = ColdStart(spans[0], spans[1:])
    await exp.export([*spans, *logs, *metrics, cold])
    t = transport(protocol)

    got = {s.span_id.hex(): (res, scope, s) for res, scope, s in rx.spans(t)}
    assert set(got) == {s.span_id for s in spans}  # ColdStart not exported a second time
    for s in spans:
        res, scope, p = got[s.span_id]
        assert p.name == s.name
        assert p.trace_id.hex() == s.trace_id
        assert p.parent_span_id.hex() == (s.parent_span_id or "")
        assert (p.start_time_unix_nano, p.end_time_unix_nano) == (s.start_ns, s.end_ns)
        assert attrs(p.attributes) == s.attributes
        assert res == {"service.name": "serve", "host.name": "gpu-01", "process.pid": 4242}
        assert scope == "infersight"
        assert p.status.code == (2 if s.error else 0)
        if s.error:
            assert p.status.message == "boom"
    root = got[spans[0].span_id][2]
    assert [(e.name, e.time_unix_nano, attrs(e.attributes)) for e in root.events] == [
        ("ready", T0 + 4_000_000_000, {"port": 8000})
    ]

    recs = rx.log_records(t)
    assert [(lr.body.string_value, lr.severity_number, lr.severity_text) for _, _, lr in recs] == [
        ("CUDA out of memory", 17, "ERROR"), ("model loaded", 9, "INFO")
    ]
    oom = recs[0][2]
    assert oom.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c"
    assert oom.span_id.hex() == "b7ad6b7169203331"
    assert oom.event_name == "oom"
    assert oom.time_unix_nano == T0 + 1
    assert attrs(oom.attributes) == {"oom.cause": "fragmentation"}
    assert recs[1][2].trace_id == b""
    assert recs[0][0]["host.name"] == "gpu-01"

    ms = {m.name: m for _, _, m in rx.metrics(t)}
    assert set(ms) == {"hw.gpu.memory.usage", "infersight.events.in", "infersight.coldstart.duration"}
    g = ms["hw.gpu.memory.usage"]
    assert g.unit == "By"
    assert [(dp.as_int, attrs(dp.attributes)) for dp in g.gauge.data_points] == [
        (123456789, {"hw.id": "GPU-a"}), (5, {"hw.id": "GPU-b"})
    ]
    sm = ms["infersight.events.in"].sum
    assert sm.is_monotonic
    assert sm.aggregation_temporality == 2  # cumulative
    assert sm.data_points[0].as_double == 42.5
    assert sm.data_points[0].start_time_unix_nano == T0 - 10
    h = ms["infersight.coldstart.duration"].histogram
    assert h.aggregation_temporality == 2
    dp = h.data_points[0]
    assert list(dp.explicit_bounds) == [1.0, 5.0, 10.0]
    assert list(dp.bucket_counts) == [1, 2, 0, 1]
    assert (dp.count, dp.sum, dp.min, dp.max) == (4, 30.5, 0.5, 20.0)
    assert attrs(dp.attributes) == {"model": "llama"}
    assert rx.point_count(t) == 4

    st = exp.state()
    assert (st["spans_exported"], st["log_records_exported"], st["metric_points_exported"]) == (3, 2, 4)
    assert st["skipped_items"] == 1
    assert st["export_failures"] == 0
    await exp.shutdown()
    await exp.shutdown()  # idempotent
    with pytest.raises(ExportError):
        await exp.export(make_spans())


async def test_histogram_without_min_max(rx):
    exp = OtlpExporter(rx.http_endpoint, timeout_s=5)
    m = MetricItem(RES, "h", "histogram", "s", "", T0, T0, [HistogramPoint([1.0], [0, 1], 1, 2.0, None, None)])
    await exp.export([m])
    dp = rx.metrics()[0][2].histogram.data_points[0]
    assert not dp.HasField("min")
    assert not dp.HasField("max")
    assert list(dp.bucket_counts) == [0, 1]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_env_headers_reach_the_receiver(rx, monkeypatch, protocol):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=team-a,authorization=Bearer%20s3cret")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint_for(rx, protocol))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    exp = OtlpExporter()
    await exp.export(make_spans(0))
    (r,) = rx.received("traces", transport(protocol))
    assert r.headers["x-tenant"] == "team-a"
    assert r.headers["authorization"] == "Bearer s3cret"
    assert "s3cret" not in repr(exp.state())


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_explicit_headers_merge_over_env(rx, monkeypatch, protocol):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-a=env,x-b=env")
    exp = OtlpExporter(endpoint_for(rx, protocol), protocol=protocol, headers="x-b=arg", timeout_s=5)
    await exp.export(make_logs())
    (r,) = rx.received("logs")
    assert (r.headers["x-a"], r.headers["x-b"]) == ("env", "arg")


async def test_gzip_compression_from_env(rx, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    exp = OtlpExporter(rx.http_endpoint, timeout_s=5)
    await exp.export(make_spans(1))
    (r,) = rx.received("traces")
    assert r.headers["content-encoding"] == "gzip"
    assert rx.span_count() == 2


async def test_custom_env_mapping(rx):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": rx.http_endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-sig=traces",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-gen=all",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
    }
    exp = OtlpExporter(env=env)
    await exp.export([*make_spans(0), *make_logs()])
    (t,) = rx.received("traces")
    (lg,) = rx.received("logs")
    assert t.headers["x-sig"] == "traces"
    assert "x-gen" not in t.headers  # signal-specific wins over generic
    assert lg.headers["x-gen"] == "all"
    assert t.headers["content-encoding"] == "gzip"


async def test_per_signal_endpoint_wins(rx, monkeypatch):
    dead = "http://127.0.0.1:%d" % free_port()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.http_endpoint + "/v1/traces")
    exp = OtlpExporter(dead, timeout_s=0.5)
    await exp.export(make_spans(1))
    assert rx.span_count() == 2
    with pytest.raises(ExportError):
        await exp.export(make_logs())  # logs still go to the dead base endpoint


def test_only_per_signal_endpoint_leaves_others_unrouted(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces")
    assert otlp_requested()
    exp = OtlpExporter()
    assert set(exp.routes) == {"traces"}
    asyncio.run(exp.export(make_logs()))  # no endpoint for logs: counted, not sent
    assert exp.state()["unrouted_items"] == 2


def test_endpoint_resolution():
    assert resolve_endpoint("traces", "http://c:4318/", "http/protobuf", {}) == "http://c:4318/v1/traces"
    assert resolve_endpoint("logs", None, "http/protobuf", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == (
        "http://c:4318/v1/logs"
    )
    assert resolve_endpoint("metrics", "http://c:4317", "grpc", {}) == "http://c:4317"
    assert resolve_endpoint("traces", None, "http/protobuf", {}) is None  # no implicit localhost
    assert safe_url("https://user:pw@c:4318/v1/traces?token=x") == "https://c:4318/v1/traces"


def test_disabled_and_unconfigured(monkeypatch):
    assert not otlp_requested()  # no endpoint anywhere
    with pytest.raises(OtlpConfigError, match="no OTLP endpoint"):
        OtlpExporter(None)
    assert otlp_requested("http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert otlp_requested()
    assert OtlpExporter() is not None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "TRUE")
    assert not otlp_requested()
    assert not otlp_requested("http://127.0.0.1:4318")
    with pytest.raises(OtlpConfigError, match="OTEL_SDK_DISABLED"):
        OtlpExporter("http://127.0.0.1:4318")


def test_bad_protocol_and_timeout(monkeypatch):
    with pytest.raises(OtlpConfigError, match="http/json"):
        OtlpExporter("http://127.0.0.1:4318", protocol="http/json")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")
    with pytest.raises(OtlpConfigError, match="timeout"):
        OtlpExporter("http://127.0.0.1:4318")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_receiver_down_fails_fast(protocol):
    # Nothing listens: the SDK's internal retries stop at the small timeout, and the
    # failure surfaces as a retryable ExportError (our worker owns the retrying).
    exp = OtlpExporter("http://127.0.0.1:%d" % free_port(), protocol=protocol, timeout_s=0.5)
    with pytest.raises(ExportError) as ei:
        await exp.export([*make_spans(1), *make_logs(), *make_metrics()])
    assert ei.value.retryable
    st = exp.state()
    assert st["export_failures"] == 3
    assert st["failed_items"] == 7
    assert st["spans_exported"] == 0
    assert "traces" in str(ei.value)
    if protocol != "grpc":  # why, not only "export result FAILURE" (the SDK logs the cause and retries)
        assert "Connection refused" in str(ei.value), str(ei.value)


async def test_http_503_is_retryable_error(rx):
    rx.set_fail_status(503)
    exp = OtlpExporter(rx.http_endpoint, timeout_s=0.5)
    with pytest.raises(ExportError) as ei:
        await exp.export(make_spans(0))
    assert ei.value.retryable
    rx.set_fail_status(None)
    await exp.export(make_spans(0))
    assert rx.span_count() == 1


async def test_grpc_reconnects_after_receiver_restart(rx):
    exp = OtlpExporter(rx.grpc_endpoint, protocol="grpc", timeout_s=1)
    await exp.export(make_spans(0))
    await asyncio.to_thread(rx.stop)
    with pytest.raises(ExportError):
        await exp.export(make_spans(0))
    await asyncio.to_thread(rx.start)  # same port
    # The first call may still fail fast while the gRPC channel sits in its reconnect
    # backoff; retrying (what ExporterWorker does) gets through on the new server.
    attempts = 0
    for _attempt in range(300):  # up to a minute, however slow the reconnect
        attempts += 1
        try:
            await exp.export(make_spans(0))
            break
        except ExportError:
            await asyncio.sleep(0.2)
    else:
        raise AssertionError("no export got through after the receiver came back")
    # The one before the stop, and the one that got through; OTLP export is at-least-once: an
    # attempt that timed out on a loaded machine (1 s) may have reached the receiver too.
    assert 2 <= rx.span_count() <= 1 + attempts


@pytest.mark.slow
async def test_receiver_down_10s_nothing_lost(tmp_path):
    """The receiver is down for 10 s and comes back: nothing is lost, retries are counted.

    Asserts exactly-once delivery for this scenario (each batch is spooled once and popped
    after its successful export); in general OTLP export is at-least-once.
    """
    rx = OtlpReceiver(grpc_=False)
    # A short timeout would fail a request the receiver is slow to answer (a loaded machine) but took, and its retry
    # would be a duplicate (at-least-once, not a loss). The SDK retries a refused connection within this deadline.
    exp = OtlpExporter(rx.http_endpoint, timeout_s=5)
    worker = ExporterWorker(exp, spool=DiskSpool(str(tmp_path / "spool")), retry_initial_s=0.1, retry_max_s=1.0)
    worker.start()
    expected_spans: list[str] = []
    expected_logs = 0
    done = 0

    def on_done() -> None:
        nonlocal done
        done += 1

    try:
        # Healthy first: one batch goes straight through.
        await asyncio.to_thread(rx.start)
        first = make_spans(1)
        expected_spans += [s.span_id for s in first]
        c = Completion(on_done)
        c.pending = 1
        worker.submit(first, c)
        n = 1
        assert await asyncio.to_thread(rx.wait_for, lambda: rx.span_count() == 2, 10)
        # Then the receiver is down for 10 s while batches keep coming.
        await asyncio.to_thread(rx.stop)
        loop = asyncio.get_running_loop()
        t_end = loop.time() + 10.0
        while loop.time() < t_end:
            spans = make_spans(3)
            logs = make_logs()
            expected_spans += [s.span_id for s in spans]
            expected_logs += len(logs)
            c = Completion(on_done)
            c.pending = 1
            worker.submit([*spans, *logs], c)
            n += 1
            await asyncio.sleep(0.25)
        assert rx.span_count() == 2  # nothing got through while down
        assert worker.export_errors > 0
        assert worker.state()["spooled_items_pending"] > 0
        await asyncio.to_thread(rx.start)  # back, on the same port
        assert await asyncio.to_thread(
            rx.wait_for, lambda: rx.span_count() >= len(expected_spans) and rx.log_count() >= expected_logs, 30
        )
        assert await worker.drain(10)
    finally:
        await asyncio.to_thread(rx.stop)
    got = [s.span_id.hex() for _, _, s in rx.spans()]
    assert sorted(got) == sorted(expected_spans)  # every span, exactly once
    assert rx.log_count() == expected_logs
    assert done == n  # every batch completed (spooled, then delivered from the spool)
    assert worker.retries > 0
    st = worker.state()
    assert st["spooled_items_pending"] == 0
    assert st["dropped_items"] == 0
    assert st["exporter.spans_exported"] == len(expected_spans)
    assert st["exporter.export_failures"] > 0


def failing_logs(exp: OtlpExporter, times: int) -> list[int]:
    """FAULT: the exporter's next ``times`` logs requests fail as refused; the returned counter may be set again."""
    real = exp._export_signal
    left = [times]

    def flaky(signal, items):  # type: ignore[no-untyped-def]
        if signal == "logs" and left[0]:
            left[0] -= 1
            return ("connection refused (injected)", "away")
        return real(signal, items)

    exp._export_signal = flaky  # type: ignore[method-assign]
    return left


async def test_a_retry_sends_only_the_signals_that_did_not_go_out(rx):
    """A batch whose spans went out and whose logs failed (the receiver restarting between the two requests) is
    retried: its spans are not sent again (the full runs' duplicates of test_receiver_down_10s_nothing_lost)."""
    exp = OtlpExporter(rx.http_endpoint, timeout_s=5)
    fail_logs = failing_logs(exp, 2)  # FAULT: the logs' request fails twice, the receiver is real
    spans, logs = make_spans(3), make_logs()
    for _ in range(2):  # the first attempt and a retry that fails again
        with pytest.raises(ExportError):
            await exp.export([*spans, *logs])
    assert rx.span_count() == 4 and rx.log_count() == 0
    await exp.export([*spans, *logs])  # the retry, as the worker or its spool makes it: the same items
    assert rx.span_count() == 4 and rx.log_count() == len(logs)
    assert exp.state()["not_resent_items"] == 8
    await exp.export([*spans, *logs])  # a later export of the same items (no failure between): sent whole
    assert rx.span_count() == 8
    # a batch remembered and never retried (refused for good) does not hide another batch's different content
    fail_logs[0] = 1
    m1, m2 = make_metrics()[0], make_metrics()[0]
    m2.points = [type(p)(p.value + 1, dict(p.attributes)) for p in m2.points]  # same name and time, another value
    with pytest.raises(ExportError):
        await exp.export([m1, *logs])
    await exp.export([m2])
    assert len(rx.metrics()) == 2


async def test_a_regrouped_retry_sends_only_the_items_that_did_not_go_out(rx):
    """The CI failure of test_receiver_down_10s_nothing_lost: a spooled batch's spans went out and its logs did not,
    and the retry read the spool back with the batches spooled meanwhile. Its 112 spans were sent again; now each
    item goes out once."""
    exp = OtlpExporter(rx.http_endpoint, timeout_s=5)
    failing_logs(exp, 1)  # FAULT: the logs' request fails once, the receiver is real
    first = [*make_spans(3), *make_logs()]
    later = [*make_spans(2), *make_logs()]  # spooled while the first attempt was out
    with pytest.raises(ExportError):
        await exp.export(first)
    assert rx.span_count() == 4 and rx.log_count() == 0
    await exp.export([*first, *later])  # the retry, regrouped
    got = sorted(s.span_id.hex() for _, _, s in rx.spans())
    assert got == sorted(it.span_id for it in first[:4] + later[:3])  # every span once
    assert rx.log_count() == 2 * len(make_logs())  # the logs of both batches (of the same content: counted)
    assert exp.state()["not_resent_items"] == 4


async def test_log_without_ids_ignores_current_span(rx):
    from opentelemetry import trace

    ctx = trace.SpanContext(0x1234, 0x5678, is_remote=False)
    exp = OtlpExporter(rx.http_endpoint, timeout_s=5)
    with trace.use_span(trace.NonRecordingSpan(ctx)):
        await exp.export(make_logs()[1:])
    (_, _, lr) = rx.log_records()[0]
    assert lr.trace_id == b""
    assert lr.span_id == b""


async def test_list_valued_resource_attribute(rx):
    res = Resource.of({"service.name": "serve", "hw.ids": ["GPU-a", "GPU-b"]})
    span = make_spans(0)[0]
    span.resource = res
    m = make_metrics()[0]
    m.resource = res
    exp = OtlpExporter(rx.http_endpoint, timeout_s=5)
    await exp.export([span, m])
    assert rx.spans()[0][0]["hw.ids"] == ["GPU-a", "GPU-b"]
    assert rx.metrics()[0][0]["hw.ids"] == ["GPU-a", "GPU-b"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_header_values_never_logged(caplog, monkeypatch, protocol):
    caplog.set_level("DEBUG")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20t0ps3cret")
    exp = OtlpExporter("http://127.0.0.1:%d" % free_port(), protocol=protocol, headers="x-key=k3y", timeout_s=0.3)
    await exp.start()
    with pytest.raises(ExportError) as ei:
        await exp.export(make_spans(0))
    text = caplog.text + str(ei.value) + repr(exp.state())
    assert "t0ps3cret" not in text
    assert "k3y" not in text


def test_retry_after_in_seconds_or_as_a_date() -> None:
    from infersight.exporters.otlp import MAX_RETRY_AFTER_S, retry_after_s

    assert retry_after_s({"Retry-After": "7"}) == 7.0
    assert retry_after_s({"Retry-After": "99999"}) == MAX_RETRY_AFTER_S
    assert retry_after_s({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, now=1445412470.0) == 10.0
    assert retry_after_s({"Retry-After": "soon"}) is None and retry_after_s({}) is None


async def test_a_throttled_collectors_retry_after_is_waited_for(rx):
    """A collector answering 429 (or 503) with Retry-After was called again after the worker's own backoff
    (0.2 s, then doubling), by every agent of a fleet at once; the worker now waits as long as it asks."""
    rx.set_fail_status(429, {"Retry-After": "2"})
    exp = OtlpExporter(rx.http_endpoint, timeout_s=1)
    with pytest.raises(ExportError) as ei:
        await exp.export(make_spans(0))
    assert ei.value.retryable and ei.value.retry_after_s == 2.0

    refused = await _worker_tries(rx, exp, lambda: rx.set_fail_status(None))
    assert len(refused) >= 2 and refused[1] - refused[0] >= 1.9, refused  # the worker's first two tries


async def _worker_tries(rx: Any, exp: OtlpExporter, accept: Callable[[], None]) -> list[float]:
    """A worker with a short backoff (0.05-0.1 s) sends one batch to the refusing receiver: when its first two
    tries were refused (``rx.store.refused_at``), once ``accept`` has the receiver take it and the batch arrived."""
    from infersight.agent.daemon.broadcast import Completion, ExporterWorker

    rx.store.refused_at.clear()
    w = ExporterWorker(exp, retry_initial_s=0.05, retry_max_s=0.1)
    w.start()
    w.submit(make_spans(0), Completion())
    try:
        deadline = time.monotonic() + 30  # the second try comes as long after the first as the receiver asked
        while len(rx.store.refused_at) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        refused = list(rx.store.refused_at)
        accept()
        deadline = time.monotonic() + 30
        while rx.span_count() < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert rx.span_count() == 1
        return refused
    finally:
        await w.drain(2)


async def test_a_throttling_grpc_collectors_retry_info_is_waited_for(rx):
    """The gRPC form of Retry-After: UNAVAILABLE (or RESOURCE_EXHAUSTED) with a google.rpc.RetryInfo in the
    status details, as the OTLP specification has a throttling server answer. It was not read: the worker
    called again after its own 0.2 s backoff."""
    import grpc

    rx.set_grpc_fail(grpc.StatusCode.UNAVAILABLE, retry_delay_s=2.5)
    exp = OtlpExporter(rx.grpc_endpoint, protocol="grpc", timeout_s=1)
    await exp.start()
    try:
        with pytest.raises(ExportError) as ei:
            await exp.export(make_spans(0))
        assert ei.value.retryable and ei.value.retry_after_s == 2.5
        assert "gRPC UNAVAILABLE" in str(ei.value)

        refused = await _worker_tries(rx, exp, lambda: rx.set_grpc_fail(None))
        assert len(refused) >= 2 and refused[1] - refused[0] >= 2.4, refused  # the worker's first two tries
    finally:
        await exp.shutdown()


def test_grpc_retry_info_is_read_where_a_server_puts_it() -> None:
    from google.protobuf import any_pb2
    from google.rpc.error_details_pb2 import ErrorInfo, RetryInfo
    from google.rpc.status_pb2 import Status

    from infersight.exporters.otlp import MAX_RETRY_AFTER_S, grpc_retry_delay_s

    def details(*msgs: object) -> bytes:
        packed = []
        for m in msgs:
            a = any_pb2.Any()
            a.Pack(m)
            packed.append(a)
        return Status(code=14, message="throttled", details=packed).SerializeToString()

    info = RetryInfo()
    info.retry_delay.FromMilliseconds(1500)
    assert grpc_retry_delay_s([("grpc-status-details-bin", details(ErrorInfo(reason="x"), info))]) == 1.5
    assert grpc_retry_delay_s([("google.rpc.retryinfo-bin", info.SerializeToString())]) == 1.5
    info.retry_delay.FromSeconds(86400)
    assert grpc_retry_delay_s([("grpc-status-details-bin", details(info))]) == MAX_RETRY_AFTER_S
    assert grpc_retry_delay_s([("grpc-status-details-bin", details(ErrorInfo(reason="x")))]) is None
    assert grpc_retry_delay_s([("grpc-status-details-bin", b"\xff\xfe not a status")]) is None
    assert grpc_retry_delay_s(None) is None and grpc_retry_delay_s([("x-other", "v")]) is None


def test_the_proxy_the_environment_puts_in_front_is_named(monkeypatch) -> None:
    from infersight.exporters.otlp import proxy_for

    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
              "no_proxy"):
        monkeypatch.delenv(k, raising=False)
    assert proxy_for("http://collector.example:4318") is None
    monkeypatch.setenv("HTTP_PROXY", "http://user:secret@proxy.corp:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,.internal")
    assert proxy_for("http://collector.example:4318/v1/traces") == "http://proxy.corp:3128"
    assert proxy_for("http://otel.svc.internal:4318") is None and proxy_for("http://localhost:4318") is None
    assert proxy_for("https://collector.example:4318") is None  # HTTPS_PROXY is not set


async def test_a_dead_proxy_is_named_in_the_reason(rx, monkeypatch):
    """A dead proxy made the reason "[Errno 111] Connection refused" for the collector's URL, though the
    collector was healthy: nothing said a proxy stood between them."""
    dead = "http://127.0.0.1:%d" % free_port()
    monkeypatch.setenv("HTTP_PROXY", dead)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    exp = OtlpExporter(rx.http_endpoint, timeout_s=0.5)
    with pytest.raises(ExportError) as ei:
        await exp.export(make_spans(0))
    assert "through the proxy %s" % dead in str(ei.value), str(ei.value)
    assert rx.span_count() == 0
