"""Render a cold start as a waterfall table (pure).

One row per stage, right under its parent's row and indented by nesting, with start offset,
duration, share of the root, a bar and a detail column: bytes/throughput (warm or cold, the
ratio to the storage ceiling) for weights, the biggest packages for imports, backend and cache
for compiles, the stage rule that named a span (rules/stages.toml).
Leaf spans of one stage under one parent share a row (``framework_import x3``, one bar per
span); a custom stage is marked ``*``, gaps are drawn with dots. A root that ended at
readiness is followed by the wait for traffic (a ``waiting for traffic`` row, in no share)
and the spans after it (``first_request``), with no share and no bar. Below: readiness, a
supervisor's workers that were ever ready, first-response timing, the unattributed time with
the sampler's top for each gap, one line per weights file (its ``weights_file`` summary:
bytes, reading time, throughput, cold or warm, share of the storage ceiling), and the three
biggest top-level stages.
"""

from __future__ import annotations

from infersight.coldstart_stages import (
    SAMPLES,
    biggest_stages,
    coverage,
    gap_frames,
    started_in_note,
    tree_coverage,
    union_ns,
    workers_ready,
)
from infersight.exporters.weights_note import weights_note
from infersight.hooks import _contract
from infersight.sanitize import terminal_line
from infersight.telemetry import ColdStart, SpanItem
from infersight.weights_files import CeilingOf, describe, files_of

# How a cold start that saw no readiness ended (the root's ended_by), in the waterfall's words.
NEVER_READY = {
    _contract.ENDED_BY_EXIT: "the process exited before any readiness signal",
    _contract.ENDED_BY_PRODUCER_LOST: "the process was killed (or lost) before any readiness signal",
}


Row = tuple[int, list[SpanItem]]  # (depth under the root's row, the spans that share it)


def _rows(cs: ColdStart, by_id: dict[str, SpanItem]) -> list[Row]:
    """The rows in tree order: each span's row right under its parent's (siblings in start order), so
    that a span nests under its real parent, not under the row drawn before it (a PEFT adapter load's
    file reads under the adapter load). Leaf spans of a grouped stage under one parent share a row
    (three import runs are one ``framework_import`` row with three bars); a span with children keeps a
    row of its own, for them to nest under. A span whose parent is not a stage of this cold start is a
    top-level row; spans whose parents loop (bad data) are drawn from the first of them, once each."""
    root_id = cs.root.span_id
    kids: dict[str, list[SpanItem]] = {}
    for s in cs.stages:
        parent = s.parent_span_id
        kids.setdefault(parent if parent in by_id and parent != s.span_id else root_id, []).append(s)
    placed: set[str] = set()
    rows: list[Row] = []

    def groups(spans: list[SpanItem]) -> list[list[SpanItem]]:
        out: list[list[SpanItem]] = []
        index: dict[str, list[SpanItem]] = {}
        for s in sorted(spans, key=_order):
            placed.add(s.span_id)
            shared = _stage(s) in GROUPED and s.span_id not in kids
            if shared and _stage(s) in index:
                index[_stage(s)].append(s)
                continue
            out.append(group := [s])
            if shared:
                index[_stage(s)] = group
        return out

    def walk(top: list[list[SpanItem]]) -> None:
        todo: list[Row] = [(0, g) for g in reversed(top)]  # a stack, not recursion: a file may nest deep
        while todo:
            depth, group = todo.pop()
            rows.append((depth, group))
            below = [c for s in group for c in kids.get(s.span_id, ()) if c.span_id not in placed]
            todo.extend((depth + 1, g) for g in reversed(groups(below)))

    walk(groups(kids.get(root_id, [])))
    for s in sorted(cs.stages, key=_order):
        if s.span_id not in placed:  # in a loop of parents: no way up to the root
            walk(groups([s]))
    return rows


def _order(s: SpanItem) -> tuple[int, int]:
    return s.start_ns, -s.end_ns


GROUPED = frozenset({"framework_import", "model_build", "tokenizer_load", "unattributed", "weights_load",
                     "graph_compile", "graph_capture"})
MAX_INDENT = 32  # levels of indentation drawn (the name column is 26 characters anyway)


