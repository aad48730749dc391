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
many repeats were skipped.
Exit 0; 1 when the file holds no cold start (text, json) or nothing to trace; 2 when it
cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, TextIO

from infersight.agent.cli import command_help
from infersight.agent.coldstart import storage_ceiling
from infersight.agent.daemon.assemble import descendants
from infersight.agent.report.parse import parse_lines
from infersight.agent.report.views import dedupe_spans
from infersight.coldstart_stages import merge, named_intervals
from infersight.exporters.waterfall import is_helper, render_waterfall
from infersight.hooks import _contract
from infersight.telemetry import ColdStart, SpanItem

if TYPE_CHECKING:
    from infersight.agent.report.scan import Scan, Source

FORMATS = ("text", "json", "chrome-trace")


def spans_from_lines(lines: list[str]) -> list[SpanItem]:
    return parse_lines(lines).spans


def coldstarts(spans: list[SpanItem]) -> list[ColdStart]:
    spans = dedupe_spans(spans)  # a span resent after a reconnect is in the file twice: count it once
    staged = [s for s in spans if s.name.startswith("coldstart.")]
    roots = sorted((s for s in spans if s.name == "coldstart"), key=lambda s: s.start_ns)
    out = []
    stages_of: dict[str, list[SpanItem]] = {}
    workers_of: dict[str, list[SpanItem]] = {}
    for r in roots:
        stages = stages_of[r.span_id] = sorted(descendants(r.span_id, staged), key=lambda s: s.start_ns)
        ids = {r.span_id, *(s.span_id for s in stages)}
        workers_of[r.span_id] = [w for w in roots if w.parent_span_id in ids and w.trace_id == r.trace_id
                                 and w.attributes.get(_contract.PROCESS_ROLE) != _contract.ROLE_HELPER]
    for r in roots:
        covered = [iv for w in workers_of[r.span_id] for iv in _tree_covered(w, stages_of, workers_of, set())]
        out.append(ColdStart(r, stages_of[r.span_id], workers_of[r.span_id], merge(covered)))
    return out


def _tree_covered(root: SpanItem, stages_of: dict[str, list[SpanItem]], workers_of: dict[str, list[SpanItem]],
                  seen: set[str]) -> list[tuple[int, int]]:
    """What the named stages of ``root``'s process and of its workers (recursively) cover."""
    if root.span_id in seen:  # a file that nests roots in a loop: each counts once
        return []
    seen.add(root.span_id)
    out = named_intervals(stages_of.get(root.span_id, []))
    for w in workers_of.get(root.span_id, []):
        out.extend(_tree_covered(w, stages_of, workers_of, seen))
    return out


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
    members = {(r.trace, r.span_id) for row in shown for r in row.flat}
    spans = dedupe_spans(s for chunk in source(traces) for s in chunk.spans if s.trace_id in traces)
    found = coldstarts(spans)
    if len(shown) < len(rows):  # the chosen families' processes, not the other cold starts of their traces
        found = [cs for cs in found if (cs.root.trace_id, cs.root.span_id) in members]
    probes = [s for s in spans if s.name == "infersight.probe"]
    helpers = [cs for cs in found if is_helper(cs)]
    for cs in found:
        if cs in helpers:
            continue
        out.write(render_waterfall(cs, ceiling_of=storage_ceiling.ceiling_of) + "\n")
        for p in probes:
            if p.parent_span_id == cs.root.span_id and p.trace_id == cs.root.trace_id:
                out.write(probe_line(p) + "\n")
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
