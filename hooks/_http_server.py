"""The first request of the standard library's HTTP servers (stdlib only): ``http.server``'s
``BaseHTTPRequestHandler`` (a handler's ``do_GET``, ``SimpleHTTPRequestHandler``, werkzeug's
development server, Flask's ``app.run()``) and ``wsgiref.simple_server``.

A handler serves one connection: ``handle_one_request`` waits for a request line (as long as a
kept-alive client waits), parses it with its headers (``parse_request``) and dispatches it to
``do_<METHOD>``; ``wsgiref``'s ``WSGIRequestHandler.handle`` does the same once, for its WSGI app.
While the cold start runs, both dispatches and ``parse_request`` are wrapped (taken out when it
ends: a later request pays nothing). The first request parsed once readiness is known from a
signal other than a request (a listening socket, ``--ready-url``, a mark, a stage rule), as
under uvicorn, is ``first_request``: from its request line (``parse_request``) to its response's
first bytes on the connection (an interim ``1xx`` is not the response), with the status code of
that status line. It is emitted once the dispatch returns: ending the cold start never delays the
response. A bare TCP connect, a request that does not parse, or one to a side server (a metrics
exporter's: ``_sideservers``) is no first request.
"""

from __future__ import annotations

import threading
import time

from . import _readiness, _runtime, _sideservers, _workers
from ._recorder import patch

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional

__all__ = ["FirstBytes", "install_http_server", "install_wsgiref"]

SOURCE = "http.server"  # infersight.first_request.source


class _Dispatch(threading.local):
    """The request a handler thread serves, while the first request is pending."""

    watching = False  # a wrapped dispatch runs on this thread
    first: Any = None  # the first request's handle, when this thread serves it
    token: Any = None  # the current span before it (the stages the request runs nest under it)


_now = _Dispatch()


class FirstBytes:
    """A handler's ``wfile`` while it answers the first request: when the response's first bytes
    went out, and its status. Everything else is the writer's own."""

    __slots__ = ("raw", "sent", "status")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sent = 0
        self.status = 0

    def write(self, data: Any) -> Any:
        out = self.raw.write(data)
        if not self.sent and data:
            self._note(data)
        return out

    def _note(self, data: Any) -> None:
        head = bytes(data[:12])
        if head.startswith(b"HTTP/") and len(head) == 12:  # "HTTP/1.1 200": the status line
            if head[9:10] == b"1":
                return  # an interim response (100 Continue): the response itself is still to come
            try:
                self.status = int(head[9:12])
            except ValueError:
                pass
        self.sent = time.time_ns()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def _dispatch(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``orig`` (a handler's dispatch of one request), watched for the first request."""

    def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        now = _now
        try:
            pending = not now.watching and _readiness.pending_first() and not _sideservers.serves_side(self)
        except Exception as exc:
            _runtime.fail(exc)
            pending = False
        if not pending:
            return orig(self, *args, **kwargs)  # nested in another dispatch, or no first request left
        now.watching = True
        err = ""
        try:
            return orig(self, *args, **kwargs)
        except BaseException as exc:
            err = type(exc).__name__
            raise
        finally:
            now.watching = False
            first, now.first = now.first, None
            if first is not None:
                token, now.token = now.token, None
                _answered(self, first, err, token)

    dispatch._infersight = True  # type: ignore[attr-defined]
    return dispatch


def _parse(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``parse_request``: a request line came; once parsed, maybe the first request."""

    def parse_request(self: Any) -> Any:
        now = _now
        arrived = time.time_ns() if now.watching and now.first is None else 0
        ok = orig(self)
        if arrived and ok:
            _begin(self, arrived)
        return ok

    parse_request._infersight = True  # type: ignore[attr-defined]
    return parse_request


def _begin(handler: Any, arrived: int) -> None:
    try:
        if not (_readiness.pending_first() and _readiness.ready_for_request()):
            return  # a request before readiness (a readiness probe) is no first request
        path = str(getattr(handler, "path", "") or "")
        attrs = {"http.request.method": str(getattr(handler, "command", "") or ""), "url.path": path.split("?", 1)[0]}
        first = _readiness.request_begin(SOURCE, attrs, arrived)
        if first is None:
            return
        handler.wfile = FirstBytes(handler.wfile)
        _now.first = first
        _now.token = _runtime.current_span.set(first.span)
    except Exception as exc:
        _runtime.fail(exc)


def _answered(handler: Any, first: Any, err: str, token: Any) -> None:
    """The first request's dispatch returned: the current span and the handler's own writer back,
    then ``first_request``."""
    try:
        try:
            _runtime.current_span.reset(token)
        except ValueError:  # set in another context (a handler that moved the request across threads)
            pass
        attrs: Dict[str, Any] = {}
        sent = 0
        wfile = getattr(handler, "wfile", None)
        if isinstance(wfile, FirstBytes):
            handler.wfile = wfile.raw
            sent = wfile.sent
            if wfile.status:
                attrs["http.response.status_code"] = wfile.status
        if err and not sent:
            attrs["error.type"] = err
        with _workers.DeferredSignals():  # a Ctrl-C now waits for first_request to go out (a one-thread server)
            _readiness.first_response(first, attrs or None, sent)
    except Exception as exc:
        _runtime.fail(exc)


def _wrap(cls: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    orig: Optional[Callable[..., Any]] = cls.__dict__.get(name) if cls is not None else None
    if orig is not None and not getattr(orig, "_infersight", False):
        patch(cls, name, make(orig))  # undone when the cold start ends


def install_http_server(module: Any) -> None:
    """``http.server`` is imported: watch ``BaseHTTPRequestHandler``'s requests for the first one."""
    cls = getattr(module, "BaseHTTPRequestHandler", None)
    _wrap(cls, "parse_request", _parse)
    _wrap(cls, "handle_one_request", _dispatch)


def install_wsgiref(module: Any) -> None:
    """``wsgiref.simple_server`` is imported: its handler serves one request in ``handle`` (it
    imported ``http.server``, whose ``parse_request`` is watched already)."""
    _wrap(getattr(module, "WSGIRequestHandler", None), "handle", _dispatch)
