"""Real serving stacks under ``infersight launch`` with no infersight call in them (issue 23):
LitServe, BentoML via ``bentoml serve``, Ray Serve, ``gunicorn --preload -w 2`` with a Flask app
and a PEFT LoRA merged and served by Flask, each serving a tiny GPT-2 built from a config
(``workloads/library_stacks.py build``). The test sends the first request, then stops the stack
with SIGTERM to launch, as a user at the terminal would. Every served process (supervisor and
workers alike) must be at least 95% covered by named stages, each its own figure: a share of
that process's own cold start, never a timing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, LaunchRun, Served, launch, launch_server, pid, stage_name  # noqa: E402

from infersight.agent.commands.show import coldstarts  # noqa: E402
from infersight.coldstart_stages import merge, named_intervals  # noqa: E402
from infersight.exporters.waterfall import coverage, is_helper, render_waterfall, tree_coverage  # noqa: E402
from infersight.rules.stage_rules import builtin_stage_rules_path, load_stage_rules  # noqa: E402
from infersight.telemetry import ColdStart  # noqa: E402

for _lib in ("torch", "transformers", "peft"):
    pytest.importorskip(_lib)

pytestmark = [pytest.mark.slow, pytest.mark.torch]

MIN_COVERAGE = 0.95
STACKS = os.path.join(HERE, "serving_stacks.py")
LIBRARY_STACKS = os.path.join(HERE, "library_stacks.py")
BIN = os.path.dirname(sys.executable)
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
       "BENTOML_DO_NOT_TRACK": "true", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("diffusers")  # library_stacks.py build makes every library's model
    out = str(tmp_path_factory.mktemp("serving_models"))
    env = dict(os.environ, **ENV)
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, LIBRARY_STACKS, "build", out], check=True, env=env, capture_output=True,
                   timeout=600)
    return out


def post(url: str, body: dict[str, object], timeout: float = 120) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def serve_once(tmp: str, argv: list[str], url: str, body: dict[str, object], env: dict[str, str],
               timeout: float = 300, before_stop: Callable[[int, Any], None] | None = None) -> tuple[LaunchRun, Any]:
    """Launch a server, send it one request as soon as it answers, then Ctrl-C as a terminal
    sends it (SIGINT to CMD's process group, the terminal's foreground one under launch), and
    read what launch wrote. Whatever of CMD's group is still there after launch has ended is
    killed (a test leaves no process behind)."""
    answers: list[Any] = []

    def answered() -> bool:
        try:
            answers.append(post(url, body))
        except urllib.error.HTTPError as exc:  # it answered, wrongly: no retry
            raise AssertionError("%s answered %d: %s" % (url, exc.code, exc.read()[:500])) from exc
        except TimeoutError as exc:  # accepted, never answered: a retry would reach another worker
            raise AssertionError("%s accepted the request and did not answer" % url) from exc
        except (urllib.error.URLError, ConnectionError) as exc:
            if isinstance(getattr(exc, "reason", None), TimeoutError):
                raise AssertionError("%s accepted the request and did not answer" % url) from exc
            return False  # not listening yet: an event we wait for, not a share of time
        return True

    def drive(s: Served) -> Any:
        s.until(answered, "answering", "no answer from %s" % url, every=0.2)
        if before_stop is not None:
            before_stop(s.group, answers[0])
        return answers[0]

    return launch_server(tmp, argv, drive, env={**ENV, **env}, unset=("PYTHONPATH",), cwd=env.get("CWD", tmp),
                         timeout=timeout, stop_timeout=180)


def served(r: LaunchRun) -> list[ColdStart]:
    return [cs for cs in coldstarts(r.spans) if not is_helper(cs)]


def names(cs: ColdStart) -> set[str]:
    return {stage_name(s) for s in cs.stages}


def check_each_process(r: LaunchRun, short: Callable[[ColdStart], bool] = lambda cs: False
                       ) -> tuple[list[ColdStart], list[tuple[Any, ...]]]:
    """Every served process: 95% of its own cold start covered by named stages (a supervisor
    whose cold start ended with its first ready worker: its wait is that worker's cold start,
    the tree's figure, which counts the workers' named stages, never their lifetimes). Processes that
    ``short`` picks are known to fall short: they are returned (with their figures) for
    ``settle``; any other process below the target fails the test here."""
    css = served(r)
    assert css, r.output[-4000:]
    low, known, shown = [], [], []
    for cs in css:
        by_workers = cs.root.attributes.get("infersight.coldstart.ended_by") == "workers"
        cov = tree_coverage(cs) if by_workers else coverage(cs)
        if cov < MIN_COVERAGE:
            gaps = [((s.end_ns - s.start_ns) / 1e9, s.attributes.get("infersight.unattributed.top"))
                    for s in cs.stages if stage_name(s) == "unattributed"]
            row = (pid(cs), cs.root.resource.get("process.command"), "%.1f%%" % (100 * cov), gaps)
            (known if short(cs) else low).append(row)
            if not short(cs):  # its own waterfall and where no stage was (launch's output may have cut it)
                shown.append("%s\nuncovered (start s, duration s): %s" % (render_waterfall(cs), [
                    (round((a - cs.root.start_ns) / 1e9, 3), round((b - a) / 1e9, 3)) for a, b in uncovered(cs)]))
    assert not low, "%r\n%s\n%s" % (low, "\n".join(shown), r.output[-3000:])
    return css, known


def uncovered(cs: ColdStart) -> list[tuple[int, int]]:
    """The stretches of the root that no named stage covers, 1 ms or longer."""
    out, at, end = [], cs.root.start_ns, cs.root.end_ns
    for a, b in merge(named_intervals(cs.stages)):
        a, b = max(a, cs.root.start_ns), min(b, end)
        if a >= end:
            break
        if a - at >= 1_000_000:
            out.append((at, a))
        at = max(at, b)
    if end - at >= 1_000_000:
        out.append((at, end))
    return out


def settle(known: list[tuple[Any, ...]], why: str) -> None:
    """After every other assertion: a process known to fall short of 95% marks the test xfail
    with its figures (the test passes the day it reaches the target)."""
    if known:
        pytest.xfail("%s: %r" % (why, known))


def check_run_examples(css: list[ColdStart], mode: str) -> None:
    """Every shipped stage rule whose example runs this stack (``run = "MODE"``) fired in some
    process: a span, or the ``ready_wait`` of a ``ready = "entry"`` rule, names it."""
    expected = {r.id for r in load_stage_rules([builtin_stage_rules_path()]).rules
                if any(e.kind == "run" and e.value == mode for e in r.examples)}
    assert expected, "no shipped rule has a run example %r" % mode
    fired = {s.attributes.get("infersight.stage.rule") for cs in css for s in cs.stages}
    assert expected <= fired, expected - fired


def the_one_with(css: list[ColdStart], stage: str) -> ColdStart:
    found = [cs for cs in css if stage in names(cs)]
    assert found, "no process with %s: %r" % (stage, [sorted(names(cs)) for cs in css])
    return found[0]


def test_gunicorn_preload_two_workers(models: str, tmp_path) -> None:
    pytest.importorskip("gunicorn")
    pytest.importorskip("flask")
    from conftest import free_port

    port = free_port()
    r, answer = serve_once(str(tmp_path), [os.path.join(BIN, "gunicorn"), "--preload", "-w", "2", "-b",
                                           "127.0.0.1:%d" % port, "serving_wsgi:app"],
                           "http://127.0.0.1:%d/generate" % port, {"n": 8},
                           {"STACK_MODELS": models, "CWD": HERE})
    assert len(answer["tokens"]) == 8
    css, known = check_each_process(r)
    assert not known
    master = the_one_with(css, "weights_load")  # --preload: the master loads the model once
    assert master.root.parent_span_id is None
    assert "framework_import" in names(master) and "model_build" in names(master)
    workers = [cs for cs in css if cs.root.parent_span_id is not None]
    assert len(workers) == 2, [pid(cs) for cs in css]  # forked after the load: no load of their own
    assert all(not [s for s in w.stages if stage_name(s) == "weights_load" and s.start_ns < w.root.end_ns
                    and s.parent_span_id == w.root.span_id] for w in workers)
    check_run_examples(css, "gunicorn")
    for w in workers:  # ready when it entered its accept loop, right after the fork (--preload): sent
        (ready,) = [s for s in w.stages if stage_name(s) == "ready_wait"]
        assert ready.attributes["infersight.ready.source"] == "fork"
        assert ready.attributes["infersight.stage.rule"] == "gunicorn.worker_loop"
        assert w.root.end_ns - w.root.start_ns < 5e9  # never the arbiter's 30 s graceful timeout
    idle = [w for w in workers if "first_request" not in names(w)]
    assert all(names(w) == {"runtime_init", "ready_wait"} for w in idle), [names(w) for w in idle]
    (served_by,) = [w for w in workers if "first_request" in names(w)]
    (first,) = [s for s in served_by.stages if stage_name(s) == "first_request"]
    assert first.attributes["infersight.first_request.source"] == "gunicorn"  # from the accepted connection
    assert served_by.root.attributes["infersight.ready.source"] == "fork_served"
    assert served_by.root.end_ns <= first.start_ns  # its wait for the request is no cold start


def test_gunicorn_worker_killed_after_its_graceful_timeout(models: str, tmp_path) -> None:
    """A sync worker that misses the stop signals (they came before it set its handlers) is
    SIGKILLed by the arbiter once its graceful timeout has passed: killed, it ran no exit handler.
    Its readiness, sent when it entered its accept loop, still ends its cold start there, not at
    its death. Here the idle worker is SIGKILLed right away, as the arbiter would 30 s later."""
    pytest.importorskip("gunicorn")
    pytest.importorskip("flask")
    from conftest import free_port

    killed: list[int] = []

    def kids(master: int) -> list[int]:
        return [int(k) for t in os.listdir("/proc/%d/task" % master)
                for k in open("/proc/%d/task/%s/children" % (master, t)).read().split()]  # noqa: SIM115

    def kill_idle(master: int, answer: Any) -> None:
        # The arbiter forks its workers one by one (up to 0.1 s apart) after the socket
        # listens: the first one can answer before the second exists. Wait for it.
        deadline = time.monotonic() + 30
        while len(idle := [k for k in kids(master) if k != answer["pid"]]) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(idle) == 1, (kids(master), answer["pid"])
        time.sleep(0.3)  # its loop has started (the arbiter's timeout is 30 s)
        os.kill(idle[0], signal.SIGKILL)
        killed.append(idle[0])
        time.sleep(1.0)  # the agent sees it gone

    port = free_port()
    r, answer = serve_once(str(tmp_path), [os.path.join(BIN, "gunicorn"), "--preload", "-w", "2", "-b",
                                           "127.0.0.1:%d" % port, "serving_wsgi:app"],
                           "http://127.0.0.1:%d/generate" % port, {"n": 8},
                           {"STACK_MODELS": models, "CWD": HERE}, before_stop=kill_idle)
    css, known = check_each_process(r)
    assert not known
    (dead,) = [cs for cs in css if pid(cs) == killed[0]]
    assert dead.root.attributes["infersight.coldstart.ended_by"] == "ready"  # closed by the agent, at readiness
    # the arbiter logs "Worker (pid:N) was sent SIGKILL! Perhaps out of memory?" for it: a guess, no OOM
    assert "was sent SIGKILL! Perhaps out of memory?" in r.output and "OOM [" not in r.output, r.output[-3000:]
    (ready,) = [s for s in dead.stages if stage_name(s) == "ready_wait"]
    assert ready.attributes["infersight.ready.source"] == "fork"
    assert dead.root.end_ns == ready.end_ns


def test_peft_lora_merged_behind_flask(models: str, tmp_path) -> None:
    pytest.importorskip("flask")
    from conftest import free_port

    port = free_port()
    r, answer = serve_once(str(tmp_path), [sys.executable, STACKS, "peft_flask", models, str(port)],
                           "http://127.0.0.1:%d/generate" % port, {"n": 4}, {})
    assert len(answer["tokens"]) == 4
    (cs,), known = check_each_process(r)
    assert not known
    rules = {s.attributes.get("infersight.stage.rule") for s in cs.stages}
    assert {"peft.load_adapter", "peft.merge_and_unload"} <= rules, rules
    (ready,) = [s for s in cs.stages if stage_name(s) == "ready_wait"]  # werkzeug's socket listens
    assert ready.attributes["infersight.ready.source"] in ("listen", "listening_socket")
    assert cs.root.end_ns == ready.end_ns


def test_litserve(models: str, tmp_path) -> None:
    pytest.importorskip("litserve")
    from conftest import free_port

    port = free_port()
    r, answer = serve_once(str(tmp_path), [sys.executable, os.path.join(HERE, "serving_litserve.py"), str(port)],
                           "http://127.0.0.1:%d/predict" % port, {"n": 8}, {"STACK_MODELS": models})
    assert len(answer["tokens"]) == 8
    css, known = check_each_process(r, short=forked_uvicorn)
    worker = the_one_with(css, "weights_load")  # LitAPI.setup runs in LitServe's inference worker
    assert worker.root.parent_span_id is not None  # nested under the server that started it
    assert "framework_import" in names(worker)
    check_run_examples(coldstarts(r.spans), "litserve")  # helpers too: its multiprocessing manager is one
    (ready,) = [s for s in worker.stages if stage_name(s) == "ready_wait"]  # queues, no socket: its loop
    assert ready.attributes["infersight.stage.rule"] == "litserve.serving_loop"
    assert worker.root.attributes["infersight.coldstart.ended_by"] == "ready"  # not its idle loop, nor exit
    assert worker.root.end_ns - worker.root.start_ns < 60e9
    assert pid(worker) not in {row[0] for row in known}  # the inference worker is never short
    managers = [cs for cs in coldstarts(r.spans) if any(
        s.attributes.get("infersight.stage.rule") == "python.multiprocessing.manager" for s in cs.stages)]
    assert managers and all(is_helper(cs) for cs in managers), "its manager process is a helper, not a server"
    assert all(cs.root.attributes["infersight.coldstart.ended_by"] == "ready" for cs in managers)
    settle(known, "the uvicorn process LitServe forks lives about 0.1 s and listens on a socket its parent "
                  "bound: its readiness is seen by the sampler's poll (every 100 ms), and in some runs "
                  "20-45 ms between its server's start and that poll are in no stage")


def forked_uvicorn(cs: ColdStart) -> bool:
    """LitServe's forked uvicorn server process (no model of its own)."""
    return (cs.root.parent_span_id is not None and "weights_load" not in names(cs)
            and any(s.attributes.get("infersight.runtime_init.forked") for s in cs.stages))


