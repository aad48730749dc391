"""The first request of servers the hooks reach at the server's own entry point, under ``infersight
launch`` with no infersight call in the served code: waitress (``waitress-serve``), the standard
library's ``http.server`` (a ``BaseHTTPRequestHandler`` answering ``/health``) and
``wsgiref.simple_server``, and a WSGI app under Hypercorn. Each server is waited for with bare TCP
connects (no request), then sent ``/health`` and a second request; each request of the app sleeps
``SLEEP_S``. The serving process's cold start must hold exactly one ``first_request`` stage, in its
trace under its root, after its readiness (a listening socket: the root ends there), for the first
request sent, not a probe, nor the second."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, Answers, LaunchRun, assert_well_formed, serve, stage_name  # noqa: E402
from ports import free_port  # noqa: E402

from infersight.agent.commands.show import coldstarts  # noqa: E402
from infersight.exporters.waterfall import is_helper  # noqa: E402
from infersight.telemetry import ColdStart, SpanItem  # noqa: E402

pytestmark = [pytest.mark.slow]

BIN = os.path.dirname(sys.executable)
SLEEP_S = 0.2  # every request's own work: the first request's floor
ENV = {"PYTHONWARNINGS": "ignore", "FORK_APP_SLEEP": str(SLEEP_S)}


def serving_process(r: LaunchRun, pid: int) -> ColdStart:
    found = [cs for cs in coldstarts(r.spans) if not is_helper(cs) and cs.root.resource.get("process.pid") == pid]
    assert len(found) == 1, ([cs.root.resource.get("process.pid") for cs in coldstarts(r.spans)], r.output[-3000:])
    return found[0]


def check_first_request(r: LaunchRun, served: Answers, source: str, well_formed: bool = True) -> SpanItem:
    """The process that answered: one first_request, the first request sent, after its readiness
    (``well_formed``: and every stage of its cold start nested as ``assert_well_formed`` checks)."""
    assert [status for status, _ in served.answers] == [200, 200], served.answers
    pid = json.loads(served.answers[0][1])["pid"]
    cs = serving_process(r, pid)
    names = [stage_name(s) for s in cs.stages]
    firsts = [s for s in cs.stages if stage_name(s) == "first_request"]
    assert len(firsts) == 1, (names, r.output[-3000:])  # the second request passed through
    first = firsts[0]
    (ready,) = [s for s in cs.stages if stage_name(s) == "ready_wait"]
    root = cs.root
    assert first.trace_id == root.trace_id and first.parent_span_id == root.span_id  # the process's cold start
    assert first.attributes["infersight.first_request.source"] == source
    assert first.attributes["http.response.status_code"] == 200
    assert first.attributes["url.path"] == "/health"
    assert first.attributes["http.request.method"] == "GET"
    assert ready.attributes["infersight.ready.source"] in ("listen", "listening_socket"), ready.attributes
    assert root.attributes["infersight.coldstart.ended_by"] == "ready", root.attributes
    # after readiness, the wait for traffic outside the root; the request sent, not a bare connect before it
    assert ready.end_ns == root.end_ns <= served.sent_ns <= first.start_ns
    assert first.end_ns - first.start_ns >= SLEEP_S * 1e9 * 0.9  # the request's own work, to its response
    assert 0 < float(first.attributes["infersight.first_request.ttfb_s"]) <= (first.end_ns - first.start_ns) / 1e9
    if well_formed:
        assert_well_formed(root, cs.stages)
    return first


def test_waitress_serve(tmp_path) -> None:
    pytest.importorskip("waitress")
    port = free_port()
    r, served = serve(
        str(tmp_path),
        [os.path.join(BIN, "waitress-serve"), "--listen=127.0.0.1:%d" % port, "--threads=2", "fork_apps:wsgi"],
        port,
        ("/health", "/"),
        env=ENV,
    )
    check_first_request(r, served, "waitress")


@pytest.mark.parametrize("kind", ["http.server", "wsgiref"])
def test_stdlib_http_server(tmp_path, kind: str) -> None:
    port = free_port()
    r, served = serve(
        str(tmp_path),
        [sys.executable, os.path.join(HERE, "stdlib_servers.py"), kind, str(port)],
        port,
        ("/health", "/"),
        env=ENV,
    )
    check_first_request(r, served, "http.server")


def test_hypercorn_wsgi_app(tmp_path) -> None:
    """Hypercorn serves a WSGI app through its own ``WSGIWrapper`` (no ASGI app to wrap): the worker
    that served it has the first request, at its ASGI level."""
    pytest.importorskip("hypercorn")
    hypercorn = shutil.which("hypercorn", path=BIN)
    assert hypercorn is not None
    port = free_port()
    r, served = serve(
        str(tmp_path), [hypercorn, "-b", "127.0.0.1:%d" % port, "fork_apps:wsgi"], port, ("/health", "/"), env=ENV
    )
    # (a spawned worker's framework_import can straddle the start of its process_bootstrap rule stage: not
    # this test's matter)
    check_first_request(r, served, "asgi", well_formed=False)
