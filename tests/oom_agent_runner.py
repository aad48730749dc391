"""``infersight agent --config PATH`` with the OOM handlers installed, as a subprocess.

    python tests/oom_agent_runner.py CONFIG

Builds the agent exactly as ``_cmd_agent`` does (config file, exporters from it), adds
``agent.oom_kind.install`` and runs ``serve_forever()`` (SIGHUP reloads, SIGTERM stops).
Until the lead wires ``oom_kind.install`` into ``_cmd_agent``, this is the daemon with it.
"""

from __future__ import annotations

import asyncio
import logging
import sys


def main(argv: list[str]) -> int:
    from infersight.agent import config as cfg
    from infersight.agent import oom_kind
    from infersight.agent.daemon import Agent
    from infersight.agent.sinks import build_exporters

    conf = cfg.load(argv[0], require_file=True)
    logging.basicConfig(level=conf["agent.log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> int:
        agent = Agent(conf, build_exporters(conf))
        oom_kind.install(agent, conf)
        return await agent.serve_forever()

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
