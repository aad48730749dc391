"""Telemetry -> what the report draws (pure): cold-start waterfalls and OOMs.

Memory and devices are in ``report.gpu``.

Each view is built only from what the file holds; an empty list means "no such section".
Attribute names are the ones the agent exports (README metric tables, docs/coldstart.md);
attributes this module does not know are carried along for the hover text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from infersight.bytesize import human_bytes
from infersight.coldstart_stages import biggest_stages, workers_ready
from infersight.hooks import _contract
from infersight.telemetry import AttrValue, ColdStart, LogItem, SpanItem
from infersight.weights_files import COLD_BELOW, CeilingOf, ceiling_share, files_of

GAP_MIN_SHARE = 0.005  # computed unattributed gaps shorter than this share of the root are not drawn
UNATTRIBUTED = "unattributed"
ROOT = "coldstart"
PROBE = "infersight.probe"
OOM_NUMBERS = ("R", "T", "F", "A", "P", "U", "O", "L")


def num(v: AttrValue | None) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


MAX_OFFSET_S = 1e9  # ~31 years: a mark further from its root than this is junk, not a time


def offset_ns(seconds: float | None) -> int | None:
    """``seconds`` after a start as nanoseconds; None when it is no plausible offset."""
    if seconds is None or not 0 <= seconds <= MAX_OFFSET_S:
        return None
    return int(seconds * 1e9)


def stage_name(s: SpanItem) -> str:
    st = s.attributes.get(_contract.STAGE)
    if isinstance(st, str) and st:
        return st
    return s.name[len("coldstart."):] if s.name.startswith("coldstart.") else s.name


OWNER = "process.user.id"  # the producer's uid, as the kernel told the agent (never the producer's word)


def owner_uid(s: SpanItem) -> int | None:
    """The uid of the process that sent ``s`` (None when the record carries none: an in-process
    producer, the launcher's own root, a file of an older agent)."""
    v = s.resource.get(OWNER)
    return v if type(v) is int else None


def adopts(parent: int | None, child: int | None) -> bool:
    """Whether a process of uid ``parent`` nests ``child``'s cold start under its own: the same
    user, or root (a root supervisor or launch whose CMD or workers run as another user). Never
    the other way: trace and span ids are no secret (MQTT publishes them), and another user's
    spans that name them are left out, counted (:attr:`ProcessWaterfall.foreign`)."""
    return parent in (child, 0)


def span_key(s: SpanItem) -> tuple[str, str, int | None]:
    """A span's identity: its trace and span id, and its producer's uid (ids are chosen by the
    producer: another user's span of the same ids is another span)."""
    return s.trace_id, s.span_id, owner_uid(s)


def process_label(s: SpanItem | LogItem) -> str:
    r = s.resource
    svc, pid = r.get("service.name"), r.get("process.pid")
    return "%s (pid %s)" % (svc or "?", pid if pid is not None else "?")


# -- cold start ---------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    span: SpanItem
    depth: int  # 0 for the root, 1 for a top-level stage, ...
    label: str
    kind: str  # root | stage | unattributed | custom


@dataclass(slots=True)
class Mark:
    t_ns: int
    label: str
    title: str


@dataclass(slots=True)
class Summary:
    total_s: float
    ready_s: float | None
    biggest: list[tuple[str, float]]
    unattributed_s: float
    unattributed_share: float
    weights_files: list[dict[str, AttrValue]] = field(default_factory=list)  # weights_file summaries
    workers: str = ""  # a supervisor's workers that reported and were ever ready (coldstart_stages.workers_ready)


@dataclass(slots=True)
class ProcessWaterfall:
    root: SpanItem
    rows: list[Row]  # root first, then stages in start order (parents before children)
    gaps: list[tuple[int, int]]  # stretches no stage covers, drawn on the root row
    marks: list[Mark]
    summary: Summary
    depth: int = 0  # process nesting: 0 for a family's top process
    parent: str | None = None  # "pid N, during <stage>" for a nested process
    helper: bool = False
    children: list[ProcessWaterfall] = field(default_factory=list)
    # Spans of another user's process that named this process's root or stages as their parent
    # (its trace and span ids are no secret): not drawn, counted, said under the waterfall.
    foreign: int = 0


@dataclass(slots=True)
class Family:
    """The processes of one cold start (a root and every process started under it), on one axis."""

    processes: list[ProcessWaterfall]  # depth-first: parents before their children
    t0_ns: int
    t1_ns: int


def dedupe_spans(spans: Iterable[SpanItem]) -> list[SpanItem]:
    """The same file read twice (a path and its rotation) must not double a waterfall. Another
    user's span of the same ids is another span (:func:`span_key`): it does not replace this one."""
    seen: set[tuple[str, str, int | None]] = set()
    out: list[SpanItem] = []
    for s in spans:
        k = span_key(s)
        if k not in seen:
            seen.add(k)
            out.append(s)
    return out


def stages_of(root: SpanItem, by_parent: dict[str, list[SpanItem]]) -> list[SpanItem]:
    """The ``coldstart.*`` spans under ``root`` (of its trace) that its own user's processes sent."""
    out: list[SpanItem] = []
    uid = owner_uid(root)
    todo, seen = [root.span_id], {root.span_id}
    while todo:
        for child in by_parent.get(todo.pop(), []):
            if (child.span_id not in seen and child.name.startswith("coldstart.") and child.trace_id == root.trace_id
                    and owner_uid(child) == uid):
                seen.add(child.span_id)
                out.append(child)
                todo.append(child.span_id)
    return out


def by_parent_id(spans: Iterable[SpanItem]) -> dict[str, list[SpanItem]]:
    """Spans by their parent span id (those with one)."""
    out: dict[str, list[SpanItem]] = {}
    for s in spans:
        if s.parent_span_id:
            out.setdefault(s.parent_span_id, []).append(s)
    return out


def foreign_claims(root: SpanItem, stages: list[SpanItem], by_parent: dict[str, list[SpanItem]]) -> int:
    """How many spans of another user's process name ``root`` or one of its ``stages`` as their
    parent (in its trace) where the waterfall would draw them: a stage, a probe, or a process's
    root that this one does not adopt (:func:`adopts`). They are left out of ``root``'s waterfall."""
    uid = owner_uid(root)
    n = 0
    for s in (root, *stages):
        for c in by_parent.get(s.span_id, []):
            if c.trace_id != root.trace_id or not (c.name.startswith("coldstart") or c.name == PROBE):
                continue
            cu = owner_uid(c)
            n += not adopts(uid, cu) if c.name == ROOT else cu != uid
    return n


def _ordered_rows(root: SpanItem, stages: list[SpanItem]) -> list[Row]:
    kids: dict[str, list[SpanItem]] = {}
    for s in stages:
        kids.setdefault(s.parent_span_id or "", []).append(s)
    rows = [Row(root, 0, ROOT, "root")]

    def walk(parent_id: str, depth: int) -> None:
        for s in sorted(kids.get(parent_id, []), key=lambda x: (x.start_ns, -x.end_ns)):
            name = stage_name(s)
            kind = "unattributed" if name == UNATTRIBUTED else (
                "custom" if s.attributes.get(_contract.STAGE_CUSTOM) is True else "stage")
            rows.append(Row(s, depth, name, kind))
            if depth < 32:
                walk(s.span_id, depth + 1)

    walk(root.span_id, 1)
    return rows


def uncovered(lo: int, hi: int, intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [lo, hi] that no interval covers."""
    out: list[tuple[int, int]] = []
    cur = lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if s > cur:
            out.append((cur, s))
        cur = max(cur, e)
    if cur < hi:
        out.append((cur, hi))
    return out


def _marks(root: SpanItem, stages: list[SpanItem], probes: list[SpanItem]) -> list[Mark]:
    marks: list[Mark] = []
    ready = num(root.attributes.get(_contract.READY_S))
    ready_ns = offset_ns(ready)
    if ready is not None and ready_ns is not None:
        marks.append(Mark(root.start_ns + ready_ns, "ready", "ready after %.3f s (%s)" % (
            ready, root.attributes.get(_contract.READY_SOURCE) or "?")))
    for s in stages:
        if stage_name(s) == _contract.FIRST_REQUEST:
            ttfb = num(s.attributes.get(_contract.FIRST_REQUEST_TTFB_S))
            ttfb_ns = offset_ns(ttfb)
            if ttfb_ns is None:
                ttfb = None
            t = s.start_ns + ttfb_ns if ttfb_ns is not None else s.end_ns
            note = " (first byte %.3f s after the request)" % ttfb if ttfb is not None else ""
            marks.append(Mark(t, "first response", "first response at %.3f s%s" % ((t - root.start_ns) / 1e9, note)))
            break
    marks.extend(Mark(p.end_ns, "probe", "probe GET %s: HTTP %s, first byte %.3f s after sending" % (
        p.attributes.get("url.full"), p.attributes.get("http.response.status_code"), (p.end_ns - p.start_ns) / 1e9))
        for p in probes)
    return marks


def _summary(root: SpanItem, stages: list[SpanItem], gaps: list[tuple[int, int]]) -> Summary:
    total = max(root.end_ns - root.start_ns, 1)
    top = biggest_stages(root, stages)  # as ``show`` says it
    un = num(root.attributes.get(_contract.UNATTRIBUTED_S))
    if un is None:
        un = sum(e - s for s, e in gaps) / 1e9
    ready = num(root.attributes.get(_contract.READY_S))
    return Summary(total / 1e9, ready if offset_ns(ready) is not None else None,
                   [(name, ns / 1e9) for name, ns in top], un, un * 1e9 / total, workers=workers_ready(root))


def waterfalls(spans: list[SpanItem], ceiling_of: CeilingOf | None = None) -> list[Family]:
    """One family per top-level cold start; a root whose parent span lies in another root's
    cold start (a worker, a rank) nests under that process. ``ceiling_of`` (a file's cached
    storage ceiling) fills in the ceiling ratio of a cold weights file that lacks one."""
    spans = dedupe_spans(spans)
    by_parent = by_parent_id(spans)
    roots = sorted((s for s in spans if s.name == ROOT), key=lambda s: s.start_ns)
    owner: dict[tuple[str, str], list[ProcessWaterfall]] = {}  # (trace, span id) -> the processes it belongs to
    procs: list[ProcessWaterfall] = []
    for root in roots:
        stages = stages_of(root, by_parent)
        covered = [(s.start_ns, s.end_ns) for s in stages if stage_name(s) != UNATTRIBUTED]
        total = max(root.end_ns - root.start_ns, 1)
        gaps = [g for g in uncovered(root.start_ns, root.end_ns, covered) if g[1] - g[0] >= GAP_MIN_SHARE * total]
        probes = [p for p in by_parent.get(root.span_id, []) if p.name == PROBE and p.trace_id == root.trace_id
                  and owner_uid(p) == owner_uid(root)]
        summary = _summary(root, stages, gaps)
        summary.weights_files = files_of(ColdStart(root, stages), ceiling_of)
        wf = ProcessWaterfall(root, _ordered_rows(root, stages), gaps, _marks(root, stages, probes), summary,
                              helper=root.resource.get(_contract.PROCESS_ROLE) == _contract.ROLE_HELPER
                              or root.attributes.get(_contract.PROCESS_ROLE) == _contract.ROLE_HELPER,
                              foreign=foreign_claims(root, stages, by_parent))
        procs.append(wf)
        for s in (root, *stages):
            owner.setdefault((root.trace_id, s.span_id), []).append(wf)
    chosen = {id(wf): p for wf in procs if (p := _parent_process(wf, owner)) is not None}
    tops: list[ProcessWaterfall] = []
    for wf in procs:
        r = wf.root
        parent = chosen.get(id(wf))
        if parent is None or _is_under(parent, wf, chosen):
            tops.append(wf)
            continue
        during = next((row.label for row in parent.rows if row.span.span_id == r.parent_span_id), ROOT)
        wf.parent = "started by pid %s during %s" % (parent.root.resource.get("process.pid") or "?", during)
        parent.children.append(wf)
    families: list[Family] = []
    for top in tops:
        flat = _depth_first(top)
        t0 = min(w.root.start_ns for w in flat)
        t1 = max(max([w.root.end_ns] + [m.t_ns for m in w.marks]) for w in flat)
        families.append(Family(flat, t0, max(t1, t0 + 1)))
    return families


def _depth_first(top: ProcessWaterfall) -> list[ProcessWaterfall]:
    flat: list[ProcessWaterfall] = []
    todo = [(top, 0)]
    while todo:
        wf, depth = todo.pop()
        wf.depth = depth
        flat.append(wf)
        if depth < 16:
            todo.extend((c, depth + 1) for c in sorted(wf.children, key=lambda c: c.root.start_ns, reverse=True))
    return flat


def _parent_process(wf: ProcessWaterfall, owner: dict[tuple[str, str], list[ProcessWaterfall]]
                    ) -> ProcessWaterfall | None:
    """The process ``wf``'s root nests under: the one whose root or stage is its parent span, of
    the same user first, else root's (:func:`adopts`); None when there is none."""
    uid = owner_uid(wf.root)
    found = [p for p in owner.get((wf.root.trace_id, wf.root.parent_span_id or ""), ())
             if adopts(owner_uid(p.root), uid)]
    best = min(found, key=lambda p: owner_uid(p.root) != uid, default=None)
    return None if best is wf else best  # (its own span: bad data, a top of its own)


def _is_under(parent: ProcessWaterfall, wf: ProcessWaterfall, chosen: dict[int, ProcessWaterfall]) -> bool:
    """True if ``parent`` already descends from ``wf`` (a cycle in bad data)."""
    cur = parent
    for _ in range(64):
        if cur is wf:
            return True
        nxt = chosen.get(id(cur))
        if nxt is None or nxt is cur:
            return False
        cur = nxt
    return True


def weights_note(s: SpanItem) -> str:
    """``128.0 MiB @ 1.4 GiB/s, cold`` for weights stages; '' otherwise."""
    a = s.attributes
    nbytes = num(a.get(_contract.WEIGHTS_BYTES))
    if nbytes is None:
        return ""
    out = human_bytes(nbytes)
    rate = num(a.get(_contract.WEIGHTS_BYTES_PER_S))
    if rate is not None:
        out += " @ %s/s" % human_bytes(rate)
    pcr = num(a.get(_contract.WEIGHTS_PAGE_CACHE_RATIO))
    if pcr is not None:
        out += ", %s (page cache %.0f%%)" % ("warm" if pcr >= COLD_BELOW else "cold", 100 * pcr)
    elif num(a.get(_contract.WEIGHTS_CEILING_RATIO)) is not None:
        out += ", cold"
    ceiling = num(a.get(_contract.WEIGHTS_CEILING_RATIO))
    if ceiling is not None:
        out += ", %s of storage ceiling" % ceiling_share(ceiling)
    if a.get(_contract.WEIGHTS_LAZY) is True:
        out += ", lazy (mapped)"
    return out


# -- OOMs ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Oom:
    log: LogItem
    cls: str
    rule: str
    remedy: str
    note: str
    device: str  # cuda:N or ""
    hw_id: str
    numbers: dict[str, float | None]

    @property
    def pid(self) -> AttrValue | None:
        return self.log.resource.get("process.pid")


def is_oom(x: LogItem) -> bool:
    return x.event_name == "oom" or "infersight.oom.class" in x.attributes


def ooms(logs: list[LogItem]) -> list[Oom]:
    out: list[Oom] = []
    seen: set[tuple[int, str, AttrValue | None]] = set()
    for x in sorted((x for x in logs if is_oom(x)), key=lambda x: x.time_ns):
        key = (x.time_ns, x.body, x.resource.get("process.pid"))
        if key in seen:
            continue
        seen.add(key)
        a = x.attributes
        out.append(Oom(
            x, str(a.get("infersight.oom.class") or "unknown"), str(a.get("infersight.oom.rule") or ""),
            str(a.get("infersight.oom.remedy") or ""), str(a.get("infersight.oom.note") or ""),
            str(a.get("infersight.oom.device") or ""), str(a.get("hw.id") or ""),
            {k: num(a.get("infersight.oom.%s_bytes" % k)) for k in OOM_NUMBERS},
        ))
    return out
