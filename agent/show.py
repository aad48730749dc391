"""``infersight show FILE``: the waterfall again, from an OTLP JSON lines file.

Prints one waterfall per ``coldstart`` root in the file (the served process and any
hooked children), oldest first, with launch's probe result under its root.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from infersight.agent.assemble import descendants
from infersight.agent.model import AttrValue, ColdStart, Resource, SpanItem
from infersight.exporters.waterfall import is_helper, render_waterfall


def _value(v: dict[str, Any]) -> AttrValue:
    if "stringValue" in v:
        return str(v["stringValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "arrayValue" in v:
        return [str(_value(x)) for x in v["arrayValue"].get("values", [])]
    return ""


def _attrs(kvs: list[dict[str, Any]]) -> dict[str, AttrValue]:
    return {kv["key"]: _value(kv.get("value", {})) for kv in kvs}


def spans_from_lines(lines: list[str]) -> list[SpanItem]:
    spans: list[SpanItem] = []
    for line in lines:
        if not line.strip():
            continue
        req = json.loads(line)
        for rs in req.get("resourceSpans", []):
            res = Resource.of(_attrs(rs.get("resource", {}).get("attributes", [])))
            for ss in rs.get("scopeSpans", []):
                spans.extend(
                    SpanItem(
                        res, s["traceId"], s["spanId"], s.get("parentSpanId") or None, s["name"],
                        int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]), _attrs(s.get("attributes", [])),
                    )
                    for s in ss.get("spans", [])
                )
    return spans


def coldstarts(spans: list[SpanItem]) -> list[ColdStart]:
    staged = [s for s in spans if s.name.startswith("coldstart.")]
    roots = sorted((s for s in spans if s.name == "coldstart"), key=lambda s: s.start_ns)
    out = []
    for r in roots:
        stages = sorted(descendants(r.span_id, staged), key=lambda s: s.start_ns)
        ids = {r.span_id, *(s.span_id for s in stages)}
        workers = [w for w in roots if w.parent_span_id in ids and w.trace_id == r.trace_id
                   and w.attributes.get("infersight.process.role") != "helper"]
        out.append(ColdStart(r, stages, workers))
    return out


def show_file(path: str, out: TextIO) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            spans = spans_from_lines(f.readlines())
    except (OSError, ValueError, KeyError) as exc:
        out.write("infersight show: cannot read %s: %s\n" % (path, exc))
        return 2
    found = coldstarts(spans)
    if not found:
        out.write("infersight show: no coldstart span in %s\n" % path)
        return 1
    probes = [s for s in spans if s.name == "infersight.probe"]
    helpers = [cs for cs in found if is_helper(cs)]
    for cs in found:
        if cs in helpers:
            continue
        out.write(render_waterfall(cs) + "\n")
        for p in probes:
            if p.parent_span_id == cs.root.span_id and p.trace_id == cs.root.trace_id:
                out.write(probe_line(p) + "\n")
        out.write("\n")
    if helpers:
        out.write("(%d helper process%s not shown: %s)\n" % (
            len(helpers), "" if len(helpers) == 1 else "es",
            ", ".join("pid %s" % cs.root.resource.get("process.pid") for cs in helpers)))
    return 0


def probe_line(p: SpanItem) -> str:
    return "probe GET %s: HTTP %s, first byte %.3f s after sending" % (
        p.attributes.get("url.full"), p.attributes.get("http.response.status_code"),
        (p.end_ns - p.start_ns) / 1e9)
