"""The hooks' per-process state (``hooks/_state.py``): one instance per process, replaced
(not reset field by field) in a forked child, carrying over only what must survive."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FlatQueue, hook_env

from infersight.hooks import _state


def test_a_forked_cold_start_starts_over_and_keeps_what_the_fork_kept() -> None:
    parent = _state.ColdStart()
    parent.installed = parent.collecting = True
    parent.role = "helper"
    parent.ready_ns, parent.ready_source = 10, "listen"
    parent.last_end_ns = 20
    parent.explicit = True
    parent.first_done = True
    parent.first, parent.warm = object(), object()
    parent.covered += (1, 2)
    parent.children_dir = "/run/children"
    parent.main_end_ns = 30
    parent.undo.append(lambda: None)
    parent.post_import["torch"] = []
    parent.watched.add("torch")
    parent.callbacks["ready"] = lambda t: None
    parent.finder, parent.imports = object(), object()
    parent.tls.compile = 1

    child = parent.forked(root_start_ns=100)

    assert child is not parent
    # What the fork kept in memory, and what stays true, is carried over...
    assert child.installed and child.collecting and child.role == "helper"
    assert child.undo is parent.undo and child.post_import is parent.post_import
    assert child.watched is parent.watched and child.callbacks is parent.callbacks
    assert child.finder is parent.finder and child.imports is parent.imports
    # ... readiness (the fork: ready_source "fork") and the last stage's end move to the child's own root ...
    assert (child.ready_ns, child.ready_source, child.last_end_ns) == (100, "fork", 100)
    assert child.parent_dir == "/run/children" and child.children_dir is None
    # ... and the rest starts fresh.
    assert child.first is None and child.warm is None and not child.first_done and not child.explicit
    assert child.covered == [] and child.main_end_ns == 0
    assert child.lock is not parent.lock and not hasattr(child.tls, "compile")


def test_a_forked_allocator_attaches_again() -> None:
    parent = _state.Alloc()
    parent.installed = parent.started = parent.observer_attached = True
    parent.torch = torch = object()
    parent.history, parent.backend = 8, "native"
    parent.prev_sys_hook = hook = print
    parent.last_obs[1] = (0.0, None, 0)
    parent.status["observer"] = True

    child = parent.forked()

    assert child.installed and child.torch is torch and child.prev_sys_hook is hook
    assert not child.started and not child.observer_attached and child.history == 0
    assert child.last_obs == {} and child.status["observer"] is False
    assert child.wake is not parent.wake


def test_the_hook_state_follows_the_forking_thread() -> None:
    state = _state.HookState()
    state.main_span = "a" * 16
    child = state.forked(root_start_ns=1)
    assert child.main_ident == threading.get_ident()
    assert child.main_span is None
    assert child.coldstart is not state.coldstart and child.alloc is not state.alloc


def test_installing_a_fresh_state_resets_every_part_of_the_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer, import timing, nn.init runs, weights and requests all keep their state in
    ``_state.current``: a test installs a fresh instance and every module sees a clean slate."""
    from infersight.hooks import _build, _imports, _runtime, _weights

    old = _state.HookState()
    old.runtime.client = client = FlatQueue()
    old.runtime.root_span_id = "b" * 16
    monkeypatch.setattr(_state, "current", old)
    old.imports.runs[1] = _imports._Run("p" * 16, 0, 10_000_000, {"pkg": 10_000_000}, 0)
    old.build.init_runs[1] = ["p" * 16, 0, 10_000_000, 3, 0, "s" * 16]
    old.build.hf_done = True
    old.weights.mapped.append(object())
    old.requests.hw_cache[0] = ("GPU-0", "name")
    assert [r[0] for r in _imports.open_runs() + _build.open_runs()] == ["framework_import", "model_build"]
    assert _runtime.state().client is client

    child = old.forked(root_start_ns=5)  # a fork keeps what its memory kept, and no open run
    assert child.runtime.client is client and child.build.hf_done and child.weights.mapped is old.weights.mapped
    assert child.imports.runs == {} and child.build.init_runs == {}
    assert child.requests.hw_cache == {0: ("GPU-0", "name")}

    monkeypatch.setattr(_state, "current", _state.HookState())
    assert _imports.open_runs() == [] and _build.open_runs() == []
    assert _runtime.state().client is None and not _runtime.active()
    assert _weights._weights().mapped == [] and not _state.current.build.hf_done
    assert _state.current.requests.hw_cache == {}


