"""WSGI middleware: every request's duration, for the agent's per-instance latency (stdlib only).

    from infersight.hooks.wsgi import RequestTimingMiddleware
    app.wsgi_app = RequestTimingMiddleware(app.wsgi_app)   # Flask
    application = RequestTimingMiddleware(application)     # any WSGI app

No code change is needed under gunicorn's sync and gthread workers nor waitress: the hooks wrap the
app each gunicorn worker loads (``load_wsgi``), and the one each waitress server holds, in this
middleware, as uvicorn's ASGI app is wrapped (``hooks.asgi``; Hypercorn's WSGI apps are timed there,
at Hypercorn's ASGI level). A request is timed once however many layers of it it goes through.

Every request is a ``req`` event of request class ``http``, as the ASGI middleware's: from the
app's call until the server closes the response's iterable (PEP 3333: the whole body was sent,
or the client went away), so a streamed response's generation is in it; an exception, or a status
of 500 or more, is its ``error.type``. A body the app returns as a list (computed already) or a
file the server sends itself (``wsgi.file_wrapper``) is timed to the app's return: the server's
write to a slow client is not the instance's latency. The cold
start's first request is not this middleware's: the server hooks time it from the request's
arrival (gunicorn's workers in ``_coldstart``, waitress in ``_waitress``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, Optional

from . import _state
from .asgi import SERVER_ERROR, queue_request, wrap_loaded_app

__all__ = ["RequestTimingMiddleware", "wrap_gunicorn_worker", "wrap_waitress_server"]

_wall_ns = time.time_ns  # bound once: two clock reads a request, no module attribute lookups
_clock_ns = time.perf_counter_ns
TIMED = "infersight.timed"  # an environ key: an outer layer of this middleware times this request

WSGIApp = Callable[[dict, Callable[..., Any]], Iterable[bytes]]  # type: ignore[type-arg]


class RequestTimingMiddleware:
    """Pure WSGI middleware (no framework import): times every request."""

    __slots__ = ("app",)

    def __init__(self, app: WSGIApp) -> None:
        self.app = app

    def __call__(self, environ: dict, start_response: Callable[..., Any]) -> Iterable[bytes]:  # type: ignore[type-arg]
        c = _state.current.runtime.client
        if c is None or TIMED in environ:
            return self.app(environ, start_response)  # hooks off, or an outer layer times it
        environ[TIMED] = True
        timed = _TimedBody(c, start_response)
        try:
            body = self.app(environ, timed.start_response)
        except BaseException as exc:
            timed.finish(type(exc).__name__)
            raise
        if type(body) is list:  # computed already: what is left is the server's write
            timed.finish(None)
            return body
        wrapper = environ.get("wsgi.file_wrapper")
        if wrapper is not None and isinstance(wrapper, type) and isinstance(body, wrapper):
            timed.finish(None)  # the server sends the file itself (sendfile): timed to the app's return
            return body
        timed.body = body
        return timed


class _TimedBody:
    """The app's response: its status, and its iterable timed until the server closes it."""

    __slots__ = ("body", "client", "closed", "done", "respond", "start", "status", "t0")

    def __init__(self, client: Any, respond: Callable[..., Any]) -> None:
        self.client = client
        self.respond = respond
        self.body: Iterable[bytes] = ()
        self.status = 0
        self.done = False  # its event was queued
        self.closed = False
        self.start = _wall_ns()
        self.t0 = _clock_ns()

    def start_response(self, status: str, headers: Any, exc_info: Any = None) -> Any:
        try:
            self.status = int(status[:3])  # PEP 3333: "200 OK"
        except (TypeError, ValueError):
            pass  # not PEP 3333's "200 OK": the server says so
        return self.respond(status, headers) if exc_info is None else self.respond(status, headers, exc_info)

    def __iter__(self) -> Iterator[bytes]:
        # A loop, not ``yield from``: when the server stops (its client went away) and this generator is
        # dropped, GeneratorExit must not reach the app's iterable (werkzeug's would run its close twice,
        # Flask's call_on_close callbacks too); the server's close() closes it, once.
        try:
            for chunk in self.body:  # noqa: UP028 (see above: yield from would forward the close)
                yield chunk
        except GeneratorExit:
            raise  # the server stopped iterating: no failure of the app's (a client that left)
        except BaseException as exc:
            self.finish(type(exc).__name__)
            raise

    def close(self) -> None:
        if self.closed:
            return  # the body's close runs once
        self.closed = True
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        except BaseException as exc:
            self.finish(type(exc).__name__)
            raise
        self.finish(None)

    def finish(self, err: Optional[str]) -> None:
        """One ``req`` event, once: an exception's type, else a server error's status code."""
        if self.done:
            return
        self.done = True
        if err is None and self.status >= SERVER_ERROR:
            err = str(self.status)  # OpenTelemetry's error.type of an HTTP server error: its status code
        queue_request(self.client, self.start, _clock_ns() - self.t0, err)


def wrap_gunicorn_worker(cls: Any) -> None:
    """Make a gunicorn WSGI worker class (sync, gthread) wrap the app each worker loads
    (``load_wsgi``, after the fork) in :class:`RequestTimingMiddleware`, for the worker's life.
    Patched on that class only: gunicorn's base ``Worker`` (UvicornWorker's) keeps its loader."""
    wrap_loaded_app(cls, "load_wsgi", "wsgi", RequestTimingMiddleware, RequestTimingMiddleware)


def wrap_waitress_server(cls: Any) -> None:
    """Make waitress's ``BaseWSGIServer`` (one per listening socket: ``create_server``, ``serve``,
    ``waitress-serve``) wrap the app it holds in :class:`RequestTimingMiddleware`, for its life."""
    wrap_loaded_app(cls, "__init__", "application", RequestTimingMiddleware, RequestTimingMiddleware)
