"""Readiness from the kernel's listening sockets, whatever opens them (``hooks/_listening.py``).

uvloop opens the server socket in C: ``socket.listen`` is never called, and the hooks' wrapper
sees nothing. The kernel's tables (sock_diag, or ``/proc/<pid>/net/tcp{,6}`` and ``unix``)
against the process's socket inodes still say when it listens: real uvicorn on real uvloop,
and a non-Python CMD under ``launch``, whose launcher polls its process tree.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, hook_env, read_otlp_lines, spans, wait_for

from infersight.agent.commands.show import coldstarts, spans_from_lines
from infersight.coldstart_stages import stage_name
from infersight.hooks import _listening

pytest.importorskip("uvloop")

SERVER = """
import sys, time
time.sleep(0.5)  # start-up work before the server listens
import uvicorn
from infersight.hooks.asgi import ColdStartMiddleware

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})

uvicorn.run(ColdStartMiddleware(app), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", loop="uvloop")
"""


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_uvicorn_on_uvloop_is_ready_when_it_listens(tmp_path: Path) -> None:
    port = free_port()
    server = tmp_path / "server.py"
    server.write_text(SERVER)
    out = tmp_path / "out.otlp.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env["OTEL_SERVICE_NAME"] = "uvloop-svc"
    p = subprocess.Popen([sys.executable, "-m", "infersight", "launch", "--otlp-file", str(out), "--",
                          sys.executable, str(server), str(port)], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: _accepts(port), 60)
        time.sleep(1.0)  # a wait for traffic after readiness
        sent_ns = time.time_ns()
        with urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=30) as r:
            assert r.read() == b"ok"
        p.send_signal(signal.SIGINT)
        output, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    (cs,) = [c for c in coldstarts(spans_from_lines(out.read_text().splitlines()))
             if c.root.resource.get("service.name") == "uvloop-svc"]
    (ready,) = [s for s in cs.stages if stage_name(s) == "ready_wait"]
    (first,) = [s for s in cs.stages if stage_name(s) == "first_request"]
    assert ready.attributes["infersight.ready.source"] == "listening_socket", output
    assert ready.attributes["server.port"] == port
    assert cs.root.attributes["infersight.coldstart.ended_by"] == "ready"
    assert cs.root.end_ns == ready.end_ns < sent_ns <= first.start_ns  # ready before the request, not at it
    assert "ended by ready" in output


@pytest.mark.slow
def test_non_python_cmd_under_launch_is_ready_when_its_child_listens(tmp_path: Path) -> None:
    """A shell whose child (no hooks: ``python -I``) listens: the launcher finds the socket in CMD's
    process tree and says so; then the child is told to end, and so the command."""
    port = free_port()
    done = tmp_path / "done"
    code = ("import os, socket, time; time.sleep(0.3); s = socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', %d)); s.listen()\n"
            "while not os.path.exists(%r):\n    time.sleep(0.02)\n" % (port, str(done)))
    out = tmp_path / "out.otlp.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env["OTEL_SERVICE_NAME"] = "shell-listener"
    p = subprocess.Popen([sys.executable, "-m", "infersight", "launch", "--otlp-file", str(out), "--",
                          "sh", "-c", '"$0" -I -c "$1"; true', sys.executable, code], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    guard = threading.Timer(60, done.touch)  # never seen: the command ends anyway, and the test fails
    guard.start()
    try:
        assert p.stdout is not None
        for line in p.stdout:  # launch says when it saw CMD listen
            lines.append(line)
            if "CMD listens on tcp port %d" % port in line:
                break
        done.touch()
        output = "".join(lines) + p.communicate(timeout=60)[0]
    finally:
        guard.cancel()
        done.touch()
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, output
    (cs,) = coldstarts(spans_from_lines(out.read_text().splitlines()))
    assert cs.root.attributes["infersight.coldstart.source"] == "launcher"
    (ready,) = [s for s in cs.stages if stage_name(s) == "ready_wait"]
    assert ready.attributes["infersight.ready.source"] == "listening_socket"
    assert ready.attributes["server.port"] == port
    assert cs.root.end_ns == ready.end_ns
    assert cs.root.attributes["infersight.coldstart.ended_by"] == "ready"
    assert "ended by ready" in output or "ready after" in output


def test_a_socket_listening_since_start_is_no_readiness(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """Socket activation, a re-exec: the process starts holding a listening socket. That says
    nothing of when it is ready; its cold start ends at exit, not at the sampler's first look."""
    agent = agent_factory().start()
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    script = tmp_path / "w.py"
    script.write_text("import time\nfrom infersight import hooks\nwith hooks.stage('load'):\n    time.sleep(0.5)\n")
    env = hook_env(agent.sock, agent.spool, INFERSIGHT_EXIT_FLUSH_S="5")
    r = subprocess.run([sys.executable, str(script)], env=env, pass_fds=[held.fileno()], capture_output=True,
                       text=True, timeout=60)
    held.close()
    assert r.returncode == 0, r.stderr
    assert agent.stop() == 0
    sp = spans(read_otlp_lines(agent.out))
    assert "coldstart.load" in [s["name"] for s in sp]
    assert "coldstart.ready_wait" not in [s["name"] for s in sp]


def test_tables_parse_and_agree_with_netlink() -> None:
    tcp = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
           "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1\n"
           "   1: 0100007F:1F91 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 4343 1\n")
    assert _listening.tcp_listening(tcp) == {4242: ("tcp", 8080)}
    assert _listening.tcp_listening(tcp, skip_ports=(8080,)) == {}
    unix = ("Num       RefCount Protocol Flags    Type St Inode Path\n"
            "0000000000000000: 00000002 00000000 00010000 0001 01 77 /run/app.sock\n"
            "0000000000000000: 00000002 00000000 00010000 0001 01 78 @abstract\n"
            "0000000000000000: 00000003 00000000 00000000 0001 03 79 /run/connected.sock\n"
            "0000000000000000: 00000002 00000000 00010000 0001 01 80 /tmp/pymp-x1/listener-y\n")
    assert _listening.unix_listening(unix) == {77: ("unix", "/run/app.sock")}
    s = socket.socket(socket.AF_INET6)
    s.bind(("::1", 0))
    s.listen()
    path = "/tmp/infersight-test-%d.sock" % os.getpid()
    u = socket.socket(socket.AF_UNIX)
    u.bind(path)
    u.listen()
    try:
        nl = _listening.netlink_listening()
        proc = {**_listening.tcp_listening(Path("/proc/self/net/tcp6").read_text()),
                **_listening.unix_listening(Path("/proc/self/net/unix").read_text())}
        mine = {os.fstat(s.fileno()).st_ino: ("tcp", s.getsockname()[1]), os.fstat(u.fileno()).st_ino: ("unix", path)}
        for inode, found in mine.items():
            assert nl[inode] == proc[inode] == found
        for netlink in (True, False):
            w = _listening.ListenWatch(lambda: ["self"], netlink=netlink)
            assert w.poll() == ("tcp", s.getsockname()[1])  # a TCP port first: it names the server
    finally:
        s.close()
        u.close()
        os.unlink(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="a new network namespace needs root")
def test_a_cmd_in_its_own_network_namespace_is_watched_in_that_namespace() -> None:
    """sock_diag answers for the watcher's own network namespace: launch watching a CMD that
    runs in another (``unshare -n``, ``ip netns exec``) reads that CMD's /proc tables instead."""
    child = subprocess.Popen(
        ["unshare", "-n", sys.executable, "-c",
         "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 8123)); s.listen(); "
         "print('listening', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "listening"
        watch = _listening.ListenWatch(lambda: _listening.tree(child.pid))
        assert watch.poll() == ("tcp", 8123)
    finally:
        child.kill()
        child.wait()
