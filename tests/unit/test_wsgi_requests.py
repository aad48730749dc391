"""The WSGI middleware times every request, as the ASGI one does: once even when stacked, to the
server's close of the body, with its error; gunicorn's WSGI workers wrap their app without a code
change."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from hook_fakes import QueueClient

from infersight.hooks import _state, asgi, wsgi


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> QueueClient:
    c = QueueClient()
    st = _state.HookState()
    st.runtime.client = c
    monkeypatch.setattr(_state, "current", st)
    return c


class FileWrapper:
    """A server's ``wsgi.file_wrapper`` (it sends the file itself)."""

    def __init__(self, f: Any, blksize: int = 8192) -> None:
        self.f = f

    def __iter__(self) -> Iterator[bytes]:
        return iter([self.f.read()])


def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    path = environ["PATH_INFO"]
    if path == "/boom":
        raise ValueError("bad request body")
    if path == "/503":
        start_response("503 Service Unavailable", [])
        return [b"down"]
    if path == "/file":
        start_response("200 OK", [])
        return environ["wsgi.file_wrapper"](io.BytesIO(b"file"))  # type: ignore[no-any-return]
    start_response("200 OK", [("Content-Type", "text/plain")])
    if path == "/stream-fails":
        return _failing()
    if path == "/stream":
        return iter([b"o", b"k"])  # generated while the server sends it (tokens)
    return [b"o", b"k"]


def _failing() -> Iterator[bytes]:
    yield b"first"
    raise RuntimeError("the model died mid-stream")


def serve(application: Any, path: str) -> tuple[list[bytes], list[str]]:
    """What a WSGI server does (PEP 3333): call, iterate, close."""
    statuses: list[str] = []
    environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET", "wsgi.file_wrapper": FileWrapper}
    body = application(environ, lambda st, headers, exc_info=None: statuses.append(st))
    try:
        return list(body), statuses
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()


def test_every_request_is_one_event_even_through_two_layers(client: QueueClient) -> None:
    stacked = wsgi.RequestTimingMiddleware(wsgi.RequestTimingMiddleware(app))  # by hand and by the worker hook
    for _ in range(3):
        assert serve(stacked, "/") == ([b"o", b"k"], ["200 OK"])
    assert len(client.queued) == 3
    ev = client.queued[0]
    assert ev[2] == "req" and ev[6] == asgi.HTTP_CLASS and ev[8] > 0 and ev[11] is None
    assert ev[7] + ev[8] == ev[1]


def test_a_streamed_request_lasts_until_the_server_closes_the_body(client: QueueClient) -> None:
    body = wsgi.RequestTimingMiddleware(app)({"PATH_INFO": "/stream", "wsgi.file_wrapper": FileWrapper},
                                             lambda *a: None)
    assert list(body) == [b"o", b"k"]
    assert client.queued == []  # sent, not yet closed
    body.close()  # type: ignore[attr-defined]
    body.close()  # type: ignore[attr-defined]
    assert len(client.queued) == 1
    assert serve(wsgi.RequestTimingMiddleware(app), "/stream") == ([b"o", b"k"], ["200 OK"])
    assert len(client.queued) == 2


def test_a_body_computed_already_is_the_apps_own_list_timed_to_its_return(client: QueueClient) -> None:
    body = wsgi.RequestTimingMiddleware(app)({"PATH_INFO": "/", "wsgi.file_wrapper": FileWrapper}, lambda *a: None)
    assert type(body) is list and body == [b"o", b"k"]  # no layer between the server and the list
    assert len(client.queued) == 1 and client.queued[0][11] is None


@pytest.mark.parametrize(("path", "error"), [("/503", "503"), ("/boom", "ValueError"),
                                             ("/stream-fails", "RuntimeError")])
def test_a_failed_request_carries_its_error_and_the_error_propagates(client: QueueClient, path: str,
                                                                     error: str) -> None:
    if path == "/503":
        serve(wsgi.RequestTimingMiddleware(app), path)
    else:
        with pytest.raises((ValueError, RuntimeError)):
            serve(wsgi.RequestTimingMiddleware(app), path)
    assert [e[11] for e in client.queued] == [error]


def test_a_file_the_server_sends_stays_its_file_wrapper(client: QueueClient) -> None:
    environ = {"PATH_INFO": "/file", "wsgi.file_wrapper": FileWrapper}
    body = wsgi.RequestTimingMiddleware(app)(environ, lambda *a: None)
    assert isinstance(body, FileWrapper)  # the server's sendfile path still sees it
    assert len(client.queued) == 1 and client.queued[0][11] is None


def test_nothing_is_timed_while_the_hooks_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_state, "current", _state.HookState())
    body = wsgi.RequestTimingMiddleware(app)({"PATH_INFO": "/"}, lambda *a: None)
    assert body == [b"o", b"k"]  # the app's own list, untouched


def test_a_gunicorn_worker_class_wraps_the_app_it_loads_once(client: QueueClient) -> None:
    class Worker:
        def load_wsgi(self) -> None:
            self.wsgi = app

    class SyncWorker(Worker):
        pass

    wsgi.wrap_gunicorn_worker(SyncWorker)
    wsgi.wrap_gunicorn_worker(SyncWorker)  # imported twice: one layer
    w = SyncWorker()
    w.load_wsgi()
    assert isinstance(w.wsgi, wsgi.RequestTimingMiddleware) and w.wsgi.app is app
    assert Worker.load_wsgi is not SyncWorker.load_wsgi  # the base class (UvicornWorker's too) is left alone
    serve(w.wsgi, "/")
    assert len(client.queued) == 1


class ClosingIterator:
    """werkzeug's shape (Flask's response body): its own iterator, with callbacks run by close()."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.it = iter(chunks)
        self.closed = 0

    def __iter__(self) -> ClosingIterator:
        return self

    def __next__(self) -> bytes:
        return next(self.it)

    def close(self) -> None:
        self.closed += 1


def test_a_client_that_leaves_mid_stream_is_no_failure_and_the_body_closes_once(client: QueueClient) -> None:
    """gunicorn stops iterating when its write fails (EPIPE: the client went away) and closes the body:
    the dropped iteration must not close the app's iterable a second time (Flask's call_on_close
    callbacks would run twice), nor count the request as failed."""
    inner = ClosingIterator([b"token1", b"token2", b"token3"])
    body = wsgi.RequestTimingMiddleware(lambda environ, sr: inner)({"PATH_INFO": "/"}, lambda *a: None)
    it = iter(body)
    assert next(it) == b"token1"
    del it  # the server's loop ends on OSError: the generator is dropped
    import gc

    gc.collect()
    body.close()  # type: ignore[attr-defined]
    body.close()  # type: ignore[attr-defined]
    assert inner.closed == 1
    assert [e[11] for e in client.queued] == [None]


def test_a_body_that_fails_is_still_closed(client: QueueClient) -> None:
    class Failing(ClosingIterator):
        def __next__(self) -> bytes:
            raise RuntimeError("the model died")

    inner = Failing([])
    body = wsgi.RequestTimingMiddleware(lambda environ, sr: inner)({"PATH_INFO": "/"}, lambda *a: None)
    with pytest.raises(RuntimeError):
        list(body)
    body.close()  # type: ignore[attr-defined]
    assert inner.closed == 1 and [e[11] for e in client.queued] == ["RuntimeError"]
