"""A real agent process with the MQTT exporter, for the last-will test.

    python tests/mqtt_agent_runner.py ROOT URL HOST [--embedded]

Builds ``Agent(config, [MqttExporter(...)])`` with its socket and spools under ROOT and
runs ``serve_forever()`` (SIGTERM stops it cleanly). Until ``infersight agent --config``
builds the MQTT exporter from the config file, this is the daemon as a subprocess.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys


def main(argv: list[str]) -> int:
    root, url, host = argv[:3]
    embedded = "--embedded" in argv[3:]
    from infersight.agent import config as cfg
    from infersight.agent.daemon import Agent
    from infersight.exporters.mqtt import MqttExporter

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    conf = cfg.load(
        None,
        env={},
        flags={
            "agent.socket": os.path.join(root, "agent.sock"),
            "agent.spool_dir": os.path.join(root, "spool"),
            "agent.host_name": host,
            "agent.health_interval_s": 3600.0,
        },
    )

    async def run() -> int:
        exporter = MqttExporter(url, host_name=host, embedded=embedded, reconnect_max_s=1.0)
        agent = Agent(conf, [exporter], embedded=embedded)
        return await agent.serve_forever()

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
