"""``infersight report FILE... [-o PATH]``: one self-contained HTML page from OTLP JSON files.

I/O at the edge: read the files (``report.parse``), build the views (:func:`build`: ``report.views``
for cold starts and OOMs, ``report.gpu`` for memory and devices), render the page (``report.html``),
write it and print its path. Exit 0 with a page; 2 with one line on
stderr when no file could be read, none holds OTLP data, or the page cannot be written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TextIO

from infersight.agent.report import html as report_html
from infersight.agent.report.gpu import Devices, MemoryChart, devices, memory
from infersight.agent.report.parse import Telemetry, read_file
from infersight.agent.report.views import Family, Oom, dedupe_spans, ooms, waterfalls
from infersight.weights_files import CeilingOf

EXIT_ERROR = 2


@dataclass(slots=True)
class Report:
    """Everything the page shows; an empty list is a section left out."""

    families: list[Family]
    memory: list[MemoryChart]
    devices: Devices
    ooms: list[Oom]
    t0_ns: int  # the earliest record: times on the page are seconds since this
    t1_ns: int
    counts: dict[str, int]
    skipped: list[str]


def build(t: Telemetry, ceiling_of: CeilingOf | None = None) -> Report:
    spans = dedupe_spans(t.spans)
    oom_list = ooms(t.logs)
    times = [s.start_ns for s in spans] + [s.end_ns for s in spans] + [s.time_ns for s in t.samples] + \
        [x.time_ns for x in t.logs]
    t0 = min(times) if times else 0
    t1 = max(times) if times else 1
    counts = {"spans": len(spans), "metric points": len(t.samples) + len(t.histograms), "log records": len(t.logs),
              "lines": t.lines}
    return Report(waterfalls(spans, ceiling_of), memory(t, spans, oom_list), devices(t), oom_list, t0, max(t1, t0 + 1),
                  counts, list(t.skipped))


def default_output(path: str) -> str:
    """``run.otlp.jsonl`` -> ``run.html``; ``trace.json`` -> ``trace.html``; ``x`` -> ``x.html``."""
    base = path
    for suffix in (".otlp.jsonl", ".otlp.json", ".jsonl", ".json"):
        if base.endswith(suffix) and len(base) > len(suffix):
            base = base[: -len(suffix)]
            break
    return base + ".html"


def read_all(paths: list[str], err: TextIO) -> Telemetry | None:
    t = Telemetry()
    for p in paths:
        try:
            t.extend(read_file(p))
        except OSError as exc:
            err.write("infersight report: cannot read %s: %s\n" % (p, exc.strerror or exc))
            return None
    return t


def run_report(paths: list[str], output: str | None, out: TextIO, err: TextIO,
               ceiling_of: CeilingOf | None = None) -> int:
    """``ceiling_of``: a file's cached storage ceiling, for the ceiling ratio of a cold weights
    file that lacks one (the command hands in the cold-start cache's lookup)."""
    t = read_all(paths, err)
    if t is None:
        return EXIT_ERROR
    for s in t.skipped[:5]:
        err.write("infersight report: %s\n" % s)
    if len(t.skipped) > 5:
        err.write("infersight report: ... %d more skipped\n" % (len(t.skipped) - 5))
    if t.skipped:
        err.write("infersight report: %d line(s) or record(s) skipped in all; the page lists them\n" % len(t.skipped))
    if t.empty():
        err.write("infersight report: no OTLP records in %s (expected OTLP JSON lines, as written by "
                  "'infersight launch' or the agent's file exporter)\n" % ", ".join(paths))
        return EXIT_ERROR
    page = report_html.render(build(t, ceiling_of), [os.path.basename(p) for p in paths])
    dest = output or default_output(paths[0])
    if any(os.path.exists(p) and os.path.exists(dest) and os.path.samefile(p, dest) for p in paths):
        err.write("infersight report: %s is an input; choose another output with -o\n" % dest)
        return EXIT_ERROR
    tmp = "%s.tmp-%d" % (dest, os.getpid())
    try:
        with open(tmp, "w", encoding="utf-8", errors="replace") as f:
            f.write(page)
        os.replace(tmp, dest)
    except BaseException as exc:  # never leave the temporary file, whatever stopped the write
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if not isinstance(exc, OSError):
            raise
        err.write("infersight report: cannot write %s: %s\n" % (dest, exc.strerror or exc))
        return EXIT_ERROR
    out.write(dest + "\n")
    return 0
