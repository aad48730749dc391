"""A worker's report to its supervisor (``_readiness._report_to_parent``: its cold start ended by serving) goes
off the caller's thread, after a flush that waits up to REPORT_FLUSH_S for the agent's ack. A uvicorn worker
that its supervisor stops with SIGTERM raises the signal again with its default action once it has shut down
(the hooks' exit handler runs just before, ``_coldstart._install_uvicorn_signal_exit``): the process dies then,
without joining that thread. The exit handler waits for the report; the supervisor, which joined the worker,
then finds it (before, on a loaded host its cold start ended at its readiness instead of by its workers)."""

from __future__ import annotations

import threading

import pytest

from infersight.hooks import _readiness, _state, _workers


def test_the_exit_handler_waits_for_a_report_to_the_supervisor_still_in_flight(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(_state, "current", _state.HookState())
    monkeypatch.setattr(_readiness, "REPORT_JOIN_S", 60.0, raising=False)  # however late that thread runs
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
