"""A cold start ends at readiness: the wait for traffic is in no total (real uvicorn, real launch).

A server ready at about 1 s whose first request comes 4 s later has a root of about 1 s that
ends at the readiness event itself (``ready_wait``'s end), a ``first_request`` span from the
request's arrival, an unattributed share of the root alone, and history and histograms that
hold the root, not the wait. Without a readiness signal the first response still ends it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, read_otlp_lines, wait_for

from infersight.agent.commands.show import coldstarts, spans_from_lines
from infersight.coldstart_stages import stage_durations, stage_name
from infersight.telemetry import SpanItem

SERVER = """
import sys, time
time.sleep(1.0)  # start-up work the server does before it listens
import uvicorn
from infersight.hooks.asgi import ColdStartMiddleware

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})

uvicorn.run(ColdStartMiddleware(app), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", loop="asyncio")
"""


def _serve_then_request(tmp_path: Path, wait_s: float, service: str, **env: str) -> tuple[str, int, Path]:
    """launch the server; once it accepts, wait ``wait_s``, send one request, stop it.
    Returns (launch's output, when the request was sent, the OTLP file)."""
    port = free_port()
    server = tmp_path / "server.py"
    server.write_text(SERVER)
    out = tmp_path / "out.otlp.jsonl"
    e = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    e.update(OTEL_SERVICE_NAME=service, **env)
    p = subprocess.Popen([sys.executable, "-m", "infersight", "launch", "--otlp-file", str(out), "--",
                          sys.executable, str(server), str(port)], env=e, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def accepts() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
        except OSError:
            return False
        return True

    try:
        assert wait_for(accepts, 60)
        time.sleep(wait_s)  # the wait for traffic (a gap we make, not a bound we assert on)
        sent_ns = time.time_ns()
        with urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=30) as r:
            assert r.read() == b"ok"
        p.send_signal(signal.SIGINT)  # launch forwards it; uvicorn shuts down
        output, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode in (0, 130), output
    return output, sent_ns, out


def _one(spans: list[SpanItem], name: str) -> SpanItem:
    (s,) = [x for x in spans if stage_name(x) == name]
    return s


@pytest.mark.slow
def test_root_ends_at_readiness_and_first_request_is_measured_from_its_arrival(tmp_path: Path) -> None:
    output, sent_ns, out = _serve_then_request(tmp_path, 4.0, "ready-end-svc")
    lines = read_otlp_lines(out)
    (cs,) = [c for c in coldstarts(spans_from_lines(out.read_text().splitlines()))
             if c.root.resource.get("service.name") == "ready-end-svc"]
    root, stages = cs.root, cs.stages
    ready, first = _one(stages, "ready_wait"), _one(stages, "first_request")
    assert root.attributes["infersight.ready.source"] == "listen"
    assert root.attributes["infersight.coldstart.ended_by"] == "ready"
    assert root.end_ns == ready.end_ns  # the readiness event itself, not a wall-clock bound
    assert root.attributes["infersight.coldstart.ready_s"] == pytest.approx((root.end_ns - root.start_ns) / 1e9)
    # first_request: from the request's arrival (after we sent it), wholly after the root.
    assert first.parent_span_id == root.span_id
    assert sent_ns <= first.start_ns and root.end_ns < first.start_ns
    assert first.start_ns - root.end_ns >= 4_000_000_000  # the wait we made lies between them
    # The unattributed share is of the root alone: the wait is in it nowhere.
    un = root.attributes["infersight.coldstart.unattributed_s"]
    assert 0 <= un * 1e9 <= root.end_ns - root.start_ns
    # Histograms: total is the root; first_request its own service time; no stage holds the wait.
    d = stage_durations(cs)
    assert d["total"] == pytest.approx((root.end_ns - root.start_ns) / 1e9)
    assert d["first_request"] == pytest.approx((first.end_ns - first.start_ns) / 1e9)
    assert sum(v for k, v in d.items() if k != "total") * 1e9 < first.start_ns - root.start_ns
    metric_totals = [dp for req in lines for rm in req.get("resourceMetrics", []) for sm in rm["scopeMetrics"]
                     for m in sm["metrics"] if m["name"] == "infersight.coldstart.duration"
                     for dp in m["histogram"]["dataPoints"]
                     if {"key": "infersight.stage", "value": {"stringValue": "total"}} in dp["attributes"]]
    assert metric_totals and metric_totals[-1]["sum"] == pytest.approx((root.end_ns - root.start_ns) / 1e9)
    # ETA history: the root's total, the stages within it.
    history = Path(os.environ["INFERSIGHT_STATE_DIR"]) / "coldstart-history.jsonl"
    runs = [r for r in map(json.loads, history.read_text().splitlines()) if r["key"].startswith("ready-end-svc#")]
    assert len(runs) == 1
    assert runs[0]["total_s"] == pytest.approx((root.end_ns - root.start_ns) / 1e9, abs=1e-5)
    assert "first_request" not in [s for s, _d, _e in runs[0]["stages"]]
    # The waterfall shows the wait, labelled, in no share; so does the HTML report.
    assert "(waiting for traffic)" in output and "ended by ready" in output
    wait_row = next(x for x in output.splitlines() if "(waiting for traffic)" in x)
    assert wait_row.split()[5] == "-"  # name(3 words), start, duration, share
    html = tmp_path / "r.html"
    subprocess.run([sys.executable, "-m", "infersight", "report", str(out), "-o", str(html)], check=True, timeout=60)
    assert "waiting for traffic (in no total)" in html.read_text()


@pytest.mark.slow
def test_without_a_readiness_signal_the_first_response_ends_it(tmp_path: Path) -> None:
    output, sent_ns, out = _serve_then_request(tmp_path, 0.5, "no-signal-svc", INFERSIGHT_READY_ON_LISTEN="0")
    (cs,) = [c for c in coldstarts(spans_from_lines(out.read_text().splitlines()))
             if c.root.resource.get("service.name") == "no-signal-svc"]
    first = _one(cs.stages, "first_request")
    assert cs.root.attributes["infersight.ready.source"] == "request"
    assert cs.root.attributes["infersight.coldstart.ended_by"] == "first_request"
    assert cs.root.end_ns == first.end_ns and first.start_ns >= sent_ns
    assert "(waiting for traffic)" not in output


EARLY_LISTENER = """
import socket, sys
from infersight import hooks
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()  # before the model loads (vLLM's early bind); INFERSIGHT_READY_ON_LISTEN=0: not readiness
    socks.append(s)
hooks.mark_ready()
print("ports", *[s.getsockname()[1] for s in socks], flush=True)
"""


@pytest.mark.parametrize("listeners", [1, 2])
def test_an_explicit_readiness_names_the_one_port_the_process_listens_on(tmp_path: Path, listeners: int) -> None:
    """A server that binds early and says ``mark_ready()`` after its load: readiness carries ``server.port`` (what the
    agent's routing hints find the server by; without it two restarts of one service could be drained on each
    other's port), when the process listens on exactly one TCP port; on two, it names none (which serves is not
    known)."""
    script = tmp_path / "early.py"
    script.write_text(EARLY_LISTENER)
    out = tmp_path / "out.otlp.jsonl"
    e = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    e.update(INFERSIGHT_READY_ON_LISTEN="0")
    r = subprocess.run([sys.executable, "-m", "infersight", "launch", "--agent", "embedded", "--otlp-file", str(out),
                        "--", sys.executable, str(script), str(listeners)], env=e, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    ports = [int(x) for x in next(ln for ln in r.stdout.splitlines() if ln.startswith("ports")).split()[1:]]
    (ready,) = [s for s in spans_from_lines(out.read_text().splitlines()) if s.name == "coldstart.ready_wait"]
    assert ready.attributes.get("infersight.ready.source", "mark_ready") == "mark_ready"
    assert ready.attributes.get("server.port") == (ports[0] if listeners == 1 else None)
