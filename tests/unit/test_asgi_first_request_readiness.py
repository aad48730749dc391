"""Which request is the first one through uvicorn's own wrap of the app (``first_request=False``):
the first that arrives once readiness is known from a signal other than a request. A readiness
probe before that is not, and does not stop the wrap from finding the next one. And a worker
forked from a ready server has provisional readiness only where its parent's hooks are in place."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hook_fakes import QueueClient

from infersight.hooks import _readiness, _state, asgi


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(app: Any, path: str) -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(m: Any) -> None:
        return None

    asyncio.run(app({"type": "http", "method": "GET", "path": path}, receive, send))


@pytest.fixture
def begun(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A fresh state (no readiness yet, no listening watch, no ready file) whose cold start waits
    for its first request; FAKE request_begin records the paths it was asked for."""
    st = _state.HookState()
    st.runtime.client = QueueClient()
    monkeypatch.setattr(_state, "current", st)
    monkeypatch.setattr(_readiness, "pending_first", lambda: True)
    paths: list[str] = []

    def request_begin(source: str, attrs: Any = None) -> None:  # no handle: served as any other
        paths.append(str(attrs.get("url.path")))

    monkeypatch.setattr(_readiness, "request_begin", request_begin)
    return paths


@pytest.mark.parametrize("source", ["listening_socket", "listen", "ready_url", "mark_ready", "stage_rule", "fork"])
def test_the_uvicorn_wrap_finds_the_first_request_after_readiness(begun: list[str], source: str) -> None:
    wrap = asgi.ColdStartMiddleware(_app, first_request=False)
    _call(wrap, "/health")  # a readiness probe before readiness: not the first request
    assert begun == []
    cs = _state.current.coldstart
    cs.ready_ns, cs.ready_source = 1, source
    _call(wrap, "/generate")
    assert begun == ["/generate"]


def test_a_request_that_marked_readiness_is_no_signal_for_the_wrap(begun: list[str]) -> None:
    cs = _state.current.coldstart
    cs.ready_ns, cs.ready_source = 1, "request"
    _call(asgi.ColdStartMiddleware(_app, first_request=False), "/")
    assert begun == []


def test_an_app_added_middleware_takes_the_first_request_before_readiness(begun: list[str]) -> None:
    _call(asgi.ColdStartMiddleware(_app), "/")
    assert begun == ["/"]


@pytest.mark.parametrize("server", ["uvicorn.server", "gunicorn.workers.base", None])
@pytest.mark.parametrize("collecting", [True, False])
def test_fork_readiness_is_provisional_while_the_parents_hooks_are_in_place(
        collecting: bool, server: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    for name in _state.FORK_CONFIRMING_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    if server is not None:
        monkeypatch.setitem(sys.modules, server, types.ModuleType(server))
    parent = _state.ColdStart()
    parent.installed, parent.collecting = True, collecting
    parent.ready_ns, parent.ready_source = 5, "listen"
    child = parent.forked(root_start_ns=100)
    assert (child.ready_ns, child.ready_source) == (100, "fork")
    # provisional (not yet sent) where a server whose hooks confirm it runs (its request hooks, loop
    # entry, uvicorn's startup or a listen tell when it is ready); where the parent's cold start ended
    # those wrappers are gone, and with no such server nothing would tell: final at the fork
    assert child.rule_fork_ready_sent is (not (collecting and server is not None))


def test_a_claim_made_while_the_sampler_polls_is_kept_for_its_next_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn's Server.startup claims its sockets once per process: when the sampler thread's poll
    holds the lock past the claim's short wait, the claim waits for the next poll instead of being
    lost (a uvicorn --workers worker then never became ready)."""

    class Watch:  # FAKE listen watch: records what it is told
        def __init__(self) -> None:
            self.claimed: list[int] = []

        def claim(self, inodes: Any) -> None:
            self.claimed.extend(inodes)

        def absorb(self) -> None:
            pass

        def poll(self) -> None:
            return None

    st = _state.ColdStart()
    st.watch_listen = True
    st.listen_watch = watch = Watch()
    monkeypatch.setattr(_readiness, "state", lambda: st)
    monkeypatch.setattr(_readiness, "root_open", lambda: True)
    with st.listen_poll:  # the sampler's poll is reading the tables
        _readiness.check_listening(claim={4242})
    assert watch.claimed == []
    _readiness.check_listening()  # the sampler's next poll
    assert watch.claimed == [4242]
