"""What ``hooks.stage`` notes while a cold start is collected, inline on the caller's thread:
the stage mark (a stage started since), each thread's count of open stages (the main
thread's on ``ColdStart``, read by its ``ImportThread``), the import cut and set aside when the
thread is ``busy``, the imports made inside a stage timed under it; the covered interval is
read from the queued tuple."""

from __future__ import annotations

import threading
import time
from importlib.machinery import ModuleSpec

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
    outer = it.stack
    it.busy = True
    it.piece_start = it.t_last = 1
    with hooks.stage("load") as s:
        start = s._start
        # the piece so far was charged and cut at the start, the import's stack set aside
        assert it.saved == [(1, outer, start)] and it.stack == [] and it.pkgs == {}
        with hooks.stage("nested"):
            pass
        assert it.saved == [(1, outer, start)]  # only the stage opened in the import takes it up again
    assert it.saved == [] and it.stack is outer
    assert it.piece_start == it.t_last == _recorder.covered_pairs(st.coldstart)[-1][1]  # resumed at its end
    assert it.busy  # still inside the import
    it.stack.pop()
    with hooks.stage("after"):
        pass
    assert not it.busy  # settled: nothing in progress, no run open


def test_an_idle_thread_takes_no_slow_path(st: _state.HookState, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(_imports, "stage_begins", lambda _st, _at, depth: calls.append(("begin", depth)))
    monkeypatch.setattr(_imports, "stage_ends", lambda _st, _at, depth: calls.append(("end", depth)))
    with hooks.stage("plain"), hooks.stage("nested"):
        pass
    assert calls == []
    st.imports.main.run_open = True  # as _imports._piece leaves a run open
    st.imports.main.busy = True
    with hooks.stage("after_a_run"), hooks.stage("nested"):
        pass
    assert calls == [("begin", 1), ("begin", 2), ("end", 2), ("end", 1)]  # every stage of a busy thread


# -- imports inside stages: real specs through the import system's own begin and end --------


def _spec(name: str) -> ModuleSpec:
    spec = ModuleSpec(name, None)
    _imports._timed(spec, 0)
    return spec


def _begin(spec: ModuleSpec, pause_s: float = 0.0) -> None:
    spec._initializing = True  # type: ignore[attr-defined]  # as _load_unlocked does before the body
    time.sleep(pause_s)


def _end(spec: ModuleSpec, pause_s: float = 0.0) -> None:
    time.sleep(pause_s)
    spec._initializing = False  # type: ignore[attr-defined]  # and after it


def _imports_emitted(st: _state.HookState) -> list[dict[str, object]]:
    return [d for *_x, kind, d in st.runtime.client.events  # type: ignore[union-attr]
            if kind == "span" and isinstance(d, dict) and d["n"] == "coldstart.framework_import"]


def test_an_import_inside_a_stage_is_a_run_under_it(st: _state.HookState) -> None:
    it = st.imports.main
    with hooks.stage("service_init") as s:
        span = s._span
        beta = _spec("beta")
        _begin(beta, 0.003)
        assert it.stack == ["beta"] and it.piece_parent == span
        _end(beta)
        assert it.run_open and it.busy
    (run,) = _imports_emitted(st)  # emitted at the stage's end: its imports are over
    assert run["p"] == span and run["a"]["infersight.framework"] == "beta"  # type: ignore[index]
    assert not it.busy and it.stack == [] and not it.run_open


def test_an_import_that_ends_inside_the_stage_opened_in_it_is_not_taken_up_again(st: _state.HookState) -> None:
    """A stage ended by another call than the one that began it (a model built from __init__ to post_init,
    an ``until`` rule) can outlive the import it was opened in."""
    it = st.imports.main
    alpha = _spec("alpha")
    _begin(alpha, 0.003)
    o = _recorder.begin("model_build")
    assert it.saved and it.stack == []
    _end(alpha)  # popped from its set-aside stack, not from the stage's
    assert it.saved[0][1] == [] and it.stack == []
    _recorder.end(o)
    assert it.stack == [] and it.saved == [] and not it.busy
    (run,) = _imports_emitted(st)  # alpha's time up to the stage, at the stage's start
    assert run["p"] == st.runtime.root_span_id and run["e"] <= o.start


def test_an_import_begun_in_a_stage_that_ends_first_goes_on_under_the_parent(st: _state.HookState) -> None:
    it = st.imports.main
    o = _recorder.begin("model_build")
    gamma = _spec("gamma")
    _begin(gamma, 0.003)
    _recorder.end(o)  # the stage ends inside gamma's body
    assert it.stack == ["gamma"] and it.piece_parent is None  # (the root) from the stage's end
    _end(gamma, 0.003)
    _imports.flush()
    inside, after = sorted(_imports_emitted(st), key=lambda d: d["s"])  # type: ignore[arg-type, return-value]
    assert inside["p"] == o.span and after["p"] == st.runtime.root_span_id
    assert inside["e"] <= after["s"]  # cut where the stage ended: no run outlives its parent


def test_stages_ended_out_of_order_leave_the_outermost_import_in_place(st: _state.HookState) -> None:
    it = st.imports.main
    alpha, beta = _spec("alpha"), _spec("beta")
    _begin(alpha)
    outer = it.stack
    a = _recorder.begin("first")  # opened in alpha: alpha set aside
    _begin(beta)
    b = _recorder.begin("second")  # opened in beta: beta set aside too
    assert [d for d, _s, _t in it.saved] == [1, 2]
    _recorder.end(a)  # ends before the stage opened inside it
    _recorder.end(b)
    assert it.saved == [] and it.stack is outer == ["alpha"]  # the outermost import counts again
    _end(beta)  # from the stack it was pushed on, now nobody's
    _end(alpha)
    assert it.stack == [] and it.saved == [] and not st.runtime.failed
    with hooks.stage("later"):
        pass
    assert not it.busy


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
