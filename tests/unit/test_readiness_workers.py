"""Readiness of workers (``_readiness``), in-process with a FAKE client:

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


def _collecting(monkeypatch: pytest.MonkeyPatch) -> tuple[Emitted, _state.HookState]:
    """A fresh hook state collecting a cold start, its FAKE client with what readiness and the root's
    end touch (a launch that holds nothing back)."""
    client, st = collecting(monkeypatch)
    client.producer = {}  # type: ignore[attr-defined]
    client.conn = SimpleNamespace(held=lambda: False)  # type: ignore[attr-defined]
    return client, st


def _stages(client: Emitted) -> list[str]:
    return [str(d["a"]["infersight.stage"]) for k, d in client.events if k == "span" and d.get("n") != "coldstart"]


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
