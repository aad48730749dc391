"""``uvicorn --workers 2`` under ``launch``: a worker is ready when *it* serves, not when a
sibling does (issue: readiness from an inherited socket).

uvicorn's supervisor binds the socket, and every worker inherits it and listens itself. Once
the first worker listens, the kernel shows the inode LISTEN and held by every worker: the
kernel's tables alone made a worker still loading its model "ready" then (too early), or,
where that listen fell inside one of its stage rule's calls, took the socket as that call's
own for good (never ready). Here one worker loads slowly: it waits until the other one serves,
then loads for 0.5 s more; each worker notes when its lifespan start-up ended. Each worker's
readiness must come after its own load, from its own signal: its ``listen()`` call (asyncio)
or uvicorn's ``Server.startup`` returning (uvloop listens in C)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, wait_for

from infersight.agent.commands.show import coldstarts, spans_from_lines
from infersight.coldstart_stages import stage_name
from infersight.hooks import _listening

pytestmark = pytest.mark.slow

APP = '''
import json, os, socket, time

DIR = os.environ["SKEW_DIR"]
PORT = int(os.environ["SKEW_PORT"])


def _serving() -> bool:
    try:
        socket.create_connection(("127.0.0.1", PORT), 0.2).close()
    except OSError:
        return False
    return True


def load(slow: bool) -> None:
    """The model load (a stage rule wraps it in one variant). The slow worker's runs while the
    other worker already serves on the shared socket."""
    if slow:
        deadline = time.monotonic() + 30
        while not _serving() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # five sampler ticks with the socket LISTEN in the kernel's tables
    else:
        time.sleep(0.1)


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        await receive()  # startup
        try:  # the first worker here is the fast one
            os.close(os.open(os.path.join(DIR, "fast"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            slow = False
        except FileExistsError:
            slow = True
        load(slow)
        with open(os.path.join(DIR, "loaded-%d.json" % os.getpid()), "w") as f:
            json.dump({"slow": slow, "loaded_ns": time.time_ns()}, f)
        await send({"type": "lifespan.startup.complete"})
        await receive()  # shutdown
        await send({"type": "lifespan.shutdown.complete"})
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})
'''

RULES = """\
engine_version = "1.0"

[[stage]]
id = "site.skew_load"
stage = "model_load"
targets = ["skewapp:load"]

[[stage.examples]]
run = "skewapp"
"""


@pytest.mark.parametrize(("loop", "rule"), [("uvloop", False), ("uvloop", True), ("asyncio", False)],
                         ids=["uvloop", "uvloop-rule", "asyncio"])
def test_each_uvicorn_worker_is_ready_when_it_serves_not_its_sibling(tmp_path: Path, loop: str, rule: bool) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    pytest.importorskip("uvicorn")
    port = free_port()
    (tmp_path / "skewapp.py").write_text(APP)
    marks = tmp_path / "marks"
    marks.mkdir()
    flags = []
    if rule:
        rules = tmp_path / "rules"
        rules.mkdir()
        (rules / "skew.toml").write_text(RULES)
        flags = ["--rules-dir", str(rules)]
    out = tmp_path / "out.otlp.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env.update(SKEW_DIR=str(marks), SKEW_PORT=str(port), INFERSIGHT_MEASURE_STORAGE="0",
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("PYTHONPATH", None)
    p = subprocess.Popen([sys.executable, "-m", "infersight", "launch", "--otlp-file", str(out), *flags, "--",
                          sys.executable, "-m", "uvicorn", "skewapp:app", "--app-dir", str(tmp_path),
                          "--workers", "2", "--port", str(port), "--loop", loop, "--log-level", "warning"],
                         env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: len(list(marks.glob("loaded-*.json"))) == 2, 60), "the workers did not load"
        time.sleep(0.5)  # the slow worker's server starts; then a wait for traffic
        socket.create_connection(("127.0.0.1", port), 5).close()
        p.send_signal(signal.SIGINT)
        output, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    loaded = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in marks.glob("loaded-*.json")}
    assert sorted(w["slow"] for w in loaded.values()) == [False, True]
    css = {int(cs.root.resource.get("process.pid") or 0): cs
           for cs in coldstarts(spans_from_lines(out.read_text().splitlines()))}
    for pid, w in loaded.items():
        cs = css.get(pid)
        assert cs is not None, "no cold start for worker %d\n%s" % (pid, output[-3000:])
        what = "%s worker %d: %r\n%s" % ("slow" if w["slow"] else "fast", pid, cs.root.attributes, output[-3000:])
        # ready, not ended at exit: a sibling's listen taken as this worker's own call's never hides its socket
        assert cs.root.attributes["infersight.coldstart.ended_by"] == "ready", what
        (ready,) = [s for s in cs.stages if stage_name(s) == "ready_wait"]
        assert ready.attributes["infersight.ready.source"] in ("listen", "listening_socket"), what
        assert ready.attributes["server.port"] == port, what
        # ready once its own model was loaded (its lifespan start-up over), never when its sibling listened
        assert ready.end_ns >= w["loaded_ns"], (what, (w["loaded_ns"] - ready.end_ns) / 1e9)
        assert cs.root.end_ns == ready.end_ns
        if rule and w["slow"]:
            assert "model_load" in {stage_name(s) for s in cs.stages}, what


def _bound() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, os.fstat(s.fileno()).st_ino


def test_an_inherited_socket_counts_once_claimed_and_is_never_absorbed() -> None:
    w = _listening.ListenWatch(lambda: ["self"])
    w.absorb()  # whatever this test process listens on already
    s, ino = _bound()
    w.shared.add(ino)  # held when the hooks started (note_inherited_listeners), not listening yet
    try:
        s.listen()  # as a sibling worker's listen shows it here
        found, new = w._new_owned()
        assert found.get(ino) == ("tcp", s.getsockname()[1]) and ino not in new
        assert w.poll() is None
        w.absorb()  # a stage rule's call returned meanwhile: the socket is not that call's own
        assert ino not in w.foreign
        w.claim([ino])  # uvicorn's Server.startup returned: this process serves on it
        assert w.poll() == ("tcp", s.getsockname()[1])
    finally:
        s.close()


def test_a_forked_copy_of_the_parents_socket_is_shared() -> None:
    """A child forked after its parent bound a socket (LitServe's processes): whoever listens,
    the kernel shows it listening in the child too; the parent's descriptors say it is shared."""
    s, ino = _bound()
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a watch of its own, made after the fork
        code = 1
        try:
            w = _listening.ListenWatch(lambda: ["self"])
            w.absorb()
            s.listen()  # the parent's socket too: in the kernel's tables it is the same inode
            _found, new = w._new_owned()
            ok = ino not in new and ino in w.shared and w.poll() is None
            w.claim([ino])
            ok = ok and w.poll() == ("tcp", s.getsockname()[1])
            os.write(wfd, b"1" if ok else b"0")
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    try:
        assert os.read(r, 1) == b"1"
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        os.close(r)
        s.close()
