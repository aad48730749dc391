"""Items -> OTLP JSON (protobuf JSON mapping as the Collector's file exporter writes it).

Pure functions. ``encode_lines`` returns one line per signal present in the batch:
an ``ExportTraceServiceRequest``, ``ExportMetricsServiceRequest`` or
``ExportLogsServiceRequest``. Ids are hex and 64-bit integers are strings, as the
OTLP/JSON spec asks; an attribute integer outside int64 is written as a string value
(a point value as a double), so every line parses as protobuf. The JSON text is
assembled directly from our items, with the C string escaper for every string: no SDK
objects and no intermediate dicts, which is what lets the agent write 100k+ events/s to a file on one core.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from json.encoder import encode_basestring_ascii as q  # type: ignore[attr-defined]
from typing import TypeVar

from infersight import __version__
from infersight.telemetry import (
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

SPAN_KIND_INTERNAL = 1
STATUS_ERROR = 2
AGGREGATION_CUMULATIVE = 2
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
SCOPE = '{"name":"infersight","version":%s}' % q(__version__)


def _double(v: float) -> str:
    if math.isfinite(v):
        return repr(float(v))
    return '"NaN"' if math.isnan(v) else ('"Infinity"' if v > 0 else '"-Infinity"')


def any_value(v: AttrValue) -> str:
    if isinstance(v, str):
        return '{"stringValue":%s}' % q(v)
    if isinstance(v, bool):
        return '{"boolValue":true}' if v else '{"boolValue":false}'
    if isinstance(v, int):
        if INT64_MIN <= v <= INT64_MAX:
            return '{"intValue":"%d"}' % v
        return '{"stringValue":"%d"}' % v  # protobuf's int64 cannot hold it: keep the digits
    if isinstance(v, float):
        return '{"doubleValue":%s}' % _double(v)
    if isinstance(v, list):
        return '{"arrayValue":{"values":[%s]}}' % ",".join(any_value(x) for x in v)
    return '{"stringValue":%s}' % q(str(v))


def kv_list(attrs: Attributes) -> str:
    return ",".join(
        [
            '{"key":%s,"value":{"stringValue":%s}}' % (q(k), q(v))
            if type(v) is str
            else '{"key":%s,"value":%s}' % (q(k), any_value(v))
            for k, v in attrs.items()
        ]
    )


_resource_cache: dict[Resource, str] = {}


def resource_json(r: Resource) -> str:
    out = _resource_cache.get(r)
    if out is None:
        if len(_resource_cache) > 1024:
            _resource_cache.clear()
        out = _resource_cache[r] = '{"attributes":[%s]}' % kv_list(r.as_dict())
    return out


def span_json(s: SpanItem) -> str:
    parts = [
        '{"traceId":"%s","spanId":"%s"' % (s.trace_id, s.span_id),
        ',"parentSpanId":"%s"' % s.parent_span_id if s.parent_span_id else "",
        ',"name":%s,"kind":%d,"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":[%s]'
        % (q(s.name), SPAN_KIND_INTERNAL, s.start_ns, s.end_ns, kv_list(s.attributes)),
    ]
    if s.events:
        parts.append(',"events":[%s]' % ",".join(
            '{"timeUnixNano":"%d","name":%s,"attributes":[%s]}' % (e.time_ns, q(e.name), kv_list(e.attributes))
            for e in s.events))
    if s.error is not None:
        parts.append(',"status":{"code":%d,"message":%s}' % (STATUS_ERROR, q(s.error)))
    parts.append("}")
    return "".join(parts)


def log_json(x: LogItem) -> str:
    out = '{"timeUnixNano":"%d","observedTimeUnixNano":"%d","severityNumber":%d,"severityText":%s,' \
          '"body":{"stringValue":%s},"attributes":[%s]' % (
              x.time_ns, x.time_ns, x.severity_number, q(x.severity_text), q(x.body), kv_list(x.attributes))
    if x.trace_id and x.span_id:
        out += ',"traceId":"%s","spanId":"%s"' % (x.trace_id, x.span_id)
    if x.event_name:
        out += ',"eventName":%s' % q(x.event_name)
    return out + "}"


def _number_point(p: NumberPoint, m: MetricItem) -> str:
    v = p.value
    if type(v) is int and INT64_MIN <= v <= INT64_MAX:
        value = '"asInt":"%d"' % v
    else:  # a float, or an int beyond int64 (a point value has no string form)
        try:
            value = '"asDouble":%s' % _double(float(v))
        except OverflowError:  # beyond any double too
            value = '"asDouble":%s' % _double(math.inf if v > 0 else -math.inf)
    return '{"attributes":[%s],"startTimeUnixNano":"%d","timeUnixNano":"%d",%s}' % (
        kv_list(p.attributes), m.start_ns, m.time_ns, value)


def _histogram_point(p: HistogramPoint, m: MetricItem) -> str:
    out = '{"attributes":[%s],"startTimeUnixNano":"%d","timeUnixNano":"%d","count":"%d","sum":%s,' \
          '"bucketCounts":[%s],"explicitBounds":[%s]' % (
              kv_list(p.attributes), m.start_ns, m.time_ns, p.count, _double(p.sum),
              ",".join('"%d"' % c for c in p.bucket_counts), ",".join(_double(b) for b in p.bounds))
    if p.min is not None:
        out += ',"min":%s' % _double(p.min)
    if p.max is not None:
        out += ',"max":%s' % _double(p.max)
    return out + "}"


def metric_json(m: MetricItem) -> str:
    head = '{"name":%s,"unit":%s,"description":%s,' % (q(m.name), q(m.unit), q(m.description))
    if m.kind == "histogram":
        pts = ",".join(_histogram_point(p, m) for p in m.points if isinstance(p, HistogramPoint))
        return head + '"histogram":{"dataPoints":[%s],"aggregationTemporality":%d}}' % (pts, AGGREGATION_CUMULATIVE)
    pts = ",".join(_number_point(p, m) for p in m.points if isinstance(p, NumberPoint))
    if m.kind == "sum":
        return head + '"sum":{"dataPoints":[%s],"aggregationTemporality":%d,"isMonotonic":%s}}' % (
            pts, AGGREGATION_CUMULATIVE, "true" if m.monotonic else "false")
    return head + '"gauge":{"dataPoints":[%s]}}' % pts


T = TypeVar("T", SpanItem, LogItem, MetricItem)


def _request(top: str, scope_key: str, list_key: str, items: Sequence[T], one: Callable[[T], str]) -> str:
    # Group by object identity: a producer's items share one Resource, and hashing the
    # frozen dataclass per item would cost more than the grouping saves.
    groups: dict[int, tuple[Resource, list[str]]] = {}
    for it in items:
        g = groups.get(id(it.resource))
        if g is None:
            g = groups[id(it.resource)] = (it.resource, [])
        g[1].append(one(it))
    if len(groups) > 1:  # equal resources in distinct objects (decoded apart): one group each
        merged: dict[Resource, tuple[Resource, list[str]]] = {}
        for r, xs in groups.values():
            m = merged.get(r)
            if m is None:
                merged[r] = (r, xs)
            else:
                m[1].extend(xs)
        groups = {id(r): g for r, g in merged.items()}
    body = ",".join(
        '{"resource":%s,"%s":[{"scope":%s,"%s":[%s]}]}' % (resource_json(r), scope_key, SCOPE, list_key, ",".join(xs))
        for r, xs in groups.values()
    )
    return '{"%s":[%s]}' % (top, body)


def traces_request(spans: Sequence[SpanItem]) -> str:
    return _request("resourceSpans", "scopeSpans", "spans", spans, span_json)


def logs_request(logs: Sequence[LogItem]) -> str:
    return _request("resourceLogs", "scopeLogs", "logRecords", logs, log_json)


def metrics_request(metrics: Sequence[MetricItem]) -> str:
    return _request("resourceMetrics", "scopeMetrics", "metrics", metrics, metric_json)


def split(batch: Sequence[Item]) -> tuple[list[SpanItem], list[MetricItem], list[LogItem]]:
    spans: list[SpanItem] = []
    metrics: list[MetricItem] = []
    logs: list[LogItem] = []
    for it in batch:
        t = type(it)
        if t is LogItem:
            logs.append(it)  # type: ignore[arg-type]
        elif t is SpanItem:
            spans.append(it)  # type: ignore[arg-type]
        elif t is MetricItem:
            metrics.append(it)  # type: ignore[arg-type]
    return spans, metrics, logs


def encode_lines(batch: Sequence[Item]) -> list[str]:
    """One JSON line per signal present (ColdStart summaries are not re-exported)."""
    spans, metrics, logs = split(batch)
    out = []
    if spans:
        out.append(traces_request(spans))
    if metrics:
        out.append(metrics_request(metrics))
    if logs:
        out.append(logs_request(logs))
    return out
