"""The HAProxy agent-check server: read ``<port>\\n``, answer one line, close.

Each connection gets :data:`READ_TIMEOUT_S` to send its request line; a peer that stalls
(sends nothing, or no newline) is closed then, and counted. The answer comes from a function
that only looks up a table (:meth:`~infersight.agent.routing.table.RoutingTable.reply`),
so no connection waits on a routing decision, and a slow reader is cut after
:data:`WRITE_TIMEOUT_S`. At most :data:`MAX_CONNECTIONS` are served at once; more are
closed at once and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from infersight.agent.routing import hints

log = logging.getLogger("infersight.agent.routing")
READ_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 256


@dataclass
class Counters:
    checks: int = 0  # replies sent
    bad_requests: int = 0  # a line that names no port: answered as an unknown port
    timeouts: int = 0  # closed: no request line within READ_TIMEOUT_S (or a stalled reader)
    refused: int = 0  # closed at once: MAX_CONNECTIONS reached


class AgentCheckServer:
    def __init__(self, reply: Callable[[int], str], host: str, port: int) -> None:
        self.reply = reply
        self.host = host
        self.port = port
        self.counters = Counters()
        self._server: asyncio.Server | None = None
        self._open = 0

    @property
    def bound_port(self) -> int | None:
        if self._server is None or not self._server.sockets:
            return None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Bind (OSError when the port is taken or the host is not local)."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=hints.MAX_REQUEST_BYTES * 2)
        log.info("routing: HAProxy agent-check on %s:%s", self.host, self.bound_port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            self.counters.refused += 1
            writer.transport.abort()
            return
        self._open += 1
        try:
            try:
                line = await asyncio.wait_for(reader.readuntil(b"\n"), READ_TIMEOUT_S)
            except asyncio.IncompleteReadError as exc:  # closed early: answer what it sent, if a port
                line = exc.partial
            except (TimeoutError, asyncio.LimitOverrunError, ValueError, ConnectionError):
                self.counters.timeouts += 1
                writer.transport.abort()
                return
            port = hints.parse_request(line)
            if port is None:
                self.counters.bad_requests += 1
                answer = hints.UNKNOWN_REPLY
            else:
                answer = self.reply(port)
            writer.write(answer.encode("ascii"))
            self.counters.checks += 1
            try:
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
            except (TimeoutError, ConnectionError):
                self.counters.timeouts += 1
                writer.transport.abort()
                return
            writer.close()
        finally:
            self._open -= 1

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)

    def state(self) -> dict[str, int | str | None]:
        c = self.counters
        return {"host": self.host, "agent_check_port": self.bound_port, "checks": c.checks,
                "bad_requests": c.bad_requests, "timeouts": c.timeouts, "refused": c.refused,
                "open_connections": self._open}
