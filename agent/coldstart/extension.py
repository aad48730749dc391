"""Cold-start progress as an agent extension: the live tracker, its ETAs and the history.

The tracker watches every published batch; a job publishes its updates (on each stage
change, and at most once a second per service); the status reply lists the processes in
their cold start under ``coldstarts``. At shutdown, what still shows as warming is cleared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from infersight.agent.coldstart.progress import ProgressTracker, history_path_from
from infersight.agent.daemon.assemble import KindHandler
from infersight.agent.daemon.extension import AgentContext, Apply
from infersight.settings import Config

PROGRESS_TICK_S = 0.2


class ColdStartExtension:
    name = "coldstart"

    def __init__(self, config: Config) -> None:
        # agent.state_dir applies at the next restart: a reload has nothing to swap here.
        self.tracker = ProgressTracker(history_path_from(config.get("agent.state_dir")))
        self._agent: AgentContext | None = None

    def kinds(self) -> Mapping[str, KindHandler]:
        return {}

    async def start(self, agent: AgentContext) -> None:
        self._agent = agent
        self.tracker.producer_info = agent.producer_info
        agent.observe(self.tracker.observe)
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
        return {"coldstarts": self.tracker.snapshot()}

    async def aclose(self) -> None:
        """Nothing warms any more: clear what still shows as warming."""
        self.tracker.end_all()
        if self._agent is not None:
            self._agent.broadcaster.publish(self.tracker.tick())
