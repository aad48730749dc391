"""OTLP JSON lines -> typed telemetry (pure): the reader behind ``report`` and ``show``.

Reads what the file exporter (and the Collector's) writes: one ``Export*ServiceRequest`` per
line. It is lenient by design: a line that does not parse (the last one cut short by a crash,
stray text) or a record with a missing or wrong field is skipped and counted in
:attr:`Telemetry.skipped`, never raised, so one bad record costs only itself. Unknown
attributes and metric names pass through untouched.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from sys import intern
from typing import Any

from infersight.agent.errors import AgentError
from infersight.sanitize import TooDeepError, clean_tree, text_needs_cleaning
from infersight.telemetry import AttrValue, HistogramPoint, LogItem, Resource, SpanEvent, SpanItem


class _BadRecordError(AgentError, ValueError):
    """One record is malformed: skip it."""


@dataclass(slots=True)
class Sample:
    """One number data point of a gauge or sum, with its own timestamp."""

    resource: Resource
    name: str
    kind: str  # gauge | sum
    unit: str
    time_ns: int
    value: float
    attributes: dict[str, AttrValue]


@dataclass(slots=True)
class HistSample:
    resource: Resource
    name: str
    unit: str
    time_ns: int
    point: HistogramPoint


@dataclass(slots=True)
class Telemetry:
    spans: list[SpanItem] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    histograms: list[HistSample] = field(default_factory=list)
    logs: list[LogItem] = field(default_factory=list)
    lines: int = 0  # non-empty lines read
    skipped: list[str] = field(default_factory=list)  # "file:line: why", for lines and records

    def empty(self) -> bool:
        return not (self.spans or self.samples or self.histograms or self.logs)

    def extend(self, other: Telemetry) -> None:
        self.spans += other.spans
        self.samples += other.samples
        self.histograms += other.histograms
        self.logs += other.logs
        self.lines += other.lines
        self.skipped += other.skipped


def _int(v: Any) -> int:
    if isinstance(v, bool):
        raise _BadRecordError("boolean where an integer belongs")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            raise _BadRecordError("not an integer: %r" % v[:40]) from None
    if isinstance(v, float) and v.is_integer():
        return int(v)
    raise _BadRecordError("not an integer: %r" % (v,))


MAX_NS = (1 << 63) - 1  # OTLP times are fixed64; past int64 they are junk, and no clock reads them


def _time(v: Any) -> int:
    t = _int(v)
    if not 0 <= t <= MAX_NS:
        raise _BadRecordError("time out of range: %d" % t)
    return t


def _float(v: Any) -> float:
    if isinstance(v, bool):
        raise _BadRecordError("boolean where a number belongs")
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:
            raise _BadRecordError("number out of range") from None
    if isinstance(v, str):
        try:
            return float(v)  # "NaN", "Infinity" and int64 strings
        except ValueError:
            raise _BadRecordError("not a number: %r" % v[:40]) from None
    raise _BadRecordError("not a number: %r" % (v,))


def _finite(v: Any) -> float:
    """A measured value: NaN and the infinities are no measurement (the record is skipped)."""
    x = _float(v)
    if not math.isfinite(x):
        raise _BadRecordError("not a finite number: %s" % x)
    return x


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise _BadRecordError("%s is not a string" % what)
    return v


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def any_value(v: Any) -> AttrValue:
    """An OTLP AnyValue as a plain value; unknown shapes become their JSON text."""
    if not isinstance(v, dict):
        return "" if v is None else str(v)
    if "stringValue" in v:
        text = str(v["stringValue"])
        return intern(text) if len(text) <= 64 else text  # stage names, paths, classes: they repeat
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "intValue" in v:
        try:
            return _int(v["intValue"])
        except _BadRecordError:
            return str(v["intValue"])
    if "doubleValue" in v:
        try:
            return _float(v["doubleValue"])
        except _BadRecordError:
            return str(v["doubleValue"])
    if "arrayValue" in v:
        vals = [any_value(x) for x in _list(_dict(v["arrayValue"]).get("values"))]
        if vals and all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
            return [int(x) for x in vals if isinstance(x, int)]
        if vals and all(isinstance(x, float) for x in vals):
            return [float(x) for x in vals if isinstance(x, float)]
        return [str(x) for x in vals]
    if "kvlistValue" in v:
        return json.dumps({kv.get("key"): any_value(kv.get("value")) for kv in
                           _list(_dict(v["kvlistValue"]).get("values")) if isinstance(kv, dict)})
    return json.dumps(v)[:512] if v else ""


def attributes(kvs: Any) -> dict[str, AttrValue]:
    out: dict[str, AttrValue] = {}
    for kv in _list(kvs):
        if isinstance(kv, dict) and isinstance(kv.get("key"), str):
            out[kv["key"]] = any_value(kv.get("value"))
    return out


def _resource(block: dict[str, Any]) -> Resource:
    return Resource.of(attributes(_dict(block.get("resource")).get("attributes")))


def _span(res: Resource, s: Any) -> SpanItem:
    if not isinstance(s, dict):
        raise _BadRecordError("span is not an object")
    start, end = _time(s.get("startTimeUnixNano")), _time(s.get("endTimeUnixNano"))
    if end < start:
        raise _BadRecordError("span %r ends before it starts" % s.get("name"))
    events = [
        SpanEvent(_str(e.get("name"), "event name"), _time(e.get("timeUnixNano")), attributes(e.get("attributes")))
        for e in _list(s.get("events")) if isinstance(e, dict)
    ]
    status = _dict(s.get("status"))
    error = str(status.get("message") or "error") if status.get("code") in (2, "STATUS_CODE_ERROR") else None
    # Trace ids, parent ids and names repeat across a file's spans: one string each (a large
    # file holds every span while it is read).
    return SpanItem(
        res, intern(_str(s.get("traceId"), "traceId").lower()), _str(s.get("spanId"), "spanId").lower(),
        (intern(str(s["parentSpanId"]).lower()) or None) if s.get("parentSpanId") else None,
        intern(_str(s.get("name"), "span name")), start, end, attributes(s.get("attributes")), events, error,
    )


def _log(res: Resource, r: Any) -> LogItem:
    if not isinstance(r, dict):
        raise _BadRecordError("log record is not an object")
    t = r.get("timeUnixNano")
    t_ns = _time(t if t not in (None, "0", 0) else r.get("observedTimeUnixNano"))
    body = r.get("body")
    text = any_value(body) if body is not None else ""
    return LogItem(
        res, t_ns, _int(r.get("severityNumber", 0)), str(r.get("severityText") or ""),
        text if isinstance(text, str) else json.dumps(text), attributes(r.get("attributes")),
        str(r["traceId"]).lower() if r.get("traceId") else None,
        str(r["spanId"]).lower() if r.get("spanId") else None,
        str(r["eventName"]) if r.get("eventName") else None,
    )


def _number(p: dict[str, Any]) -> float:
    if "asInt" in p:
        return float(_int(p["asInt"]))
    if "asDouble" in p:
        return _finite(p["asDouble"])
    raise _BadRecordError("data point without a value")


def _metric(res: Resource, m: Any, out: Telemetry) -> None:
    if not isinstance(m, dict):
        raise _BadRecordError("metric is not an object")
    name, unit = _str(m.get("name"), "metric name"), str(m.get("unit") or "")
    for kind in ("gauge", "sum"):
        if kind in m:
            for raw in _list(_dict(m[kind]).get("dataPoints")):
                p = _dict(raw)
                out.samples.append(Sample(res, name, kind, unit, _time(p.get("timeUnixNano")), _number(p),
                                          attributes(p.get("attributes"))))
            return
    if "histogram" in m:
        for raw in _list(_dict(m["histogram"]).get("dataPoints")):
            p = _dict(raw)
            counts = [_int(c) for c in _list(p.get("bucketCounts"))]
            bounds = [_finite(b) for b in _list(p.get("explicitBounds"))]
            hp = HistogramPoint(
                bounds, counts, _int(p.get("count", sum(counts))), _finite(p.get("sum", 0.0)),
                _finite(p["min"]) if "min" in p else None, _finite(p["max"]) if "max" in p else None,
                attributes(p.get("attributes")),
            )
            out.histograms.append(HistSample(res, name, unit, _time(p.get("timeUnixNano")), hp))


def _records(req: dict[str, Any], out: Telemetry, where: str, traces: set[str] | None = None) -> None:
    """Every record of one request; a bad record is skipped, the rest are kept. With ``traces``,
    only the spans of those traces (a second pass: metrics, logs and skips were read in the first)."""
    def each(top: str, scope_key: str, list_key: str) -> Iterable[tuple[Resource, Any]]:
        for raw in _list(req.get(top)):
            block = _dict(raw)
            res = _resource(block)
            for scope in _list(block.get(scope_key)):
                for rec in _list(_dict(scope).get(list_key)):
                    yield res, rec

    for res, s in each("resourceSpans", "scopeSpans", "spans"):
        if traces is not None and not (isinstance(s, dict) and isinstance(s.get("traceId"), str)
                                       and s["traceId"].lower() in traces):
            continue
        try:
            out.spans.append(_span(res, s))
        except (_BadRecordError, TypeError, AttributeError, ValueError, OverflowError, RecursionError) as exc:
            out.skipped.append("%s: span skipped: %s" % (where, exc))
    if traces is not None:
        return
    for res, m in each("resourceMetrics", "scopeMetrics", "metrics"):
        n = (len(out.samples), len(out.histograms))
        try:
            _metric(res, m, out)
        except (_BadRecordError, TypeError, AttributeError, ValueError, OverflowError, RecursionError) as exc:
            del out.samples[n[0]:], out.histograms[n[1]:]
            out.skipped.append("%s: metric skipped: %s" % (where, exc))
    for res, r in each("resourceLogs", "scopeLogs", "logRecords"):
        try:
            out.logs.append(_log(res, r))
        except (_BadRecordError, TypeError, AttributeError, ValueError, OverflowError, RecursionError) as exc:
            out.skipped.append("%s: log record skipped: %s" % (where, exc))


MAX_READ_TEXT = 1 << 20  # a string kept whole from a file (the page and show cut their own)
OTLP_KEYS = ("resourceSpans", "resourceMetrics", "resourceLogs")


def parse_lines(lines: Iterable[str], name: str = "-") -> Telemetry:
    out = Telemetry()
    for chunk in iter_lines(lines, name):
        out.extend(chunk)
    return out


def iter_lines(lines: Iterable[str], name: str = "-", traces: set[str] | None = None) -> Iterator[Telemetry]:
    """The records of each non-empty line, one :class:`Telemetry` per line, so that a reader
    holds one line at a time. With ``traces``, only lines that may hold a span of one of those
    traces are parsed (the others are counted, not read): a second pass that collects a few
    cold starts skips the rest of a large file at the speed of a regular expression."""
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if traces is not None and not _may_hold(line, traces):
            yield Telemetry(lines=1)
            continue
        out = Telemetry(lines=1)
        try:
            req = json.loads(line)
            if text_needs_cleaning(line):  # control characters, lone surrogates: shown as U+FFFD
                req = clean_tree(req, limit=MAX_READ_TEXT)
        except (ValueError, RecursionError) as exc:  # TooDeepError is a ValueError
            cut = "" if line.endswith("\n") else " (no newline: cut short?)"
            deep = isinstance(exc, (RecursionError, TooDeepError))
            why = "line skipped: nested too deep" if deep else "not JSON%s: %s" % (cut, exc)
            out.skipped.append("%s:%d: %s" % (name, i, why))
            yield out
            continue
        if not isinstance(req, dict) or not any(k in req for k in OTLP_KEYS):
            out.skipped.append("%s:%d: not an OTLP export request" % (name, i))
            yield out
            continue
        try:
            _records(req, out, "%s:%d" % (name, i), traces)
        except (RecursionError, TypeError, AttributeError, ValueError, OverflowError) as exc:  # a resource
            out.skipped.append("%s:%d: line skipped: %s" % (name, i, "nested too deep" if isinstance(
                exc, RecursionError) else exc))
        yield out


_TRACE_ID = re.compile(r'"traceId"\s*:\s*"([^"\\]*)"')


def _may_hold(line: str, traces: set[str]) -> bool:
    """False only when no span of ``line`` can belong to ``traces``: every ``"traceId"`` key is
    written plainly and none names one of them. An escape (``\\u``) could spell a key or an id
    in another way, so such a line is always read."""
    if "\\u" in line:
        return True
    ids = _TRACE_ID.findall(line)
    if len(ids) != line.count('"traceId"'):
        return True
    return any(t.lower() in traces for t in ids)


def iter_file(path: str, traces: set[str] | None = None) -> Iterator[Telemetry]:
    """:func:`iter_lines` of one file; OSError (missing, a directory, unreadable) is the caller's."""
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from iter_lines(f, path, traces)


def read_file(path: str) -> Telemetry:
    """Parse one file; OSError (missing, a directory, unreadable) is the caller's to report."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_lines(f, path)
