"""``infersight report FILE... [-o PATH]``: one self-contained HTML page from OTLP JSON files.

I/O at the edge: read the files one line at a time into a bounded scan (``report.scan``), read
them again for the spans of the cold starts that are drawn, build the views (:func:`build_from`:
``report.views`` for cold starts and OOMs, ``report.gpu`` for memory and devices), render the page
(``report.html``), write it and print its path. Memory does not grow with the spans of the files
(docs/report.md, "Memory"). Exit 0 with a page; 2 with one line on
stderr when no file could be read, none holds OTLP data, or the page cannot be written.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import TextIO

from infersight.agent.report import html as report_html
from infersight.agent.report.gpu import devices, memory
from infersight.agent.report.html import Report
from infersight.agent.report.parse import Telemetry, iter_file
from infersight.agent.report.scan import Scan, Source, collect, memory_source, slowest_first
from infersight.agent.report.views import ooms
from infersight.weights_files import CeilingOf

EXIT_ERROR = 2


def file_source(paths: list[str]) -> Source:
    def chunks(traces: set[str] | None) -> Iterator[Telemetry]:
        for p in paths:
            yield from iter_file(p, traces)
    return chunks


def scan(source: Source) -> Scan:
    sc = Scan()
    for chunk in source(None):
        sc.add(chunk)
    return sc


def build(t: Telemetry, ceiling_of: CeilingOf | None = None) -> Report:
    return build_from(memory_source(t), ceiling_of=ceiling_of)


def build_from(source: Source, sc: Scan | None = None, ceiling_of: CeilingOf | None = None) -> Report:
    """The report in two passes over ``source``: a bounded scan (``report.scan``), then the spans
    of the cold starts that are drawn."""
    sc = sc if sc is not None else scan(source)
    rows = sc.families()
    ranked = slowest_first(rows)
    drawn = ranked[: report_html.MAX_WATERFALLS]
    oom_list = ooms(sc.oom_logs())
    kept = Telemetry(samples=sc.kept_samples(), histograms=sc.histograms, logs=sc.device_logs)
    t0 = sc.t0_ns if sc.t0_ns is not None else 0
    t1 = sc.t1_ns if sc.t1_ns is not None else 1
    counts = {"spans": sc.span_count(), "metric points": sc.points, "log records": sc.logs, "lines": sc.lines}
    return Report(collect(source, drawn, ceiling_of), memory(kept, sc.mem_spans, oom_list), devices(kept), oom_list, t0,
                  max(t1, t0 + 1), counts, list(sc.skipped), ranked[: report_html.MAX_LISTED], len(rows),
                  sc.oom_count(), len(sc.skipped) + sc.skipped_more)


def default_output(path: str) -> str:
    """``run.otlp.jsonl`` -> ``run.html``; ``trace.json`` -> ``trace.html``; ``x`` -> ``x.html``."""
    base = path
    for suffix in (".otlp.jsonl", ".otlp.json", ".jsonl", ".json"):
        if base.endswith(suffix) and len(base) > len(suffix):
            base = base[: -len(suffix)]
            break
    return base + ".html"


def scan_files(paths: list[str], err: TextIO, command: str = "report") -> Scan | None:
    """The first pass over ``paths``, one line at a time; None (and one line on ``err``) if one cannot be read."""
    sc = Scan()
    for p in paths:
        try:
            for chunk in iter_file(p):
                sc.add(chunk)
        except OSError as exc:
            err.write("infersight %s: cannot read %s: %s\n" % (command, p, exc.strerror or exc))
            return None
    return sc


def report_skips(sc: Scan, err: TextIO, command: str) -> int:
    total = len(sc.skipped) + sc.skipped_more
    for s in sc.skipped[:5]:
        err.write("infersight %s: %s\n" % (command, s))
    if total > 5:
        err.write("infersight %s: ... %d more skipped\n" % (command, total - 5))
    return total


def run_report(paths: list[str], output: str | None, out: TextIO, err: TextIO,
               ceiling_of: CeilingOf | None = None) -> int:
    """``ceiling_of``: a file's cached storage ceiling, for the ceiling ratio of a cold weights
    file that lacks one (the command hands in the cold-start cache's lookup)."""
    sc = scan_files(paths, err)
    if sc is None:
        return EXIT_ERROR
    skipped = report_skips(sc, err, "report")
    if skipped:  # the page lists them too, when there is one
        err.write("infersight report: %d line(s) or record(s) skipped in all\n" % skipped)
    if sc.empty():
        err.write("infersight report: no OTLP records in %s (expected OTLP JSON lines, as written by "
                  "'infersight launch' or the agent's file exporter)\n" % ", ".join(paths))
        return EXIT_ERROR
    try:
        report = build_from(file_source(paths), sc, ceiling_of)
    except OSError as exc:  # a file removed or cut between the two passes
        err.write("infersight report: cannot read %s again: %s\n" % (", ".join(paths), exc.strerror or exc))
        return EXIT_ERROR
    page = report_html.render(report, [os.path.basename(p) for p in paths])
    dest = output or default_output(paths[0])
    if any(os.path.exists(p) and os.path.exists(dest) and os.path.samefile(p, dest) for p in paths):
        err.write("infersight report: %s is an input; choose another output with -o\n" % dest)
        return EXIT_ERROR
    tmp = None
    try:
        # a new file of our own beside the page (O_EXCL: a name planted there, a link to another user's
        # file, is never opened), then renamed over it
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(dest) + ".tmp-", dir=os.path.dirname(dest) or ".")
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # as open() would have made it
            f.write(page)
        os.replace(tmp, dest)
    except BaseException as exc:  # never leave the temporary file, whatever stopped the write
        if tmp is not None:
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


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
