"""``INFERSIGHT_MQTT_URL=... infersight launch -- CMD`` streams to a real mosquitto."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from mosquitto import Collector, Mosquitto, retained


async def test_launch_streams_coldstart_and_clears_its_presence(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path / "mq").start()
    host = "launch-host"
    try:
        async with Collector(broker, "infersight/#") as sub:
            env = dict(os.environ, INFERSIGHT_MQTT_URL=broker.url, INFERSIGHT_HOST_NAME=host)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "infersight", "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"),
                "--", sys.executable, "-c", "from infersight import hooks\nwith hooks.stage('load'):\n    pass\n",
                env=env, stderr=asyncio.subprocess.PIPE)
            _out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()
            topic = "infersight/%s/coldstart" % host
            assert await sub.wait_for(lambda: sub.on(topic), 10), [m.topic for m in sub.messages]
            msg = sub.on(topic)[0]
            payload = msg.json()
            assert payload["schema"] >= 1 and payload["root"]["name"] == "coldstart"
            assert "coldstart.load" in [s["name"] for s in payload["stages"]]
            presence = "infersight/%s/launch/%d/status" % (host, proc.pid)
            seen = [m.payload for m in sub.on(presence)]
            assert b"online" in seen
        # A clean exit clears the launch's retained presence.
        assert await retained(broker, "infersight/%s/launch/%d/status" % (host, proc.pid)) in (None, b"")
    finally:
        broker.stop()
    assert json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])
