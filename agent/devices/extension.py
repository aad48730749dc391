"""Device telemetry as an agent extension: NVML sampling, Xid/ECC events and slow-device verdicts.

It runs the :class:`~infersight.agent.devices.job.DeviceJob` beside ingest, over the request
statistics the commands hand it (:class:`~infersight.latency.RequestWindows`, the requests
extension's); a reload validates the ``[nvml]`` and ``[devices]`` sections and the
``devices.rules`` file, and swaps its thresholds only when the whole reload is valid. NVML's
health is its own: the status reply shows NVML's state and the slow devices under ``nvml``,
and while device sampling is off each heartbeat of the agent carries the
``infersight.nvml.available`` metric (value 0, with the reason).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infersight.agent.daemon.extension import AgentContext, Apply, Extension
from infersight.agent.devices.job import DeviceJob
from infersight.agent.devices.settings import load_thresholds, parse_config
from infersight.latency import RequestWindows
from infersight.rules.device_rules import DeviceThresholds
from infersight.settings import Config


def _shipped_thresholds() -> DeviceThresholds:
    return load_thresholds(None)


class DevicesExtension(Extension):
    name = "devices"
    live_keys: frozenset[str] = frozenset({"devices.rules"})

    def __init__(self, config: Config, requests: RequestWindows, env: Mapping[str, str] | None = None) -> None:
        """Raises ConfigError (naming the key and file:line) on a bad ``nvml.*`` / ``devices.*``
        value or rule file."""
        self._env = env
        c = parse_config(config, env)
        # A user's rule file is checked now (file:line); the shipped one (CI checks it) at first use.
        thresholds = load_thresholds(c.rules) if c.rules is not None else _shipped_thresholds
        self.job = DeviceJob(
            interval_s=c.interval_s, enabled=c.enabled, proc_root=c.proc_root, thresholds=thresholds,
            requests=requests, evaluate_interval_s=c.evaluate_interval_s, window_s=c.window_s,
            export_interval_s=c.export_interval_s,
        )  # fmt: skip

    async def start(self, agent: AgentContext) -> None:
        agent.on_heartbeat(self.job.publish_health)
        agent.spawn(self.job.run(agent), "devices-job")

    def reload(self, config: Config) -> Apply | None:
        thresholds = load_thresholds(parse_config(config, self._env).rules)

        def apply() -> None:
            self.job.thresholds = thresholds

        return apply

    def health(self) -> Mapping[str, Any]:
        return {"nvml": self.job.health()}

    async def aclose(self) -> None:
        await self.job.aclose()
