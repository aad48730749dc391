"""Readiness of workers (``_readiness``), in-process with a FAKE client:

- under ``launch --ready-url``, a process that launch's child started (a spawned worker,
  ``ready_file_inherited``) is ready by the URL's answer only once it serves itself
  (``server_started``), at the later of the two: with several workers, the URL's answer says that
  one of them serves, not which;
- a worker forked from a ready server whose provisional readiness was never confirmed (its app
  failed to load, it was stopped while loading) was never ready: at exit its root ends there, not at
  the fork; one whose readiness was confirmed stays ready at exit."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
from hook_fakes import Emitted, collecting

from infersight.hooks import _readiness, _state


class Sock:
    """FAKE socket a server serves on: its address only."""

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", 8123)

    def fileno(self) -> int:
        raise OSError("not a real socket")


def _collecting(monkeypatch: pytest.MonkeyPatch) -> tuple[Emitted, _state.HookState]:
    """A fresh hook state collecting a cold start, its FAKE client with what readiness and the root's
    end touch (a launch that holds nothing back)."""
    client, st = collecting(monkeypatch)
    client.producer = {}  # type: ignore[attr-defined]
    client.conn = SimpleNamespace(held=lambda: False)  # type: ignore[attr-defined]
    return client, st


def _stages(client: Emitted) -> list[str]:
    return [str(d["a"]["infersight.stage"]) for k, d in client.events if k == "span" and d.get("n") != "coldstart"]


def _worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> tuple[Emitted, _state.ColdStart, Any]:
    client, st = _collecting(monkeypatch)
    cs = st.coldstart
    path = tmp_path / "ready"
    cs.ready_file = str(path)
    cs.ready_file_inherited = True  # passed on by launch's child
    return client, cs, path


def _ready_wait(client: Emitted) -> dict[str, Any]:
    (a,) = [d for k, d in client.events if k == "span" and d["a"].get("infersight.stage") == "ready_wait"]
    return a


def test_a_started_process_is_ready_by_the_url_only_once_it_serves(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Any) -> None:
    client, cs, path = _worker(monkeypatch, tmp_path)
    path.write_text("%d %d" % (100, 90))  # a sibling answered the URL's poll at 100
    assert not _readiness.ready_for_request()  # a request now: this worker does not serve yet
    token = _readiness.forward_begin()
    assert token is not None  # its forwards are warmup
    _readiness.forward_end(token)  # (and restores the current span: the next test's stages would nest under it)
    _readiness.tick()
    assert cs.ready_ns is None
    _readiness.server_started(None, [Sock()], "hypercorn.asyncio.start_server")
    assert cs.ready_source == "ready_url"
    assert cs.ready_ns == cs.serving_ns > 100  # when it served, not when the URL answered
    a = _ready_wait(client)["a"]
    assert a["infersight.ready.via"] == "hypercorn.asyncio.start_server"
    assert a["server.port"] == 8123
    assert not _state.current.runtime.failed


def test_a_serving_process_takes_a_later_answer_of_the_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    client, cs, path = _worker(monkeypatch, tmp_path)
    _readiness.server_started(None, [Sock()], "uvicorn.Server.startup")  # serves; the URL has not answered
    assert cs.ready_ns is None and cs.serving_ns
    answered = cs.serving_ns + 5_000_000
    path.write_text("%d %d" % (answered, answered - 1_000_000))
    _readiness.tick()  # the sampler's tick looks for it while it serves
    assert (cs.ready_ns, cs.ready_source) == (answered, "ready_url")
    assert _ready_wait(client)["e"] <= answered
    assert not _state.current.runtime.failed


def test_launch_s_own_child_is_ready_by_the_url_whatever_it_serves(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Any) -> None:
    client, cs, path = _worker(monkeypatch, tmp_path)
    cs.ready_file_inherited = False
    path.write_text("100")
    assert _readiness.ready_for_request()
    assert (cs.ready_ns, cs.ready_source) == (100, "ready_url")


def _forked_worker(monkeypatch: pytest.MonkeyPatch) -> Emitted:
    """A worker forked from a ready gunicorn master (its readiness provisional at the fork)."""
    client, st = _collecting(monkeypatch)
    st.coldstart.installed = True
    st.coldstart.ready_ns, st.coldstart.ready_source = 5, "listen"
    monkeypatch.setitem(sys.modules, "gunicorn.workers.base", types.ModuleType("gunicorn.workers.base"))
    child = st.forked(10)
    child.runtime.client = client  # type: ignore[assignment]
    child.coldstart.collecting = True
    monkeypatch.setattr(_state, "current", child)
    assert child.coldstart.ready_source == "fork" and not child.coldstart.rule_fork_ready_sent
    return client


def _root(client: Emitted) -> dict[str, Any]:
    (a,) = [d["a"] for k, d in client.events if k == "span" and d.get("n") == "coldstart"]
    return a


def test_a_forked_worker_never_confirmed_was_never_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _forked_worker(monkeypatch)
    _readiness.at_exit()  # its app failed to load: it exits before its serving loop
    root = _root(client)
    assert root["infersight.coldstart.ended_by"] == "exit"
    assert "infersight.coldstart.ready_s" not in root
    assert "infersight.ready.source" not in root
    assert "ready_wait" not in _stages(client)


def test_a_forked_worker_that_reached_its_loop_stays_ready_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _forked_worker(monkeypatch)
    assert _readiness.fork_ready("gunicorn.worker_loop")  # its accept loop: it serves
    _readiness.at_exit()  # stopped later, before any request
    root = _root(client)
    assert root["infersight.coldstart.ended_by"] == "ready"
    assert root["infersight.ready.source"] == "fork"
    assert _stages(client) == ["ready_wait"]
