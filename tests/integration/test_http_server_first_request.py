"""The first-request hook of the standard library's HTTP servers (``hooks/_http_server.py``) on real
servers and real sockets, in this process: which request it takes (one that parsed, once readiness
is known, not a bare connect), when its response's first bytes went out and with which status (an
interim ``100 Continue`` is not the response), and that its wrappers come out when the cold start
ends. ``request_begin``/``first_response`` are FAKE recorders: what ``_readiness`` does with them is
the e2e tests' matter (``test_coldstart_first_request_servers.py``)."""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import time
import types
import wsgiref.simple_server
from collections.abc import Iterator
from typing import Any

import pytest
from hook_fakes import QueueClient

from infersight.hooks import _http_server, _readiness, _runtime, _state


class Recorded:
    """FAKE ``_readiness``: the requests begun (one handle, the first), and the first response."""

    def __init__(self) -> None:
        self.ready = True
        self.begun: list[tuple[str, dict[str, Any], int]] = []
        self.answered: list[tuple[Any, dict[str, Any] | None, int, int]] = []

    def request_begin(self, source: str, attrs: dict[str, Any], t_ns: int) -> object | None:
        self.begun.append((source, dict(attrs), t_ns))
        return types.SimpleNamespace(span="f" * 16) if len(self.begun) == 1 else None

    def first_response(self, handle: Any, attrs: dict[str, Any] | None, t_ns: int) -> None:
        self.answered.append((handle, attrs, t_ns, time.time_ns()))


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorded]:
    """http.server and wsgiref hooked on a fresh state; the wrappers taken out afterwards, as the end
    of a cold start takes them out."""
    st = _state.HookState()
    st.runtime.client = QueueClient()  # type: ignore[assignment]
    monkeypatch.setattr(_state, "current", st)
    rec = Recorded()
    monkeypatch.setattr(_readiness, "pending_first", lambda: not rec.answered)
    monkeypatch.setattr(_readiness, "ready_for_request", lambda: rec.ready)
    monkeypatch.setattr(_readiness, "request_begin", rec.request_begin)
    monkeypatch.setattr(_readiness, "first_response", rec.first_response)
    _http_server.install_http_server(http.server)
    _http_server.install_wsgiref(wsgiref.simple_server)
    try:
        yield rec
    finally:
        while st.coldstart.undo:
            st.coldstart.undo.pop()()


class Handler(http.server.BaseHTTPRequestHandler):
    """Answers 201 after 0.05 s; a request that expects it gets its ``100 Continue`` from the handler,
    as werkzeug's does (not from ``parse_request``)."""

    protocol_version = "HTTP/1.1"
    spans: list[str | None] = []  # the current span in each request: the first request's, in it

    def handle_expect_100(self) -> bool:
        return True  # answered by do_POST

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.headers.get("Expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.rfile.read(int(self.headers["Content-Length"]))
        self.spans.append(_runtime.current_span.get())
        time.sleep(0.05)
        self.send_response(201)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


def serving(server: Any) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return t


def post(port: int, path: str, expect: bool = False) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Length": "4"}
    if expect:
        headers["Expect"] = "100-continue"
    conn.request("POST", path, body=b"data", headers=headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


def test_the_first_parsed_request_after_readiness_to_its_status_line(hooked: Recorded) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving(server)
    port = server.server_address[1]
    try:
        socket.create_connection(("127.0.0.1", port)).close()  # a bare connect: no request
        hooked.ready = False
        assert post(port, "/health") == 201  # before readiness: a readiness probe, no first request
        assert hooked.begun == []
        hooked.ready = True
        sent = time.time_ns()
        # an interim 100 Continue goes out before the response: the response's status line ends it
        assert post(port, "/v1/generate?stream=0", expect=True) == 201
        assert post(port, "/health") == 201
    finally:
        server.shutdown()
        server.server_close()
    (source, attrs, begun_ns), *later = hooked.begun
    assert later == []  # the first request answered: no later one is asked about
    assert (source, attrs) == ("http.server", {"http.request.method": "POST", "url.path": "/v1/generate"})
    ((_handle, answer, sent_ns, called_ns),) = hooked.answered
    assert answer == {"http.response.status_code": 201}
    assert sent <= begun_ns < sent_ns <= called_ns
    assert sent_ns - begun_ns >= 50_000_000  # the handler's own work, to its response (not the 100 Continue)
    assert Handler.spans == [None, "f" * 16, None]  # what the first request runs nests under it


def test_a_handler_that_fails_has_its_error(hooked: Recorded) -> None:
    class Failing(Handler):
        def do_GET(self) -> None:  # noqa: N802
            raise RuntimeError("the model is not loaded")

    server = http.server.HTTPServer(("127.0.0.1", 0), Failing)
    serving(server)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        conn.request("GET", "/")
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            conn.getresponse()
        conn.close()
        deadline = time.monotonic() + 10
        while not hooked.answered and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        server.shutdown()
        server.server_close()
    ((_handle, answer, sent_ns, _called),) = hooked.answered
    assert answer == {"error.type": "RuntimeError"} and sent_ns == 0  # nothing went out: it ends when it failed


def test_wsgiref_reads_the_status_of_its_app(hooked: Recorded) -> None:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("404 Not Found", [("Content-Length", "4")])
        return [b"gone"]

    class Quiet(wsgiref.simple_server.WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = wsgiref.simple_server.make_server("127.0.0.1", 0, app, handler_class=Quiet)
    serving(server)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        conn.request("GET", "/models/x")
        assert conn.getresponse().status == 404
        conn.close()
    finally:
        server.shutdown()
        server.server_close()
    assert [(s, a) for s, a, _t in hooked.begun] == [
        ("http.server", {"http.request.method": "GET", "url.path": "/models/x"})
    ]
    ((_handle, answer, sent_ns, _called),) = hooked.answered
    assert answer == {"http.response.status_code": 404} and sent_ns > hooked.begun[0][2]


def test_the_wrappers_come_out_with_the_cold_start(hooked: Recorded) -> None:
    cls = http.server.BaseHTTPRequestHandler
    assert getattr(cls.handle_one_request, "_infersight", False)
    assert getattr(cls.parse_request, "_infersight", False)
    assert getattr(wsgiref.simple_server.WSGIRequestHandler.handle, "_infersight", False)
    for undo in reversed(_state.current.coldstart.undo):
        undo()
    _state.current.coldstart.undo.clear()
    assert not getattr(cls.handle_one_request, "_infersight", False)
    assert not getattr(cls.parse_request, "_infersight", False)
    assert "handle" in wsgiref.simple_server.WSGIRequestHandler.__dict__  # its own, back
    assert not getattr(wsgiref.simple_server.WSGIRequestHandler.handle, "_infersight", False)
