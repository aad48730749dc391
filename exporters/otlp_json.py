"""Items -> OTLP JSON (protobuf JSON mapping as the Collector's file exporter writes it).

Pure functions. ``encode_lines`` returns one line per signal present in the batch:
an ``ExportTraceServiceRequest``, ``ExportMetricsServiceRequest`` or
``ExportLogsServiceRequest``. Ids are hex and 64-bit integers are strings, as the
OTLP/JSON spec asks. Built from our own items (no SDK objects) for speed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from infersight.agent.model import (
    Attributes,
    AttrValue,
    HistogramPoint,
    Item,
    LogItem,
    MetricItem,
    NumberPoint,
    Resource,
    SpanItem,
)

from infersight import __version__

SCOPE = {"name": "infersight", "version": __version__}
SPAN_KIND_INTERNAL = 1
STATUS_ERROR = 2
AGGREGATION_CUMULATIVE = 2


def any_value(v: AttrValue) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, str):
        return {"stringValue": v}
    return {"arrayValue": {"values": [any_value(x) for x in v]}}


def kv_list(attrs: Attributes | Iterable[tuple[str, AttrValue]]) -> list[dict[str, Any]]:
    pairs = attrs.items() if isinstance(attrs, dict) else attrs
    return [{"key": k, "value": any_value(v)} for k, v in pairs]


_resource_cache: dict[Resource, dict[str, Any]] = {}


def resource_json(r: Resource) -> dict[str, Any]:
    out = _resource_cache.get(r)
    if out is None:
        if len(_resource_cache) > 1024:
            _resource_cache.clear()
        out = _resource_cache[r] = {"attributes": kv_list(r.attributes)}
    return out


def span_json(s: SpanItem) -> dict[str, Any]:
    out: dict[str, Any] = {
        "traceId": s.trace_id,
        "spanId": s.span_id,
        "name": s.name,
        "kind": SPAN_KIND_INTERNAL,
        "startTimeUnixNano": str(s.start_ns),
        "endTimeUnixNano": str(s.end_ns),
        "attributes": kv_list(s.attributes),
    }
    if s.parent_span_id:
        out["parentSpanId"] = s.parent_span_id
    if s.events:
        out["events"] = [
            {"timeUnixNano": str(e.time_ns), "name": e.name, "attributes": kv_list(e.attributes)}
            for e in s.events
        ]
    if s.error is not None:
        out["status"] = {"code": STATUS_ERROR, "message": s.error}
    return out


def log_json(item: LogItem) -> dict[str, Any]:
    out: dict[str, Any] = {
        "timeUnixNano": str(item.time_ns),
        "observedTimeUnixNano": str(item.time_ns),
        "severityNumber": item.severity_number,
        "severityText": item.severity_text,
        "body": {"stringValue": item.body},
        "attributes": kv_list(item.attributes),
    }
    if item.trace_id and item.span_id:
        out["traceId"] = item.trace_id
        out["spanId"] = item.span_id
    if item.event_name:
        out["eventName"] = item.event_name
    return out


def _number_point(p: NumberPoint, m: MetricItem) -> dict[str, Any]:
    out: dict[str, Any] = {
        "attributes": kv_list(p.attributes),
        "startTimeUnixNano": str(m.start_ns),
        "timeUnixNano": str(m.time_ns),
    }
    if isinstance(p.value, int) and not isinstance(p.value, bool):
        out["asInt"] = str(p.value)
    else:
        out["asDouble"] = float(p.value)
    return out


def _histogram_point(p: HistogramPoint, m: MetricItem) -> dict[str, Any]:
    out: dict[str, Any] = {
        "attributes": kv_list(p.attributes),
        "startTimeUnixNano": str(m.start_ns),
        "timeUnixNano": str(m.time_ns),
        "count": str(p.count),
        "sum": p.sum,
        "bucketCounts": [str(c) for c in p.bucket_counts],
        "explicitBounds": list(p.bounds),
    }
    if p.min is not None:
        out["min"] = p.min
    if p.max is not None:
        out["max"] = p.max
    return out


def metric_json(m: MetricItem) -> dict[str, Any]:
    out: dict[str, Any] = {"name": m.name, "unit": m.unit, "description": m.description}
    if m.kind == "histogram":
        out["histogram"] = {
            "dataPoints": [_histogram_point(p, m) for p in m.points if isinstance(p, HistogramPoint)],
            "aggregationTemporality": AGGREGATION_CUMULATIVE,
        }
    else:
        pts = [_number_point(p, m) for p in m.points if isinstance(p, NumberPoint)]
        if m.kind == "sum":
            out["sum"] = {
                "dataPoints": pts,
                "aggregationTemporality": AGGREGATION_CUMULATIVE,
                "isMonotonic": m.monotonic,
            }
        else:
            out["gauge"] = {"dataPoints": pts}
    return out


def _group(items: Sequence[Any]) -> dict[Resource, list[Any]]:
    groups: dict[Resource, list[Any]] = {}
    for it in items:
        groups.setdefault(it.resource, []).append(it)
    return groups


def traces_request(spans: Sequence[SpanItem]) -> dict[str, Any]:
    return {
        "resourceSpans": [
            {"resource": resource_json(r), "scopeSpans": [{"scope": SCOPE, "spans": [span_json(s) for s in ss]}]}
            for r, ss in _group(spans).items()
        ]
    }


def logs_request(logs: Sequence[LogItem]) -> dict[str, Any]:
    return {
        "resourceLogs": [
            {"resource": resource_json(r), "scopeLogs": [{"scope": SCOPE, "logRecords": [log_json(x) for x in xs]}]}
            for r, xs in _group(logs).items()
        ]
    }


def metrics_request(metrics: Sequence[MetricItem]) -> dict[str, Any]:
    return {
        "resourceMetrics": [
            {"resource": resource_json(r), "scopeMetrics": [{"scope": SCOPE, "metrics": [metric_json(m) for m in ms]}]}
            for r, ms in _group(metrics).items()
        ]
    }


def split(batch: Sequence[Item]) -> tuple[list[SpanItem], list[MetricItem], list[LogItem]]:
    spans: list[SpanItem] = []
    metrics: list[MetricItem] = []
    logs: list[LogItem] = []
    for it in batch:
        if isinstance(it, SpanItem):
            spans.append(it)
        elif isinstance(it, LogItem):
            logs.append(it)
        elif isinstance(it, MetricItem):
            metrics.append(it)
    return spans, metrics, logs


def encode_lines(batch: Sequence[Item]) -> list[str]:
    """One JSON line per signal present (ColdStart summaries are not re-exported)."""
    spans, metrics, logs = split(batch)
    out = []
    dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    if spans:
        out.append(dumps(traces_request(spans)))
    if metrics:
        out.append(dumps(metrics_request(metrics)))
    if logs:
        out.append(dumps(logs_request(logs)))
    return out
