"""A real Ray driver whose task Ray's memory monitor kills, under ``infersight launch``.

Ray's raylet kills a worker when the node's host memory use crosses ``RAY_memory_usage_threshold``;
set to 5% here, any task on this machine crosses it, and ``ray.get`` raises Ray's own
``OutOfMemoryError`` (the format of the Ray release installed, not a copied text). The hooks
report the uncaught exception, and the launch's agent classifies it with ``ray.memory-monitor``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import attr, log_records, read_otlp_lines
from short_tmp import short_tmpdir

CLI = [sys.executable, "-m", "infersight"]

DRIVER = """
import time, ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote(max_retries=0)
def hold():
    block = bytearray(64 << 20)
    time.sleep(60)
    return len(block)

print(ray.get(hold.remote()))
"""


def test_rays_memory_monitor_kill_is_classified_live(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (in the test extra)")
    out = tmp_path / "run.otlp.jsonl"
    env = dict(os.environ, RAY_memory_usage_threshold="0.05", RAY_memory_monitor_refresh_ms="100",
               RAY_USAGE_STATS_ENABLED="0", TMPDIR=short_tmpdir(str(tmp_path)))  # Ray's session: /tmp/ray else
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(out), "--", sys.executable, "-c", DRIVER],
                       capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "ray.exceptions.OutOfMemoryError" in r.stderr  # the driver's own traceback is untouched
    recs = [x for x in log_records(read_otlp_lines(out)) if x.get("eventName") == "oom"]
    (rec,) = recs  # the exception and its stderr copy are one OOM
    assert attr(rec, "infersight.oom.engine") == "ray"
    assert attr(rec, "infersight.oom.rule") == "ray.memory-monitor"
    assert attr(rec, "infersight.oom.class") == "unknown"  # a 64 MiB task is not what filled the node
    assert attr(rec, "infersight.oom.knob") == "RAY_memory_usage_threshold"
    total = int(attr(rec, "infersight.oom.T_bytes"))
    assert abs(total - os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) < total * 0.1 or total < (
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))  # the node's memory, or its cgroup's limit
