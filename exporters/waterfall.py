"""Render a cold start as a waterfall table (pure).

One row per stage, indented by nesting, with start offset, duration, share of the
root, a bar and a detail column: bytes/throughput (warm or cold, the ratio to the storage
ceiling) for weights, the biggest packages for imports, backend and cache for compiles.
Spans of one stage under one parent share a row (``framework_import x3``, one bar per
span); a custom stage is marked ``*``, gaps are drawn with dots. Below: readiness,
first-response timing, the unattributed time with the sampler's top for each gap, one
line per weights file (its ``weights_file`` summary: bytes, reading time, throughput, cold
or warm, share of the storage ceiling), and the three biggest top-level stages.
"""

from __future__ import annotations

from infersight.coldstart_stages import coverage, tree_coverage, union_ns
from infersight.exporters.weights_note import weights_note
from infersight.telemetry import ColdStart, SpanItem
from infersight.weights_files import CeilingOf, describe, files_of


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


def _rows(cs: ColdStart, by_id: dict[str, SpanItem]) -> list[list[SpanItem]]:
    """Spans in start order; spans of the same stage under the same parent share one row
    (three import runs are one ``framework_import`` row with three bars)."""
    rows: list[list[SpanItem]] = []
    index: dict[tuple[str | None, str], list[SpanItem]] = {}
    for s in sorted(cs.stages, key=lambda s: (s.start_ns, -s.end_ns)):
        key = (s.parent_span_id, _stage(s))
        group = index.get(key)
        if group is not None and key[1] in GROUPED:
            group.append(s)
            continue
        index[key] = group = [s]
        rows.append(group)
    return rows


GROUPED = frozenset({"framework_import", "model_build", "tokenizer_load", "unattributed", "weights_load",
                     "graph_compile"})


def _stage(s: SpanItem) -> str:
    return str(s.attributes.get("infersight.stage") or s.name)


def _extra(group: list[SpanItem]) -> str:
    """The last column: bytes and throughput for weights, packages for imports, and so on."""
    s = group[0]
    stage = _stage(s)
    a = s.attributes
    if stage == "framework_import":
        secs: dict[str, float] = {}
        for g in group:
            packages = g.attributes.get("infersight.import.packages")
            for item in packages if isinstance(packages, list) else []:
                name, _, rest = str(item).partition(" ")
                try:
                    secs[name] = secs.get(name, 0.0) + float(rest.split()[0])
                except (ValueError, IndexError):
                    continue
        top = sorted(secs.items(), key=lambda kv: -kv[1])[:3]
        return ", ".join("%s %.2f s" % kv for kv in top)
    if stage == "graph_compile":
        parts = [str(a[k]) for k in ("infersight.compile.backend",) if a.get(k)]
        caches = {str(g.attributes["infersight.compile.cache"]) for g in group
                  if g.attributes.get("infersight.compile.cache")}
        if caches:
            parts.append("cache " + (caches.pop() if len(caches) == 1 else "mixed"))
        return ", ".join(parts)
    if stage == "model_build":
        classes = sorted({str(g.attributes["infersight.model.class"]) for g in group
                          if g.attributes.get("infersight.model.class")})
        return ", ".join(classes[:2]) + (" (meta)" if any(g.attributes.get("infersight.model.meta") for g in group)
                                         else "")
    return weights_note([g.attributes for g in group])


def _bar(group: list[SpanItem], root: SpanItem, total: int, width: int) -> str:
    cells = [" "] * width
    for s in group:
        a = int(width * max(0, s.start_ns - root.start_ns) / total)
        b = max(a + 1, int(width * max(0, s.end_ns - root.start_ns) / total))
        for i in range(min(a, width - 1), min(b, width)):
            cells[i] = "." if _stage(s) == "unattributed" else "#"
    return "".join(cells)


def _covered_short(cs: ColdStart) -> str:
    own = "covered %.1f%%" % (100.0 * coverage(cs))
    return own + (" own, %.1f%% tree" % (100.0 * tree_coverage(cs)) if cs.workers else "")


