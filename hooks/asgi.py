"""ASGI middleware: the first request's time to first body byte (stdlib only).

    from infersight.hooks.asgi import ColdStartMiddleware
    app = ColdStartMiddleware(app)                # any ASGI 3 app
    app.add_middleware(ColdStartMiddleware)       # Starlette / FastAPI

The first HTTP request that reaches the app while the cold start is open becomes the
``first_request`` stage: it starts when the request reaches the middleware and ends
when the app sends the first non-empty body chunk (or the end of an empty body), which
for a streaming response is the first token, not the last. The ``coldstart`` root ends
there too. A request also implies readiness if nothing else declared it. Every later
request, and every request when infersight is not active, passes straight through.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Dict, MutableMapping

from . import _coldstart, _runtime

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

__all__ = ["ColdStartMiddleware"]


class ColdStartMiddleware:
    """Pure ASGI middleware (no framework import); cheap pass-through after the first request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or not _coldstart.pending_first():
            await self.app(scope, receive, send)
            return
        handle = None
        token = None
        try:
            handle = _coldstart.request_begin(
                "asgi",
                {"http.request.method": str(scope.get("method", "")), "url.path": str(scope.get("path", ""))},
            )
            if handle is not None:
                token = _runtime.current_span.set(handle.span)
        except Exception as exc:
            _runtime.fail(exc)
        if handle is None:
            await self.app(scope, receive, send)
            return
        state: Dict[str, Any] = {"done": False, "status": 0, "headers_ns": 0}

        async def timed_send(message: Message) -> None:
            try:
                if not state["done"]:
                    kind = message.get("type")
                    if kind == "http.response.start":
                        state["status"] = int(message.get("status", 0))
                        state["headers_ns"] = time.time_ns()
                    elif kind == "http.response.body" and (message.get("body") or not message.get("more_body")):
                        state["done"] = True
                        _finish(handle, state)
            except Exception as exc:
                _runtime.fail(exc)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        except BaseException as exc:
            if not state["done"]:
                state["done"] = True
                state["error"] = type(exc).__name__
                _finish(handle, state)
            raise
        finally:
            if token is not None:
                try:
                    _runtime.current_span.reset(token)
                except Exception:
                    pass
        if not state["done"]:  # the app returned without a body message
            state["done"] = True
            _finish(handle, state)


def _finish(handle: Any, state: Dict[str, Any]) -> None:
    try:
        now = time.time_ns()
        attrs: Dict[str, Any] = {"infersight.first_request.ttfb_s": (now - handle.start) / 1e9}
        if state.get("status"):
            attrs["http.response.status_code"] = state["status"]
        if state.get("headers_ns"):
            attrs["infersight.first_request.headers_s"] = (state["headers_ns"] - handle.start) / 1e9
        if state.get("error"):
            attrs["error.type"] = state["error"]
        _coldstart.first_response(handle, attrs)
    except Exception as exc:
        _runtime.fail(exc)

