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
