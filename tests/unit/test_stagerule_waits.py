"""A wait rule (``until``) and an entry rule's fork readiness keep their state in the
process's ``HookState`` (``ColdStart.rule_*``): a forked child, which gets a new one, starts
its own, and a wait its parent opened before the fork is not the child's to end."""

from __future__ import annotations

import pytest
from hook_fakes import Emitted, collecting

from infersight.hooks import _stagerules, _state


def _collecting(monkeypatch: pytest.MonkeyPatch) -> Emitted:
    """A fresh hook state collecting a cold start whose root is open, emitting into a fake client."""
    return collecting(monkeypatch)[0]


def _fork(monkeypatch: pytest.MonkeyPatch, client: Emitted) -> None:
    child = _state.current.forked(2)
    child.runtime.client = client  # type: ignore[assignment]
    child.coldstart.collecting = True
    monkeypatch.setattr(_state, "current", child)


def test_a_wait_is_one_stage_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _collecting(monkeypatch)
    _stagerules._wait_begins("task_wait", "r", "m:loop")
    _stagerules._wait_begins("task_wait", "r", "m:loop")  # a second call while it is open: the same wait
    _stagerules._wait_ends("r", "m:task")
    _stagerules._wait_ends("r", "m:task")
    _stagerules._wait_begins("task_wait", "r", "m:loop")  # done in this process: no second wait
    _stagerules._wait_ends("r", "m:task")
    assert client.stages() == ["task_wait"]
    assert not _state.current.runtime.failed


def test_a_forked_child_has_its_own_wait_not_its_parents(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _collecting(monkeypatch)
    _stagerules._wait_begins("task_wait", "open", "m:loop")  # still open at the fork
    _stagerules._wait_begins("task_wait", "done", "m:loop")
    _stagerules._wait_ends("done", "m:task")
    assert client.stages() == ["task_wait"]
    _fork(monkeypatch, client)
    _stagerules._wait_ends("open", "m:task")  # the parent's wait: not ended by the child
    assert client.stages() == ["task_wait"]
    _stagerules._wait_begins("task_wait", "done", "m:loop")  # the child's own first wait counts
    _stagerules._wait_ends("done", "m:task")
    assert client.stages() == ["task_wait", "task_wait"]
    assert not _state.current.runtime.failed


def test_fork_readiness_is_sent_once_per_child(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _collecting(monkeypatch)
    _state.current.coldstart.ready_ns = 5  # the parent server was ready: its children inherit that
    _fork(monkeypatch, client)
    _stagerules._entered("r")
    _stagerules._entered("r")
    assert client.stages() == ["ready_wait"]
    _fork(monkeypatch, client)  # a grandchild forked from the child: one of its own
    _stagerules._entered("r")
    assert client.stages() == ["ready_wait", "ready_wait"]
    assert not _state.current.runtime.failed