FORK = textwrap.dedent("""\
    import os, sys
    from infersight import hooks
    from infersight.hooks import _coldstart, _state
    before = _state.current
    assert before.coldstart.collecting
    with hooks.stage("load"):
        before.coldstart.covered += (1, 2)
        pid = os.fork()
        if pid == 0:
            after = _state.current
            ok = (after is not before and after.coldstart.installed and after.coldstart.collecting
                  and after.coldstart.covered[:2] != [1, 2]  # its own: the fork's runtime_init at most
                  and len(after.coldstart.covered) <= 2 and after.coldstart.undo is before.coldstart.undo
                  and _coldstart.state() is after.coldstart)
            os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert _state.current is before  # the parent keeps its own
    """)


def test_fork_replaces_the_state_of_a_hooked_process(tmp_path: Path) -> None:
    env = hook_env(tmp_path / "none.sock", tmp_path / "spool", INFERSIGHT_EXIT_FLUSH_S="0")
    p = subprocess.run([sys.executable, "-c", FORK], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "hooks disabled" not in p.stderr


FORK_IN_AN_IMPORT = textwrap.dedent("""\
    import os, sys
    from infersight.hooks import _imports, _runtime
    import forker  # forks in its body: the child finishes the import its parent was timing
    if forker.pid == 0:
        root = _runtime.state().root_start_ns
        early = [r for r in _imports.open_runs() if r[3] < root]  # the parent's import, in the child
        os._exit(3 if early else 0)
    _, status = os.waitpid(forker.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert _imports.open_runs(), "the parent times its import"
    """)


def test_a_child_forked_inside_an_import_times_none_of_its_parents(tmp_path: Path) -> None:
    (tmp_path / "forker").mkdir()
    (tmp_path / "forker" / "__init__.py").write_text("import os, time\ntime.sleep(0.02)\npid = os.fork()\n")
    env = hook_env(tmp_path / "none.sock", tmp_path / "spool", INFERSIGHT_EXIT_FLUSH_S="0")
    env["PYTHONPATH"] += ":" + str(tmp_path)
    p = subprocess.run([sys.executable, "-c", FORK_IN_AN_IMPORT], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "hooks disabled" not in p.stderr


def _fresh_state(monkeypatch: pytest.MonkeyPatch, client: Any) -> None:
    """A fresh ``HookState`` whose producer is ``client``, in trace a..a under root b..b."""
    st = _state.HookState()
    st.runtime.client = client
    st.runtime.trace_id = "a" * 32
    st.runtime.root_span_id = "b" * 16
    monkeypatch.setattr(_state, "current", st)


def test_a_stage_is_queued_flat_and_built_on_the_drain_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from infersight import hooks
    from infersight.hooks import _buffer

    queue = FlatQueue()
    _fresh_state(monkeypatch, queue)
    with hooks.stage("outer"), pytest.raises(ValueError), hooks.stage("load", model="m", batch=8):
        raise ValueError("x")
    inner, outer = queue.events
    assert len(inner) > 4  # flat: (seq, t_ns, kind, *args) for the drain thread's builder
    assert all(v is None or v.__class__ in (str, int) for v in inner)  # atomic values only: the GC lets go early
    gc.collect()
    assert not gc.is_tracked(inner)
    built = _buffer.built(inner, queue.held)
    assert built is not None
    data = built[3]
    assert data["n"] == "coldstart.load" and data["tr"] == "a" * 32
    assert data["p"] == _buffer.built(outer, queue.held)[3]["id"] != data["id"]  # type: ignore[index]
    assert data["a"] == {"infersight.stage": "load", "infersight.stage.custom": True, "model": "m", "batch": 8}
    assert data["err"] == "ValueError"
    assert data["s"] <= data["e"] == inner[1]
    assert len(data["id"]) == 16 and int(data["id"], 16)
    assert _buffer.built(outer, queue.held)[3]["p"] == "b" * 16  # type: ignore[index]



def test_stage_attributes_wait_beside_the_queue_and_the_tuple_is_still_untracked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the inlined path (an append that cannot be refused) a stage's attributes dict
    waits in ``client.held`` under the event's sequence number instead of being flattened.
    The queued tuple must still be one the garbage collector untracks at its first pass: a
    burst of queued stages must not drive full collections of the served process's heap."""
    from infersight import hooks
    from infersight.hooks import _buffer

    queue = FlatQueue()
    _fresh_state(monkeypatch, queue)
    with hooks.stage("first"):  # an empty buffer takes the call (it wakes the drain thread)
        pass
    with hooks.stage("load", model="m", batch=8):
        pass
    flat, held = queue.events
    assert flat[-1] is not _buffer.HELD and held[-1] is _buffer.HELD
    assert list(queue.held) == [held[0]]
    gc.collect()
    assert not gc.is_tracked(flat) and not gc.is_tracked(held)
    assert not gc.is_tracked(queue.held[held[0]])  # the dict of atomic values, too
    built = _buffer.built(held, queue.held)
    assert built is not None and queue.held == {}, "built once, then forgotten"
    assert built[3]["n"] == "coldstart.load"
    assert built[3]["a"] == {"infersight.stage": "load", "infersight.stage.custom": True, "model": "m", "batch": 8}
    assert _buffer.built(flat, queue.held)[3]["a"] == {"infersight.stage": "first",  # type: ignore[index]
                                                       "infersight.stage.custom": True}


def test_a_root_end_interrupted_half_way_can_be_ended_again_and_a_second_caller_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The root's end is claimed once (the sampler's tick and the exit handler may both try); one interrupted
    by a signal's exception before the root ended gives the claim back, so the exit handler still ends it."""
    from infersight.hooks import _readiness

    st = _state.HookState()
    monkeypatch.setattr(_state, "current", st)
    cs = st.coldstart
    calls: list[str] = []

    def interrupted(_st: Any, _end: Any, ended_by: str, _at: bool) -> None:
        calls.append(ended_by)
        raise KeyboardInterrupt

    monkeypatch.setattr(_readiness, "_finish_root", interrupted)
    first = cs.finished
    with pytest.raises(KeyboardInterrupt):
        _readiness.finish_root(None, "workers")
    assert first.is_set()  # whoever waited is released
    assert not cs.finishing and cs.finished is not first and not cs.finished.is_set()

    ended = threading.Event()

    def slow(_st: Any, _end: Any, ended_by: str, _at: bool) -> None:
        calls.append(ended_by)
        ended.wait(30)  # until the test has seen the second caller wait

    monkeypatch.setattr(_readiness, "_finish_root", slow)
    t = threading.Thread(target=_readiness.finish_root, args=(None, "workers"))
    t.start()
    deadline = time.monotonic() + 30
    while not cs.finishing and time.monotonic() < deadline:
        time.sleep(0.001)
    assert cs.finishing  # the first caller holds the claim before the second comes
    waiter = threading.Thread(target=_readiness.finish_root, args=(None, "exit"))
    waiter.start()  # the second caller waits for the first, and does not end the root again
    waiter.join(0.2)
    assert waiter.is_alive()
    ended.set()
    t.join(30)
    waiter.join(30)
    assert calls == ["workers", "workers"]
    assert cs.finished.is_set()
