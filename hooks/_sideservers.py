"""Side servers: servers a process starts beside the one it serves (stdlib only).

Many model servers start a Prometheus exporter of their own at start-up
(``prometheus_client.start_http_server(9100)``: a ``wsgiref`` server in a daemon thread), before they
load their model and long before their real server (uvicorn, gunicorn, Flask...) listens. Such a
server is never the served app: its ``listen()`` is no readiness (the whole model load would count as
the wait for traffic), its port is not the ``server.port`` a balancer routes to, and a scrape of it is
no first request.

A function that starts one is wrapped here (``side_server``): while it runs on a thread, during the
cold start, the sockets that listen on that thread are side sockets (``ColdStart.side_sockets``,
noted by ``_readiness``'s ``listen()`` wrapper before the socket listens, so no poll sees it first),
and so are those of the server it returns (where the listening heuristics are off, ``--ready-url``
or ``INFERSIGHT_READY_ON_LISTEN=0``, there is no such wrapper; prometheus_client returns its server
from 0.20 on). The ``listen()`` readiness, the poll
of the kernel's tables (``_listening.ListenWatch``) and the serving port of an explicit readiness
skip them, and ``_http_server`` leaves the requests a handler serves on one alone (``serves_side``).
One registration: prometheus_client's ``start_wsgi_server`` (``start_http_server`` is the same
function), wrapped once ``prometheus_client.exposition`` is imported; the wrapper is taken out when
the cold start ends.
"""

from __future__ import annotations

import functools
import os
import sys

from . import _runtime
from ._recorder import add_undo, patch, state

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterable

__all__ = ["install_prometheus", "serves_side", "side_server"]

# prometheus_client's functions that start its exporter's own HTTP server (one function, two names)
PROMETHEUS_STARTS = ("start_wsgi_server", "start_http_server")


def side_server(start: Callable[..., Any], sockets: Callable[[Any], Iterable[Any]]) -> Callable[..., Any]:
    """``start``, a function that starts a side server, wrapped: while it runs during the cold start, the
    sockets that listen on its thread are side sockets, and so are ``sockets(what it returned)``."""

    @functools.wraps(start)
    def started(*args: Any, **kwargs: Any) -> Any:
        st = state()
        if not st.collecting:
            return start(*args, **kwargs)
        tls = st.tls.__dict__  # this thread's (read by the listen() wrapper)
        tls["side"] = tls.get("side", 0) + 1
        try:
            out = start(*args, **kwargs)
        finally:
            tls["side"] -= 1
        try:
            for sock in sockets(out):
                st.side_sockets.add(os.fstat(sock.fileno()).st_ino)
        except Exception as exc:
            _runtime.fail(exc)
        return out

    started._infersight = True  # type: ignore[attr-defined]
    return started


def serves_side(handler: Any) -> bool:
    """Whether ``handler`` (an ``http.server`` handler) serves a connection of a side server's socket. One
    ``fstat`` per request while the first request is pending, and only once a side server listens."""
    side = state().side_sockets
    if not side:
        return False
    try:
        return os.fstat(handler.server.socket.fileno()).st_ino in side
    except (AttributeError, OSError, TypeError, ValueError):
        return False


def _prometheus_sockets(started: Any) -> Iterable[Any]:
    """The socket of the server ``start_wsgi_server`` returned (``(httpd, thread)``; None before 0.20)."""
    httpd = started[0] if isinstance(started, tuple) and started else None
    sock = getattr(httpd, "socket", None)
    return [sock] if sock is not None else []


def install_prometheus(exposition: Any) -> None:
    """``prometheus_client.exposition`` is imported: the functions that start its exporter's server start a
    side server. The package binds its names from the module after this (its ``__init__`` imports the
    module first): it gets the wrapper too, and the original back with the module's when the cold start
    ends (a reference the app took meanwhile keeps the wrapper, which then only passes the call on)."""
    wrapped: Dict[int, Callable[..., Any]] = {}  # id(original) -> its wrapper: one per function, whatever its names
    originals: Dict[str, Callable[..., Any]] = {}
    for name in PROMETHEUS_STARTS:
        orig = getattr(exposition, name, None)
        if orig is None or getattr(orig, "_infersight", False):
            continue
        new = wrapped.get(id(orig))
        if new is None:
            new = wrapped[id(orig)] = side_server(orig, _prometheus_sockets)
        patch(exposition, name, new)  # undone when the cold start ends
        originals[name] = orig
    if originals:
        package = exposition.__name__.rpartition(".")[0]
        _bind_package(package, originals, wrapped)
        add_undo(lambda: _unbind_package(package, originals, wrapped))


def _bind_package(package: str, originals: Dict[str, Callable[..., Any]], wrapped: Dict[int, Any]) -> None:
    """The package imported already (the hooks came after it): its names too."""
    mod = sys.modules.get(package)
    for name, orig in originals.items():
        if mod is not None and getattr(mod, name, None) is orig:
            setattr(mod, name, wrapped[id(orig)])


def _unbind_package(package: str, originals: Dict[str, Callable[..., Any]], wrapped: Dict[int, Any]) -> None:
    mod = sys.modules.get(package)
    for name, orig in originals.items():
        if mod is not None and getattr(mod, name, None) is wrapped[id(orig)]:
            setattr(mod, name, orig)
