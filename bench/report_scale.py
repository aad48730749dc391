"""Size and speed of ``report`` and ``show --format chrome-trace`` on large files, side by side.

    python bench/report_scale.py [--spans 5000] [--coldstarts 3000] [--file-spans 0]

Three comparisons, each measured in the same run:
- chrome-trace lanes for ``--spans`` spans that all overlap and none nests (the worst case:
  one lane each): the first-fit scan over every lane that ``show`` used before (kept here as
  the reference, O(N^2)) against ``report.trace._lanes`` (O(N log N)). Issue 22 measured
  20k such spans at 40 s with the old one.
- the page for ``--coldstarts`` cold starts: with the page's bounds (the slowest 50 drawn,
  200 listed) against the same code with the bounds lifted (every cold start drawn, as before).
  Issue 22 measured 30k cold starts at 168 MB.
- with ``--file-spans N``: a file of N spans (cold starts of 10 spans, 50 to a line), read by
  ``report`` and ``show`` (text, json, chrome-trace) in a child process, which streams the file
  and keeps a bounded scan, against the same page built with every record held in memory (as
  ``report`` did before): wall time and peak RSS (``ru_maxrss`` of the child) side by side.
Times are medians of three runs (one for the file); the ratios are what to compare across machines.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infersight.agent.report import html as report_html
from infersight.agent.report.page import run_report
from infersight.agent.report.trace import _lanes
from infersight.exporters.otlp_json import traces_request
from infersight.telemetry import Resource, SpanItem

S = 1_000_000_000


def first_fit_lanes(spans: list[SpanItem]) -> dict[str, int]:
    """The lane assignment ``show`` had before: each span scans every lane."""
    stacks: list[list[int]] = []
    out: dict[str, int] = {}
    for s in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        for i, st in enumerate(stacks):
            while st and st[-1] <= s.start_ns:
                st.pop()
            if not st or s.end_ns <= st[-1]:
                st.append(s.end_ns)
                out[s.span_id] = i
                break
        else:
            stacks.append([s.end_ns])
            out[s.span_id] = len(stacks) - 1
    return out


def median_s(fn: Callable[[], Any], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def lanes(n: int) -> None:
    res = Resource.of({"service.name": "svc", "process.pid": 7})
    spans = [SpanItem(res, "ab" * 16, "%016x" % (i + 1), None, "coldstart.step", i * 1000, (n + i) * 1000, {})
             for i in range(n)]
    old = median_s(lambda: first_fit_lanes(spans), runs=1 if n > 5000 else 3)
    new = median_s(lambda: _lanes(spans))
    assert len(set(_lanes(spans).values())) == len(set(first_fit_lanes(spans).values())) == n
    print("chrome-trace lanes, %d overlapping spans: first-fit %.3f s, heap %.4f s, ratio %.0fx" % (
        n, old, new, old / new))


def page(n: int, tmp: str) -> None:
    rng = random.Random(7)
    spans = []
    for i in range(n):
        res = Resource.of({"service.name": "svc", "process.pid": 10_000 + i})
        base, total = i * 10 * S, rng.randrange(1, 5000) * S // 1000
        spans.append(SpanItem(res, "%032x" % i, "%016x" % (2 * i + 1), None, "coldstart", base, base + total, {}))
        spans.append(SpanItem(res, "%032x" % i, "%016x" % (2 * i + 2), "%016x" % (2 * i + 1), "coldstart.warmup",
                              base, base + total // 2, {"infersight.stage": "warmup"}))
    src = os.path.join(tmp, "many.otlp.jsonl")
    with open(src, "w") as f:
        f.write(traces_request(spans) + "\n")
    out = os.path.join(tmp, "many.html")

    def one() -> None:
        assert run_report([src], out, io.StringIO(), io.StringIO()) == 0

    bounded_s, bounded_bytes = median_s(one), os.path.getsize(out)
    saved = report_html.MAX_WATERFALLS, report_html.MAX_LISTED
    report_html.MAX_WATERFALLS = report_html.MAX_LISTED = 1 << 30
    try:
        unbounded_s, unbounded_bytes = median_s(one), os.path.getsize(out)
    finally:
        report_html.MAX_WATERFALLS, report_html.MAX_LISTED = saved
    print("page of %d cold starts: every one drawn %.1f MB in %.2f s; bounded %.2f MB in %.2f s; "
          "size ratio %.0fx, time ratio %.1fx" % (
              n, unbounded_bytes / 1e6, unbounded_s, bounded_bytes / 1e6, bounded_s,
              unbounded_bytes / bounded_bytes, unbounded_s / bounded_s))


def write_file(path: str, n_spans: int) -> None:
    """Cold starts of 10 spans (a root and 9 stages), 50 to a line, streamed to disk."""
    rng = random.Random(22)
    per_line, stages = 50, 9
    with open(path, "w") as f:
        for first in range(0, n_spans // (1 + stages), per_line):
            spans: list[SpanItem] = []
            for i in range(first, first + per_line):
                res = Resource.of({"service.name": "svc-%d" % (i % 7), "process.pid": 100_000 + i,
                                   "process.command": "python serve.py --model m%d" % i})
                trace, base, total = "%032x" % (i + 1), i * 20 * S, rng.randrange(1_000, 10_000_000) * 1000
                root = "%016x" % (i * 16 + 1)
                spans.append(SpanItem(res, trace, root, None, "coldstart", base, base + total,
                                      {"infersight.coldstart.ready_s": total / S}))
                step = total // stages
                spans += [SpanItem(res, trace, "%016x" % (i * 16 + 2 + k), root, "coldstart.stage%d" % k,
                                   base + k * step, base + (k + 1) * step,
                                   {"infersight.stage": "stage%d" % k, "code.filepath": "/srv/app/model_%d.py" % k,
                                    "infersight.weights.bytes": 1 << 30}) for k in range(stages)]
            f.write(traces_request(spans) + "\n")


HELD = """
import sys
from infersight.agent.report import html
from infersight.agent.report.page import build
from infersight.agent.report.parse import read_file
page = html.render(build(read_file(sys.argv[1])), ["x"])
open(sys.argv[2], "w").write(page)
"""


def child(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one child process."""
    wrapper = ("import resource, subprocess, sys, time\n"
               "t = time.perf_counter(); p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
               "assert p.returncode == 0, p.returncode\n"
               "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n")
    out = subprocess.run([sys.executable, "-c", wrapper, *args], capture_output=True, text=True, check=True).stdout
    wall, rss = out.split()
    return float(wall), float(rss)


