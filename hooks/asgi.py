"""ASGI middleware: every request's duration, and the first one's time to first byte (stdlib only).

    from infersight.hooks.asgi import ColdStartMiddleware
    app = ColdStartMiddleware(app)                # any ASGI 3 app
    app.add_middleware(ColdStartMiddleware)       # Starlette / FastAPI

No code change is needed under uvicorn (FastAPI, vLLM's API server, ...) nor Hypercorn: the hooks
wrap ``uvicorn.config.Config.load`` when uvicorn is imported (Hypercorn's ``ASGIWrapper``, and
its ``WSGIWrapper``'s requests for a WSGI app), so the app the server serves is wrapped in this
middleware (``first_request=False``: the first request is the first HTTP request that arrives
once readiness is known from another signal: a listening socket, ``--ready-url``, a mark, a stage
rule, the fork of a ready server; a readiness probe before that is not, and says nothing of
readiness). A request is timed once however many
layers of this middleware it goes through; the one the app added itself still finds the first
request.

Every HTTP request is a ``req`` event of request class ``http`` (``hooks._request``): from
the moment it reaches the middleware until the app returns (the whole response, streamed or
not); an exception, or a response status of 500 or more (a server that answers 503 while its
engine is down), is its ``error.type``. The agent keeps them per serving instance (P50/P99,
routing hints). The per-request cost is a few attribute tests, two clock reads and one
queued tuple: ``bench/emit_vs_span.py`` measures it (the middleware's added cost per request).

The first HTTP request that reaches the app while the cold start is open (through the uvicorn
wrap: the first once readiness is known) also becomes the ``first_request`` stage: it starts
when the request reaches the middleware, lazy imports and loads it makes included, and ends
when the app sends the first non-empty body chunk (or the end of an empty body), which
for a streaming response is the first token, not the last. The root ends at readiness when a
signal said when, else there. A request through a middleware the app added also implies
readiness if nothing else declared it.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Awaitable, Callable, Dict, MutableMapping, Optional

from . import _contract, _readiness, _runtime, _state

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

__all__ = ["HTTP_CLASS", "SERVER_ERROR", "ColdStartMiddleware", "HypercornWSGIRequests", "queue_request",
           "wrap_gunicorn_asgi", "wrap_hypercorn", "wrap_loaded_app", "wrap_uvicorn"]

HTTP_CLASS = "http"  # the request class of requests timed here
TIMED = "infersight.timed"  # a scope key: an outer layer of this middleware times this request
SERVER_ERROR = 500  # a response with this status or above is a failed request, as an exception is


class ColdStartMiddleware:
    """Pure ASGI middleware (no framework import): times every HTTP request; the first one is
    also the cold start's ``first_request``."""

    def __init__(self, app: ASGIApp, first_request: bool = True) -> None:
        self.app = app
        self._first_pending = True  # the cold start's first request may still come through here
        # True: the first HTTP request is the first request (and readiness, if nothing said it
        # before). False (the uvicorn wrap): only one that arrives once readiness is known from
        # another signal, so that a readiness probe before it never becomes first_request.
        self._any_request = first_request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        c = _state.current.runtime.client
        if c is None or scope.get("type") != "http":
            await self.app(scope, receive, send)  # hooks off, or not HTTP
            return
        first = self._first_pending and self._is_first()
        if TIMED in scope:  # an outer layer times this request
            await (self._first(scope, receive, send) if first else self.app(scope, receive, send))
            return
        scope[TIMED] = True
        start = time.time_ns()
        t0 = time.perf_counter_ns()
        err = None
        status = [0]

        def status_send(message: Message) -> Awaitable[None]:
            # Not a coroutine of its own: the app awaits send's own awaitable (a streamed response's
            # every chunk pays one call and one test, no extra frame).
            if not status[0] and message.get("type") == "http.response.start":
                status[0] = message.get("status", 0)
            return send(message)

        try:
            await (self._first(scope, receive, status_send) if first else self.app(scope, receive, status_send))
        except BaseException as exc:
            err = type(exc).__name__
            raise
        finally:
            if err is None and type(status[0]) is int and status[0] >= SERVER_ERROR:
                err = str(status[0])  # OpenTelemetry's error.type of an HTTP server error: its status code
            queue_request(c, start, time.perf_counter_ns() - t0, err)

    def _is_first(self) -> bool:
        """The cold start's first request may be this one (once no longer, never again)."""
        try:
            if _readiness.pending_first():
                return self._any_request or _readiness.ready_for_request()
        except Exception as exc:
            _runtime.fail(exc)
        self._first_pending = False
        return False

    async def _first(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The first request after readiness: the ``first_request`` stage."""
        handle = None
        token = None
        try:
            handle = _readiness.request_begin(
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
            end_ns = 0
            try:
                if not state["done"]:
                    kind = message.get("type")
                    if kind == "http.response.start":
                        state["status"] = int(message.get("status", 0))
                        state["headers_ns"] = time.time_ns()
                    elif kind == "http.response.body" and (message.get("body") or not message.get("more_body")):
                        state["done"] = True
                        end_ns = time.time_ns()
            except Exception as exc:
                _runtime.fail(exc)
            # The chunk goes out first: ending the cold start (it flushes every stage) never delays it. It ends
            # from the loop, once this task yields or the send returns: a send held by backpressure (a server
            # that drains its writer) does not hold the cold start open, nor lose it if the send is cancelled.
            later = _finish_soon(handle, state, end_ns) if end_ns else None
            try:
                await send(message)
            except BaseException as exc:
                if end_ns and not state.get("finished"):  # the server could not take it: no response went out
                    if later is not None:
                        later.cancel()
                    state["error"] = type(exc).__name__
                    _finish(handle, state, end_ns)
                raise
            if end_ns and later is None:  # no asyncio loop (another event loop): after the send
                _finish(handle, state, end_ns)

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


def queue_request(c: Any, start: int, dur_ns: int, err: Optional[str]) -> None:
    """One ``req`` event of an HTTP request (the tuple ``_request`` queues; built into a dict on the drain
    thread); the WSGI middleware's too."""
    try:
        if c.enabled:
            event = (next(c._seq), start + dur_ns, "req", None, None, None, HTTP_CLASS, start, dur_ns, None, None, err)
            buf = c._buf
            queued = len(buf)
            if 0 < queued < c.calm or c.calm_from <= queued < c.calm_to:
                buf.append(event)  # c.queue(event), inlined as in _request: nothing to wake, spill or drop
            else:
                c.queue(event)
    except Exception as exc:
        _runtime.fail(exc)


def _finish_soon(handle: Any, state: Dict[str, Any], end_ns: int) -> Any:
    """``_finish`` scheduled on the running asyncio loop (its handle), or None where there is none (asyncio
    is not imported here: an ASGI server on asyncio has loaded it)."""
    aio = sys.modules.get("asyncio")
    try:
        return aio.get_running_loop().call_soon(_finish, handle, state, end_ns) if aio is not None else None
    except RuntimeError:
        return None


def _finish(handle: Any, state: Dict[str, Any], now: int = 0) -> None:
    """End ``first_request`` at ``now`` (0: this moment), once."""
    if state.get("finished"):
        return
    state["finished"] = True
    try:
        now = now or time.time_ns()
        attrs: Dict[str, Any] = {_contract.FIRST_REQUEST_TTFB_S: (now - handle.start) / 1e9}
        if state.get("status"):
            attrs["http.response.status_code"] = state["status"]
        if state.get("headers_ns"):
            attrs["infersight.first_request.headers_s"] = (state["headers_ns"] - handle.start) / 1e9
        if state.get("error"):
            attrs["error.type"] = state["error"]
        _readiness.first_response(handle, attrs, now)
    except Exception as exc:
        _runtime.fail(exc)



def wrap_loaded_app(cls: Any, method: str, attr: str, middleware: Callable[[Any], Any], kind: type) -> None:
    """Make ``cls.<method>`` (a server's app loader) wrap the app it leaves in ``self.<attr>`` with
    ``middleware``: once (not a ``kind`` already, not twice patched), and only while the hooks report.
    Never undone: the requests are timed for the server's life. Shared by uvicorn's ``Config.load``,
    hypercorn's ``ASGIWrapper``, gunicorn's ASGI worker here and gunicorn's WSGI workers (``hooks.wsgi``)."""
    orig = getattr(cls, method, None)
    if orig is None or getattr(orig, "_infersight", False):
        return

    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        try:
            app = getattr(self, attr, None)
            if app is not None and not isinstance(app, kind) and _runtime.state().client is not None:
                setattr(self, attr, middleware(app))
        except Exception as exc:
            _runtime.fail(exc)
        return out

    load._infersight = True  # type: ignore[attr-defined]
    setattr(cls, method, load)


def _timing_only(app: ASGIApp) -> ColdStartMiddleware:
    return ColdStartMiddleware(app, first_request=False)


def wrap_uvicorn(module: Any) -> None:
    """Make ``uvicorn.config.Config.load`` wrap the loaded app in :class:`ColdStartMiddleware`
    (a post-import callback of the hooks: nothing to change in the served code)."""
    cls = getattr(module, "Config", None)
    if cls is not None:
        wrap_loaded_app(cls, "load", "loaded_app", _timing_only, ColdStartMiddleware)


def wrap_gunicorn_asgi(module: Any) -> None:
    """Make gunicorn's own ASGI worker (``-k asgi``, ``gunicorn.workers.gasgi.ASGIWorker``) wrap the
    app it loads in each worker (``load_wsgi``, after the fork) in :class:`ColdStartMiddleware`,
    as uvicorn's ``Config.load`` is wrapped: every request is timed, and the first one that arrives
    once readiness is known is the first request (the worker's wait for it is no cold start)."""
    cls = getattr(module, "ASGIWorker", None)
    if cls is not None:
        wrap_loaded_app(cls, "load_wsgi", "asgi", _timing_only, ColdStartMiddleware)


def wrap_hypercorn(module: Any) -> None:
    """Make hypercorn's ``ASGIWrapper`` and ``WSGIWrapper`` (``hypercorn.app_wrappers``: what
    ``load_application`` and ``hypercorn.asyncio.serve`` make of an ASGI or a WSGI app) serve their
    HTTP requests through :class:`ColdStartMiddleware`, as uvicorn's ``Config.load`` does: every
    request is timed, and the first one that arrives once readiness is known is the first request.
    An ASGI app is wrapped; a WSGI app's requests are, where hypercorn still sees them as ASGI
    (``WSGIWrapper.handle_http``: :class:`HypercornWSGIRequests`)."""
    cls = getattr(module, "ASGIWrapper", None)
    if cls is not None:
        wrap_loaded_app(cls, "__init__", "app", _timing_only, ColdStartMiddleware)
    cls = getattr(module, "WSGIWrapper", None)
    if cls is not None:
        wrap_loaded_app(cls, "__init__", "handle_http", HypercornWSGIRequests, HypercornWSGIRequests)


_SPAWN = "infersight.hypercorn_spawn"  # a scope key: hypercorn's sync_spawn and call_soon, through the middleware


class HypercornWSGIRequests:
    """One hypercorn ``WSGIWrapper``'s ``handle_http`` (its bound method: the WSGI app's HTTP requests,
    each read, run in a thread with ``sync_spawn`` and answered through ``call_soon``) behind
    :class:`ColdStartMiddleware`: the response messages it sends are the ones the middleware watches
    for an ASGI app, so the first request ends at its first body bytes. ``sync_spawn`` and
    ``call_soon`` ride in the scope through the middleware (never into the WSGI environ)."""

    __slots__ = ("handle_http", "middleware")

    def __init__(self, handle_http: Callable[..., Awaitable[None]]) -> None:
        self.handle_http = handle_http
        self.middleware = ColdStartMiddleware(self._serve, first_request=False)

    def __call__(self, scope: Scope, receive: Receive, send: Send, sync_spawn: Any, call_soon: Any) -> Awaitable[None]:
        scope[_SPAWN] = (sync_spawn, call_soon)
        return self.middleware(scope, receive, send)

    def _serve(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        sync_spawn, call_soon = scope.pop(_SPAWN)
        return self.handle_http(scope, receive, send, sync_spawn, call_soon)
