"""Readiness of workers forked from a ready server, and which request is the first one, on real
gunicorn and uvicorn processes under ``infersight launch`` (tiny apps: ``workloads/fork_apps.py``).

- gunicorn without ``--preload`` (sync and ``UvicornWorker``): the master listens before it forks,
  so a worker's fork readiness is provisional: its app load and warmup after the fork are its cold
  start, the warmup forward is ``warmup``, and the HTTP request is ``first_request``.
- gunicorn ``--preload`` with ``UvicornWorker``: a worker is ready when uvicorn's startup returns;
  the one that served is ``fork_served``, the idle one ends at its readiness, not at its death.
- uvicorn with a model loaded by the first request: ``first_request`` runs from the request's
  arrival, the lazy ``import torch`` and the load inside it.
- gunicorn's own ASGI worker (``-k asgi``): its app is wrapped as uvicorn's is, the HTTP request is
  its first request.
- gunicorn's sync and gthread workers: a bare TCP connect (a tcpSocket probe) carries no request
  and is not the first request.
- gunicorn workers that never reached their serving loop (the app failed to load; Ctrl-C while it
  loaded): never ready, their root ends at their exit, and the master says none of its workers was.

Each test waits for the port with a bare TCP connect (a probe that carries no request), sends one
HTTP request, then stops the stack with SIGINT to its process group, as a terminal does."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import LaunchRun, Served, bare_connect, get_json, launch_server, one, pid, stage_name, the  # noqa: E402

from infersight.agent.commands.show import coldstarts  # noqa: E402
from infersight.exporters.waterfall import is_helper  # noqa: E402
from infersight.rules.stage_rules import builtin_stage_rules_path, load_stage_rules  # noqa: E402
from infersight.telemetry import ColdStart, SpanItem  # noqa: E402

pytest.importorskip("gunicorn")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.slow]

BIN = os.path.dirname(sys.executable)
SLEEP_S = 0.3  # every request of fork_apps sleeps this long: the first request's floor
ENV = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "FORK_APP_SLEEP": str(SLEEP_S)}
# gunicorn's gthread worker can deadlock on the group SIGINT: its SIGINT handler is inside
# ThreadPoolExecutor.shutdown (holding the pool's non-reentrant _shutdown_lock) when the
# master's SIGQUIT runs the same handler, which waits for that lock forever. The master then
# waits its graceful timeout (30 s by default) and SIGKILLs the worker. Everything asserted is
# delivered by then (the worker's root ended at its readiness, its first request at its
# response, 50 ms batches): a shorter wait changes only how long the stop takes. 5 s still
# leaves a worker that exits normally (well under 1 s here) its whole exit flush (3 s).
GTHREAD_STOP = ["--graceful-timeout", "5"]


def serve(tmp: str, argv: list[str], port: int, env: dict[str, str], idle_s: float = 0.5,
          timeout: float = 120) -> tuple[LaunchRun, Any]:
    """Launch ``argv``; wait for its port with bare connects; one more bare connect, then one GET;
    ``idle_s`` later, SIGINT to CMD's process group; read what launch wrote."""

    def drive(s: Served) -> Any:
        s.until(lambda: bare_connect(port), "listening", "port %d never listened" % port)
        time.sleep(0.2)
        assert bare_connect(port)  # another probe, once a --preload worker is in its loop
        time.sleep(0.1)
        answer = get_json(port)
        time.sleep(idle_s)  # the other workers are up and idle
        return answer

    return launch_server(tmp, argv, drive, env={**ENV, **env}, timeout=timeout)


def processes(r: LaunchRun) -> list[ColdStart]:
    css = [cs for cs in coldstarts(r.spans) if not is_helper(cs)]
    assert css, r.output[-4000:]
    return css


def check_served_worker(w: ColdStart, r: LaunchRun, source: str) -> SpanItem:
    """The worker that served: ready when its own work after the fork was done (``fork_served``),
    its wait for the request outside its root, and ``first_request`` that request (its sleep)."""
    first = one(w, "first_request", r)
    assert first.attributes["infersight.first_request.source"] == source, r.output[-3000:]
    assert first.end_ns - first.start_ns >= SLEEP_S * 1e9 * 0.9  # the HTTP request, not a forward or a probe
    assert w.root.attributes["infersight.ready.source"] == "fork_served", w.root.attributes
    assert w.root.attributes["infersight.coldstart.ended_by"] == "ready"
    assert w.root.end_ns <= first.start_ns  # the wait for traffic is no cold start
    return first


