"""A server the process starts beside the one it serves (``hooks/_sideservers.py``): a Prometheus
exporter's own HTTP server, ``prometheus_client.start_http_server(METRICS_PORT)``, started before the
model loads and uvicorn serves the app (``metrics_exporter_app.py``), under ``infersight launch``
with no infersight call in the served code. Its listen is no readiness (the whole model load would
count as the wait for traffic), its port is not the port the server is ready on, and a scrape of it
after readiness is no first request."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, LaunchRun, Served, bare_connect, get_json, launch_server, one, pid  # noqa: E402
from ports import free_port  # noqa: E402

from infersight.agent.commands.show import coldstarts  # noqa: E402
from infersight.exporters.waterfall import is_helper  # noqa: E402
from infersight.telemetry import ColdStart  # noqa: E402

pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.slow]

ENV = {"PYTHONWARNINGS": "ignore"}


def run(
    tmp: str, loop: str, metrics_port: int, port: int, drive_app: Callable[[int, int], dict[str, Any]], *flags: str
) -> tuple[LaunchRun, ColdStart, dict[str, Any], dict[str, int]]:
    """Launch the app (uvicorn on ``loop`` and ``port``, ``flags`` to launch) with its metrics server on
    ``metrics_port``; once its port answers bare connects, ``drive_app(metrics_port, port)`` (the answer of
    the app it got, JSON); Ctrl-C. Returns the run, the serving process's cold start, that answer, and what
    the app wrote (when its model load ended)."""
    out = os.path.join(tmp, "app.json")
    argv = [sys.executable, os.path.join(HERE, "metrics_exporter_app.py"), str(metrics_port), str(port), loop, out]

    def drive(s: Served) -> dict[str, Any]:
        s.until(lambda: bare_connect(port), "listening", "port %d never listened" % port)
        return drive_app(metrics_port, port)

    r, answer = launch_server(tmp, argv, drive, *flags, env=ENV)
    served = [cs for cs in coldstarts(r.spans) if not is_helper(cs) and pid(cs) == answer["pid"]]
    assert len(served) == 1, r.output[-3000:]
    with open(out, encoding="utf-8") as f:
        app = json.load(f)
    return r, served[0], answer, app


def scrape(metrics_port: int) -> bytes:
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % metrics_port, timeout=30) as resp:
        assert resp.status == 200
        return bytes(resp.read())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_metrics_server_started_first_is_no_readiness(tmp_path, loop: str) -> None:
    """Ready when uvicorn listens, on uvicorn's port, after the model load: not at the metrics server's
    listen before it (asyncio: uvicorn's own ``listen()`` call; uvloop: the kernel's tables)."""
    pytest.importorskip(loop)
    metrics_port, port = free_port(), free_port()
    r, cs, _answer, app = run(str(tmp_path), loop, metrics_port, port, lambda _m, p: get_json(p))
    ready = one(cs, "ready_wait", r)
    assert ready.attributes["server.port"] == port != metrics_port, (ready.attributes, r.output[-3000:])
    sources = ("listening_socket",) if loop == "uvloop" else ("listen", "listening_socket")
    assert ready.attributes["infersight.ready.source"] in sources, ready.attributes
    assert cs.root.attributes["infersight.coldstart.ended_by"] == "ready", cs.root.attributes
    assert cs.root.end_ns == ready.end_ns >= app["loaded_ns"]  # the model load is part of the cold start
    assert one(cs, "first_request", r).attributes["url.path"] == "/"


def test_a_scrape_after_readiness_is_no_first_request(tmp_path) -> None:
    """Prometheus scrapes the metrics server once the app is ready, before any traffic: the first
    request is still the app's first, served by uvicorn."""

    def drive(metrics_port: int, port: int) -> dict[str, Any]:
        assert b"python_info" in scrape(metrics_port)
        sent = time.time_ns()  # the scrape was answered before
        with urllib.request.urlopen("http://127.0.0.1:%d/generate" % port, timeout=60) as resp:
            answer: dict[str, Any] = json.load(resp)
        answer["sent_ns"] = sent
        return answer

    metrics_port, port = free_port(), free_port()
    r, cs, answer, _app = run(str(tmp_path), "asyncio", metrics_port, port, drive)
    first = one(cs, "first_request", r)
    assert first.attributes["url.path"] == "/generate", (first.attributes, r.output[-3000:])
    assert first.attributes["infersight.first_request.source"] == "asgi"
    assert one(cs, "ready_wait", r).attributes["server.port"] == port
    assert cs.root.end_ns <= answer["sent_ns"] <= first.start_ns  # ready before the scrape; the request sent


def test_an_explicit_readiness_names_the_served_port(tmp_path) -> None:
    """``--ready-url`` (the listening heuristics off, no ``listen()`` wrapper): readiness names the one
    TCP port the process serves on (the port a balancer's hints route to), which the metrics server's
    port does not make two (none named)."""
    metrics_port, port = free_port(), free_port()

    def drive(_metrics_port: int, app_port: int) -> dict[str, Any]:
        time.sleep(2.0)  # launch's poll of the URL (every 0.5 s at most) answered meanwhile
        answer: dict[str, Any] = get_json(app_port)
        return answer

    r, cs, _answer, _app = run(
        str(tmp_path), "asyncio", metrics_port, port, drive, "--ready-url", "http://127.0.0.1:%d/health" % port
    )
    ready = one(cs, "ready_wait", r)
    assert ready.attributes["infersight.ready.source"] == "ready_url", (ready.attributes, r.output[-3000:])
    assert ready.attributes.get("server.port") == port, (ready.attributes, r.output[-3000:])
