"""``report`` and ``show`` on hostile files (issue 22, points 11, 12 and 13).

Any producer can put values into the agent's file. Each fault below made ``report`` or
``show`` loop for ever or end in a traceback (and ``report`` leave its ``.tmp-PID`` file):
now what cannot be read is skipped and counted, and said on stderr and on the page. The
page has bounds past which it summarises; ``show --format chrome-trace`` gives every span a
lane in which it nests, for any overlap.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from report_data import chrome_trace
from test_report import CHROMIUM, needs_chromium, render
from trace_checks import check_nesting, complete_events

from infersight.agent.report import html as report_html
from infersight.agent.report.parse import Telemetry
from infersight.exporters.otlp_json import logs_request, traces_request
from infersight.telemetry import LogItem, Resource, SpanItem

INFERSIGHT = [sys.executable, "-m", "infersight"]
S = 1_000_000_000
TRACE = "ab" * 16


def _attr(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"key": key, "value": value}


def _spans_line(svc: str, root_attrs: list[dict[str, Any]] | None = None, trace: str = TRACE) -> str:
    res = {"attributes": [_attr("service.name", {"stringValue": svc}), _attr("process.pid", {"intValue": "7"})]}
    spans = [
        {"traceId": trace, "spanId": "10" * 8, "name": "coldstart", "startTimeUnixNano": str(S),
         "endTimeUnixNano": str(3 * S), "attributes": root_attrs or []},
        {"traceId": trace, "spanId": "11" * 8, "parentSpanId": "10" * 8, "name": "coldstart.weights_load",
         "startTimeUnixNano": str(S + S // 10), "endTimeUnixNano": str(2 * S),
         "attributes": [_attr("infersight.stage", {"stringValue": "weights_load"})]},
    ]
    return json.dumps({"resourceSpans": [{"resource": res, "scopeSpans": [{"spans": spans}]}]})


def _gauge_line(value: Any, t_ns: int = 2 * S) -> str:
    res = {"attributes": [_attr("process.pid", {"intValue": "7"})]}
    point = {"timeUnixNano": str(t_ns), "asDouble": value, "attributes": [_attr("device", {"stringValue": "cuda:0"})]}
    metric = {"name": "infersight.memory.allocated", "unit": "By", "gauge": {"dataPoints": [point]}}
    return json.dumps({"resourceMetrics": [{"resource": res, "scopeMetrics": [{"metrics": [metric]}]}]})


# Each: lines of a file that used to break report or show. Every file also has a good cold start.
FAULTS: dict[str, list[str]] = {
    "huge_gauge": [_gauge_line(1.7e308), _gauge_line(1.0, 2 * S + 1)],  # report looped for ever
    "inf_nan_gauges": [_gauge_line("Infinity"), _gauge_line("NaN"), _gauge_line("-Infinity"), _gauge_line(3.0)],
    "ready_1e300": [_spans_line("svc", [_attr("infersight.coldstart.ready_s", {"doubleValue": 1e300})])],
    "lone_surrogates": [_spans_line("s\ud800vc\udcff", [_attr("k\udfff", {"stringValue": "\ud83d"})])],
    "control_chars": [_spans_line("svc\x1b[2J\x00\x07\x85", [_attr("note", {"stringValue": "a\x1b]0;pwn\x07b"})])],
    "nested_lines": ["[" * 100_000 + "]" * 100_000, '{"resourceSpans": ' + "[" * 3000 + "]" * 3000 + "}",
                     # JSON reads it; an attribute this deep used to recurse past Python's limit
                     '{"resourceSpans": [{"resource": {"attributes": [{"key": "deep", "value": '
                     + '{"arrayValue": {"values": [' * 450 + "]}}" * 450 + "}]}}]}"],
}


def _strings(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list):
        return [s for x in v for s in _strings(x)]
    if isinstance(v, dict):
        return [s for k, x in v.items() for s in [k, *_strings(x)]]
    return []


def _no_controls(text: str) -> bool:
    return not any(c in text for c in ("\x00", "\x1b", "\x07", "\x85"))


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """The CLI; its timeout only stops a hang from stalling the suite (a loop for ever)."""
    return subprocess.run([*INFERSIGHT, *args], capture_output=True, timeout=120, cwd=cwd, check=False)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_report_and_show_skip_count_and_never_crash(fault: str, tmp_path: Path) -> None:
    src = tmp_path / "hostile.otlp.jsonl"
    lines = [*FAULTS[fault], _spans_line("good-svc", trace="cd" * 16)]
    src.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))  # raw surrogates too
    p = _run("report", str(src), cwd=tmp_path)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr.decode(errors="replace")[-3000:]
    page = (tmp_path / "hostile.html").read_bytes()
    text = page.decode("utf-8")  # strict: valid UTF-8
    assert _no_controls(text) and "good-svc" in text
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    if fault in ("inf_nan_gauges", "nested_lines"):
        assert b"skipped" in p.stderr and 'class="skipped"' in text  # said, and on the page
    for fmt in ("text", "json", "chrome-trace"):
        p = _run("show", "--format", fmt, str(src), cwd=tmp_path)
        assert p.returncode == 0 and b"Traceback" not in p.stderr, (fmt, p.stderr.decode(errors="replace")[-3000:])
        out = p.stdout.decode("utf-8")
        assert _no_controls(out), fmt
        if fmt != "text":
            assert "\\ud8" not in out.lower() and "\\udc" not in out.lower() and "\\udf" not in out.lower(), fmt
            for s in _strings(json.loads(out)):
                s.encode("utf-8")
    if fault == "ready_1e300":
        wf = json.loads(_run("show", "--format", "json", str(src), cwd=tmp_path).stdout)["coldstarts"][0]
        assert wf["ready_s"] is None and not [m for m in wf["marks"] if m["label"] == "ready"]


@needs_chromium
def test_a_page_of_hostile_strings_renders_as_plain_text_in_chromium(tmp_path: Path) -> None:
    assert CHROMIUM is not None
    src = tmp_path / "ctl.otlp.jsonl"
    src.write_bytes((FAULTS["control_chars"][0] + "\n" + _spans_line("s\ud800vc\udcff", trace="ef" * 16) + "\n")
                    .encode("utf-8", "surrogatepass"))
    assert _run("report", str(src), cwd=tmp_path).returncode == 0
    dom, requests, violations = render(tmp_path / "ctl.html", tmp_path)
    assert not requests and not violations
    assert "svc\ufffd[2J" in dom and "s\ufffdvc\ufffd" in dom
    assert _no_controls(dom)


def test_a_non_utf8_script_name_under_launch_reads_back(tmp_path: Path) -> None:
    script = os.fsencode(str(tmp_path)) + b"/\xff\x1bserve.py"
    with open(script, "w") as f:
        f.write("import time\ntime.sleep(0.1)\n")
    out = tmp_path / "launch.otlp.jsonl"
    p = subprocess.run([*INFERSIGHT, "launch", "--otlp-file", str(out), "--no-console", "--", sys.executable,
                        script], capture_output=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr.decode(errors="replace")[-2000:]
    for args in (["show", str(out)], ["show", "--format", "json", str(out)], ["report", str(out)]):
        r = _run(*args, cwd=tmp_path)
        assert r.returncode == 0 and b"Traceback" not in r.stderr, (args, r.stderr.decode(errors="replace"))
        r.stdout.decode("utf-8")
    assert "\ufffd\ufffdserve.py" in (tmp_path / "launch.html").read_text()


# -- size bounds -----------------------------------------------------------------------------------


def _coldstarts(n: int) -> list[SpanItem]:
    rng = random.Random(7)
    out = []
    for i in range(n):
        res = Resource.of({"service.name": "svc", "process.pid": 10_000 + i})
        base = i * 10 * S
        total = rng.randrange(1, 5000) * S // 1000
        out.append(SpanItem(res, "%032x" % i, "%016x" % (2 * i + 1), None, "coldstart", base, base + total, {}))
        out.append(SpanItem(res, "%032x" % i, "%016x" % (2 * i + 2), "%016x" % (2 * i + 1), "coldstart.warmup",
                            base, base + total // 2, {"infersight.stage": "warmup"}))
    return out


def test_past_the_bound_the_page_draws_the_slowest_and_lists_the_rest(tmp_path: Path) -> None:
    n = 3000
    spans = _coldstarts(n)
    src = tmp_path / "many.otlp.jsonl"
    src.write_text(traces_request(spans) + "\n")
    p = _run("report", str(src), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "many.html").read_text()
    drawn = html.count('<svg class="chart wf"')
    assert drawn == report_html.MAX_WATERFALLS
    slowest = sorted((s for s in spans if s.name == "coldstart"), key=lambda s: s.start_ns - s.end_ns)
    want = {str(s.resource.get("process.pid")) for s in slowest[: report_html.MAX_WATERFALLS]}
    got = {part.split('"', 1)[0] for part in html.split('<div class="proc" data-pid="')[1:]}
    assert got == want
    assert html.count('<tr class="slow-row">') == report_html.MAX_LISTED
    assert "%d more cold starts not listed" % (n - report_html.MAX_LISTED) in html
    assert "%d cold starts: this page draws the %d slowest" % (n, report_html.MAX_WATERFALLS) in html
    assert len(html.encode()) < 2_000_000  # 30k cold starts made 168 MB
    # Under the bound: every cold start drawn, no summary.
    few = tmp_path / "few.otlp.jsonl"
    few.write_text(traces_request(spans[: 2 * 10]) + "\n")
    assert _run("report", str(few), cwd=tmp_path).returncode == 0
    page = (tmp_path / "few.html").read_text()
    assert page.count('<svg class="chart wf"') == 10 and 'class="bound"' not in page


def test_ooms_past_the_bound_are_counted_not_listed(tmp_path: Path) -> None:
    res = Resource.of({"service.name": "svc", "process.pid": 7})
    logs = [LogItem(res, S + i * 1000, 17, "ERROR", "CUDA out of memory %d" % i,
                    {"infersight.oom.class": "capacity", "infersight.oom.rule": "r"}, event_name="oom")
            for i in range(report_html.MAX_OOM_ROWS + 50)]
    src = tmp_path / "ooms.otlp.jsonl"
    src.write_text(logs_request(logs) + "\n")
    assert _run("report", str(src), cwd=tmp_path).returncode == 0
    html = (tmp_path / "ooms.html").read_text()
    assert html.count('<tr class="oom-row"') == report_html.MAX_OOM_ROWS
    assert "50 more OOMs not listed" in html


# -- chrome-trace lanes ----------------------------------------------------------------------------


def _trace_of(intervals: list[tuple[int, int]]) -> dict[str, Any]:
    res = Resource.of({"service.name": "svc", "process.pid": 7})
    t = Telemetry()
    t.spans = [SpanItem(res, TRACE, "%016x" % (i + 1), None, "coldstart.step", s, e, {})
               for i, (s, e) in enumerate(intervals)]
    return chrome_trace(t)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=60))
def test_every_lane_nests_for_any_overlap(raw: list[tuple[int, int]]) -> None:
    intervals = [(min(a, b) * 1000, max(a, b) * 1000) for a, b in raw]
    trace = _trace_of(intervals)
    events = complete_events(trace)
    assert len(events) == len(intervals)
    check_nesting(events)


def test_spans_that_all_overlap_get_one_lane_each_and_nested_ones_share() -> None:
    n = 2000
    staircase = [(i * 1000, (n + i) * 1000) for i in range(n)]  # each overlaps all, none nests
    events = complete_events(_trace_of(staircase))
    check_nesting(events)
    assert len({e["tid"] for e in events}) == n
    nested = [(i * 1000, (2 * n - i) * 1000) for i in range(n)]  # each inside the one before
    events = complete_events(_trace_of(nested))
    assert {e["tid"] for e in events} == {7}
