"""A request's server CPU after the first one, hooked vs not, on the servers the hooks reach at their
own entry point: waitress, ``http.server`` (a ``BaseHTTPRequestHandler``), ``wsgiref.simple_server``
and a WSGI app under Hypercorn; gunicorn's sync worker and an ASGI app under Hypercorn, hooked as
before, are the comparisons.

Goal: once the first request has ended the cold start, a request costs the server nothing measurable
beyond what the other WSGI hooks cost: waitress's app gets the timing middleware gunicorn's does (its
caller-side cost alone: ``bench/emit_vs_span.py``'s ``wsgi_added_us``; here, with the drain thread
that ships each request's event), Hypercorn's WSGI requests go through the ASGI middleware, and
``http.server`` and ``wsgiref`` pay nothing: the first-request wrappers are taken out when the cold
start ends (``first_request_wrappers_left`` says whether any was still in place after it).

Each run is a real server process (for Hypercorn, its worker too) on loopback, hooked (shipping to a
real agent in another process) or not (``off``). The bench sends the first request (hooked: it ends the
cold start), asks the server whether any first-request wrapper is still in place (``/wrapped``), sends
WARMUP requests, then REQUESTS more on one kept-alive connection, and reads the server's on-CPU time
over them from the kernel (``/proc/<pid>/task/*/schedstat``, every thread of the server's processes,
in ns). Variants run in turns, REPEAT times; figures are medians of the per-request CPU (µs).

Run: python bench/server_request_cost.py [--requests N] [--repeat N] [--servers waitress,http.server,...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from emit_vs_span import start_agent_process  # bench/ is on sys.path when run as a script

WARMUP = 300
SERVERS = ("waitress", "http.server", "wsgiref", "hypercorn", "hypercorn_asgi", "gunicorn")
BOOTSTRAP = str(Path(__file__).resolve().parent.parent / "hooks" / "bootstrap")

# The served code: no infersight call in it. ``/wrapped`` says whether a first-request wrapper is in place.
APP = r"""
import json, sys

def wrappers():
    found = []
    for mod, cls, name in (("waitress.task", "WSGITask", "service"),
                           ("http.server", "BaseHTTPRequestHandler", "handle_one_request"),
                           ("http.server", "BaseHTTPRequestHandler", "parse_request"),
                           ("wsgiref.simple_server", "WSGIRequestHandler", "handle")):
        fn = getattr(getattr(sys.modules.get(mod), cls, None), name, None)
        if getattr(fn, "_infersight", False):
            found.append("%s.%s.%s" % (mod, cls, name))
    return found

def body(path):
    return json.dumps(wrappers()).encode() if path == "/wrapped" else b"ok"

def wsgi(environ, start_response):
    data = body(environ.get("PATH_INFO"))
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(data)))])
    return [data]

async def asgi(scope, receive, send):  # the comparison for Hypercorn's WSGI requests: its ASGI ones
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    data = body(scope["path"])
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(data))]})
    await send({"type": "http.response.body", "body": data})
"""

SERVER = (
    APP
    + r"""
kind, port = sys.argv[1], int(sys.argv[2])
if kind == "waitress":
    import waitress
    waitress.serve(wsgi, host="127.0.0.1", port=port, threads=2, _quiet=True)
elif kind == "wsgiref":
    from wsgiref.simple_server import WSGIRequestHandler, make_server
    class Quiet(WSGIRequestHandler):
        def log_message(self, *a):
            pass
    make_server("127.0.0.1", port, wsgi, handler_class=Quiet).serve_forever()
else:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK wait between them
        def do_GET(self):
            data = body(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def log_message(self, *a):
            pass
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir("/proc/%d/task" % p):
                with open("/proc/%d/task/%s/children" % (p, tid)) as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def on_cpu_ns(pids: list[int]) -> int:
    """Time on a CPU of every live thread of ``pids`` (the scheduler's own count, in ns)."""
    total = 0
    for p in pids:
        try:
            tids = os.listdir("/proc/%d/task" % p)
        except OSError:
            continue
        for tid in tids:
            try:
                with open("/proc/%d/task/%s/schedstat" % (p, tid)) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total


def get(conn: http.client.HTTPConnection, path: str) -> bytes:
    conn.request("GET", path)
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise SystemExit("%s answered %d" % (path, resp.status))
    return data


def run(kind: str, env: dict[str, str], workdir: str, requests: int) -> tuple[float, list[str]]:
    """(server CPU per request in µs over ``requests`` after the first, the wrappers left after the first)."""
    port = free_port()
    bin_dir = os.path.dirname(sys.executable)
    if kind in ("hypercorn", "hypercorn_asgi"):
        argv = [
            os.path.join(bin_dir, "hypercorn"),
            "-b",
            "127.0.0.1:%d" % port,
            "--log-level",
            "warning",
            "served_app:asgi" if kind == "hypercorn_asgi" else "served_app:wsgi",
        ]
    elif kind == "gunicorn":
        argv = [
            os.path.join(bin_dir, "gunicorn"),
            "-w",
            "1",
            "-b",
            "127.0.0.1:%d" % port,
            "--log-level",
            "warning",
            "served_app:wsgi",
        ]
    else:
        argv = [sys.executable, "served_server.py", kind, str(port)]
    p = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if p.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("%s did not listen" % kind) from None
                time.sleep(0.05)
        time.sleep(0.3)  # a wait for traffic
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        get(conn, "/")  # the first request: hooked, it ends the cold start (its wrappers go)
        time.sleep(0.2)
        left = json.loads(get(conn, "/wrapped"))
        for _ in range(WARMUP):
            get(conn, "/")
        pids = tree(p.pid)
        c0 = on_cpu_ns(pids)
        for _ in range(requests):
            get(conn, "/")
        c1 = on_cpu_ns(pids)
        conn.close()
        return (c1 - c0) / requests / 1e3, left
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--servers", default=",".join(SERVERS))
    args = ap.parse_args()
    servers = [s for s in args.servers.split(",") if s]
    sock, spool, _agent = start_agent_process()
    d = tempfile.mkdtemp()
    Path(d, "served_app.py").write_text(APP)
    Path(d, "served_server.py").write_text(SERVER)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT", "OTEL_", "TRACEPARENT"))}
    base["PYTHONPATH"] = d  # hypercorn imports served_app from here
    variants = {
        "off": base,
        "hooked": dict(
            base,
            INFERSIGHT="1",
            INFERSIGHT_SOCKET=sock,
            INFERSIGHT_SPOOL_DIR=spool,
            PYTHONPATH=BOOTSTRAP + os.pathsep + d,
        ),
    }
    out: dict[str, object] = {"requests": args.requests, "repeat": args.repeat, "python": sys.version.split()[0]}
    for kind in servers:
        got: dict[str, list[float]] = {v: [] for v in variants}
        left: list[str] = []
        for _ in range(args.repeat):
            for name, env in variants.items():
                us, wrapped = run(kind, env, d, args.requests)
                got[name].append(us)
                if name == "hooked":
                    left.extend(w for w in wrapped if w not in left)
        off, hooked = statistics.median(got["off"]), statistics.median(got["hooked"])
        out[kind] = {
            "cpu_us_per_request_off": round(off, 2),
            "cpu_us_per_request_hooked": round(hooked, 2),
            "added_us": round(hooked - off, 2),
            "runs_off": [round(x, 1) for x in got["off"]],
            "runs_hooked": [round(x, 1) for x in got["hooked"]],
            "first_request_wrappers_left": left,
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
