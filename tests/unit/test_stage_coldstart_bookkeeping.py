"""What ``hooks.stage`` notes while a cold start is collected, inline on the caller's thread:
the stage mark (a stage started since), each thread's count of open stages (the main
thread's on ``ColdStart``, read by its ``ImportThread``), the import cut when the thread is
``busy``; the covered interval is read from the queued tuple."""

from __future__ import annotations

import threading

import pytest
from conftest import FlatQueue

from infersight import hooks
from infersight.hooks import _imports, _recorder, _state


@pytest.fixture
def st(monkeypatch: pytest.MonkeyPatch) -> _state.HookState:
    """A fresh hook state, its cold start collected, with import timing installed."""
    hs = _state.HookState()
    q = FlatQueue()
    q.emit = lambda kind, data: q.events.append((0, 0, kind, data))  # type: ignore[attr-defined]
    hs.runtime.client = q  # type: ignore[assignment]
    hs.runtime.root_span_id = "r" * 16
    hs.coldstart.collecting = True
    hs.coldstart.imports = _imports
    monkeypatch.setattr(_state, "current", hs)
    return hs


def test_the_main_threads_import_state_is_the_cold_starts() -> None:
    hs = _state.HookState()
    main, cs = hs.imports.main, hs.coldstart
    main.paused += 2
    main.busy = True
    assert (cs.main_paused, cs.main_busy) == (2, True)
    cs.main_paused, cs.main_busy = 0, False
    assert (main.paused, main.busy) == (0, False)
    child = hs.forked(5)  # a forked child counts afresh, on its own cold start
    assert child.imports.main.paused == 0 and child.imports.main.cold is child.coldstart  # type: ignore[attr-defined]


def test_stages_change_the_mark_and_count_per_thread(st: _state.HookState) -> None:
    cs = st.coldstart
    seen: list[object] = []
    with hooks.stage("outer") as outer:
        seen.append(cs.stage_mark)
        assert cs.main_paused == 1 and cs.stage_mark == outer._span
        with hooks.stage("inner"):
            seen.append(cs.stage_mark)
            assert cs.main_paused == 2
        assert cs.main_paused == 1
    assert cs.main_paused == 0

    def other() -> None:
        it = st.imports.thread()
        with hooks.stage("elsewhere"):
            seen.append(cs.stage_mark)
            seen.append(it.paused)
        seen.append(it.paused)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert cs.main_paused == 0
    assert seen[3:] == [1, 0]  # the other thread's count, not the main thread's
    marks = seen[:3]
    assert len(set(marks)) == 3 and all(isinstance(m, str) for m in marks)  # each stage's own span id
    before = cs.stage_mark
    _recorder.note_begin()
    assert cs.stage_mark != before  # a stage of the recorder's changes it too
    pairs = _recorder.covered_pairs(cs)
    assert len(pairs) == 3 and all(s < e for s, e in pairs)  # three intervals, two on the main thread
    assert cs.covered == []  # none noted by the callers: read from their queued tuples
    assert _recorder.last_end() == max(e for _s, e in pairs)


def test_a_half_written_interval_is_not_read(st: _state.HookState) -> None:
    cs = st.coldstart
    cs.covered += (5, 15, 30)  # a start without its end
    assert _recorder.covered_pairs(cs) == [(5, 15)]
    assert _recorder.last_end() == 15
    cs.covered.append(40)
    assert _recorder.last_end() == 40 and (30, 40) in _recorder.covered_pairs(cs)


def test_a_stage_opened_before_collecting_leaves_the_count_at_zero(st: _state.HookState) -> None:
    cs = st.coldstart
    cs.collecting = False
    with hooks.stage("early"):
        cs.collecting = True
    assert cs.main_paused == 0


def test_a_stage_in_an_import_cuts_it_and_the_import_resumes_after(st: _state.HookState) -> None:
    it = st.imports.main
    it.stack.append("alpha")  # as _imports._begin leaves an outermost import in progress
    it.busy = True
    it.piece_start = it.t_last = 1
    with hooks.stage("load") as s:
        start = s._start
        assert it.pause_t == start and it.pkgs == {}  # the piece so far was charged and cut at the start
        with hooks.stage("nested"):
            pass
        assert it.pause_t == start  # only the outermost stage resumes it
    assert it.pause_t == 0 and it.piece_start == _recorder.covered_pairs(st.coldstart)[-1][1]  # resumed at its end
    assert it.busy  # still inside the import
    it.stack.pop()
    with hooks.stage("after"):
        pass
    assert not it.busy  # settled: nothing in progress, no run open


def test_an_idle_thread_takes_no_slow_path(st: _state.HookState, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_imports, "paused_first", lambda *a: calls.append("pause"))
    monkeypatch.setattr(_imports, "unpaused", lambda *a: calls.append("resume"))
    with hooks.stage("plain"):
        pass
    assert calls == []
    st.imports.main.run_open = True  # as _imports._piece leaves a run open
    st.imports.main.busy = True
    with hooks.stage("after_a_run"):
        pass
    assert calls == ["pause", "resume"]


def test_a_run_left_open_is_emitted_by_the_next_stage_and_busy_clears(st: _state.HookState) -> None:
    it = st.imports.main
    it.run_open = True
    it.busy = True
    with hooks.stage("next"):
        assert not it.run_open and not it.busy


def test_a_safetensors_handle_closed_without_with_leaves_import_timing_on(
        st: _state.HookState, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers opens a ``safe_open`` handle and closes it itself: its ``weights_load`` is
    emitted at the close, a stage that begins and ends there. The thread's import timing is
    paused for it and resumed after (it once stayed paused: no import timed again)."""
    from infersight.hooks import _runtime, _weights

    monkeypatch.setattr(_runtime, "active", lambda: True)

    class Probe:
        def attrs(self, *_a: object, **_k: object) -> dict[str, object]:
            return {"infersight.weights.bytes": 100}

    h = _weights._SafeOpen(None, "/m.safetensors")
    h._probe, h._nbytes, h._start = Probe(), 100, 1  # type: ignore[assignment]
    h._quiet = _weights._activity()
    mark = st.coldstart.stage_mark
    h._close(None)
    spans = [d for *_x, kind, d in st.runtime.client.events if kind == "span"]  # type: ignore[union-attr]
    assert [d["n"] for d in spans] == ["coldstart.weights_load"]
    assert st.coldstart.stage_mark is not mark  # the stage split warmups and import runs
    assert st.coldstart.main_paused == 0  # import timing resumed


def test_a_stage_opened_before_a_fork_ends_in_the_child_with_no_trace(st: _state.HookState) -> None:
    """The parent emits it: the child neither counts it, nor covers it, nor queues it."""
    parent_client = st.runtime.client
    with hooks.stage("across_the_fork"):
        child = _state.replace_after_fork(5)  # as _activate's after-fork handler does
        parent_client.enabled = False  # type: ignore[union-attr]  # close_inherited, in the child
        child_client = FlatQueue()
        child.runtime.client = child_client  # type: ignore[assignment]
        assert child.coldstart.collecting and not st.coldstart.collecting
    assert _state.current is child
    assert child.coldstart.main_paused == 0 and child.coldstart.covered == []
    assert st.coldstart.covered == []  # the parent's state (the child's copy) is left alone too
    assert child_client.events == [] and parent_client.events == []  # type: ignore[union-attr]
