"""``infersight doctor`` on this CPU-only machine: passes, and says what is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "infersight", "doctor", *args], capture_output=True, text=True,
                          timeout=120, env=e)


def test_doctor_passes_without_gpu_and_says_why(tmp_path: Path) -> None:
    r = run("--json", env={"INFERSIGHT_SPOOL_DIR": str(tmp_path / "spool"),
                           "INFERSIGHT_SOCKET": str(tmp_path / "none.sock"), "LD_LIBRARY_PATH": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["launch_ok"] is True and checks["launch"]["status"] == "ok"
    assert checks["nvml"]["status"] == "warn" and "NVMLError_LibraryNotFound" in checks["nvml"]["detail"]
    assert checks["cuda"]["status"] == "warn" and "CUDA is not compiled in" in checks["cuda"]["detail"]
    assert checks["agent"]["status"] == "warn"


def test_doctor_reports_unreachable_collector_as_warning(tmp_path: Path) -> None:
    r = run(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "INFERSIGHT_SPOOL_DIR": str(tmp_path)})
    assert r.returncode == 0
    assert "unreachable" in r.stdout and "launch can run here." in r.stdout


def test_doctor_asks_whether_otlp_is_requested_as_the_agent_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from infersight.agent.commands.doctor import check_exporters
    from infersight.agent.daemon import config as cfg

    for k in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(k)
    assert "not configured" in check_exporters(cfg.load(None, env={}))[0].detail
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces")
    assert "per-signal endpoints" in check_exporters(cfg.load(None, env={}))[0].detail
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert "not configured" in check_exporters(cfg.load(None, env={}))[0].detail
