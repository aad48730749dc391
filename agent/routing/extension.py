"""Routing hints as an agent extension (off by default: ``[routing] enabled``).

When enabled it serves HAProxy's agent-check on ``routing.host:routing.agent_check_port``
(127.0.0.1:9465; port 0 picks a free one, shown in ``status --json`` as
``routing.agent_check_port``) and publishes a :class:`~infersight.telemetry.RoutingHint`
per serving instance when its hint changes: Prometheus shows it as
``infersight_routing_weight_ratio`` / ``infersight_instance_settled``, MQTT as a retained
``routing/<service>/<port>`` topic.

What it needs from other features comes in as plain functions (the composition root wires
them): each instance's latency (requests) and the slow devices (devices verdicts).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from infersight.agent.daemon.extension import AgentContext, Apply, Extension
from infersight.settings import (
    Config,
    ConfigError,
    Key,
    parse_bool,
    parse_int,
    parse_listen_host,
    parse_listen_port,
    section_settings,
)

if TYPE_CHECKING:  # imported when routing is enabled (off by default: ~3 ms an agent need not pay)
    from infersight.agent.routing.agentcheck import AgentCheckServer
    from infersight.agent.routing.table import LatencySource, RoutingTable, SlowDevices

log = logging.getLogger("infersight.agent.routing")
REFRESH_S = 0.25
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9465


def _max_concurrency(v: Any) -> int | None:
    if v is None or v == "":
        return None
    n = parse_int(v)
    if not 1 <= n <= 1_000_000:
        raise ValueError("expected a number of concurrent requests in 1..1000000")
    return n


_K = "routing."
ROUTING_KEYS: tuple[Key, ...] = (
    Key(_K + "enabled", parse_bool, lambda: False, "INFERSIGHT_ROUTING",
        "serve routing hints: HAProxy agent-check, weight gauges (docs/routing.md)"),
    Key(_K + "host", parse_listen_host, lambda: DEFAULT_HOST, "INFERSIGHT_ROUTING_HOST",
        "address the agent-check server binds (0.0.0.0 or :: exposes it on every interface)"),
    Key(_K + "agent_check_port", parse_listen_port, lambda: DEFAULT_PORT, "INFERSIGHT_ROUTING_AGENT_CHECK_PORT",
        "port of the HAProxy agent-check server (0: any free port, see status --json)"),
    Key(_K + "max_concurrency", _max_concurrency, lambda: None, "INFERSIGHT_ROUTING_MAX_CONCURRENCY",
        "an instance's concurrent requests at full weight: adds maxconn:N, scaled by the weight"),
)  # fmt: skip


def parse_config(config: Config, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``[routing]`` section; ConfigError names a bad or unknown key."""
    return section_settings(config, _K, ROUTING_KEYS, os.environ if env is None else env)


class RoutingExtension(Extension):
    name = "routing"
    live_keys: frozenset[str] = frozenset()  # every routing key applies at the next restart

    def __init__(self, config: Config, latency: LatencySource, slow_devices: SlowDevices,
                 env: Mapping[str, str] | None = None) -> None:
        self._env = env
        self.settings = parse_config(config, env)
        self.enabled: bool = self.settings["enabled"]
        self.table: RoutingTable | None = None
        if self.enabled:
            from infersight.agent.routing.table import RoutingTable

            self.table = RoutingTable(latency, slow_devices, self.settings["max_concurrency"])
        self.server: AgentCheckServer | None = None
        self._agent: AgentContext | None = None

    async def start(self, agent: AgentContext) -> None:
        if self.table is None:
            return
        from infersight.agent.routing.agentcheck import AgentCheckServer

        self._agent = agent
        server = AgentCheckServer(self.table.reply, self.settings["host"], self.settings["agent_check_port"])
        try:
            await server.start()
        except OSError as exc:
            raise ConfigError("routing: cannot listen on %s:%d: %s" % (
                self.settings["host"], self.settings["agent_check_port"], exc.strerror or exc)) from None
        self.server = server
        if self.settings["host"] in ("0.0.0.0", "::"):
            log.warning("routing agent-check configured on all interfaces (%s)", self.settings["host"])
        self.table.visible_pid = getattr(agent, "visible_pid", None)  # (an AgentContext of an older make has none)
        agent.observe(self.table.observe)
        table = self.table
        agent.on_hello(lambda p: table.readmit(p.id, p.resource, p.info))
        agent.spawn(self._refresh(agent, self.table), "routing-refresh")

    async def _refresh(self, agent: AgentContext, table: RoutingTable) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            changed = table.refresh()
            if changed:
                agent.broadcaster.publish(changed)

    def reload(self, config: Config) -> Apply | None:
        parse_config(config, self._env)  # validate; the values apply at the next restart
        return None

    def health(self) -> Mapping[str, Any]:
        if self.server is None or self.table is None:
            return {"routing": {"enabled": self.enabled, "agent_check_port": None}}
        return {"routing": {"enabled": True, **self.server.state(), "instances": self.table.snapshot(),
                            "port_claims_refused": self.table.port_claims_refused,
                            "ports_contested": self.table.ports_contested,
                            "vacated_dropped": self.table.vacated_dropped,
                            "instances_refused": self.table.instances_refused}}

    async def aclose(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            await server.aclose()
        if self._agent is not None and self.table is not None:
            cleared = self.table.clear_all()
            if cleared:
                self._agent.broadcaster.publish(cleared)
            self._agent = None


__all__ = ["ROUTING_KEYS", "RoutingExtension", "parse_config"]