@pytest.mark.torch
@pytest.mark.parametrize("worker", ["sync", "gthread", "uvicorn"])
def test_gunicorn_worker_that_loads_after_the_fork(tmp_path, worker: str) -> None:
    """Without --preload the master listens, then forks: the worker loads torch and its model
    and runs a warmup forward after the fork. That is its cold start (warmup, not first_request),
    ready when it serves (its accept loop, uvicorn's startup), and the HTTP request is its first."""
    pytest.importorskip("torch")
    from conftest import free_port

    port = free_port()
    if worker in ("sync", "gthread"):
        argv, env = [*GTHREAD_STOP, "--threads", "4" if worker == "gthread" else "1", "fork_apps:wsgi"], {
            "FORK_APP_MODEL": "import"}
    else:
        argv, env = ["-k", "uvicorn.workers.UvicornWorker", "fork_apps:asgi"], {"FORK_APP_MODEL": "lifespan"}
    r, answer = serve(str(tmp_path), [os.path.join(BIN, "gunicorn"), "-w", "1", "-b", "127.0.0.1:%d" % port, *argv],
                      port, env)
    assert answer["served"] == 1
    css = processes(r)
    (w,) = [cs for cs in css if pid(cs) == answer["pid"]]
    assert w.root.parent_span_id is not None  # nested under the master
    warm = one(w, "warmup", r)  # the warmup forward, after the fork
    assert warm.end_ns <= w.root.end_ns
    ready = one(w, "ready_wait", r)
    assert ready.attributes["infersight.ready.source"] == "fork"
    if worker == "uvicorn":
        assert ready.attributes["infersight.ready.via"] == "uvicorn.Server.startup"
        # the app's lifespan startup, where it loads and warms up its model, is a stage (it was drawn as ready_wait):
        # the load's stages nest in it, its lifespan running in a task uvicorn creates there
        startup = one(w, "app_startup", r)
        assert startup.attributes["infersight.stage.rule"] == "uvicorn.lifespan_startup"
        runs_here = {rule.id for rule in load_stage_rules([builtin_stage_rules_path()]).rules
                     if any(e.kind == "run" and e.value == "uvicorn" for e in rule.examples)}
        assert runs_here == {"uvicorn.lifespan_startup"}  # every shipped rule whose example runs uvicorn fired
        assert warm.parent_span_id == startup.span_id, (warm.parent_span_id, startup.span_id)
        assert startup.end_ns <= ready.start_ns  # its ready_wait begins where the lifespan's work ended
    else:
        assert ready.attributes["infersight.stage.rule"] == "gunicorn.worker_loop"
        assert answer["threaded"] is (worker == "gthread")
    assert ready.end_ns >= warm.end_ns  # ready once the warmup is done
    check_served_worker(w, r, "asgi" if worker == "uvicorn" else "gunicorn")
    (master,) = [cs for cs in css if cs.root.parent_span_id is None]
    assert master.root.attributes["infersight.coldstart.ended_by"] == "workers"
    assert master.root.end_ns == w.root.end_ns  # its first worker's readiness


# An app whose whole load is its module's import (a config and a tokenizer read at import, say): no stage, no
# forward, one import run that is still open when the worker enters its accept loop
IMPORT_ONLY_APP = """
import json, os, time
time.sleep(0.5)  # the app's load, at its import
def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "application/json")])
    return [json.dumps({"pid": os.getpid()}).encode()]
"""


