"""Items to and from JSON-able dicts, for the exporters' disk spool (pure)."""

from __future__ import annotations

from typing import Any

from infersight.telemetry import (
    ColdStart,
    ColdStartProgress,
    HistogramPoint,
    Item,
    LogItem,
    MetricItem,
    NumberPoint,
    Origin,
    Resource,
    RoutingHint,
    SpanEvent,
    SpanItem,
)


def _res(r: Resource) -> list[Any]:
    return [list(kv) for kv in r.attributes]


# Decoded resources, interned: spilled items of one producer come back sharing one
# ``Resource`` (as they left), so the OTLP encoders, which group by resource, write it once
# per batch rather than once per record. Bounded: cleared past INTERN_MAX distinct sets.
INTERN_MAX = 4096
_interned: dict[tuple[tuple[str, Any], ...], Resource] = {}


def _unres(v: list[Any]) -> Resource:
    key = tuple((k, (tuple(x) if isinstance(x, list) else x)) for k, x in v)
    r = _interned.get(key)
    if r is None:
        if len(_interned) >= INTERN_MAX:
            _interned.clear()
        r = _interned[key] = Resource(key)
    return r


def _origin(o: Origin | None) -> list[Any] | None:
    return None if o is None else [o.producer, o.seq]


def _unorigin(v: list[Any] | None) -> Origin | None:
    return None if v is None else Origin(v[0], v[1])


def _span(s: SpanItem) -> dict[str, Any]:
    return {
        "r": _res(s.resource), "tr": s.trace_id, "id": s.span_id, "p": s.parent_span_id,
        "n": s.name, "s": s.start_ns, "e": s.end_ns, "a": s.attributes,
        "ev": [[e.name, e.time_ns, e.attributes] for e in s.events], "err": s.error,
        "o": _origin(s.origin),
    }


def _unspan(d: dict[str, Any]) -> SpanItem:
    return SpanItem(
        _unres(d["r"]), d["tr"], d["id"], d["p"], d["n"], d["s"], d["e"], d["a"],
        [SpanEvent(n, t, a) for n, t, a in d["ev"]], d["err"], _unorigin(d["o"]),
    )


def to_dict(item: Item) -> dict[str, Any]:
    if isinstance(item, SpanItem):
        return {"k": "span", **_span(item)}
    if isinstance(item, ColdStart):
        return {"k": "coldstart", "root": _span(item.root), "stages": [_span(s) for s in item.stages]}
    if isinstance(item, ColdStartProgress):
        return {"k": "progress", "r": _res(item.resource), "sv": item.service, "pid": item.pid,
                "t": item.time_ns, "st": item.state}
    if isinstance(item, RoutingHint):
        return {"k": "routing", "r": _res(item.resource), "sv": item.service, "port": item.port,
                "t": item.time_ns, "st": item.state}
    if isinstance(item, LogItem):
        return {
            "k": "log", "r": _res(item.resource), "t": item.time_ns, "sn": item.severity_number,
            "st": item.severity_text, "b": item.body, "a": item.attributes, "tr": item.trace_id,
            "sp": item.span_id, "en": item.event_name, "o": _origin(item.origin),
        }
    pts: list[Any]
    if item.kind == "histogram":
        pts = [
            [p.bounds, p.bucket_counts, p.count, p.sum, p.min, p.max, p.attributes]
            for p in item.points
            if isinstance(p, HistogramPoint)
        ]
    else:
        pts = [[p.value, p.attributes] for p in item.points if isinstance(p, NumberPoint)]
    return {
        "k": "metric", "r": _res(item.resource), "n": item.name, "kind": item.kind, "u": item.unit,
        "d": item.description, "t": item.time_ns, "s": item.start_ns, "p": pts, "m": item.monotonic,
    }


def from_dict(d: dict[str, Any]) -> Item:
    k = d["k"]
    if k == "span":
        return _unspan(d)
    if k == "coldstart":
        return ColdStart(_unspan(d["root"]), [_unspan(s) for s in d["stages"]])
    if k == "progress":
        return ColdStartProgress(_unres(d["r"]), d["sv"], d["pid"], d["t"], d["st"])
    if k == "routing":
        return RoutingHint(_unres(d["r"]), d["sv"], d["port"], d["t"], d["st"])
    if k == "log":
        return LogItem(
            _unres(d["r"]), d["t"], d["sn"], d["st"], d["b"], d["a"], d["tr"], d["sp"], d["en"],
            _unorigin(d["o"]),
        )
    if k == "metric":
        points: list[NumberPoint] | list[HistogramPoint]
        if d["kind"] == "histogram":
            points = [HistogramPoint(*p) for p in d["p"]]
        else:
            points = [NumberPoint(v, a) for v, a in d["p"]]
        return MetricItem(
            _unres(d["r"]), d["n"], d["kind"], d["u"], d["d"], d["t"], d["s"], points, d["m"]
        )
    raise ValueError("unknown item kind %r" % (k,))
