"""Cold starts as an agent extension: live progress with ETAs and history, and fleet metrics.

The tracker watches every published batch; a job publishes its updates (on each stage
change, and at most once a second per service); the status reply lists the processes in
their cold start under ``coldstarts``. At shutdown, what still shows as warming is cleared.

Each finished cold start feeds :class:`~infersight.agent.coldstart.metrics.ColdStartMetrics`,
whose snapshot goes out in the cold start's own batch, right after its summary (the MQTT
payload and ``launch`` read them together); on each heartbeat the services that did not start
for a while are re-sent, so the series of rarely starting services stay live.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from infersight.agent.coldstart.metrics import ColdStartMetrics
from infersight.agent.coldstart.progress import ProgressTracker, history_path_from
from infersight.agent.daemon.assemble import KindHandler
from infersight.agent.daemon.extension import AgentContext, Apply
from infersight.settings import Config

PROGRESS_TICK_S = 0.2


class ColdStartExtension:
    name = "coldstart"
    live_keys: frozenset[str] = frozenset()  # agent.state_dir applies at the next restart

    def __init__(self, config: Config) -> None:
        self.tracker = ProgressTracker(history_path_from(config.get("agent.state_dir")))
        self.metrics = ColdStartMetrics()  # per service, across producers
        self._agent: AgentContext | None = None

    def kinds(self) -> Mapping[str, KindHandler]:
        return {}

    async def start(self, agent: AgentContext) -> None:
        self._agent = agent
        self.tracker.producer_info = agent.producer_info
        agent.observe(self.tracker.observe)
        agent.on_coldstart(self.metrics.observe)
        agent.on_heartbeat(lambda: agent.broadcaster.publish(self.metrics.due(time.time_ns())))
        agent.spawn(self._publish_progress(agent), "coldstart-progress")

    async def _publish_progress(self, agent: AgentContext) -> None:
        while True:
            await asyncio.sleep(PROGRESS_TICK_S)
            updates = self.tracker.tick()
            if updates:
                agent.broadcaster.publish(updates)

    def reload(self, config: Config) -> Apply | None:
        return None

    def health(self) -> Mapping[str, Any]:
        return {"coldstarts": self.tracker.snapshot(), "coldstarts_not_tracked": self.tracker.refused_warming,
                "coldstart_history_lines_skipped": self.tracker.history.corrupt_lines}

    async def aclose(self) -> None:
        """Nothing warms any more: clear what still shows as warming."""
        self.tracker.end_all()
        if self._agent is not None:
            self._agent.broadcaster.publish(self.tracker.tick())