def _stage(s: SpanItem) -> str:
    return str(s.attributes.get(_contract.STAGE) or s.name)


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
        caches = {str(g.attributes[_contract.COMPILE_CACHE]) for g in group
                  if g.attributes.get(_contract.COMPILE_CACHE)}
        if caches:
            parts.append("cache " + (caches.pop() if len(caches) == 1 else "mixed"))
        return ", ".join(parts)
    classes = sorted({str(g.attributes["infersight.model.class"]) for g in group
                      if g.attributes.get("infersight.model.class")})
    if stage == "model_build" and classes:  # (else a stage rule's build: which rule, below)
        return ", ".join(classes[:2]) + (" (meta)" if any(g.attributes.get("infersight.model.meta") for g in group)
                                         else "")
    note = weights_note([g.attributes for g in group])
    rules = sorted({str(g.attributes[_contract.STAGE_RULE]) for g in group
                    if g.attributes.get(_contract.STAGE_RULE)})
    if rules and not note:
        note = "rule " + ", ".join(rules[:2])  # a stage rule's span: which rule named it
    return "; ".join(x for x in (note, started_in_note(group)) if x)


def _bar(group: list[SpanItem], root: SpanItem, total: int, width: int) -> str:
    cells = [" "] * width
    for s in group:
        a = int(width * max(0, s.start_ns - root.start_ns) / total)
        b = max(a + 1, int(width * max(0, s.end_ns - root.start_ns) / total))
        for i in range(min(a, width - 1), min(b, width)):
            cells[i] = "." if _stage(s) == "unattributed" else "#"
    return "".join(cells)


def _after(s: SpanItem, by_id: dict[str, SpanItem], root: SpanItem) -> bool:
    """A span inside one that started after the root's end (a compile inside first_request)."""
    cur = by_id.get(s.parent_span_id or "")
    for _ in range(32):
        if cur is None or cur.span_id == root.span_id:
            return False
        if cur.start_ns >= root.end_ns:
            return True
        cur = by_id.get(cur.parent_span_id or "")
    return False


def _name(group: list[SpanItem], depth: int) -> str:
    s = group[0]
    name = "  " * (1 + min(depth, MAX_INDENT)) + _stage(s)
    if len(group) > 1:
        name += " x%d" % len(group)
    if s.attributes.get(_contract.STAGE_CUSTOM) is True:
        name += "*"
    return name


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
    return cs.root.attributes.get(_contract.PROCESS_ROLE) == _contract.ROLE_HELPER


