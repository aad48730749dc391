"""A hooked program that execs another in the same process (Ray's `runtime_env` worker
start: `setup_worker.py` execs `bash -c "exec python default_worker.py"`; shell wrappers
that `exec python`). The pid and its fork time stay; each program gets its own cold start,
the new one from the exec, nested under the first. Real launch, real agent, real bash."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import attr, read_otlp_lines, spans

CLI = [sys.executable, "-m", "infersight"]

FIRST = """
import os, sys, time
t = time.monotonic()
while time.monotonic() - t < 0.4:
    pass
os.execvp("bash", ["bash", "-c", "exec %s %s" % (sys.executable, sys.argv[1])])
"""

SECOND = """
import time
t = time.monotonic()
while time.monotonic() - t < 0.3:
    pass
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_an_execd_program_starts_its_cold_start_at_the_exec(tmp_path: Path) -> None:
    (tmp_path / "first.py").write_text(FIRST)
    (tmp_path / "second.py").write_text(SECOND)
    out = tmp_path / "out.otlp.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INFERSIGHT", "TRACEPARENT"))}
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(out), "--", sys.executable,
                        str(tmp_path / "first.py"), str(tmp_path / "second.py")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    got = spans(read_otlp_lines(out))
    roots = sorted((s for s in got if s["name"] == "coldstart"), key=lambda s: int(s["startTimeUnixNano"]))
    assert len(roots) == 2, [(s["name"], attr(s, "infersight.coldstart.ended_by")) for s in roots]
    first, second = roots
    assert second["traceId"] == first["traceId"] and second.get("parentSpanId") == first["spanId"]
    first_end = max(int(s["endTimeUnixNano"]) for s in got if s["traceId"] == first["traceId"]
                    and s.get("parentSpanId") == first["spanId"] and s is not second)
    # The second program's root begins at the exec: after everything the first one did (its
    # 0.4 s of work, explained by its samples), not at the fork that both programs share.
    assert int(second["startTimeUnixNano"]) >= first_end - 20_000_000
    assert attr(second, "infersight.coldstart.ended_by") == "exit"
    kids = [s for s in got if s.get("parentSpanId") == second["spanId"]]
    assert any(s["name"] == "coldstart.unattributed" for s in kids), [(s["name"], s.get("parentSpanId")) for s in got]
    assert all(int(s["startTimeUnixNano"]) >= int(second["startTimeUnixNano"]) for s in kids)