@pytest.mark.parametrize("rules", ["on", "off"])
def test_a_worker_whose_load_is_its_apps_import_is_ready_after_it(tmp_path, rules: str) -> None:
    """The worker's readiness at its accept loop stood at the end of its last stage sent, its runtime_init:
    its app's import was one run not sent yet, so its ready_wait lay before the whole load (0.003 s into a
    2 s cold start), where the agent would also end the root of a worker killed later. Without the stage
    rules (a worker class no rule knows), the first request's arrival makes it ready: after the load too."""
    from conftest import free_port

    (tmp_path / "import_only_app.py").write_text(IMPORT_ONLY_APP)
    port = free_port()
    r, answer = serve(str(tmp_path), [os.path.join(BIN, "gunicorn"), "-w", "1", "--chdir", str(tmp_path), "-b",
                                      "127.0.0.1:%d" % port, "import_only_app:app"], port,
                      {"INFERSIGHT_STAGE_RULES": "1" if rules == "on" else "0"})
    (w,) = [cs for cs in processes(r) if pid(cs) == answer["pid"]]
    (load,) = [s for s in w.stages if stage_name(s) == "framework_import"
               and any(str(p).startswith("import_only_app ") for p in s.attributes["infersight.import.packages"])]
    assert load.end_ns - load.start_ns >= 0.45e9
    if rules == "on":
        ready = one(w, "ready_wait", r)
        assert ready.attributes["infersight.stage.rule"] == "gunicorn.worker_loop", ready.attributes
        assert ready.start_ns >= load.end_ns, r.output[-3000:]  # ready after its app's load, not before it
    assert w.root.attributes["infersight.ready.source"] == "fork_served", w.root.attributes
    ready_s = w.root.attributes["infersight.coldstart.ready_s"]
    assert w.root.start_ns + ready_s * 1e9 >= load.end_ns - 1000, r.output[-3000:]
    assert w.root.end_ns >= load.end_ns


@pytest.mark.torch
def test_gunicorn_preload_uvicorn_workers(tmp_path) -> None:
    """--preload: the master loads the model and warms it up, then forks two UvicornWorkers. Each is
    ready when uvicorn's startup returns; the one that served ends its root there (its wait for the
    request is no cold start), the idle one too (SIGINT kills it: the agent ends it at the
    readiness it sent, not at its death)."""
    pytest.importorskip("torch")
    from conftest import free_port

    port = free_port()
    r, answer = serve(str(tmp_path), [os.path.join(BIN, "gunicorn"), "--preload", "-w", "2", "-k",
                                      "uvicorn.workers.UvicornWorker", "-b", "127.0.0.1:%d" % port, "fork_apps:asgi"],
                      port, {"FORK_APP_MODEL": "import"}, idle_s=1.0)
    css = processes(r)
    (master,) = [cs for cs in css if cs.root.parent_span_id is None]
    assert the(master, "warmup") and master.root.attributes["infersight.coldstart.ended_by"] == "workers"
    workers = [cs for cs in css if cs.root.parent_span_id is not None]
    assert len(workers) == 2, [pid(cs) for cs in css]
    (served,) = [w for w in workers if pid(w) == answer["pid"]]
    (idle,) = [w for w in workers if w is not served]
    check_served_worker(served, r, "asgi")
    for w in workers:
        ready = one(w, "ready_wait", r)
        assert ready.attributes["infersight.ready.source"] == "fork"
        assert ready.attributes["infersight.ready.via"] == "uvicorn.Server.startup"
        assert not the(w, "warmup")  # the model came loaded and warm from the master
        # ended at its readiness, never its life until shutdown (exit, or the agent's producer_lost)
        assert w.root.attributes["infersight.coldstart.ended_by"] == "ready", (w.root.attributes, r.output[-3000:])
    assert not the(idle, "first_request")
    assert idle.root.attributes["infersight.coldstart.ended_by"] == "ready", idle.root.attributes
    assert idle.root.end_ns == one(idle, "ready_wait", r).end_ns
    assert master.root.end_ns == served.root.end_ns


@pytest.mark.torch
def test_uvicorn_model_loaded_by_the_first_request(tmp_path) -> None:
    """uvicorn listens, then the first request imports torch and builds the model: first_request
    runs from that request's arrival (the lazy import inside it), after the wait for traffic."""
    pytest.importorskip("torch")
    from conftest import free_port

    port = free_port()
    r, answer = serve(str(tmp_path), [sys.executable, "-m", "uvicorn", "fork_apps:asgi", "--port", str(port),
                                      "--log-level", "warning"], port, {"FORK_APP_MODEL": "lazy"})
    assert answer["served"] == 1
    (cs,) = processes(r)
    assert cs.root.attributes["infersight.coldstart.ended_by"] == "ready"
    assert cs.root.attributes["infersight.ready.source"] in ("listen", "listening_socket")
    first = one(cs, "first_request", r)
    assert first.attributes["infersight.first_request.source"] == "asgi", r.output[-3000:]
    assert cs.root.end_ns <= first.start_ns
    lazy = [s for s in the(cs, "framework_import") if s.parent_span_id == first.span_id
            and any(p.startswith("torch ") for p in s.attributes.get("infersight.import.packages", []))]
    assert lazy, [(stage_name(s), s.attributes) for s in cs.stages]  # import torch, inside the first request
    assert first.start_ns <= lazy[0].start_ns and lazy[0].end_ns <= first.end_ns
    assert not the(cs, "warmup")


