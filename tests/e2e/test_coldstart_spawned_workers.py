"""Hypercorn under ``infersight launch --agent embedded`` with no infersight call in the app
(``workloads/fork_apps.py``: ``FORK_APP_MODEL=lifespan``, the model built and warmed up by one
forward in the ASGI lifespan). Hypercorn's main process binds the socket and spawns its workers
(``-w N``); each loads the app, runs its lifespan, and only then listens on that shared socket
(``-k asyncio``: ``listen()`` from Python; ``-k uvloop``: in C, which no ``listen()`` wrapper sees and
the kernel's tables alone never count for a shared socket). A worker is ready when it serves
(``asyncio.start_server`` returned in hypercorn's ``worker_serve``), after its lifespan's warmup;
the HTTP request is its ``first_request`` (the ASGI middleware the hooks put in hypercorn's
``ASGIWrapper``), its wait for it no cold start; an idle worker ends at its readiness, not at its
exit; the supervisor ends with the worker that served. Under ``--ready-url``, a spawned worker
(Hypercorn's, ``uvicorn --workers``') is ready when the URL answers, never before it serves itself.

Each test waits until every worker has run its lifespan and for the port with bare TCP connects
(no request), sends one GET, then stops the stack with SIGINT to its process group, as a terminal
does."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import LaunchRun, Served, bare_connect, get_json, launch_server, one, pid, the  # noqa: E402

from infersight.agent.commands.show import coldstarts  # noqa: E402
from infersight.exporters.waterfall import is_helper  # noqa: E402
from infersight.rules.stage_rules import builtin_stage_rules_path, load_stage_rules  # noqa: E402
from infersight.telemetry import ColdStart, SpanItem  # noqa: E402

pytest.importorskip("hypercorn")
pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.torch]

BIN = os.path.dirname(sys.executable)
SLEEP_S = 0.3  # every request of fork_apps sleeps this long: the first request's floor
ENV = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "FORK_APP_SLEEP": str(SLEEP_S),
       "FORK_APP_MODEL": "lifespan"}


def serve(tmp: str, argv: list[str], port: int, workers: int, *flags: str, idle_s: float = 0.5,
          timeout: float = 180) -> tuple[LaunchRun, Any]:
    """Launch ``argv`` (``flags`` go to launch); wait until its ``workers`` have run their lifespan (however
    slow a loaded host makes them) and for its port with bare connects; one GET; ``idle_s`` later, SIGINT to
    CMD's process group; read what launch wrote."""
    started = os.path.join(tmp, "started")
    os.mkdir(started)

    def drive(s: Served) -> Any:
        s.until(lambda: len(os.listdir(started)) >= workers and bare_connect(port), "listening",
                "port %d never listened" % port)
        answer = get_json(port)
        time.sleep(idle_s)
        return answer

    return launch_server(tmp, argv, drive, "--agent", "embedded", *flags, env={**ENV, "FORK_APP_STARTED_DIR": started},
                         timeout=timeout)


def hypercorn(worker: str, workers: int, port: int) -> list[str]:
    pytest.importorskip(worker)  # uvloop; asyncio always there
    return [os.path.join(BIN, "hypercorn"), "-k", worker, "-w", str(workers), "-b", "127.0.0.1:%d" % port,
            "fork_apps:asgi"]


