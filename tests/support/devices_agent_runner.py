"""Helpers for the device tests: a real ``infersight agent --config`` process (the device
job is part of every agent), and readers for what it exported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any


def write_config(root: Path, extra: str, agent_keys: str = "") -> Path:
    """The agent's config file: its socket and spool under ``root``, ``agent_keys`` (lines)
    added to ``[agent]``, then the sections of ``extra``."""
    conf = root / "infersight.toml"
    conf.write_text(
        "[agent]\n"
        f'socket = "{root / "agent.sock"}"\n'
        f'spool_dir = "{root / "spool"}"\n'
        "health_interval_s = 0.5\n"
        "shutdown_timeout_s = 10\n" + agent_keys
        + "[exporters.file]\n"
        f'path = "{root / "out.otlp.jsonl"}"\n' + extra
    )
    return conf


def start_agent(root: Path, env: dict[str, str], extra: str, agent_keys: str = "") -> subprocess.Popen[bytes]:
    conf = write_config(root, extra, agent_keys)
    env = {k: v for k, v in env.items() if not k.startswith(("INFERSIGHT_", "OTEL_EXPORTER_OTLP"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "infersight", "agent", "--config", str(conf)],
        stdout=open(root / "agent.log", "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env=env,
    )
    if not _wait_for((root / "agent.sock").exists, 15):
        proc.kill()
        raise AssertionError((root / "agent.log").read_text())
    return proc


def metric_points(lines: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    out = []
    for req in lines:
        for rm in req.get("resourceMetrics", []):
            for sm in rm["scopeMetrics"]:
                for m in sm["metrics"]:
                    if m["name"] == name:
                        body = m.get("gauge") or m.get("sum") or m.get("histogram") or {}
                        out += body.get("dataPoints", [])
    return out


def value(p: dict[str, Any]) -> float:
    return float(p["asDouble"]) if "asDouble" in p else float(p["asInt"])


def _wait_for(pred: Any, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())