@pytest.mark.parametrize("threads", [1, 4])
def test_gunicorn_tcp_probe_is_no_request(tmp_path, threads: int) -> None:
    """A bare TCP connect to a sync worker or a gthread one (``--threads 4``) carries no request (a
    tcpSocket probe): the first request is the first connection that carried one, from its accept to
    its response's first bytes, and the worker's wait for it is no cold start."""
    from conftest import free_port

    port = free_port()
    r, answer = serve(str(tmp_path), [os.path.join(BIN, "gunicorn"), "--preload", "-w", "1", *GTHREAD_STOP,
                                      "--threads", str(threads), "-b", "127.0.0.1:%d" % port, "fork_apps:wsgi"],
                      port, {})
    css = processes(r)
    (w,) = [cs for cs in css if pid(cs) == answer["pid"]]
    assert answer["threaded"] is (threads > 1)  # gunicorn picked the gthread worker
    first = check_served_worker(w, r, "gunicorn")
    ttfb = first.attributes["infersight.first_request.ttfb_s"]
    assert SLEEP_S * 0.9 <= ttfb <= (first.end_ns - first.start_ns) / 1e9 + 1e-6
    assert "error.type" not in first.attributes


@pytest.mark.torch
def test_gunicorn_own_asgi_worker(tmp_path) -> None:
    """gunicorn's own ASGI worker (``-k asgi``) forked from a --preload master that loaded and warmed
    up the model: ready at its serving loop's first heartbeat (``Worker.notify``); the app it loads is
    wrapped like uvicorn's, so the HTTP request is its first request and its wait for it no cold start."""
    pytest.importorskip("torch")
    from conftest import free_port

    port = free_port()
    r, answer = serve(str(tmp_path), [os.path.join(BIN, "gunicorn"), "--preload", "-w", "1", "-k", "asgi", "-b",
                                      "127.0.0.1:%d" % port, "fork_apps:asgi"], port, {"FORK_APP_MODEL": "import"})
    assert answer["served"] == 1
    (w,) = [cs for cs in processes(r) if pid(cs) == answer["pid"]]
    ready = one(w, "ready_wait", r)
    assert ready.attributes["infersight.ready.source"] == "fork"
    assert ready.attributes["infersight.stage.rule"] == "gunicorn.worker_loop"
    assert not the(w, "warmup")  # the model came loaded and warm from the master
    check_served_worker(w, r, "asgi")


FORK_POOL = """
import os, socket, sys, time
import torch
m = torch.nn.Linear(16, 16)
x = torch.randn(2, 16)
with torch.no_grad():
    m(x)  # the parent's warmup
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()  # the parent is ready
time.sleep(0.2)
pid = os.fork()
if pid == 0:  # a queue-fed inference worker: no HTTP server, no listen of its own
    for _ in range(4):
        with torch.no_grad():
            m(x)
        time.sleep(0.3)
    print("threads", sorted(t.name for t in __import__("threading").enumerate()), flush=True)
    sys.exit(0)  # its exit handlers flush what its hooks hold
os.waitpid(pid, 0)
"""


def test_a_fork_pool_worker_of_a_ready_server_is_ready_at_its_fork(tmp_path) -> None:
    """No gunicorn nor uvicorn, whose hooks would confirm a forked worker's own readiness: the
    worker of a ready parent is ready at its fork, its first forward is its first request, and
    its cold-start hooks (the sampler) leave then, not a cold start of its whole life."""
    from launchutil import launch

    script = tmp_path / "fork_pool.py"  # a script: a python -c process is a helper (a probe)
    script.write_text(FORK_POOL)
    r = launch(str(tmp_path), [sys.executable, str(script)], result=False, env=ENV)
    assert r.rc == 0, r.output[-3000:]
    children = [cs for cs in coldstarts(r.spans) if cs.root.parent_span_id is not None and not is_helper(cs)]
    assert len(children) == 1, r.output[-3000:]
    (child,) = children
    assert child.root.attributes["infersight.coldstart.ended_by"] == "first_request", child.root.attributes
    assert "warmup" not in {stage_name(s) for s in child.stages}  # its serving forwards: no cold start
    threads = next(line for line in r.output.splitlines() if line.startswith("threads"))
    assert "infersight-coldstart-sampler" not in threads, threads


