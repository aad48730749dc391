"""Hypercorn's trio workers (``-k trio``) under ``infersight launch --agent embedded``: ``trio_worker``
listens on its supervisor's sockets before it imports the app, and serves only once the app's lifespan
startup has run. A worker is ready when it serves (``trio.serve_listeners`` starts in ``worker_serve``),
after the app's import and its lifespan, never at that early ``listen()``; the HTTP request is its
``first_request``. With ``-w 0`` the main process is that worker (no supervisor holds the socket: the
kernel's tables alone would have said ready at the early listen). A trio worker whose app's import
raises was never ready, nor is its supervisor, none of whose workers was.

Each test waits for the app's lifespan (a file it writes) and for the port with bare TCP connects (no
request), sends one GET, then stops the stack with SIGINT (launch hands it to CMD's process group)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import INFERSIGHT, bare_connect, pid, stage_name, the  # noqa: E402
from short_tmp import short_tmpdir  # noqa: E402

from infersight.agent.commands.show import coldstarts, spans_from_lines  # noqa: E402
from infersight.exporters.waterfall import is_helper  # noqa: E402
from infersight.telemetry import ColdStart, SpanItem  # noqa: E402

pytest.importorskip("hypercorn")
pytest.importorskip("trio", reason="Hypercorn's -k trio needs trio (the test extras install it)")

pytestmark = [pytest.mark.slow]

BIN = os.path.dirname(sys.executable)
IMPORT_S = 0.5  # the app's import: readiness comes after it

TRIO_APP = """
import json, os, time
time.sleep(%(import_s)s)  # the app's own start-up (a model load at import)
if os.environ.get("TRIO_APP_FAIL"):
    raise OSError("model directory /models/gpt not found")


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                began = time.time_ns()
                time.sleep(0.2)  # its lifespan's start-up (a warmup)
                with open(os.path.join(os.environ["TRIO_APP_DIR"], "lifespan.%%d" %% os.getpid()), "w") as f:
                    f.write("%%d %%d" %% (began, time.time_ns()))  # when it began and ended
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    body = json.dumps({"pid": os.getpid()}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
""" % {"import_s": IMPORT_S}


def run(tmp: str, workers: int, fail: bool = False, timeout: float = 120) -> tuple[int, str, list[ColdStart], Any]:
    """``hypercorn -k trio -w workers trio_app:app`` under launch: unless it ``fail``s, one GET once its
    lifespan ran and its port takes connections, then SIGINT to launch. (rc, output, cold starts, answer)."""
    from conftest import free_port

    with open(os.path.join(tmp, "trio_app.py"), "w", encoding="utf-8") as f:
        f.write(TRIO_APP)
    port = free_port()
    otlp = os.path.join(tmp, "out.otlp.jsonl")
    e = dict(os.environ, XDG_CACHE_HOME=os.path.join(tmp, "cache"), INFERSIGHT_MEASURE_STORAGE="0",
             TMPDIR=short_tmpdir(tmp), TRIO_APP_DIR=tmp, PYTHONWARNINGS="ignore")
    if fail:
        e["TRIO_APP_FAIL"] = "1"
    argv = [os.path.join(BIN, "hypercorn"), "-k", "trio", "-w", str(workers), "-b", "127.0.0.1:%d" % port,
            "trio_app:app"]
    log = open(os.path.join(tmp, "launch.log"), "w+", encoding="utf-8")  # noqa: SIM115 (a pipe would wait for CMD's orphans)
    p = subprocess.Popen([*INFERSIGHT, "launch", "--agent", "embedded", "--otlp-file", otlp, "--", *argv],
                         cwd=tmp, env=e, stdout=log, stderr=subprocess.STDOUT)
    answer: Any = None
    try:
        if not fail:
            deadline = time.monotonic() + timeout
            while not any(n.startswith("lifespan.") for n in os.listdir(tmp)) or not bare_connect(port):
                assert p.poll() is None, "the stack exited before it served"
                assert time.monotonic() < deadline, "port %d never served" % port
                time.sleep(0.05)
            with urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=60) as resp:
                answer = json.load(resp)
            time.sleep(0.3)
            p.send_signal(signal.SIGINT)
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.seek(0)
        out = log.read()
        log.close()
    with open(otlp, encoding="utf-8") as f:
        css = [cs for cs in coldstarts(spans_from_lines(f.readlines())) if not is_helper(cs)]
    return p.returncode, out, css, answer


def app_import(cs: ColdStart) -> SpanItem:
    found = [s for s in the(cs, "framework_import")
             if any(p.startswith("trio_app ") for p in s.attributes.get("infersight.import.packages", []))]
    assert found, [(stage_name(s), s.attributes) for s in cs.stages]
    return found[0]


@pytest.mark.parametrize("workers", [1, 0])
def test_a_trio_worker_is_ready_when_it_serves_not_at_its_early_listen(tmp_path, workers: int) -> None:
    rc, out, css, answer = run(str(tmp_path), workers)
    assert rc == 0, out[-3000:]
    (w,) = [cs for cs in css if pid(cs) == answer["pid"]]
    (ready,) = the(w, "ready_wait")
    a = w.root.attributes
    assert a["infersight.coldstart.ended_by"] == "ready", (a, out[-3000:])
    assert a["infersight.ready.source"] == "listening_socket", a  # its sockets, claimed when it serves
    assert ready.attributes["server.port"] > 0
    # after the app's import and its lifespan's start-up: at its early listen, both were still to come
    assert app_import(w).end_ns <= ready.end_ns == w.root.end_ns, out[-3000:]
    with open(tmp_path / ("lifespan.%d" % answer["pid"]), encoding="ascii") as f:
        lifespan_begin, lifespan_end = (int(x) for x in f.read().split())
    assert lifespan_end <= ready.end_ns
    # the lifespan's start-up, in its own trio task, up to the app's lifespan.startup.complete
    (startup,) = the(w, "app_startup")
    assert startup.attributes["infersight.stage.until"] == "hypercorn.trio.lifespan:Lifespan.asgi_send"
    assert startup.start_ns <= lifespan_begin <= lifespan_end <= startup.end_ns, startup
    (first,) = the(w, "first_request")
    assert first.attributes["infersight.first_request.source"] == "asgi", first.attributes
    assert first.start_ns >= ready.end_ns  # the HTTP request, after readiness: its wait no cold start


def test_a_trio_worker_whose_app_fails_to_import_was_never_ready(tmp_path) -> None:
    _rc, out, css, _ = run(str(tmp_path), 1, fail=True)  # (Hypercorn 0.18's main process exits 0 all the same)
    assert "OSError: model directory /models/gpt not found" in out, out[-3000:]
    (master,) = [cs for cs in css if cs.root.parent_span_id is None]
    (w,) = [cs for cs in css if cs.root.parent_span_id is not None]
    assert w.root.attributes["infersight.coldstart.ended_by"] == "exit", (w.root.attributes, out[-3000:])
    assert "infersight.coldstart.ready_s" not in w.root.attributes
    assert not the(w, "ready_wait")  # its early listen was none
    assert app_import(w).end_ns <= w.root.end_ns  # the failed import inside its cold start
    a = master.root.attributes
    assert a["infersight.coldstart.workers"] == 1 and a["infersight.coldstart.workers_ready"] == 0, a
    assert a["infersight.coldstart.ended_by"] == "exit", a  # its worker's listen on its socket served nobody
    assert "infersight.coldstart.ready_s" not in a, a
