"""The daemon's MQTT status topic with a real mosquitto and the real ``infersight agent``
process: "online" once connected, the broker's last will "offline" when the process is
SIGKILLed, "online" again after a restart, and "offline" from the agent on a clean stop
(the exporter in-process against the broker: tests/integration/test_mqtt_broker.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mosquitto import Collector, Mosquitto, retained, running_broker


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with running_broker(tmp_path / "mosquitto") as b:
        yield b


async def test_last_will_on_sigkill_and_online_after_restart(broker: Mosquitto, tmp_path: Path) -> None:
    host = "lw-host"
    status = "infersight/%s/status" % host

    root = tmp_path / "agent"
    root.mkdir()
    config = root / "infersight.toml"  # the real daemon, MQTT from its config file
    config.write_text(
        f'[agent]\nsocket = "{root / "agent.sock"}"\nspool_dir = "{root / "spool"}"\n'
        f'host_name = "{host}"\nhealth_interval_s = 3600\n[exporters.mqtt]\nurl = "{broker.url}"\n'
    )

    def spawn() -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT_", "OTEL_EXPORTER_OTLP"))}
        return subprocess.Popen([sys.executable, "-m", "infersight", "agent", "--config", str(config)], env=env,
                                stdout=open(tmp_path / "agent.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115

    async with Collector(broker, status) as sub:
        proc = spawn()
        try:
            assert await sub.wait_for(lambda: [m.payload for m in sub.messages][-1:] == [b"online"], 20), (
                tmp_path / "agent.log").read_text()
            n = len(sub.messages)
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
            assert await sub.wait_for(lambda: len(sub.messages) > n, 5)
            assert sub.messages[n].payload == b"offline"  # the last will, first thing after the kill
            assert await retained(broker, status) == b"offline"
            proc = spawn()
            assert await sub.wait_for(lambda: sub.messages[-1].payload == b"online", 20)
            assert await retained(broker, status) == b"online"
            proc.send_signal(signal.SIGTERM)  # clean stop: offline by the agent itself
            assert proc.wait(15) == 0
            assert await retained(broker, status) == b"offline"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
