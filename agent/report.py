"""``infersight report FILE... [-o PATH]``: one self-contained HTML page from OTLP JSON files.

I/O at the edge: read the files (report_parse), build the views (report_views), render the
page (report_html), write it and print its path. Exit 0 with a page; 2 with one line on
stderr when no file could be read, none holds OTLP data, or the page cannot be written.
"""

from __future__ import annotations

import os
from typing import TextIO

from infersight.agent import report_html, report_views
from infersight.agent.report_parse import Telemetry, read_file

EXIT_ERROR = 2


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


def run_report(paths: list[str], output: str | None, out: TextIO, err: TextIO) -> int:
    t = read_all(paths, err)
    if t is None:
        return EXIT_ERROR
    for s in t.skipped[:5]:
        err.write("infersight report: %s\n" % s)
    if len(t.skipped) > 5:
        err.write("infersight report: ... %d more skipped\n" % (len(t.skipped) - 5))
    if t.empty():
        err.write("infersight report: no OTLP records in %s (expected OTLP JSON lines, as written by "
                  "'infersight launch' or the agent's file exporter)\n" % ", ".join(paths))
        return EXIT_ERROR
    page = report_html.render(report_views.build(t), [os.path.basename(p) for p in paths])
    dest = output or default_output(paths[0])
    tmp = "%s.tmp-%d" % (dest, os.getpid())
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, dest)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        err.write("infersight report: cannot write %s: %s\n" % (dest, exc.strerror or exc))
        return EXIT_ERROR
    out.write(dest + "\n")
    return 0