def test_bentoml_serve(models: str, tmp_path) -> None:
    pytest.importorskip("bentoml")
    from conftest import free_port

    port = free_port()
    r, answer = serve_once(str(tmp_path), [os.path.join(BIN, "bentoml"), "serve", "serving_bento:Generator",
                                           "--port", str(port), "--host", "127.0.0.1"],
                           "http://127.0.0.1:%d/generate" % port, {"n": 8},
                           {"STACK_MODELS": models, "CWD": HERE, "BENTOML_HOME": str(tmp_path / "bentoml")})
    assert answer == [t for t in answer if isinstance(t, int)] and len(answer) == 8, answer
    css, known = check_each_process(r, short=lambda cs: cs.root.parent_span_id is not None)
    worker = the_one_with(css, "weights_load")  # the service's __init__ runs in its worker process
    assert worker.root.parent_span_id is not None
    check_run_examples(css, "bentoml")
    (ready,) = [s for s in worker.stages if stage_name(s) == "ready_wait"]  # its socket is the supervisor's
    assert ready.attributes["infersight.stage.rule"] == "bentoml.service_init"
    assert worker.root.attributes["infersight.coldstart.ended_by"] == "ready"
    settle(known, "BentoML's workers fall short")


def test_ray_serve(models: str, tmp_path) -> None:
    """ray.init, serve.start, serve.run named in the driver, which is ready when serve.run
    returns (though a request sent as soon as the proxy answered was served meanwhile); the
    replica's constructor (its ``import torch`` on Serve's user-code thread and its model load)
    is its own cold start, ready when the replica reports to the controller,
    and nests under the driver's wait for replicas although the C++ raylet started it."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ray[serve]', in the test extra)")
    from conftest import free_port

    r = launch(str(tmp_path), [sys.executable, STACKS, "ray", models, str(free_port())], result=False,
               env={**ENV, "PYTHONPATH": ""}, timeout=600)
    assert r.rc == 0, r.output[-4000:]
    assert "ray: tokens 8" in r.output and "ray: early tokens 8" in r.output
    css, known = check_each_process(r)
    assert not known
    (driver,) = [cs for cs in css if cs.root.parent_span_id is None]
    by_rule = {s.attributes.get("infersight.stage.rule"): s for s in driver.stages if stage_name(s) != "ready_wait"}
    assert {"ray.init", "ray.serve.start", "ray.serve.run", "ray.serve.replicas_wait",
            "ray.serve.proxy_wait"} <= set(by_rule), sorted(map(str, by_rule))
    deploy = by_rule["ray.serve.run"]
    waits = [s for s in driver.stages if s.attributes.get("infersight.stage.rule") == "ray.serve.replicas_wait"]
    assert all(w.parent_span_id == deploy.span_id for w in waits)  # serve.run's waits nest in it
    (ready,) = [s for s in driver.stages if stage_name(s) == "ready_wait"]
    assert ready.attributes["infersight.ready.source"] == "stage_rule"
    assert driver.root.end_ns <= ready.end_ns  # not at exit, past the response and the shutdown
    # The early request, served by the replica while serve.run still deployed, did not end the
    # driver's cold start half way: it ends at the deploy's return, every stage inside it.
    assert deploy.end_ns <= driver.root.end_ns, "the driver ended while serve.run still deployed"
    assert driver.root.attributes["infersight.coldstart.ended_by"] in ("ready", "workers")

    replica = the_one_with(css, "replica_init")
    (init,) = [s for s in replica.stages if stage_name(s) == "replica_init"]
    imports = [s for s in replica.stages if stage_name(s) == "framework_import"
               and any(str(p).startswith("torch ") for p in s.attributes.get("infersight.import.packages", []))]
    assert imports, "the replica's import torch is not timed"
    assert any(init.start_ns <= s.start_ns and s.end_ns <= init.end_ns for s in imports)
    assert "weights_load" in names(replica)
    (r_ready,) = [s for s in replica.stages if stage_name(s) == "ready_wait"]
    assert r_ready.attributes["infersight.stage.rule"] == "ray.serve.replica_init"
    assert replica.root.parent_span_id in {w.span_id for w in waits}, "the replica hangs elsewhere"

    controller = the_one_with(css, "serve_controller_init")  # ready when its constructor returned
    (c_ready,) = [s for s in controller.stages if stage_name(s) == "ready_wait"]
    assert c_ready.attributes["infersight.stage.rule"] == "ray.serve.controller_init"
    for worker in (controller, replica):  # joined the raylet, then waited for its actor's creation task
        (wait,) = [s for s in worker.stages if stage_name(s) == "ray_task_wait"]
        assert wait.attributes["infersight.stage.until"].startswith("ray._private.function_manager:")
        # its session handle and its connect are ray_init; its log set-up runs on to the task loop
        joins = {s.attributes["infersight.stage.target"] for s in worker.stages if stage_name(s) == "ray_init"}
        assert joins == {"ray._private.node:Node.__init__", "ray._private.worker:connect"}, joins
        (setup,) = [s for s in worker.stages if stage_name(s) == "ray_worker_setup"]
        assert setup.attributes["infersight.stage.until"] == "ray._private.worker:Worker.main_loop"
        assert setup.end_ns <= wait.start_ns
    assert not [s for s in driver.stages if stage_name(s) == "ray_worker_setup"]  # no task loop: no span
    monitors = [cs for cs in css if cs.root.resource.get("process.command") == "log_monitor.py"]
    assert monitors, sorted(str(cs.root.resource.get("process.command")) for cs in css)
    for m in monitors:  # no socket: ready when its loop started, not at its death
        assert m.root.attributes["infersight.coldstart.ended_by"] == "ready", m.root.attributes
