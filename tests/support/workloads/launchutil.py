"""Helpers for the cold-start tests: run a workload under ``infersight launch``, read spans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from short_tmp import short_tmpdir

from infersight.agent.commands.show import coldstarts, spans_from_lines
from infersight.telemetry import SpanItem

HERE = os.path.dirname(os.path.abspath(__file__))
INFERSIGHT = [os.path.join(os.path.dirname(sys.executable), "infersight")]


@dataclass
class LaunchRun:
    rc: int
    output: str
    spans: list[SpanItem]
    result: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def roots(self) -> list[SpanItem]:
        return [s for s in self.spans if s.name == "coldstart"]

    def root_of(self, pid: int) -> SpanItem:
        found = [r for r in self.roots() if r.resource.get("process.pid") == pid]
        assert len(found) == 1, "expected one coldstart root for pid %d, got %r" % (pid, found)
        return found[0]

    def stages(self, root: SpanItem) -> list[SpanItem]:
        for cs in coldstarts(self.spans):
            if cs.root.span_id == root.span_id:
                return cs.stages
        raise AssertionError("no stages for root")


def launch(tmp: str, argv: list[str], *flags: str, result: bool = True, timeout: float = 300,
           env: dict[str, str] | None = None) -> LaunchRun:
    otlp = os.path.join(tmp, "out.otlp.jsonl")
    res_path = os.path.join(tmp, "result.json")
    cmd = [*INFERSIGHT, "launch", "--otlp-file", otlp, *flags, "--", *argv]
    if result:
        cmd.append(res_path)
    e = dict(os.environ)
    # launch replays the leftover directories of dead launches (same uid) in $TMPDIR into its
    # output: a test's own TMPDIR keeps other tests' and other runs' leftovers out of it
    # (short: the socket path must fit AF_UNIX's 108 bytes)
    tmpdir = short_tmpdir(tmp)
    e.update({"XDG_CACHE_HOME": os.path.join(tmp, "cache"), "INFERSIGHT_MEASURE_STORAGE": "0", "TMPDIR": tmpdir})
    e.update(env or {})
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=e)
    wall = time.monotonic() - t0
    try:
        os.rmdir(tmpdir)  # empty unless launch kept a directory for a later replay
    except OSError:
        pass
    with open(otlp, encoding="utf-8") as f:
        spans = spans_from_lines(f.readlines())
    data: dict[str, Any] = {}
    if result and os.path.exists(res_path):
        with open(res_path, encoding="utf-8") as f:
            data = json.load(f)
    return LaunchRun(p.returncode, p.stdout + p.stderr, spans, data, wall)


def stage_name(s: SpanItem) -> str:
    return str(s.attributes.get("infersight.stage"))


def assert_well_formed(root: SpanItem, stages: list[SpanItem]) -> None:
    """Names, nesting under the root, no negative durations, no overlap unless nested. A root
    that ended at readiness may be followed by its first request (and what nests in it), which
    then lies wholly after the root."""
    by_id = {s.span_id: s for s in stages}
    at_ready = root.attributes.get("infersight.coldstart.ended_by") == "ready"

    def after_root(s: SpanItem) -> bool:
        cur: SpanItem | None = s
        while cur is not None:
            if cur.parent_span_id == root.span_id:
                return at_ready and cur.start_ns >= root.end_ns
            cur = by_id.get(cur.parent_span_id or "")
        return False

    for s in stages:
        assert s.name == "coldstart." + stage_name(s), s.name
        assert s.trace_id == root.trace_id
        assert s.end_ns >= s.start_ns, "negative duration: %s" % s.name
        if after_root(s):
            assert s.start_ns >= root.end_ns, "%s straddles the root's end" % s.name
        else:
            assert s.start_ns >= root.start_ns and s.end_ns <= root.end_ns, "%s outside the root" % s.name
        parent = by_id.get(s.parent_span_id or "")
        if parent is not None:
            assert parent.start_ns <= s.start_ns and s.end_ns <= parent.end_ns, "%s outside its parent" % s.name
        else:
            assert s.parent_span_id == root.span_id, "%s does not descend from the root" % s.name

    def ancestors(s: SpanItem) -> set[str]:
        out, cur = set(), s
        while cur.parent_span_id in by_id:
            cur = by_id[cur.parent_span_id]
            out.add(cur.span_id)
        return out

    for i, a in enumerate(stages):
        for b in stages[i + 1:]:
            overlap = min(a.end_ns, b.end_ns) - max(a.start_ns, b.start_ns)
            if overlap > 0:
                assert a.span_id in ancestors(b) or b.span_id in ancestors(a), (
                    "%s and %s overlap by %d ns without nesting" % (a.name, b.name, overlap))
