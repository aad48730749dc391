"""The ASGI middleware times every HTTP request (issue 26), once even when stacked, and
uvicorn's loaded app is wrapped without a code change."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hook_fakes import QueueClient

from infersight.hooks import _readiness, _state, asgi


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> QueueClient:
    c = QueueClient()
    st = _state.HookState()
    st.runtime.client = c
    monkeypatch.setattr(_state, "current", st)
    monkeypatch.setattr(_readiness, "pending_first", lambda: False)  # after the first request
    return c


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if scope.get("path") == "/boom":
        raise ValueError("bad request body")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(app: Any, scope: dict[str, Any]) -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(m: Any) -> None:
        return None

    asyncio.run(app(dict(scope), receive, send))


def test_every_request_is_one_event_even_through_two_layers(client: QueueClient) -> None:
    app = asgi.ColdStartMiddleware(asgi.ColdStartMiddleware(_app))  # added by hand and by the uvicorn wrap
    for _ in range(3):
        _call(app, {"type": "http", "method": "GET", "path": "/"})
    _call(app, {"type": "lifespan"})
    assert len(client.queued) == 3
    ev = client.queued[0]
    assert ev[2] == "req" and ev[6] == asgi.HTTP_CLASS and ev[8] > 0 and ev[11] is None
    assert ev[7] + ev[8] == ev[1]  # start + duration = the event's time


def test_a_failed_request_carries_its_error_and_the_error_propagates(client: QueueClient) -> None:
    with pytest.raises(ValueError, match="bad request body"):
        _call(asgi.ColdStartMiddleware(_app), {"type": "http", "method": "POST", "path": "/boom"})
    assert [e[11] for e in client.queued] == ["ValueError"]


@pytest.mark.parametrize(("status", "error"), [(200, None), (404, None), (499, None), (500, "500"), (503, "503")])
def test_a_server_error_response_is_a_failed_request(client: QueueClient, status: int, error: str | None) -> None:
    """A server that answers 503 at once (its engine down, a FastAPI exception handler) did not
    serve the request fast: a status of 500 or more is the request's error.type, as an exception is."""

    async def answers(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    _call(asgi.ColdStartMiddleware(asgi.ColdStartMiddleware(answers)), {"type": "http", "method": "GET", "path": "/"})
    assert [e[11] for e in client.queued] == [error]


def test_the_event_builds_into_a_valid_req(client: QueueClient) -> None:
    from infersight.agent.requests.kind import parse_req
    from infersight.hooks import _request

    _call(asgi.ColdStartMiddleware(_app), {"type": "http", "method": "GET", "path": "/"})
    ev = client.queued[0]
    data = _request._request_data(*ev[3:])  # what the drain thread builds from the tuple
    req = parse_req(data)
    assert req.request_class == "http" and req.device is None and req.duration_s > 0


def test_uvicorn_config_load_wraps_the_app_once(client: QueueClient, monkeypatch: pytest.MonkeyPatch) -> None:
    uvicorn_config = pytest.importorskip("uvicorn.config")
    monkeypatch.setattr(uvicorn_config.Config, "load", uvicorn_config.Config.load)  # restored after
    asgi.wrap_uvicorn(uvicorn_config)
    asgi.wrap_uvicorn(uvicorn_config)  # idempotent
    cfg = uvicorn_config.Config(_app, lifespan="off", log_level="warning")
    cfg.load()
    assert isinstance(cfg.loaded_app, asgi.ColdStartMiddleware)
    assert not isinstance(cfg.loaded_app.app, asgi.ColdStartMiddleware)
    _call(cfg.loaded_app, {"type": "http", "method": "GET", "path": "/"})
    assert len(client.queued) == 1


def test_nothing_is_timed_while_the_hooks_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_state, "current", _state.HookState())  # no client: the hooks are off
    scopes: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scopes.append(scope)

    _call(asgi.ColdStartMiddleware(app), {"type": "http", "method": "GET", "path": "/"})
    assert len(scopes) == 1 and asgi.TIMED not in scopes[0]  # passed straight through, untouched


