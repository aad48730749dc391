"""``infersight show [--format text|json|chrome-trace] FILE``: a cold start again, from an OTLP JSON file.

- ``text`` (default): one waterfall per ``coldstart`` root in the file (the served process and
  any hooked children), oldest first, with launch's probe result under its root; past
  :data:`MAX_TEXT` cold starts, those of the slowest ones and a line that says so;
- ``json``: the waterfalls as JSON for scripts (``report.trace.waterfall_json``), every one,
  streamed a batch of cold starts at a time;
- ``chrome-trace``: Chrome trace-event JSON for Perfetto UI and ``chrome://tracing``, streamed
  one event at a time.

The file is read as a stream, in passes (``report.scan``): memory does not grow with its spans.

Lines that do not parse (a last line cut short) are skipped with a note on stderr. A span that
is in the file more than once (the same ``traceId`` and ``spanId``: a producer resent it to a
restarted agent, delivery is at least once) counts once, the first; a note on stderr says how
many repeats were skipped. A process's waterfall holds only its own user's spans (the resource's
``process.user.id``, the kernel's word): trace and span ids are no secret, and another user's spans
that name them as parent are left out, with a line that counts them (``views.adopts``: a root
process adopts any user's child processes, as a root ``launch`` whose CMD runs as another user).
Exit 0; 1 when the file holds no cold start (text, json) or nothing to trace; 2 when it
cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, TextIO

from infersight.agent.cli import command_help
from infersight.agent.coldstart import storage_ceiling
from infersight.agent.report.parse import parse_lines
from infersight.agent.report.views import (
    adopts,
    by_parent_id,
    dedupe_spans,
    foreign_claims,
    owner_uid,
    span_key,
    stages_of,
)
from infersight.coldstart_stages import merge, named_intervals
from infersight.exporters.waterfall import is_helper, render_waterfall
from infersight.hooks import _contract
from infersight.telemetry import ColdStart, SpanItem

if TYPE_CHECKING:
    from infersight.agent.report.scan import Scan, Source

FORMATS = ("text", "json", "chrome-trace")


def spans_from_lines(lines: list[str]) -> list[SpanItem]:
    return parse_lines(lines).spans


Key = tuple[str, str, int | None]  # a root, as views.span_key names it


def coldstarts(spans: list[SpanItem], foreign: dict[Key, int] | None = None) -> list[ColdStart]:
    """One cold start per root: its stages of its trace that its own user's processes sent, and the
    workers it adopts (``views.adopts``: its user's, or any under root's). ``foreign`` gets, per root
    (``views.span_key``), how many spans of another user's process claimed a place in it, left out."""
    spans = dedupe_spans(spans)  # a span resent after a reconnect is in the file twice: count it once
    by_parent = by_parent_id(spans)
    roots = sorted((s for s in spans if s.name == "coldstart"), key=lambda s: s.start_ns)
    out = []
    stages_by: dict[Key, list[SpanItem]] = {}
    workers_of: dict[Key, list[SpanItem]] = {}
    for r in roots:
        stages = stages_by[span_key(r)] = sorted(stages_of(r, by_parent), key=lambda s: s.start_ns)
        if foreign is not None:
            foreign[span_key(r)] = foreign_claims(r, stages, by_parent)
        ids = {r.span_id, *(s.span_id for s in stages)}
        workers_of[span_key(r)] = [w for w in roots if w.parent_span_id in ids and w.trace_id == r.trace_id
                                   and w is not r and adopts(owner_uid(r), owner_uid(w))
                                   and w.attributes.get(_contract.PROCESS_ROLE) != _contract.ROLE_HELPER]
    for r in roots:
        covered = [iv for w in workers_of[span_key(r)] for iv in _tree_covered(w, stages_by, workers_of, set())]
        out.append(ColdStart(r, stages_by[span_key(r)], workers_of[span_key(r)], merge(covered)))
    return out


def _tree_covered(root: SpanItem, stages_by: dict[Key, list[SpanItem]], workers_of: dict[Key, list[SpanItem]],
                  seen: set[Key]) -> list[tuple[int, int]]:
    """What the named stages of ``root``'s process and of its workers (recursively) cover."""
    key = span_key(root)
    if key in seen:  # a file that nests roots in a loop: each counts once
        return []
    seen.add(key)
    out = named_intervals(stages_by.get(key, []))
    for w in workers_of.get(key, []):
        out.extend(_tree_covered(w, stages_by, workers_of, seen))
    return out


def foreign_line(n: int) -> str:
    """What ``show`` says under a waterfall that other users' spans claimed a place in."""
    return "(%d span%s of another user's process claimed this trace; left out)" % (n, "" if n == 1 else "s")


MAX_TEXT = 50  # cold starts (families) printed as text; past it, the slowest ones (as the page draws)
JSON_BATCH_SPANS = 20_000  # spans read at once for --format json: each batch of cold starts is one pass


def show_file(path: str, out: TextIO, fmt: str = "text", err: TextIO | None = None) -> int:
    err = err if err is not None else (out if out is not sys.stdout else sys.stderr)
    from infersight.agent.report.page import file_source, scan_files

    if fmt == "chrome-trace":
        return _chrome(path, out, err)
    sc = scan_files([path], err, "show")
    if sc is None:
        return 2
    _skips(sc, err)
    if not sc.roots:
        err.write("infersight show: no coldstart span in %s\n" % path)
        return 1
    try:
        if fmt == "json":
            _json(sc, file_source([path]), out)
        else:
            _text(sc, file_source([path]), path, out)
    except OSError as exc:  # the file removed or cut between the passes
        err.write("infersight show: cannot read %s again: %s\n" % (path, exc.strerror or exc))
        return 2
    return 0