def check_worker(w: ColdStart, r: LaunchRun, sources: tuple[str, ...]) -> SpanItem:
    """Ready once its lifespan (the model load, the warmup forward) was done, from a signal of its
    own; its root ends there, at exit too."""
    warm = one(w, "warmup", r)  # the lifespan's forward, not a first request
    ready = one(w, "ready_wait", r)
    assert ready.attributes["infersight.ready.source"] in sources, (ready.attributes, r.output[-3000:])
    assert w.root.attributes["infersight.ready.source"] in sources
    assert w.root.attributes["infersight.coldstart.ended_by"] == "ready", (w.root.attributes, r.output[-3000:])
    assert warm.end_ns <= ready.end_ns == w.root.end_ns
    assert w.root.attributes["infersight.coldstart.ready_s"] == pytest.approx((ready.end_ns - w.root.start_ns) / 1e9)
    return ready


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("worker", ["uvloop", "asyncio"])
def test_hypercorn_workers_are_ready_when_they_serve(tmp_path, worker: str, workers: int) -> None:
    from conftest import free_port

    port = free_port()
    r, answer = serve(str(tmp_path), hypercorn(worker, workers, port), port, workers)
    assert r.rc == 0, r.output[-3000:]
    css = [cs for cs in coldstarts(r.spans) if not is_helper(cs)]
    (master,) = [cs for cs in css if cs.root.parent_span_id is None]
    ws = [cs for cs in css if cs.root.parent_span_id is not None]
    assert len(ws) == workers, ([pid(cs) for cs in css], r.output[-3000:])
    (served,) = [w for w in ws if pid(w) == answer["pid"]]
    # uvloop listens in C: its sockets, claimed when start_server returns; asyncio calls listen()
    sources = ("listening_socket",) if worker == "uvloop" else ("listen", "listening_socket")
    for w in ws:
        check_worker(w, r, sources)
        # its lifespan startup (the model load, the warmup) is a stage, not ready_wait, from the lifespan task's start
        # to the app's startup.complete: the load's stages nest in it (they lay beside it when it timed
        # wait_for_startup, in the worker's main task)
        startup, warm = one(w, "app_startup", r), one(w, "warmup", r)
        assert startup.attributes["infersight.stage.rule"] == "hypercorn.lifespan_startup"
        assert startup.attributes["infersight.stage.until"] == "hypercorn.asyncio.lifespan:Lifespan.asgi_send"
        assert warm.parent_span_id == startup.span_id, r.output[-3000:]
        assert startup.start_ns <= warm.start_ns and warm.end_ns <= startup.end_ns, r.output[-3000:]
    assert {rule.id for rule in load_stage_rules([builtin_stage_rules_path()]).rules
            if any(e.kind == "run" and e.value == "hypercorn" for e in rule.examples)} == {"hypercorn.lifespan_startup"}
    first = one(served, "first_request", r)
    assert first.attributes["infersight.first_request.source"] == "asgi", r.output[-3000:]
    assert first.end_ns - first.start_ns >= SLEEP_S * 1e9 * 0.9  # the HTTP request, not a probe
    assert served.root.end_ns <= first.start_ns  # ready before the request came: its wait is no cold start
    for w in ws:
        if w is not served:
            assert not the(w, "first_request")
    assert master.root.attributes["infersight.coldstart.ended_by"] == "workers", master.root.attributes
    # at its first worker's readiness, or at its own if that came later (its tables read at its next tick)
    assert served.root.end_ns <= master.root.end_ns
    # the workers that had reported when it ended (the one that served) were all ready
    assert master.root.attributes["infersight.coldstart.workers_ready"] == master.root.attributes[
        "infersight.coldstart.workers"] >= 1


@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
def test_spawned_workers_under_ready_url(tmp_path, server: str) -> None:
    """--ready-url: the URL's answer is readiness for the server's main process (launch's child) and
    for the workers it spawned (they serve that URL: ``hypercorn -k uvloop -w 2``, ``uvicorn --workers
    2``), each only once it serves itself (ready at the later of the two): never before its own
    lifespan's load and warmup."""
    from conftest import free_port

    port = free_port()
    if server == "hypercorn":
        argv, via = hypercorn("uvloop", 2, port), "hypercorn.asyncio.start_server"
    else:
        pytest.importorskip("uvicorn")
        argv = [sys.executable, "-m", "uvicorn", "fork_apps:asgi", "--workers", "2", "--port", str(port),
                "--log-level", "warning"]
        via = "uvicorn.Server.startup"
    # (launch polls the URL every 0.5 s at most: it answers well within the idle time)
    r, _ = serve(str(tmp_path), argv, port, 2, "--ready-url", "http://127.0.0.1:%d/" % port, idle_s=2.0)
    assert r.rc == 0, r.output[-3000:]
    css = [cs for cs in coldstarts(r.spans) if not is_helper(cs)]
    (master,) = [cs for cs in css if cs.root.parent_span_id is None]
    ws = [cs for cs in css if cs.root.parent_span_id is not None]
    assert len(ws) == 2, ([pid(cs) for cs in css], r.output[-3000:])
    assert master.root.attributes["infersight.ready.source"] == "ready_url"
    answered = master.root.start_ns + master.root.attributes["infersight.coldstart.ready_s"] * 1e9
    for w in ws:
        # (its ready_wait may end before its readiness: what the server did for launch's successful poll,
        # or the test's request, is that request's work, "ready_wait" in docs/coldstart.md)
        ready = one(w, "ready_wait", r)
        assert ready.attributes["infersight.ready.source"] == "ready_url", (ready.attributes, r.output[-3000:])
        assert ready.attributes["infersight.ready.via"] == via  # it served: the URL's answer became its own
        assert ready.attributes["server.port"] == port
        assert w.root.attributes["infersight.coldstart.ended_by"] == "ready", (w.root.attributes, r.output[-3000:])
        assert w.root.end_ns >= answered - 1e3  # not before the URL answered (ready_s: a float)
        # nor before its own start: its lifespan's model load inside its cold start, its warmup begun in it
        torch_import = [s for s in the(w, "framework_import")
                        if any(p.startswith("torch ") for p in s.attributes.get("infersight.import.packages", []))]
        assert torch_import and torch_import[0].end_ns <= w.root.end_ns
        assert the(w, "warmup") and min(s.start_ns for s in the(w, "warmup")) <= w.root.end_ns
