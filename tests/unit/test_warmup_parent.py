"""A warmup run's parent (``_readiness``, ``_checkpoint``), in-process with a FAKE client: the span its first
forward ran in (a user's stage, BentoML's ``service_init``), not always the root. The hooks sent every warmup
with the root as parent, so a service's warmup in its constructor was drawn as its ``service_init``'s sibling.
A forward in another span starts a run of its own; one that joins a run in flight from another span (another
thread, outside the stage) makes the run the root's: it would outlast the stage it began in."""

from __future__ import annotations

import contextvars
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hook_fakes import Emitted, collecting

from infersight.hooks import _checkpoint, _readiness, _runtime, _state

ROOT = "a" * 16
STAGE = "5" * 16


def _collecting(monkeypatch: pytest.MonkeyPatch) -> tuple[Emitted, _state.HookState]:
    """A fresh hook state collecting a cold start, its FAKE client with what readiness touches."""
    client, st = collecting(monkeypatch)
    client.producer = {}  # type: ignore[attr-defined]
    client.conn = SimpleNamespace(held=lambda: False)  # type: ignore[attr-defined]
    return client, st


def _warmups(client: Emitted) -> list[dict[str, Any]]:
    return [d for k, d in client.events if k == "span" and d["a"].get("infersight.stage") == "warmup"]


def _forward() -> None:
    token = _readiness.forward_begin()
    assert token is not None  # before readiness: warmup
    _readiness.forward_end(token)


def _in_stage(fn: Any, span: str = STAGE) -> Any:
    """Run ``fn`` with ``span`` current (as inside ``hooks.stage``), in a context of its own."""
    def run() -> Any:
        _runtime.current_span.set(span)
        return fn()

    return contextvars.copy_context().run(run)


def test_a_warmup_inside_a_stage_nests_in_it_and_one_after_it_is_the_roots(monkeypatch: pytest.MonkeyPatch) -> None:
    client, st = _collecting(monkeypatch)
    _in_stage(lambda: [_forward() for _ in range(3)])
    (opened,) = [s for s in _checkpoint.open_stages() if s[0] == "warmup"]
    assert opened[2] == STAGE  # a checkpoint sends it under its stage too (killed now: nested in its stand-in)
    _forward()  # after the stage, in no stage: a new run (the stage started none in between)
    _forward()
    _readiness.mark_ready()
    inner, outer = _warmups(client)
    assert (inner["p"], inner["a"]["infersight.warmup.forwards"]) == (STAGE, 3)
    assert (outer["p"], outer["a"]["infersight.warmup.forwards"]) == (ROOT, 2)
    assert inner["e"] <= outer["s"]
    assert not _state.current.runtime.failed


def test_forwards_of_two_spans_at_once_make_one_run_of_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    client, st = _collecting(monkeypatch)

    def in_flight() -> Any:
        return _readiness.forward_begin()

    token = _in_stage(in_flight)  # a forward inside the stage, still running ...
    _forward()  # ... when another thread's, in no stage, runs
    _in_stage(lambda: _readiness.forward_end(token))
    _readiness.mark_ready()
    (run,) = _warmups(client)
    assert (run["p"], run["a"]["infersight.warmup.forwards"]) == (ROOT, 2)


def test_a_fork_readiness_ends_at_the_warmup_s_end_not_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """(A closed run's fields moved by one: a worker's fork readiness confirmed at its last stage reads the
    run's end from them; with a forward still in flight, that end is the confirmation's time.)"""
    client, st = _collecting(monkeypatch)
    cs = st.coldstart
    cs.ready_ns, cs.ready_source = 1, "fork"
    token = _in_stage(_readiness.forward_begin)  # another thread's forward, still running
    assert token is not None
    started = cs.warm.start
    before = time.time_ns()
    assert _readiness.fork_ready("entry", at_last_stage=True)
    assert cs.ready_ns >= before > started  # the run's end, not its start
    _in_stage(lambda: _readiness.forward_end(token))
    (run,) = _warmups(client)
    assert run["e"] == cs.ready_ns
