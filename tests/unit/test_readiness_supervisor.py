"""A pre-fork master's readiness at its exit (``_readiness``), in-process with a FAKE client and a real
children directory its workers' reports are written into (``_workers.report``):

- a supervisor (gunicorn's arbiter, Hypercorn's main process with workers) whose workers all reported
  and none was ever ready (each failed to boot) was never ready: its own listen served nobody;
- one whose worker was ready, or whose workers said nothing (a worker SIGKILLed never reports), keeps
  the readiness of its listen;
- a process that is no supervisor keeps its own readiness whatever a child of it reported (a one-off
  job it ran before it listened)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hook_fakes import Emitted
from test_readiness_supervisor_held import _master, _root

from infersight.hooks import _readiness, _workers


def _listening(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, supervisor: bool,
               reported: str | None) -> Emitted:
    """A process ready at its listen whose child reported ``reported`` (None: no report), stopped now."""
    client, cs = _master(monkeypatch, tmp_path, supervisor)
    if reported is not None:
        assert _workers.report(cs.children_dir, 10, 20, reported)
    _readiness.at_exit()
    return client


def test_a_supervisor_none_of_whose_workers_was_ready_was_never_ready(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Any) -> None:
    root = _root(_listening(monkeypatch, tmp_path, True, "exit"))
    assert root["infersight.coldstart.ended_by"] == "exit", root
    assert "infersight.coldstart.ready_s" not in root
    assert "infersight.ready.source" not in root
    assert root["infersight.coldstart.workers"] == 1
    assert root["infersight.coldstart.workers_ready"] == 0
    assert not os.path.exists(tmp_path / "children" / "producer")  # its directory went with its cold start


@pytest.mark.parametrize("reported", ["ready", None])
def test_a_supervisor_with_a_ready_or_silent_worker_stays_ready(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                                                reported: str | None) -> None:
    root = _root(_listening(monkeypatch, tmp_path, True, reported))
    assert root["infersight.coldstart.ended_by"] == "ready", root
    assert root["infersight.ready.source"] == "listen"


def test_a_process_that_supervises_nothing_keeps_its_readiness(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Any) -> None:
    root = _root(_listening(monkeypatch, tmp_path, False, "exit"))
    assert root["infersight.coldstart.ended_by"] == "ready", root
    assert root["infersight.ready.source"] == "listen"
    assert root["infersight.coldstart.workers_ready"] == 0
