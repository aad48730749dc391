"""Property test: an OTLP file with any part replaced by junk still gives a page, a trace and
the waterfall JSON, never an exception. The base file is what the agent's real code exports
(tests/support/report_data.py, FAKE device readings)."""

from __future__ import annotations

import copy
import json
from typing import Any

import report_data as rd
from hypothesis import given, settings
from hypothesis import strategies as st

from infersight.agent.report.html import render
from infersight.agent.report.page import build
from infersight.agent.report.parse import parse_lines
from infersight.agent.report.trace import dumps, waterfall_json
from infersight.exporters.otlp_json import encode_lines
from infersight.telemetry import LogItem, MetricItem, SpanItem

KEEP_METRICS = {"infersight.memory.allocated", "hw.gpu.memory.usage", "hw.gpu.memory.limit",
                "infersight.device.throttle", "infersight.request.duration", "infersight.device.coefficient",
                "hw.errors"}


def _base() -> list[dict[str, Any]]:
    items = rd.gpu_items(1_800_000_000_000_000_000)
    small = [i for i in items if isinstance(i, (SpanItem, LogItem))
             or (isinstance(i, MetricItem) and i.name in KEEP_METRICS)][:60]
    return [json.loads(line) for line in encode_lines(small)]


BASE = _base()
junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-(2**70), 2**70).map(str)
    | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=6,
)


def replace_at(doc: Any, path: list[int], value: Any) -> Any:
    """Replace the node that ``path`` picks (each step an index into the children) by ``value``."""
    if not path:
        return value
    cur = doc
    for n, step in enumerate(path):
        keys = list(cur.keys()) if isinstance(cur, dict) else list(range(len(cur))) if isinstance(cur, list) else []
        if not keys:
            return doc
        k = keys[step % len(keys)]
        if n == len(path) - 1 or not isinstance(cur[k], (dict, list)):
            cur[k] = value
            return doc
        cur = cur[k]
    return doc


@given(st.integers(0, len(BASE) - 1), st.lists(st.integers(0, 50), min_size=1, max_size=12), junk)
@settings(max_examples=80, deadline=None)
def test_junk_anywhere_never_raises(line: int, path: list[int], value: Any) -> None:
    docs = copy.deepcopy(BASE)
    docs[line] = replace_at(docs[line], path, value)
    lines = [json.dumps(d) + "\n" for d in docs]
    t = parse_lines(lines, "fuzz")
    page = render(build(t), ["fuzz"])
    assert page.startswith("<!doctype html>") and page.endswith("</html>\n")
    rd.chrome_trace(t)
    json.loads(dumps(waterfall_json(build(t).families)))


def test_times_past_int64_are_skipped_not_fatal() -> None:
    """Regression: a time of 10^30 ns once reached time.gmtime and raised OverflowError."""
    text = json.dumps(BASE)
    for big in (str(10**30), str(2**64), "1e300"):
        docs = json.loads(text.replace('"timeUnixNano": "', '"timeUnixNano": "%s", "was": "' % big)
                          .replace('"startTimeUnixNano": "', '"startTimeUnixNano": "%s", "was": "' % big))
        t = parse_lines([json.dumps(d) + "\n" for d in docs], "big")
        assert not t.spans and not t.samples and not t.logs
        assert t.skipped and all("time out of range" in s or "not an integer" in s for s in t.skipped), t.skipped[:3]
        render(build(t), ["big"])


def test_a_pid_that_is_no_pid_gets_a_synthetic_one_in_the_trace() -> None:
    """Regression (found by the property test above): a process.pid of 2**63 reached the trace's
    64-bit arrays and raised OverflowError; a negative one or one past PID_MAX_LIMIT is no PID either."""
    text = json.dumps(BASE)
    assert '{"key": "process.pid", "value": {"intValue": "424242"}}' in text
    for bad in (2**63, 2**40, -7):
        docs = json.loads(text.replace('"intValue": "424242"', '"intValue": "%d"' % bad))
        t = parse_lines([json.dumps(d) + "\n" for d in docs], "pid")
        pids = {e["pid"] for e in rd.chrome_trace(t)["traceEvents"] if "pid" in e}
        assert pids and bad not in pids and all(0 <= p < 2**31 for p in pids)
    t = parse_lines([json.dumps(d) + "\n" for d in BASE], "pid")
    assert 424242 in {e["pid"] for e in rd.chrome_trace(t)["traceEvents"] if "pid" in e}
