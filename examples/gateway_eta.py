"""A small ASGI reverse proxy that hides a backend's cold start behind an honest ETA.

While the backend's service is in its cold start, as the local infersight agent sees it,
every request gets ``503 Service Unavailable`` with ``Retry-After: <ceil(eta)>`` and a JSON
body ``{"status": "warming", "stage": ..., "eta_s": ..., "progress": ...}``. Once the
backend is ready, requests are proxied to it. A backend that refuses connections and is
not known to be warming gets ``503`` with ``{"status": "unavailable"}`` and ``Retry-After: 1``.

Run it beside a served model (the agent must run on the same host)::

    GATEWAY_BACKEND=http://127.0.0.1:8000 GATEWAY_SERVICE=my-model \\
        uvicorn examples.gateway_eta:app --port 8080

Settings (environment): ``GATEWAY_BACKEND`` (base URL), ``GATEWAY_SERVICE`` (the backend's
``service.name``; empty: any process warming on this host), ``INFERSIGHT_SOCKET`` (the
agent's socket; the usual default otherwise). The same data is published as the retained
MQTT topic ``infersight/<host>/coldstart/<service>/progress`` and as the Prometheus gauges
``infersight_coldstart_eta_seconds{service}`` / ``infersight_coldstart_progress_ratio{service}``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from infersight.agent.commands.status import query_status
from infersight.hooks import _paths

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}


def warming_of(status: dict[str, Any], service: str) -> dict[str, Any] | None:
    """The least advanced warming process of ``service`` (any service when empty), or None."""
    rows = [c for c in status.get("coldstarts") or [] if not service or c.get("service") == service]
    if not rows:
        return None
    return max(rows, key=lambda c: c.get("eta_s") or 0.0)


def retry_after(eta_s: float | None) -> int:
    return max(1, math.ceil(eta_s)) if isinstance(eta_s, (int, float)) else 1


class Gateway:
    def __init__(self, backend: str, service: str = "", socket_path: str | None = None) -> None:
        self.backend = backend.rstrip("/")
        self.service = service
        self.socket_path = socket_path or _paths.socket_path(dict(os.environ))
        self.client: httpx.AsyncClient | None = None

    async def warming(self) -> dict[str, Any] | None:
        try:
            status = await asyncio.to_thread(query_status, self.socket_path, 1.0)
        except OSError:
            return None
        return warming_of(status, self.service)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    self.client = httpx.AsyncClient(timeout=60.0)
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self.client is not None:
                        await self.client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        warm = await self.warming()
        if warm is not None:
            body = {"status": "warming", "stage": warm.get("stage"), "eta_s": warm.get("eta_s"),
                    "progress": warm.get("progress"), "eta_runs": warm.get("eta_runs")}
            await self._reply(send, 503, body, retry_after(warm.get("eta_s")))
            return
        await self._proxy(scope, receive, send)

    async def _reply(self, send: Send, status: int, body: dict[str, Any], retry: int | None = None) -> None:
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        if retry is not None:
            headers.append((b"retry-after", str(retry).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        url = self.backend + scope["path"] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k.decode().lower() not in HOP_BY_HOP]
        client = self.client or httpx.AsyncClient(timeout=60.0)
        try:
            r = await client.request(scope["method"], url, headers=headers, content=b"".join(chunks))
        except httpx.TransportError:
            await self._reply(send, 503, {"status": "unavailable"}, 1)
            return
        finally:
            if client is not self.client:
                await client.aclose()
        out = [(k.encode(), v.encode()) for k, v in r.headers.items() if k.lower() not in HOP_BY_HOP]
        out.append((b"content-length", str(len(r.content)).encode()))
        await send({"type": "http.response.start", "status": r.status_code, "headers": out})
        await send({"type": "http.response.body", "body": r.content})


app = Gateway(os.environ.get("GATEWAY_BACKEND", "http://127.0.0.1:8000"), os.environ.get("GATEWAY_SERVICE", ""))
