"""A worker's report to its supervisor (``_readiness._report_to_parent``: its cold start ended by serving) goes
off the caller's thread, after a flush that waits up to REPORT_FLUSH_S for the agent's ack. A uvicorn worker
that its supervisor stops with SIGTERM raises the signal again with its default action once it has shut down
(the hooks' exit handler runs just before, ``_coldstart._install_uvicorn_signal_exit``): the process dies then,
without joining that thread. The exit handler waits for the report; the supervisor, which joined the worker,
then finds it (before, on a loaded host its cold start ended at its readiness instead of by its workers)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from infersight.hooks import _readiness, _state, _workers


def test_the_exit_handler_waits_for_a_report_to_the_supervisor_still_in_flight(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_state, "current", _state.HookState())
    monkeypatch.setattr(_readiness, "REPORT_JOIN_S", 60.0, raising=False)  # however late that thread runs
    monkeypatch.setenv("INFERSIGHT_EXIT_FLUSH_S", "60")  # (the wait is part of the exit flush's budget)
    writing, written = threading.Event(), []
    go = threading.Event()

    def report(parent_dir: str, start_ns: int, end_ns: int, ended_by: str) -> bool:
        writing.set()
        go.wait(60)  # the flush before it waited for a busy agent's ack
        written.append((parent_dir, start_ns, end_ns, ended_by))
        return True

    monkeypatch.setattr(_workers, "report", report)
    _readiness._report_to_parent(str(tmp_path), 1, 2, "first_request")  # the first response went out
    assert writing.wait(60)
    assert written == []  # still in flight when SIGTERM comes
    threading.Timer(0.2, go.set).start()
    _readiness.at_exit()  # uvicorn's shutdown, just before it raises SIGTERM again (the process dies then)
    assert written == [(str(tmp_path), 1, 2, "first_request")]


def test_a_report_thread_that_could_not_start_is_no_error_at_exit(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """No new thread (a pids cgroup at its limit, an interpreter shutting down): the report goes in line, and the
    exit handler later neither raises into the user's atexit nor skips the rest of its work (joining a thread
    that never started raises RuntimeError)."""
    monkeypatch.setattr(_state, "current", _state.HookState())
    written: list[tuple[str, int, int, str]] = []
    monkeypatch.setattr(_workers, "report", lambda *a: written.append(a) or True)

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", no_thread)
        _readiness._report_to_parent(str(tmp_path), 1, 2, "first_request")
    assert written == [(str(tmp_path), 1, 2, "first_request")]  # in line
    failed: list[BaseException] = []
    monkeypatch.setattr(_readiness._runtime, "fail", failed.append)
    _readiness.at_exit()  # raised RuntimeError("cannot join thread before it is started")
    assert failed == []


@pytest.mark.parametrize("budget", ["0", "0.05"])
def test_the_wait_for_a_report_in_flight_is_within_the_exit_flush_budget(
        tmp_path, monkeypatch: pytest.MonkeyPatch, budget: str) -> None:  # type: ignore[no-untyped-def]
    """INFERSIGHT_EXIT_FLUSH_S bounds how long a process waits at exit to deliver (docs/hooks-env.md): the wait
    for a report in flight is part of it (0: none at all), and the exit flush after it gets only what is left."""
    monkeypatch.setattr(_state, "current", _state.HookState())
    monkeypatch.setenv("INFERSIGHT_EXIT_FLUSH_S", budget)
    writing, go, written = threading.Event(), threading.Event(), []

    def report(*a: object) -> bool:
        writing.set()
        go.wait(60)  # an agent that never acks: the report's flush takes its whole REPORT_FLUSH_S, and more
        written.append(a)
        return True

    monkeypatch.setattr(_workers, "report", report)
    joins: list[float | None] = []
    try:
        _readiness._report_to_parent(str(tmp_path), 1, 2, "first_request")
        assert writing.wait(60)
        t = _readiness.state().reporting
        assert t is not None
        join = t.join
        t.join = lambda timeout=None: (joins.append(timeout), join(timeout))[1]  # type: ignore[method-assign]
        _readiness.at_exit()
        assert written == []  # it gave up within the budget
        assert all(j is not None and j <= float(budget) for j in joins)  # it waited REPORT_JOIN_S (2 s) whatever
    finally:
        go.set()


def test_the_exit_flush_gets_what_the_wait_for_the_report_left(monkeypatch: pytest.MonkeyPatch) -> None:
    from infersight.hooks import _activate, _runtime

    monkeypatch.setattr(_state, "current", _state.HookState())
    monkeypatch.setenv("INFERSIGHT_EXIT_FLUSH_S", "3")
    closed: list[float] = []
    monkeypatch.setattr(_runtime, "end_root", lambda *a, **k: None)
    _runtime.state().client = SimpleNamespace(close=closed.append)  # type: ignore[assignment]
    _readiness.state().exit_waited_s = 1.25
    _activate._at_exit()
    assert closed == [1.75]