def _skips(sc: Scan, err: TextIO, repeated: int | None = None) -> None:
    total = len(sc.skipped) + sc.skipped_more
    for s in sc.skipped[:5]:
        err.write("infersight show: %s\n" % s)
    if total > 5:
        err.write("infersight show: ... %d more skipped\n" % (total - 5))
    repeated = len(sc.span_keys) - sc.span_count() if repeated is None else repeated
    if repeated:
        err.write("infersight show: %d duplicate span%s skipped (the same traceId and spanId again, as a producer "
                  "resends after a reconnect): each counts once\n" % (repeated, "" if repeated == 1 else "s"))


def _json(sc: Scan, source: Source, out: TextIO) -> None:
    """Every cold start, streamed: a batch of cold starts per pass over the file, so that memory
    holds the spans of about JSON_BATCH_SPANS (or of one cold start, if it is larger), not the file."""
    from infersight.agent.report.scan import batches, collect
    from infersight.agent.report.trace import dumps, waterfall_json

    out.write('{"coldstarts": [')
    first = True
    for batch in batches(sc, sc.families(), JSON_BATCH_SPANS):
        for item in waterfall_json(collect(source, batch, storage_ceiling.ceiling_of))["coldstarts"]:
            out.write(("" if first else ", ") + dumps(item))
            first = False
    out.write("]}\n")


def _text(sc: Scan, source: Source, path: str, out: TextIO) -> None:
    """The waterfalls of every cold start, or of the MAX_TEXT slowest ones (oldest first) and a
    line that says so: text is for reading, ``--format json`` has them all."""
    from infersight.agent.report.scan import slowest_first

    rows = sc.families()
    shown = rows if len(rows) <= MAX_TEXT else slowest_first(rows)[:MAX_TEXT]
    if len(shown) < len(rows):
        out.write("(%d cold starts in %s: the %d slowest are shown, oldest first; --format json has them all)\n\n"
                  % (len(rows), path, len(shown)))
    traces = set().union(*(r.traces for r in shown))
    members = {(r.trace, r.span_id, r.uid) for row in shown for r in row.flat}
    spans = dedupe_spans(s for chunk in source(traces) for s in chunk.spans if s.trace_id in traces)
    foreign: dict[Key, int] = {}
    found = coldstarts(spans, foreign)
    if len(shown) < len(rows):  # the chosen families' processes, not the other cold starts of their traces
        found = [cs for cs in found if span_key(cs.root) in members]
    probes = [s for s in spans if s.name == "infersight.probe"]
    helpers = [cs for cs in found if is_helper(cs)]
    for cs in found:
        if cs in helpers:
            continue
        out.write(render_waterfall(cs, ceiling_of=storage_ceiling.ceiling_of) + "\n")
        for p in probes:
            if (p.parent_span_id == cs.root.span_id and p.trace_id == cs.root.trace_id
                    and owner_uid(p) == owner_uid(cs.root)):
                out.write(probe_line(p) + "\n")
        if foreign.get(span_key(cs.root)):
            out.write(foreign_line(foreign[span_key(cs.root)]) + "\n")
        out.write("\n")
    if helpers:
        out.write("(%d helper process%s not shown: %s)\n" % (
            len(helpers), "" if len(helpers) == 1 else "es",
            ", ".join("pid %s" % cs.root.resource.get("process.pid") for cs in helpers)))


def _chrome(path: str, out: TextIO, err: TextIO) -> int:
    """The Chrome trace, written one event at a time: a planning pass (``report.trace.plan_trace``,
    about 40 bytes a span), then the spans again, then the cold starts' marks in batches."""
    from infersight.agent.report.page import file_source
    from infersight.agent.report.trace import plan_trace, write_chrome_trace

    source = file_source([path])
    try:
        plan = plan_trace(source)
    except OSError as exc:
        err.write("infersight show: cannot read %s: %s\n" % (path, exc.strerror or exc))
        return 2
    _skips(plan.scan, err, sum(plan.dup))
    if plan.empty():
        err.write("infersight show: no spans or OOMs to trace in %s\n" % path)
        return 1
    try:
        write_chrome_trace(source, plan, out)
    except OSError as exc:  # the file removed between the passes
        err.write("infersight show: cannot read %s again: %s\n" % (path, exc.strerror or exc))
        return 2
    out.write("\n")
    return 0


def probe_line(p: SpanItem) -> str:
    from infersight.sanitize import terminal_line

    return terminal_line("probe GET %s: HTTP %s, first byte %.3f s after sending" % (
        p.attributes.get("url.full"), p.attributes.get("http.response.status_code"),
        (p.end_ns - p.start_ns) / 1e9))


def add_parser(sub: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    shp: argparse.ArgumentParser = sub.add_parser("show", help=help_line or command_help("show"))
    shp.add_argument("--format", choices=FORMATS, default="text",
                     help="text (default), json (the waterfall for scripts) or chrome-trace (Perfetto)")
    shp.add_argument("path", metavar="FILE")
    shp.set_defaults(func=run)
    return shp


def run(args: argparse.Namespace) -> int:
    from infersight.agent.commands.show import show_file

    return show_file(args.path, sys.stdout, args.format, sys.stderr)
