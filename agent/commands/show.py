"""``infersight show [--format text|json|chrome-trace] FILE``: a cold start again, from an OTLP JSON file.

- ``text`` (default): one waterfall per ``coldstart`` root in the file (the served process and
  any hooked children), oldest first, with launch's probe result under its root;
- ``json``: the waterfalls as JSON for scripts (``report.trace.waterfall_json``);
- ``chrome-trace``: Chrome trace-event JSON for Perfetto UI and ``chrome://tracing``.

Lines that do not parse (a last line cut short) are skipped with a note on stderr.
Exit 0; 1 when the file holds no cold start (text, json) or nothing to trace; 2 when it
cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from infersight.agent.cli import command_help
from infersight.agent.coldstart import storage_ceiling
from infersight.agent.daemon.assemble import descendants
from infersight.agent.report.parse import Telemetry, parse_lines, read_file
from infersight.coldstart_stages import merge, named_intervals
from infersight.exporters.waterfall import is_helper, render_waterfall
from infersight.telemetry import ColdStart, SpanItem

FORMATS = ("text", "json", "chrome-trace")


def spans_from_lines(lines: list[str]) -> list[SpanItem]:
    return parse_lines(lines).spans


def coldstarts(spans: list[SpanItem]) -> list[ColdStart]:
    staged = [s for s in spans if s.name.startswith("coldstart.")]
    roots = sorted((s for s in spans if s.name == "coldstart"), key=lambda s: s.start_ns)
    out = []
    stages_of: dict[str, list[SpanItem]] = {}
    workers_of: dict[str, list[SpanItem]] = {}
    for r in roots:
        stages = stages_of[r.span_id] = sorted(descendants(r.span_id, staged), key=lambda s: s.start_ns)
        ids = {r.span_id, *(s.span_id for s in stages)}
        workers_of[r.span_id] = [w for w in roots if w.parent_span_id in ids and w.trace_id == r.trace_id
                                 and w.attributes.get("infersight.process.role") != "helper"]
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


def show_file(path: str, out: TextIO, fmt: str = "text", err: TextIO | None = None) -> int:
    err = err if err is not None else (out if out is not sys.stdout else sys.stderr)
    try:
        t = read_file(path)
    except OSError as exc:
        err.write("infersight show: cannot read %s: %s\n" % (path, exc.strerror or exc))
        return 2
    for s in t.skipped[:5]:
        err.write("infersight show: %s\n" % s)
    if len(t.skipped) > 5:
        err.write("infersight show: ... %d more skipped\n" % (len(t.skipped) - 5))
    if fmt == "chrome-trace":
        return _chrome(t, path, out, err)
    found = coldstarts(t.spans)
    if not found:
        err.write("infersight show: no coldstart span in %s\n" % path)
        return 1
    if fmt == "json":
        from infersight.agent.report.trace import dumps, waterfall_json
        from infersight.agent.report.views import waterfalls

        out.write(dumps(waterfall_json(waterfalls(t.spans, storage_ceiling.ceiling_of))) + "\n")
        return 0
    probes = [s for s in t.spans if s.name == "infersight.probe"]
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
    return 0


def _chrome(t: Telemetry, path: str, out: TextIO, err: TextIO) -> int:
    from infersight.agent.report.trace import chrome_trace, dumps

    trace = chrome_trace(t)
    if not trace["traceEvents"]:
        err.write("infersight show: no spans or OOMs to trace in %s\n" % path)
        return 1
    out.write(dumps(trace) + "\n")
    return 0


def probe_line(p: SpanItem) -> str:
    return "probe GET %s: HTTP %s, first byte %.3f s after sending" % (
        p.attributes.get("url.full"), p.attributes.get("http.response.status_code"),
        (p.end_ns - p.start_ns) / 1e9)


def add_parser(sub: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    shp: argparse.ArgumentParser = sub.add_parser("show", help=help_line or command_help("show"))
    shp.add_argument("--format", choices=("text", "json", "chrome-trace"), default="text",
                     help="text (default), json (the waterfall for scripts) or chrome-trace (Perfetto)")
    shp.add_argument("path", metavar="FILE")
    shp.set_defaults(func=run)
    return shp


def run(args: argparse.Namespace) -> int:
    from infersight.agent.commands.show import show_file

    return show_file(args.path, sys.stdout, args.format, sys.stderr)
