"""Round trips: wire frames, item codec (exporter spool), OTLP JSON encoding."""

from __future__ import annotations

import json

from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from infersight.agent.daemon.itemcodec import from_dict, to_dict
from infersight.exporters.otlp_json import encode_lines
from infersight.hooks import _wire
from infersight.telemetry import (
    ColdStart,
    HistogramPoint,
    LogItem,
    MetricItem,
    NumberPoint,
    Origin,
    Resource,
    SpanEvent,
    SpanItem,
)

RES = Resource.of({"service.name": "svc", "process.pid": 42, "host.name": "h"})


def sample_items() -> list:  # type: ignore[type-arg]
    root = SpanItem(RES, "a" * 32, "b" * 16, None, "coldstart", 10, 50, {"faas.coldstart": True},
                    origin=Origin("p", 3))
    child = SpanItem(RES, "a" * 32, "c" * 16, "b" * 16, "coldstart.warmup", 20, 30,
                     {"infersight.stage": "warmup", "n": [1, 2]}, [SpanEvent("ev", 25, {"x": 1.5})], error="boom")
    return [
        root,
        child,
        ColdStart(root, [child]),
        LogItem(RES, 7, 17, "ERROR", "oom", {"infersight.oom.class": "capacity"}, "a" * 32, "c" * 16, "oom",
                Origin("p", 4)),
        MetricItem(RES, "infersight.events.lost", "sum", "{event}", "d", 9, 1, [NumberPoint(3, {"k": "v"})]),
        MetricItem(RES, "g", "gauge", "1", "", 9, 1, [NumberPoint(0.5)]),
        MetricItem(RES, "infersight.request.duration", "histogram", "s", "", 9, 1,
                   [HistogramPoint([0.1, 1.0], [1, 2, 0], 3, 1.3, 0.05, 0.9, {"hw.id": "GPU-x"})]),
    ]


def test_frame_roundtrip_and_split() -> None:
    events = [[1, 100, "log", {"body": "x"}], [2, 101, "metric", {"n": "m", "v": 1}]]
    buf = _wire.encode_batch(events) + _wire.encode_frame({"t": "ack", "seq": 2})  # type: ignore[arg-type]
    frames, rest, bad = _wire.split_frames(buf + b"\x00\x00")
    assert not bad and rest == b"\x00\x00"
    assert _wire.decode_payload(frames[0]) == {"t": "b", "n": 2, "l": 2, "e": events}
    assert _wire.decode_payload(frames[1]) == {"t": "ack", "seq": 2}
    assert _wire.batch_header(frames[0]) == {"t": "b", "n": 2, "l": 2}


def test_hook_encoder_matches_json_module() -> None:
    import json

    obj = {"t": "b", "e": [[1, 2, "log", {"s": 'q"\\\n\u00e9\u2603', "f": 1.5, "n": None, "b": False}]]}
    frame = _wire.encode_frame(obj)
    assert json.loads(frame[4:]) == obj
    assert frame[4:].isascii()


def test_reply_parser_reads_agent_replies_without_json() -> None:
    for msg in ({"t": "ack", "seq": 123456789}, {"t": "welcome", "schema": 1},
                {"t": "refuse", "schema": 1, "error": 'uid 5 is "not" allowed, {x}: y\\'}):
        frame = _wire.encode_frame(msg)  # type: ignore[arg-type]
        assert _wire.decode_reply(frame[4:]) == msg
    assert _wire.decode_reply(b"garbage") is None
    assert _wire.decode_reply(b'{"t": "ack", "seq": 12x}') is None


def test_oversized_header_is_flagged() -> None:
    frames, _rest, bad = _wire.split_frames(_wire.HEADER.pack(_wire.MAX_FRAME_BYTES + 1) + b"x")
    assert bad and not frames


def test_decode_payload_rejects_non_objects() -> None:
    assert _wire.decode_payload(b"[1,2]") is None
    assert _wire.decode_payload(b"\xff\xfe") is None
    assert _wire.decode_payload(b"{") is None


def test_item_codec_roundtrip() -> None:
    for item in sample_items():
        back = from_dict(json.loads(json.dumps(to_dict(item))))
        assert back == item


def test_otlp_json_lines_parse_into_export_requests() -> None:
    lines = encode_lines(sample_items())
    assert len(lines) == 3  # traces, metrics, logs (ColdStart is a summary, not re-exported)
    kinds = {next(iter(json.loads(line))) for line in lines}
    assert kinds == {"resourceSpans", "resourceMetrics", "resourceLogs"}
    for line in lines:
        obj = json.loads(line)
        msg = {
            "resourceSpans": ExportTraceServiceRequest,
            "resourceMetrics": ExportMetricsServiceRequest,
            "resourceLogs": ExportLogsServiceRequest,
        }[next(iter(obj))]()
        json_format.Parse(line, msg)
    traces = json.loads(lines[0])
    spans = traces["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert [s["name"] for s in spans] == ["coldstart", "coldstart.warmup"]
    assert spans[1]["parentSpanId"] == "b" * 16 and spans[1]["status"]["code"] == 2
    assert spans[0]["startTimeUnixNano"] == "10"
    hist = json.loads(lines[1])["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][2]["histogram"]
    assert hist["dataPoints"][0]["bucketCounts"] == ["1", "2", "0"]


def test_resource_with_list_values_is_hashable_and_keeps_lists() -> None:
    r = Resource.of({"k": [1, 2], "s": "x"})
    assert hash(r) == hash(Resource.of({"s": "x", "k": [1, 2]}))
    assert {r: 1}[Resource.of({"k": [1, 2], "s": "x"})] == 1
    assert r.as_dict() == {"k": [1, 2], "s": "x"} and r.get("k") == [1, 2]
    back = from_dict(json.loads(json.dumps(to_dict(LogItem(r, 1, 9, "INFO", "b")))))
    assert back.resource == r and hash(back.resource) == hash(r)
    line = encode_lines([LogItem(r, 1, 9, "INFO", "b")])[0]
    res = json.loads(line)["resourceLogs"][0]["resource"]["attributes"]
    assert {"key": "k", "value": {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": "2"}]}}} in res


async def test_console_exporter_keeps_a_bounded_number_of_coldstarts() -> None:
    import io

    from infersight.exporters.console import ConsoleExporter

    out = io.StringIO()
    exp = ConsoleExporter(out, keep=3)
    root = SpanItem(Resource.of({"service.name": "s"}), "a" * 32, "b" * 16, None, "coldstart", 0, 10**9)
    for _ in range(10):
        await exp.export([ColdStart(root, [])])
    assert exp.printed == 10 and len(exp.coldstarts) == 3


async def test_console_exporter_prints_a_line_for_each_classified_oom_and_no_other_log() -> None:
    """launch's terminal shows the verdict as it comes (the report was the only place that showed it)."""
    import io

    from infersight.exporters.console import ConsoleExporter
    from infersight.telemetry import LogItem

    out = io.StringIO()
    exp = ConsoleExporter(out)
    res = Resource.of({"service.name": "s", "process.pid": 4242})
    body = "OOM [vllm]: reservation_conflict by rule vllm.kv.no-cache-blocks: raise --gpu-memory-utilization"
    await exp.export([LogItem(res, 1, 17, "ERROR", body, {}, None, None, "oom", None),
                      LogItem(res, 2, 9, "INFO", "a user's log line", {}, None, None, None, None),
                      LogItem(Resource.of({}), 3, 9, "INFO", "gpu0 is slow", {}, None, None, "device", None)])
    assert out.getvalue() == "infersight: pid 4242: %s\n" % body
    assert exp.state()["ooms"] == 1