def _worker_row(w: SpanItem, root: SpanItem, total: int, width: int) -> str:
    """A worker's row: its cold start's whole length, from its start (its fork) to its root's end, also where
    that runs past this root's (a master closed at its last event when it was killed, a worker that came
    late); the share and the bar are the part within this root."""
    within = union_ns([(w.start_ns, w.end_ns)], root.start_ns, root.end_ns)
    detail = "its own waterfall: ended by %s" % (w.attributes.get(_contract.ENDED_BY) or "?")
    after = w.end_ns - max(w.start_ns, root.end_ns)
    if after > 0:
        detail += "; %.3f s of it after this cold start's end" % (after / 1e9)
    inside = w.start_ns < root.end_ns
    return "%-26s %9.3f %9.3f %6s  %-*s %s" % (
        ("  worker pid %s" % w.resource.get("process.pid"))[:26], (w.start_ns - root.start_ns) / 1e9,
        max(w.end_ns - w.start_ns, 0) / 1e9, "%5.1f%%" % (100.0 * within / total) if inside else "-",
        width, _bar([w], root, total, width) if inside else "", detail)


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
    at_ready = root.attributes.get(_contract.ENDED_BY) == _contract.ENDED_BY_READY
    # (a ready_wait of no length at the root's end, a worker ready as it started serving, ends the cold start)
    later_ids = {s.span_id for s in cs.stages if at_ready and (
        s.start_ns > root.end_ns or (s.start_ns == root.end_ns < s.end_ns) or _after(s, by_id, root))}
    later: list[Row] = []  # rows after the root's end (it ended at readiness)
    for depth, group in _rows(cs, by_id):
        s = group[0]
        if s.span_id in later_ids:
            later.append((depth, group))
            continue
        dur_ns = union_ns([(g.start_ns, g.end_ns) for g in group], root.start_ns, root.end_ns)
        lines.append("%-26s %9.3f %9.3f %5.1f%%  %-*s %s" % (
            _name(group, depth)[:26], (s.start_ns - root.start_ns) / 1e9, dur_ns / 1e9, 100.0 * dur_ns / total,
            width, _bar(group, root, total, width), _extra(group)))
    lines.extend(_worker_row(w, root, total, width) for w in cs.workers)
    if later:
        # the wait ends where the first request arrives, not at a span that merely came after
        # readiness (a lazy import on a task that inherited a stage's context)
        firsts = [g[0].start_ns for _, g in later if g[0].attributes.get(_contract.STAGE) == _contract.FIRST_REQUEST]
        first = min(firsts) if firsts else min(g[0].start_ns for _, g in later)
        lines.append("%-26s %9.3f %9.3f %6s  %-*s %s" % (
            "  (waiting for traffic)", (root.end_ns - root.start_ns) / 1e9, (first - root.end_ns) / 1e9, "-",
            width, "", "not part of the cold start"))
        for depth, group in later:
            s = group[0]
            dur_ns = union_ns([(g.start_ns, g.end_ns) for g in group], s.start_ns, max(g.end_ns for g in group))
            lines.append("%-26s %9.3f %9.3f %6s  %-*s %s" % (
                _name(group, depth)[:26], (s.start_ns - root.start_ns) / 1e9, dur_ns / 1e9, "-", width, "",
                _extra(group)))
    ready = root.attributes.get(_contract.READY_S)
    ended = root.attributes.get(_contract.ENDED_BY)
    if isinstance(ready, (int, float)) and not isinstance(ready, bool) and 0 <= ready <= 1e9:  # not junk
        lines.append("ready after %.3f s (%s); ended by %s" % (
            ready, root.attributes.get(_contract.READY_SOURCE) or "?", ended or "?"))
    elif ended in NEVER_READY:  # the whole life was cold start: say so, not an ordinary-looking total
        lines.append("never ready: %s" % NEVER_READY[str(ended)])
    elif isinstance(ended, str) and ended:
        lines.append("ended by %s" % ended)
    if workers := workers_ready(root):
        lines.append(workers)
    ttfb = [s.attributes.get(_contract.FIRST_REQUEST_TTFB_S) for s in cs.stages
            if s.attributes.get(_contract.STAGE) == _contract.FIRST_REQUEST]
    if ttfb and isinstance(ttfb[0], (int, float)):
        lines.append("first response: first byte %.3f s after the request arrived" % ttfb[0])

    un = root.attributes.get(_contract.UNATTRIBUTED_S)
    if isinstance(un, (int, float)):
        line = "unattributed: %.3f s (%.1f%% of the cold start)" % (un, 100.0 * un * 1e9 / total)
        tree = root.attributes.get("infersight.coldstart.tree_unattributed_s")
        if cs.workers and isinstance(tree, (int, float)):
            line += " own; %.3f s (%.1f%%) with its workers' stages" % (tree, 100.0 * tree * 1e9 / total)
        lines.append(line)
    lines.append(coverage_line(cs))
    gaps = sorted((s for s in cs.stages if _stage(s) == "unattributed"), key=lambda s: s.start_ns - s.end_ns)
    for g in gaps[:5]:
        frames, instead = gap_frames(g.attributes)
        n = g.attributes.get(SAMPLES)
        lines.append("  gap at %.3f s, %.3f s%s: %s" % (
            (g.start_ns - root.start_ns) / 1e9, (g.end_ns - g.start_ns) / 1e9,
            " (%d samples)" % n if isinstance(n, int) and frames else "", ", ".join(frames) or instead))
    lines.extend("weights file " + describe(f) for f in files_of(cs, ceiling_of))
    top_stages = biggest_stages(root, cs.stages)
    if top_stages:
        lines.append("biggest stages: " + ", ".join("%s %.3f s" % (name, ns / 1e9) for name, ns in top_stages))
    return "\n".join(terminal_line(line) for line in lines)
