"""A wait rule (``until``) and an entry rule's fork readiness keep their state in the
process's ``HookState`` (``ColdStart.rule_*``): a forked child, which gets a new one, starts
its own, and a wait its parent opened before the fork is not the child's to end."""

from __future__ import annotations

import sys
import types

import pytest
from hook_fakes import Emitted, collecting

from infersight.hooks import _stagerules, _state


def _collecting(monkeypatch: pytest.MonkeyPatch) -> Emitted:
    """A fresh hook state collecting a cold start whose root is open, emitting into a fake client."""
    return collecting(monkeypatch)[0]


def _fork(monkeypatch: pytest.MonkeyPatch, client: Emitted) -> None:
    # a server whose hooks confirm a forked worker's readiness (gunicorn's entry rules) is loaded:
    # its fork readiness is provisional, for the entry rule to send (not whatever other tests imported)
    monkeypatch.setitem(sys.modules, "gunicorn.workers.base", types.ModuleType("gunicorn.workers.base"))
    child = _state.current.forked(2)
    child.runtime.client = client  # type: ignore[assignment]
    child.coldstart.collecting = True
    monkeypatch.setattr(_state, "current", child)


def test_a_wait_is_one_stage_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _collecting(monkeypatch)
    _stagerules._wait_begins("task_wait", "r", "m:loop", False)
    _stagerules._wait_begins("task_wait", "r", "m:loop", False)  # a second call while it is open: the same wait
    _stagerules._wait_ends("r", "m:task")
    _stagerules._wait_ends("r", "m:task")
    _stagerules._wait_begins("task_wait", "r", "m:loop", False)  # done in this process: no second wait
    _stagerules._wait_ends("r", "m:task")
    assert client.stages() == ["task_wait"]
    assert not _state.current.runtime.failed


def test_a_forked_child_has_its_own_wait_not_its_parents(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _collecting(monkeypatch)
    _stagerules._wait_begins("task_wait", "open", "m:loop", False)  # still open at the fork
    _stagerules._wait_begins("task_wait", "done", "m:loop", False)
    _stagerules._wait_ends("done", "m:task")
    assert client.stages() == ["task_wait"]
    _fork(monkeypatch, client)
    _stagerules._wait_ends("open", "m:task")  # the parent's wait: not ended by the child
    assert client.stages() == ["task_wait"]
    _stagerules._wait_begins("task_wait", "done", "m:loop", False)  # the child's own first wait counts
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


@pytest.mark.parametrize("a_first", [True, False])
def test_a_call_that_ends_one_wait_and_starts_another_ends_the_first_before(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path, a_first: bool) -> None:
    """``loop`` ends rule a's wait (its ``until``) and starts rule b's: a's stage ends before b's
    begins, whatever the order of the rules in the file (the ends of waits wrap outermost)."""
    import time
    import types

    rules = tmp_path / "r.toml"
    a = '[[stage]]\nid = "a"\nstage = "setup"\ntargets = ["m:begin"]\nuntil = ["m:loop"]\n'
    b = '[[stage]]\nid = "b"\nstage = "task_wait"\ntargets = ["m:loop"]\nuntil = ["m:task"]\n'
    rules.write_text('engine_version = "1"\n' + (a + b if a_first else b + a))
    targets, problems = _stagerules.load([str(rules)])
    assert not problems
    client = _collecting(monkeypatch)
    module = types.ModuleType("m")
    module.begin = lambda: None  # type: ignore[attr-defined]

    def loop() -> None:
        module.task()  # the wrapped task, looked up at the call

    module.loop = loop  # type: ignore[attr-defined]
    module.task = lambda: time.sleep(0.001)  # type: ignore[attr-defined]
    _stagerules._installer(targets["m"])(module)
    module.begin()
    time.sleep(0.001)
    module.loop()
    spans = {d["a"]["infersight.stage"]: d for kind, d in client.events if kind == "span"}
    assert set(spans) == {"setup", "task_wait"}, client.events
    assert spans["setup"]["e"] <= spans["task_wait"]["s"]
    assert not _state.current.runtime.failed


def test_a_nesting_wait_left_open_is_in_checkpoints_and_ends_with_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """A coroutine target's wait is its task's current span: the stages in it take it as parent. One whose
    ``until`` never comes is listed as a stage so far (the checkpoint a SIGKILLed process leaves), and the root's
    end emits it, so that its children keep their parent; the span current before it comes back when it ends
    in its own context, and a sync target's wait is no current span at all."""
    import contextvars

    from infersight.hooks import _recorder, _runtime

    client = _collecting(monkeypatch)
    ctx = contextvars.copy_context()  # the target's task
    ctx.run(_stagerules._wait_begins, "app_startup", "lifespan", "m:Lifespan.run", True)
    span = ctx.run(_runtime.current_span.get)
    assert span is not None and _runtime.current_span.get() is None  # only the task's context
    (so_far,) = _stagerules._open_waits()
    assert (so_far[0], so_far[1], so_far[2]) == ("app_startup", span, "a" * 16)
    assert so_far[5]["infersight.stage.rule"] == "lifespan"
    assert client.stages() == []
    _recorder.flush_runs(10**18, final=False)  # readiness: nothing yet
    assert client.stages() == []
    _recorder.flush_runs(10**18, final=True)  # the root's end
    assert client.stages() == ["app_startup"] and "infersight.stage.until" not in client.stage_attrs()[0]
    assert _stagerules._open_waits() == []
    # a sync target: no current span, not closed at the root's end (it has no children)
    _stagerules._wait_begins("task_wait", "loop", "m:loop", False)
    assert _runtime.current_span.get() is None and _stagerules._open_waits() == []
    _recorder.flush_runs(10**18, final=True)
    assert client.stages() == ["app_startup"]
    # ended in its own context by an until call: the span current before it is current again
    ctx2 = contextvars.copy_context()
    ctx2.run(_runtime.current_span.set, "b" * 16)
    ctx2.run(_stagerules._wait_begins, "app_startup", "lifespan2", "m:Lifespan.run", True)
    assert ctx2.run(_runtime.current_span.get) != "b" * 16
    ctx2.run(_stagerules._wait_ends, "lifespan2", "m:Lifespan.send")
    assert ctx2.run(_runtime.current_span.get) == "b" * 16
    assert client.stages() == ["app_startup", "app_startup"]
    assert client.stage_attrs()[1]["infersight.stage.until"] == "m:Lifespan.send"
    assert not _state.current.runtime.failed