def big_file(n: int, tmp: str) -> None:
    src = os.path.join(tmp, "big.otlp.jsonl")
    write_file(src, n)
    size = os.path.getsize(src) / (1 << 20)
    cli = [sys.executable, "-m", "infersight"]
    held_s, held_mb = child([sys.executable, "-c", HELD, src, os.path.join(tmp, "held.html")])
    rep_s, rep_mb = child([*cli, "report", "-o", os.path.join(tmp, "big.html"), src])
    print("file of %d spans (%.0f MiB): report, every record held %.1f s %.0f MB; streamed %.1f s %.0f MB; "
          "memory ratio %.1fx, time ratio %.2fx" % (n, size, held_s, held_mb, rep_s, rep_mb, held_mb / rep_mb,
                                                   rep_s / held_s))
    for fmt in ("text", "json", "chrome-trace"):
        s, mb = child([*cli, "show", "--format", fmt, src])
        print("  show --format %s, streamed: %.1f s %.0f MB" % (fmt, s, mb))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--spans", type=int, default=5000)
    ap.add_argument("--coldstarts", type=int, default=3000)
    ap.add_argument("--file-spans", type=int, default=0, help="also a file of this many spans (e.g. 1000000)")
    a = ap.parse_args()
    lanes(a.spans)
    with tempfile.TemporaryDirectory() as tmp:
        page(a.coldstarts, tmp)
        if a.file_spans:
            big_file(a.file_spans, tmp)


if __name__ == "__main__":
    main()
