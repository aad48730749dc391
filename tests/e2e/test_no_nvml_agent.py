"""An agent with the device job and no NVML library at all: it starts, reports
NVMLError_LibraryNotFound once (log, ``infersight status --json``, the
``infersight.nvml.available`` health metric), keeps running and still histograms requests."""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import attr, hook_env, read_otlp_lines, wait_for
from devices_agent_runner import metric_points, start_agent, value

REASON = "NVMLError_LibraryNotFound: NVML Shared Library Not Found"
CHILD = textwrap.dedent(
    """
    from infersight import hooks
    from infersight.hooks._request import request
    for i in range(30):
        with request(device="cpu", model="tiny", request_class="b1"):
            pass
        with request(device="cuda:0", model="tiny", request_class="b1"):
            pass
    print("flushed", hooks.flush(10))
    """
)


def _real_nvml_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_agent_without_nvml(tmp_path: Path) -> None:
    if _real_nvml_present():
        pytest.skip("a real libnvidia-ml.so.1 is installed on this host")
    import os

    env = dict(os.environ)
    (tmp_path / "empty").mkdir()
    env["LD_LIBRARY_PATH"] = str(tmp_path / "empty")
    extra = "[nvml]\ninterval_s = 0.1\n[devices]\nevaluate_interval_s = 0.3\n"
    agent = start_agent(tmp_path, env, extra)
    out = tmp_path / "out.otlp.jsonl"
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD], env=hook_env(tmp_path / "agent.sock", tmp_path / "spool"),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert "flushed True" in child.stdout, child.stdout + child.stderr

        def seen() -> bool:
            if not out.exists():
                return False
            lines = read_otlp_lines(out)
            return bool(metric_points(lines, "infersight.nvml.available")) and any(
                int(p["count"]) == 30 for p in metric_points(lines, "infersight.request.duration")
            )

        assert wait_for(seen, 15, 0.1), (tmp_path / "agent.log").read_text()
        time.sleep(1.0)  # several sampling intervals and health reports later ...
        assert agent.poll() is None  # ... still running
        cli = subprocess.run(
            [sys.executable, "-m", "infersight", "status", "--json", "--socket", str(tmp_path / "agent.sock")],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stdout + cli.stderr
        health = json.loads(cli.stdout)
        assert health["healthy"] is True
        assert health["nvml"]["available"] is False
        assert health["nvml"]["reason"] == REASON
        assert health["nvml"]["devices"] == 0
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(20) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(5)
    log = (tmp_path / "agent.log").read_text()
    assert log.count("NVMLError_LibraryNotFound") == 1, log
    assert "Traceback" not in log
    lines = read_otlp_lines(out)
    avail = metric_points(lines, "infersight.nvml.available")
    assert len(avail) >= 3  # reported with every health export
    assert {(value(p), attr(p, "infersight.nvml.reason")) for p in avail} == {(0.0, REASON)}
    assert not metric_points(lines, "hw.gpu.utilization")
    hist = {attr(p, "infersight.device"): p for p in metric_points(lines, "infersight.request.duration")}
    assert set(hist) == {"cpu", "cuda:0"}
    assert attr(hist["cuda:0"], "hw.id") is None  # unresolved without NVML or torch
    assert attr(hist["cpu"], "infersight.request.class") == "b1"
    assert not metric_points(lines, "infersight.device.coefficient")  # cpu and cuda are not peers
