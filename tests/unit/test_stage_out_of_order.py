"""User stages (``hooks.stage``) ended out of order: A entered, B entered inside it, A exited
before B (a generator's stage closed inside the caller's, manual ``__enter__``/``__exit__``).
As the recorder's stages do (``test_recorder_out_of_order``): the current span stays on B, the
innermost still open, and B's exit does not make the ended A current again, so later stages
nest under the root, not under a stage that has ended. A's own span is queued as it happened."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import FlatQueue

from infersight import hooks
from infersight.hooks import _recorder, _runtime, _state


@pytest.fixture
def st(monkeypatch: pytest.MonkeyPatch) -> _state.HookState:
    """A fresh hook state collecting a cold start, its stages queued in a FAKE client (the
    suite's fixture leaves no current span before and after each test)."""
    hs = _state.HookState()
    hs.runtime.client = FlatQueue()  # type: ignore[assignment]
    hs.runtime.root_span_id = "r" * 16
    hs.coldstart.collecting = True
    monkeypatch.setattr(_state, "current", hs)
    return hs


def parents(hs: _state.HookState) -> dict[str, object]:
    """Each queued user stage's parent span (None: the root)."""
    return {str(e[3]): e[5] for e in hs.runtime.client.events if e[2] == "span"}  # type: ignore[attr-defined]


def test_a_stage_exited_before_the_one_inside_it_is_no_later_stages_parent(st: _state.HookState) -> None:
    a = hooks.stage("weights_load").__enter__()
    b = hooks.stage("weights_to_device").__enter__()
    b_span = b._span
    a.__exit__(None, None, None)  # before b
    assert _runtime.current_span.get() == b_span == st.main_span  # b is still open
    with hooks.stage("cuda_init") as c:
        c_span = c._span
    assert _runtime.current_span.get() == b_span
    b.__exit__(None, None, None)
    assert _runtime.current_span.get() is None and st.main_span is None  # not a, which has ended
    with hooks.stage("warmup"):
        pass
    got = parents(st)
    assert got["weights_load"] is None
    assert got["weights_to_device"] not in (None, b_span)  # it began inside a: a's span
    assert got["cuda_init"] == b_span != c_span
    assert got["warmup"] is None


def test_a_generators_stage_closed_inside_the_callers_stage(st: _state.HookState) -> None:
    def batches() -> Iterator[int]:
        with hooks.stage("tokenizer_load"):
            yield 1

    gen = batches()
    next(gen)
    with hooks.stage("weights_load") as outer:
        outer_span = outer._span
        assert next(gen, None) is None  # the generator's stage ends here, inside weights_load
        assert _runtime.current_span.get() == outer_span
    assert _runtime.current_span.get() is None
    with hooks.stage("warmup"):
        pass
    got = parents(st)
    assert got["tokenizer_load"] is None and got["weights_load"] is not None
    assert got["warmup"] is None


def test_ends_out_of_order_under_an_open_stage_go_back_to_it(st: _state.HookState) -> None:
    """Outer stays open; a, b, c nest inside it and exit a, c, b: the current span goes back to outer."""
    with hooks.stage("model_build") as outer:
        a = hooks.stage("weights_load").__enter__()
        b = hooks.stage("weights_to_device").__enter__()
        c = hooks.stage("cuda_init").__enter__()
        b_span = b._span
        a.__exit__(None, None, None)
        c.__exit__(None, None, None)
        assert _runtime.current_span.get() == b_span
        b.__exit__(None, None, None)
        assert _runtime.current_span.get() == outer._span == st.main_span
        with hooks.stage("warmup"):
            pass
        assert parents(st)["warmup"] == outer._span
    assert _runtime.current_span.get() is None


def test_user_and_recorder_stages_skip_each_others_out_of_order_ends(st: _state.HookState) -> None:
    """One record of the stages ended out of order: a recorder's stage inside a user's, and a
    user's inside a recorder's, each outlived by the stage inside it."""
    a = hooks.stage("setup").__enter__()
    b = _recorder.begin("weights_load")
    a.__exit__(None, None, None)
    assert _runtime.current_span.get() == b.span
    _recorder.end(b)
    assert _runtime.current_span.get() is None

    o = _recorder.begin("model_build")
    u = hooks.stage("setup").__enter__()
    _recorder.end(o)
    assert _runtime.current_span.get() == u._span
    u.__exit__(None, None, None)
    assert _runtime.current_span.get() is None and st.main_span is None


def test_a_forked_child_skips_what_its_parent_ended_out_of_order(
        st: _state.HookState, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork's child keeps its parent's current span: a stage its parent had exited out of
    order is skipped there too, when the child exits the stage opened inside it."""
    a = hooks.stage("weights_load").__enter__()
    b = hooks.stage("weights_to_device").__enter__()
    a.__exit__(None, None, None)
    child = st.forked(1)
    monkeypatch.setattr(_state, "current", child)
    b.__exit__(None, None, None)  # opened by the parent: ended in the child on the parent's state
    assert _runtime.current_span.get() is None


def test_a_stage_exited_in_another_context_than_its_entrys_keeps_the_hooks_on(st: _state.HookState) -> None:
    """A stage entered in one context and exited in a copy of it (an asyncio task made inside the stage
    that closes it, ``contextvars.copy_context().run``): its token belongs to the entry's context, whose
    ``reset`` raises there. The exit sets the parent back instead; the hooks stay on and the span is queued."""
    import contextvars

    a = hooks.stage("weights_load").__enter__()
    ctx = contextvars.copy_context()  # the current span is a's in the copy too
    ctx.run(a.__exit__, None, None, None)
    assert ctx.run(_runtime.current_span.get) is None  # back to a's parent in the context it exited in
    assert "weights_load" in parents(st)
    assert not _runtime.state().failed  # the hooks were not turned off
    with hooks.stage("cuda_init"):
        pass
    assert "cuda_init" in parents(st)
