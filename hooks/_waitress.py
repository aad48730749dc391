"""waitress: the first request, and every request of the WSGI app it serves timed (stdlib only).

waitress parses each request on its main thread and serves it on one of its threads: the
channel makes a ``WSGITask``, whose ``service`` calls the app and writes the response through the
task's ``write`` (the status line and headers with the first body bytes), which queues the bytes
for the main thread to send. While the cold start runs, ``WSGITask.service`` is wrapped (taken out
when it ends: a later request pays nothing): the first request served once readiness is known
from a signal other than a request (its ``listen()``, ``--ready-url``, a mark, a stage rule), as
under uvicorn, is ``first_request``, from when a waitress thread takes it to its response's
first bytes (the task's first ``write`` that sends the headers), with its status. It is emitted
once ``service`` returns: ending the cold start never delays the response. A request that does
not parse (waitress answers it with an ``ErrorTask``), or a bare TCP connect, is none.

Every request of the app is a ``req`` event, as under gunicorn's WSGI workers: the app each
server holds (``BaseWSGIServer.__init__``, one per listening socket) is wrapped in
``wsgi.RequestTimingMiddleware`` for the server's life.
"""

from __future__ import annotations

import sys
import time

from . import _lazy, _readiness, _runtime
from ._recorder import patch

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Dict

__all__ = ["install"]

SOURCE = "waitress"  # infersight.first_request.source


class _FirstWrite:
    """The first request's task's ``write``: when the headers went out, with which status."""

    __slots__ = ("sent", "status", "task")

    def __init__(self, task: Any) -> None:
        self.task = task
        self.sent = 0
        self.status = 0

    def write(self, data: Any) -> Any:
        task = self.task
        out = type(task).write(task, data)  # the class's own write (this one shadows it on the task)
        if not self.sent and getattr(task, "wrote_header", False):
            self.sent = time.time_ns()
            try:
                self.status = int(str(task.status)[:3])  # "200 OK"
            except ValueError:
                pass
        return out


def _service(orig: Any) -> Any:
    def service(self: Any) -> Any:
        first = None
        try:
            arrived = time.time_ns()
            if _readiness.pending_first() and _readiness.ready_for_request():
                req = self.request
                attrs = {"http.request.method": str(req.command or ""), "url.path": str(req.path or "")}
                first = _readiness.request_begin(SOURCE, attrs, arrived)
        except Exception as exc:
            _runtime.fail(exc)
        if first is None:
            return orig(self)
        timed = _FirstWrite(self)
        self.write = timed.write  # start_response hands the app this task's write: ours, for this task only
        token = _runtime.current_span.set(first.span)  # the stages the request runs nest under it
        err = ""
        try:
            return orig(self)
        except BaseException as exc:
            err = type(exc).__name__
            raise
        finally:
            try:
                _runtime.current_span.reset(token)
            except ValueError:  # set in another context: nothing of ours to put back
                pass
            _answered(self, first, timed, err)

    service._infersight = True  # type: ignore[attr-defined]
    return service


def _answered(task: Any, first: Any, timed: _FirstWrite, err: str) -> None:
    try:
        task.__dict__.pop("write", None)
        attrs: Dict[str, Any] = {}
        if timed.status:
            attrs["http.response.status_code"] = timed.status
        if err and not timed.sent:
            attrs["error.type"] = err  # waitress answers 500 itself: no response of the app's went out
        _readiness.first_response(first, attrs or None, timed.sent)
    except Exception as exc:
        _runtime.fail(exc)


def install(module: Any) -> None:
    """``waitress.server`` is imported (with ``waitress.task``): time every request of the apps its
    servers hold, and watch ``WSGITask.service`` for the first request."""
    server = getattr(module, "BaseWSGIServer", None)
    if server is not None and _lazy.fresh("wsgi", "waitress's request timing"):
        from . import wsgi

        wsgi.wrap_waitress_server(server)
    task = getattr(sys.modules.get("waitress.task"), "WSGITask", None)
    service = getattr(task, "service", None)
    if service is not None and not getattr(service, "_infersight", False):
        patch(task, "service", _service(service))  # undone when the cold start ends
