"""A real agent process with the device job installed, for the device tests.

    python tests/devices_agent_runner.py CONFIG.toml

Builds the exporters from the config file, then ``Agent(config, exporters)`` and
``devices_job.install(agent, config)``, and runs ``serve_forever()`` (SIGTERM stops it
cleanly). It is what ``infersight agent --config`` does once the CLI calls ``install``.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).resolve()


def write_config(root: Path, extra: str) -> Path:
    conf = root / "infersight.toml"
    conf.write_text(
        "[agent]\n"
        f'socket = "{root / "agent.sock"}"\n'
        f'spool_dir = "{root / "spool"}"\n'
        "health_interval_s = 0.5\n"
        "shutdown_timeout_s = 10\n"
        "[exporters.file]\n"
        f'path = "{root / "out.otlp.jsonl"}"\n' + extra
    )
    return conf


def start_agent(root: Path, env: dict[str, str], extra: str) -> subprocess.Popen[bytes]:
    conf = write_config(root, extra)
    env = dict(env)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), str(conf)],
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


def main(argv: list[str]) -> int:
    from infersight.agent import config as cfg
    from infersight.agent.daemon import Agent
    from infersight.agent.devices_job import install
    from infersight.agent.sinks import build_exporters

    conf = cfg.load(argv[0], env={}, require_file=True)
    logging.basicConfig(level=conf["agent.log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> int:
        agent = Agent(conf, build_exporters(conf, env={}))
        install(agent, conf)
        return await agent.serve_forever()

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
