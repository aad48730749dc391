"""The interval a ``hooks.stage`` covers is read from its queued tuple: by the readers
(``covered_pairs``, ``last_end``) while it waits in the queue, and noted in ``covered`` by
the drain thread before it leaves the queue; the caller notes it only when it is not queued."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from conftest import FlatQueue

from infersight import hooks
from infersight.hooks import _buffer, _imports, _recorder, _state


@pytest.fixture
def st(monkeypatch: pytest.MonkeyPatch) -> _state.HookState:
    """A fresh hook state, its cold start collected, stages queued on a fake client."""
    hs = _state.HookState()
    hs.runtime.client = FlatQueue()  # type: ignore[assignment]
    hs.runtime.root_span_id = "r" * 16
    hs.coldstart.collecting = True
    hs.coldstart.imports = _imports
    monkeypatch.setattr(_state, "current", hs)
    return hs


def _real_buffer(hs: _state.HookState) -> _buffer.Buffer:
    """A real buffer behind the fake client: ``take`` pops as the drain thread does."""
    buf = _buffer.Buffer(threading.Event(), max_events=64, batch_events=8)
    q: Any = hs.runtime.client
    q._buf = q.events = buf.events
    q.held = buf.held
    q._seq = buf.seq
    q.queue = buf.queue
    return buf


def test_a_queued_stage_is_covered_before_and_after_the_drain_thread_takes_it(st: _state.HookState) -> None:
    buf = _real_buffer(st)
    with hooks.stage("load", model="m"):
        pass
    with hooks.stage("unattributed"):  # the gap sampler's own: covers nothing
        pass
    assert st.coldstart.covered == []
    (pair,) = _recorder.covered_pairs(st.coldstart)  # from the queue
    assert pair[0] <= pair[1] and _recorder.last_end() == pair[1]
    taken = buf.take(10)
    assert [e[3]["n"] for e in taken] == ["coldstart.load", "coldstart.unattributed"]
    assert _recorder.covered_pairs(st.coldstart) == [pair]  # noted as it left the queue
    assert st.coldstart.covered == list(pair)


def test_a_stage_the_drain_thread_has_popped_but_not_built_is_covered(
        st: _state.HookState, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window between the pop and the build: the interval was noted before the pop."""
    buf = _real_buffer(st)
    seen: list[list[tuple[int, int]]] = []
    build = _buffer.builders["span"]

    def building(*args: Any) -> Any:
        seen.append(_recorder.covered_pairs(st.coldstart))  # what the root's end would read now
        assert len(buf.events) == 0  # popped already
        return build(*args)

    monkeypatch.setitem(_buffer.builders, "span", building)
    with hooks.stage("tokenizer_load") as s:
        start = s._start
    buf.take(10)
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0][0] == start


def test_nothing_is_noted_once_the_root_ended(st: _state.HookState) -> None:
    buf = _real_buffer(st)
    with hooks.stage("load"):
        pass
    st.coldstart.collecting = False
    buf.take(10)
    assert st.coldstart.covered == []


def test_a_stage_a_full_buffer_refuses_is_covered_by_the_caller(st: _state.HookState) -> None:
    q: Any = st.runtime.client
    q.calm = 0  # no calm range: the stage goes through queue(), which refuses it
    q.queue = lambda event: None
    with hooks.stage("load", batch=8) as s:
        start = s._start
    assert q.events == [] and st.coldstart.covered[0] == start and len(st.coldstart.covered) == 2


def test_a_stage_of_a_disabled_client_is_covered_by_the_caller(st: _state.HookState) -> None:
    q: Any = st.runtime.client
    with hooks.stage("load") as s:
        q.enabled = False  # an internal error, or the agent refused this producer
        start = s._start
    assert q.events == [] and st.coldstart.covered[0] == start


def test_a_stage_left_by_an_exception_is_built_with_its_name(st: _state.HookState) -> None:
    buf = _real_buffer(st)
    with pytest.raises(KeyError), hooks.stage("load", model="m"):
        raise KeyError("x")
    with hooks.stage("next"):
        pass
    queued = list(buf.events)
    assert queued[0][8] == "KeyError" and queued[1][8] is None
    built = [e[3] for e in buf.take(10)]
    assert built[0]["err"] == "KeyError" and "err" not in built[1]
    assert built[0]["a"]["model"] == "m" and built[0]["p"] == "r" * 16  # the root, filled in for a top stage
