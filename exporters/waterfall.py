"""Render a cold start as a waterfall table (pure).

One row per stage, indented by nesting, with start offset, duration, share of the
root, a bar, and bytes/throughput (and the ratio to the storage ceiling) for weights
stages; a custom stage is marked ``*``. Below: readiness, first-response timing, the
unattributed time and the three biggest top-level stages.
"""

from __future__ import annotations

from infersight.agent.model import ColdStart, SpanItem
from infersight.exporters.weights_note import weights_note


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return ("%.0f %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024
    return str(n)


def _depth(span: SpanItem, by_id: dict[str, SpanItem], root_id: str) -> int:
    d, cur = 0, span
    while cur.parent_span_id and cur.parent_span_id != root_id and cur.parent_span_id in by_id:
        d += 1
        cur = by_id[cur.parent_span_id]
        if d > 32:
            break
    return d


def render_waterfall(cs: ColdStart, width: int = 24) -> str:
    root = cs.root
    total = max(root.end_ns - root.start_ns, 1)
    by_id = {s.span_id: s for s in cs.stages}
    service = root.resource.get("service.name") or ""
    pid = root.resource.get("process.pid") or ""
    lines = [
        "infersight cold start: %s (pid %s) %.3f s" % (service, pid, total / 1e9),
        "%-26s %9s %9s %6s  %-*s %s" % ("stage", "start s", "dur s", "share", width, "", "weights"),
    ]
    rows = [root, *sorted(cs.stages, key=lambda s: (s.start_ns, -s.end_ns))]
    for s in rows:
        off = (s.start_ns - root.start_ns) / 1e9
        dur = (s.end_ns - s.start_ns) / 1e9
        share = 100.0 * (s.end_ns - s.start_ns) / total
        a = int(width * max(0, s.start_ns - root.start_ns) / total)
        b = max(a + 1, int(width * max(0, s.end_ns - root.start_ns) / total))
        bar = (" " * a + "#" * (b - a))[:width]
        name = "coldstart" if s is root else "  " * (1 + _depth(s, by_id, root.span_id)) + (
            str(s.attributes.get("infersight.stage") or s.name)
        )
        extra = weights_note([s.attributes])
        if s.attributes.get("infersight.stage.custom") is True:
            name += "*"
        lines.append("%-26s %9.3f %9.3f %5.1f%%  %-*s %s" % (name[:26], off, dur, share, width, bar, extra))
    ready = root.attributes.get("infersight.coldstart.ready_s")
    if isinstance(ready, (int, float)):
        lines.append("ready after %.3f s (%s); ended by %s" % (
            ready, root.attributes.get("infersight.ready.source") or "?",
            root.attributes.get("infersight.coldstart.ended_by") or "?"))
    ttfb = [s.attributes.get("infersight.first_request.ttfb_s") for s in cs.stages
            if s.attributes.get("infersight.stage") == "first_request"]
    if ttfb and isinstance(ttfb[0], (int, float)):
        lines.append("first response: first byte %.3f s after the request arrived" % ttfb[0])
    un = root.attributes.get("infersight.coldstart.unattributed_s")
    if isinstance(un, (int, float)):
        lines.append("unattributed: %.3f s (%.1f%% of the cold start)" % (un, 100.0 * un * 1e9 / total))
    top = sorted(
        (s for s in cs.stages if s.parent_span_id == root.span_id),
        key=lambda s: s.end_ns - s.start_ns,
        reverse=True,
    )[:3]
    if top:
        lines.append(
            "biggest stages: "
            + ", ".join(
                "%s %.3f s" % (s.attributes.get("infersight.stage") or s.name, (s.end_ns - s.start_ns) / 1e9)
                for s in top
            )
        )
    return "\n".join(lines)