def coverage_line(cs: ColdStart) -> str:
    """The process's own coverage and, with workers, the tree's (their named stages)."""
    own = "covered by named stages: %.1f%%" % (100.0 * coverage(cs))
    if not cs.workers:
        return own
    n = len(cs.workers)
    return "%s own, %.1f%% with its %s stages" % (own, 100.0 * tree_coverage(cs),
                                                 "worker's" if n == 1 else "%d workers'" % n)


def is_helper(cs: ColdStart) -> bool:
    return cs.root.attributes.get("infersight.process.role") == "helper"


def render_waterfall(cs: ColdStart, width: int = 24, ceiling_of: CeilingOf | None = None) -> str:
    """The waterfall of ``cs``; ``ceiling_of`` (a file's cached storage ceiling) fills in the
    ceiling ratio of a cold weights file whose summary lacks one."""
    root = cs.root
    total = max(root.end_ns - root.start_ns, 1)
    by_id = {s.span_id: s for s in cs.stages}
    service = root.resource.get("service.name") or ""
    pid = root.resource.get("process.pid") or ""
    lines = [
        "infersight cold start: %s (pid %s) %.3f s, %s" % (service, pid, total / 1e9, _covered_short(cs)),
        "%-26s %9s %9s %6s  %-*s %s" % ("stage", "start s", "dur s", "share", width, "", "detail"),
        "%-26s %9.3f %9.3f %5.1f%%  %-*s" % ("coldstart", 0.0, total / 1e9, 100.0, width, "#" * width),
    ]
    for group in _rows(cs, by_id):
        s = group[0]
        off = (s.start_ns - root.start_ns) / 1e9
        dur_ns = union_ns([(g.start_ns, g.end_ns) for g in group], root.start_ns, root.end_ns)
        name = "  " * (1 + _depth(s, by_id, root.span_id)) + _stage(s)
        if len(group) > 1:
            name += " x%d" % len(group)
        if s.attributes.get("infersight.stage.custom") is True:
            name += "*"
        lines.append("%-26s %9.3f %9.3f %5.1f%%  %-*s %s" % (
            name[:26], off, dur_ns / 1e9, 100.0 * dur_ns / total, width, _bar(group, root, total, width),
            _extra(group)))
    for w in cs.workers:
        dur_ns = union_ns([(w.start_ns, w.end_ns)], root.start_ns, root.end_ns)
        lines.append("%-26s %9.3f %9.3f %5.1f%%  %-*s %s" % (
            ("  worker pid %s" % w.resource.get("process.pid"))[:26], (w.start_ns - root.start_ns) / 1e9,
            dur_ns / 1e9, 100.0 * dur_ns / total, width, _bar([w], root, total, width),
            "its own waterfall: ended by %s" % (w.attributes.get("infersight.coldstart.ended_by") or "?")))
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
        line = "unattributed: %.3f s (%.1f%% of the cold start)" % (un, 100.0 * un * 1e9 / total)
        tree = root.attributes.get("infersight.coldstart.tree_unattributed_s")
        if cs.workers and isinstance(tree, (int, float)):
            line += " own; %.3f s (%.1f%%) with its workers' stages" % (tree, 100.0 * tree * 1e9 / total)
        lines.append(line)
    lines.append(coverage_line(cs))
    gaps = sorted((s for s in cs.stages if _stage(s) == "unattributed"), key=lambda s: s.start_ns - s.end_ns)
    for g in gaps[:5]:
        top = g.attributes.get("infersight.unattributed.top")
        lines.append("  gap at %.3f s, %.3f s: %s" % (
            (g.start_ns - root.start_ns) / 1e9, (g.end_ns - g.start_ns) / 1e9,
            ", ".join(str(t) for t in top) if isinstance(top, list) and top else "no samples"))
    lines.extend("weights file " + describe(f) for f in files_of(cs, ceiling_of))
    per_stage: dict[str, int] = {}
    for s in cs.stages:
        if s.parent_span_id == root.span_id and _stage(s) != "unattributed":
            per_stage[_stage(s)] = per_stage.get(_stage(s), 0) + s.end_ns - s.start_ns
    top_stages = sorted(per_stage.items(), key=lambda kv: -kv[1])[:3]
    if top_stages:
        lines.append("biggest stages: " + ", ".join("%s %.3f s" % (name, ns / 1e9) for name, ns in top_stages))
    return "\n".join(lines)