FAILING_APP = "import time\ntime.sleep(1.0)\nraise OSError('model directory /models/gpt not found')\n"


def test_gunicorn_worker_that_fails_to_boot_was_never_ready(tmp_path) -> None:
    """A worker whose app fails to load (gunicorn: "Worker failed to boot", exit 3) never reached its
    serving loop: its provisional fork readiness was never confirmed, so it was never ready, its whole
    life (the failed load) its cold start. Its supervisor says that none of its workers was ready."""
    from conftest import free_port
    from launchutil import launch

    (tmp_path / "failing_app.py").write_text(FAILING_APP)
    argv = [os.path.join(BIN, "gunicorn"), "-w", "1", "-b", "127.0.0.1:%d" % free_port(), "failing_app:app"]
    r = launch(str(tmp_path), argv, "--agent", "embedded", result=False, timeout=120)
    assert r.rc == 3, r.output[-2000:]
    (w,) = [cs for cs in coldstarts(r.spans) if cs.root.parent_span_id is not None]
    assert w.root.attributes["infersight.coldstart.ended_by"] == "exit", w.root.attributes  # main: "ready"
    assert "infersight.coldstart.ready_s" not in w.root.attributes
    assert "infersight.ready.source" not in w.root.attributes
    assert not the(w, "ready_wait")
    load = [s for s in the(w, "framework_import")
            if any(p.startswith("failing_app ") for p in s.attributes.get("infersight.import.packages", []))]
    assert load and load[0].end_ns <= w.root.end_ns  # the failed load is inside its cold start
    assert (w.root.end_ns - w.root.start_ns) / 1e9 >= 1.0
    (master,) = [cs for cs in coldstarts(r.spans) if cs.root.parent_span_id is None]
    assert master.root.attributes["infersight.coldstart.workers"] == 1
    # none ready (a worker SIGKILLed under load never reported to its supervisor: no count then)
    assert master.root.attributes.get("infersight.coldstart.workers_ready", 0) == 0


LOADING_APP = """
import os, time
open(os.environ["LOADING_MARK"], "w").close()  # the worker loads its model now
time.sleep(60)


def app(environ, start_response):
    start_response("200 OK", [("Content-Length", "0")])
    return []
"""


def test_gunicorn_worker_stopped_while_loading_was_never_ready(tmp_path) -> None:
    """Ctrl-C while a gthread worker loads its app: it exits (gunicorn's SIGINT handler) before its
    serving loop. It was never ready: its cold start runs to its exit, the load inside it."""
    from conftest import free_port

    (tmp_path / "loading_app.py").write_text(LOADING_APP)
    mark = tmp_path / "loading"
    port = free_port()
    argv = [os.path.join(BIN, "gunicorn"), "-w", "1", "--threads", "4", *GTHREAD_STOP, "-b", "127.0.0.1:%d" % port,
            "loading_app:app"]

    def drive(s: Served) -> None:
        s.until(mark.exists, "the worker started to load", "the worker never started to load")
        time.sleep(0.5)  # well inside the load

    r, _ = launch_server(str(tmp_path), argv, drive, "--agent", "embedded", env={"LOADING_MARK": str(mark), **ENV},
                         cwd=str(tmp_path), timeout=60)
    css = coldstarts(r.spans)
    (w,) = [cs for cs in css if cs.root.parent_span_id is not None]
    # its exit, or (a loaded machine: gunicorn's graceful timeout ran out and it SIGKILLed the worker) its loss
    assert w.root.attributes["infersight.coldstart.ended_by"] in ("exit", "producer_lost"), (w.root.attributes,
                                                                                            r.output[-3000:])
    assert "infersight.coldstart.ready_s" not in w.root.attributes, w.root.attributes
    assert w.root.end_ns >= os.stat(mark).st_mtime_ns  # it was loading, inside its cold start
    (master,) = [cs for cs in css if cs.root.parent_span_id is None]
    # none ready (a worker SIGKILLed under load never reported to its supervisor: no count then)
    assert master.root.attributes.get("infersight.coldstart.workers_ready", 0) == 0
