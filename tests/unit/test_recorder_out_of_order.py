"""Stages of the recorder ended out of order: A open, B opened inside it, A ended before B. The
current span stays on B (the innermost still open), and B's end does not make the ended A current
again: the next stage nests under the root, not under a stage that has ended. A's own end is
recorded as it happened."""

from __future__ import annotations

import contextvars
import threading

import pytest
from hook_fakes import collecting

from infersight.hooks import _recorder, _runtime, _state


def spans(client: object) -> dict[str, dict[str, object]]:
    return {str(d["a"]["infersight.stage"]): d for k, d in client.events if k == "span"}  # type: ignore[attr-defined]


def test_a_stage_ended_before_the_one_inside_it_is_no_later_stages_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    client, st = collecting(monkeypatch)
    root = st.runtime.root_span_id
    assert st.main_ident == threading.get_ident()  # set_current keeps main_span here too
    a = _recorder.begin("weights_load", start=100)
    b = _recorder.begin("weights_to_device", start=200)
    _recorder.end(a, end_ns=300)  # before b
    assert _runtime.current_span.get() == b.span == st.main_span  # b is still open
    c = _recorder.begin("cuda_init", start=400)
    assert c.parent == b.span
    _recorder.end(c, end_ns=500)
    assert _runtime.current_span.get() == b.span
    _recorder.end(b, end_ns=600)
    assert _runtime.current_span.get() is None and st.main_span is None  # not a, which has ended
    d = _recorder.begin("warmup", start=700)
    assert d.parent == root
    _recorder.end(d, end_ns=800)
    got = spans(client)
    assert (got["weights_load"]["p"], got["weights_load"]["s"], got["weights_load"]["e"]) == (root, 100, 300)
    assert (got["weights_to_device"]["p"], got["weights_to_device"]["s"], got["weights_to_device"]["e"]) == (
        a.span, 200, 600)  # it began inside a
    assert got["cuda_init"]["p"] == b.span
    assert got["warmup"]["p"] == root


def test_ends_out_of_order_under_an_open_stage_go_back_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outer stays open; a, b, c nest inside it and end a, c, b: the current span goes back to outer."""
    client, st = collecting(monkeypatch)

    def run() -> None:
        outer = _recorder.begin("model_build")
        a = _recorder.begin("weights_load")
        b = _recorder.begin("weights_to_device")
        c = _recorder.begin("cuda_init")
        _recorder.end(a)
        _recorder.end(c)
        assert _runtime.current_span.get() == b.span
        _recorder.end(b)
        assert _runtime.current_span.get() == outer.span
        nxt = _recorder.begin("warmup")
        assert nxt.parent == outer.span
        _recorder.end(nxt)
        _recorder.end(outer)
        assert _runtime.current_span.get() is None

    contextvars.copy_context().run(run)
    assert sorted(spans(client)) == ["cuda_init", "model_build", "warmup", "weights_load", "weights_to_device"]


def test_a_forked_child_skips_what_its_parent_ended_out_of_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork's child keeps its parent's current span: the stages its parent had ended out of order
    are skipped there too."""
    _client, st = collecting(monkeypatch)
    a = _recorder.begin("weights_load")
    b = _recorder.begin("weights_to_device")
    _recorder.end(a)
    child = st.forked(1)
    monkeypatch.setattr(_state, "current", child)
    _recorder.end(b, keep=False)  # opened by the parent: the child emits nothing of it
    assert _runtime.current_span.get() is None
