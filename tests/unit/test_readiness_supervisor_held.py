"""A pre-fork master's ``ready_wait`` waits for a worker (``_readiness``, ``_workers``), in-process with a FAKE
client and a real children directory.

The master (gunicorn's arbiter) listens before it forks, and sent its ``ready_wait`` there. Made unready at its
exit when its workers all failed to boot, it still had that span: its waterfall drew a ``ready_wait`` row beside
"never ready", and SIGKILLed, the agent closed its root as ``ready`` at that span. Now the span is held until one
of its workers says it is ready (``_workers.report_ready``, read at the sampler's tick): sent then, with the
listen's times, so a healthy master is ready as soon as a worker is; sent at its exit where its readiness stands
(a worker was ready, or none said anything); never sent where none was ready."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from hook_fakes import Emitted, collecting

from infersight.hooks import _readiness, _state, _workers


def _master(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, supervisor: bool = True) -> tuple[Emitted, Any]:
    """A process with a children directory that listened (a supervisor: gunicorn's arbiter)."""
    client, st = collecting(monkeypatch)
    client.producer = {}  # type: ignore[attr-defined]
    client.conn = SimpleNamespace(held=lambda: False)  # type: ignore[attr-defined]
    cs: _state.ColdStart = st.coldstart
    cs.children_dir = str(tmp_path / "children" / "producer")
    cs.children_ready = _workers.prepare(cs.children_dir)
    assert cs.children_ready
    if supervisor:
        _readiness.supervise()
    _readiness.mark_ready("listen", attrs={"server.port": 8123})
    return client, cs


def _spans(client: Emitted, stage: str) -> list[dict[str, Any]]:
    return [d for k, d in client.events if k == "span" and d["a"].get("infersight.stage") == stage]


def _root(client: Emitted) -> dict[str, Any]:
    (a,) = [d["a"] for k, d in client.events if k == "span" and d.get("n") == "coldstart"]
    return a


def test_a_master_is_ready_when_a_worker_is_with_its_listen_s_times(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Any) -> None:
    client, cs = _master(monkeypatch, tmp_path)
    assert _spans(client, "ready_wait") == [] and "ready_ns" not in client.producer  # type: ignore[attr-defined]
    listened = cs.ready_ns
    _readiness.tick()
    assert _spans(client, "ready_wait") == []  # its worker still loads: it is warming
    # the worker, a process of its own (a child's pid in the name)
    os.close(os.open(os.path.join(cs.children_dir, "ready.%d" % (os.getpid() + 1)), os.O_CREAT | os.O_WRONLY, 0o600))
    _readiness.tick()
    (wait,) = _spans(client, "ready_wait")
    assert wait["e"] == listened and wait["a"]["infersight.ready.source"] == "listen"
    assert client.producer["ready_ns"] == listened  # type: ignore[attr-defined]
    _readiness.at_exit()
    assert len(_spans(client, "ready_wait")) == 1
    root = _root(client)
    assert root["infersight.coldstart.ended_by"] == "ready" and root["infersight.ready.source"] == "listen"
    assert not os.path.exists(cs.children_dir)  # its ready notes went with the directory


def test_a_master_none_of_whose_workers_was_ready_sends_no_ready_wait(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Any) -> None:
    client, cs = _master(monkeypatch, tmp_path)
    assert _workers.report(cs.children_dir, 10, 20, "exit")  # its worker failed to boot
    _readiness.tick()
    _readiness.at_exit()
    assert _spans(client, "ready_wait") == []
    assert _root(client)["infersight.coldstart.ended_by"] == "exit"


@pytest.mark.parametrize("reported", ["ready", None])
def test_a_master_whose_readiness_stands_sends_it_at_its_exit(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                                             reported: str | None) -> None:
    """A worker that reported it was ready (and exited), or workers that said nothing (SIGKILLed)."""
    client, cs = _master(monkeypatch, tmp_path)
    if reported is not None:
        assert _workers.report(cs.children_dir, 10, 20, reported)
    _readiness.at_exit()
    (wait,) = _spans(client, "ready_wait")
    root = _root(client)
    assert root["infersight.coldstart.ended_by"] == "ready"
    assert wait["e"] == cs.ready_ns


def test_a_process_that_supervises_nothing_sends_its_ready_wait_at_once(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Any) -> None:
    client, _cs = _master(monkeypatch, tmp_path, supervisor=False)
    assert len(_spans(client, "ready_wait")) == 1


def test_a_forked_worker_tells_its_master_when_it_serves_not_at_the_fork(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Any) -> None:
    client, st = collecting(monkeypatch)
    client.producer = {}  # type: ignore[attr-defined]
    cs: _state.ColdStart = st.coldstart
    master = str(tmp_path / "children" / "master")
    assert _workers.prepare(master)
    cs.parent_dir = master
    cs.ready_ns, cs.ready_source = 1, "fork"  # forked from a master that listened: provisional
    assert _workers.ready_children(master) == 0
    assert _readiness.fork_ready("gunicorn.workers.base:Worker.notify")  # its serving loop
    assert _workers.ready_children(master) == 1
    assert os.listdir(master) == ["ready.%d" % os.getpid()]


def test_a_worker_that_said_it_was_ready_and_was_killed_keeps_its_master_ready(monkeypatch: pytest.MonkeyPatch,
                                                                              tmp_path: Any) -> None:
    """One worker ready (then SIGKILLed: no report of its end), another that failed to boot: the master was ready,
    as the ready_wait it sent at the first one's word says."""
    client, cs = _master(monkeypatch, tmp_path)
    os.close(os.open(os.path.join(cs.children_dir, "ready.%d" % (os.getpid() + 1)), os.O_CREAT | os.O_WRONLY, 0o600))
    _readiness.tick()
    assert _workers.report(cs.children_dir, 10, 20, "exit")
    _readiness.at_exit()
    assert len(_spans(client, "ready_wait")) == 1
    assert _root(client)["infersight.coldstart.ended_by"] == "ready"