def test_the_uvicorn_wrap_leaves_the_first_request_to_the_apps_own_middleware(
    client: QueueClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    begun: list[str] = []

    def request_begin(source: str, attrs: Any = None) -> None:  # no handle: the request goes on as any other
        begun.append(str(attrs.get("url.path")))

    monkeypatch.setattr(_readiness, "pending_first", lambda: True)  # the cold start waits for its first request
    monkeypatch.setattr(_readiness, "request_begin", request_begin)
    _call(asgi.ColdStartMiddleware(_app, first_request=False), {"type": "http", "method": "GET", "path": "/health"})
    assert begun == []  # a readiness probe through the uvicorn wrap alone is no first_request
    stacked = asgi.ColdStartMiddleware(asgi.ColdStartMiddleware(_app), first_request=False)
    _call(stacked, {"type": "http", "method": "GET", "path": "/v1/completions"})
    assert begun == ["/v1/completions"]  # the app's own middleware still sees it
    assert len(client.queued) == 2  # and each request was timed once


class FirstHandle:
    """FAKE first-request handle of ``_readiness``: when it began, the span it is."""

    start = 1
    span = "b" * 16


def _first_request(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, dict[str, Any], list[str]]]:
    """The first request's path with a FAKE readiness: records each first_response as (its
    time, its attributes, what the server had been handed by then)."""
    sent: list[str] = []
    ended: list[tuple[int, dict[str, Any], list[str]]] = []
    monkeypatch.setattr(_readiness, "pending_first", lambda: True)
    monkeypatch.setattr(_readiness, "request_begin", lambda source, attrs=None: FirstHandle())
    monkeypatch.setattr(_readiness, "first_response",
                        lambda handle, attrs, t_ns=0: ended.append((t_ns, dict(attrs), list(sent))))
    return ended


def test_the_first_chunk_goes_out_before_the_cold_start_ends(client: QueueClient,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Ending the cold start flushes every stage: the client must not wait for it. The chunk is
    handed over first; first_request ends at the moment it was."""
    import time

    ended = _first_request(monkeypatch)
    handed: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(m: Any) -> None:
        handed.append(time.time_ns())
        if m["type"] == "http.response.body":
            assert ended == []  # not ended yet while the server takes the chunk

    asyncio.run(asgi.ColdStartMiddleware(_app)({"type": "http", "method": "GET", "path": "/"}, receive, send))
    (t_ns, attrs, _), = ended
    assert 0 < t_ns <= handed[-1]  # the moment it was handed over, not after the flush
    assert attrs["http.response.status_code"] == 200 and "error.type" not in attrs


def test_a_chunk_the_server_could_not_take_ends_first_request_with_the_error(
    client: QueueClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ended = _first_request(monkeypatch)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(m: Any) -> None:
        if m["type"] == "http.response.body":
            raise OSError("client went away")

    with pytest.raises(OSError, match="client went away"):
        asyncio.run(asgi.ColdStartMiddleware(_app)({"type": "http", "method": "GET", "path": "/"}, receive, send))
    (_, attrs, _), = ended
    assert attrs["error.type"] == "OSError"


def test_a_send_held_by_backpressure_does_not_hold_the_cold_start(
    client: QueueClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that drains its writer may hold the first chunk's send open: the chunk was handed over,
    so the cold start ends from the loop meanwhile, without an error, and a later cancellation of that
    send (the server shutting down) does not tag it."""
    ended = _first_request(monkeypatch)
    pending: list[bool] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def main() -> None:
        held = asyncio.Event()

        async def send(m: Any) -> None:
            if m["type"] == "http.response.body":
                pending.append(True)
                await held.wait()  # never set: backpressure that does not clear

        task = asyncio.ensure_future(
            asgi.ColdStartMiddleware(_app)({"type": "http", "method": "GET", "path": "/"}, receive, send))
        for _ in range(20):
            await asyncio.sleep(0)
            if ended:
                break
        assert pending and ended and not task.done()  # ended while the send was still held
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    (_, attrs, _), = ended
    assert attrs["http.response.status_code"] == 200 and "error.type" not in attrs
