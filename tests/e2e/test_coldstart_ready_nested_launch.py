"""A launch nested in an outer ``launch --ready-url`` run's CMD (a wrapper script that launches the server
itself): the outer run's URL is no readiness of the nested launch's CMD, nor is the outer run's default
that switches the listening heuristics off (``INFERSIGHT_READY_ON_LISTEN``): the nested CMD is ready at its
own ``listen()``, as any launched CMD is. Given ``--ready-url`` itself, the nested launch's CMD is ready by
that URL instead, its listen no readiness. Real launches, a real HTTP server; what the nested launch's OTLP
file says."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import INFERSIGHT, launch  # noqa: E402

from infersight.agent.commands.show import coldstarts, spans_from_lines  # noqa: E402
from infersight.exporters.waterfall import is_helper  # noqa: E402

pytestmark = [pytest.mark.slow]

SERVER = """
import http.server, sys

seen = set()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen.add(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)  # its listen(): from Python
while not {"/outer", "/stop"} <= seen:  # the outer run's URL answered, and a launch's --probe said stop
    srv.handle_request()
"""


@pytest.mark.parametrize("inner_url", [False, True])
def test_a_nested_launch_s_cmd_is_ready_by_its_own_signals(tmp_path, inner_url: bool) -> None:
    from conftest import free_port

    (tmp_path / "server.py").write_text(SERVER)
    port = free_port()
    url = "http://127.0.0.1:%d/" % port
    inner_otlp = str(tmp_path / "inner.otlp.jsonl")
    # the nested launch's own URL, then its probe (sent once it handed that readiness on) stops the server;
    # without one, the outer run's probe does
    own = ["--ready-url", url + "inner", "--probe", url + "stop"] if inner_url else []
    inner = [*INFERSIGHT, "launch", "--agent", "embedded", "--otlp-file", inner_otlp, *own,
             "--", sys.executable, str(tmp_path / "server.py"), str(port)]
    outer = ["--agent", "embedded", "--ready-url", url + "outer", *([] if inner_url else ["--probe", url + "stop"])]
    r = launch(str(tmp_path), inner, *outer, result=False, timeout=120)
    assert r.rc == 0, r.output[-3000:]
    with open(inner_otlp, encoding="utf-8") as f:
        css = [cs for cs in coldstarts(spans_from_lines(f.readlines())) if not is_helper(cs)]
    servers = [cs for cs in css if cs.root.resource.as_dict().get("process.command") == "server.py"]
    assert len(servers) == 1, [(cs.root.resource.as_dict(), cs.root.attributes) for cs in css]
    server = servers[0]
    a = server.root.attributes
    # was, without its own URL: never ready ("exit"), the outer run's INFERSIGHT_READY_ON_LISTEN=0 in its environment
    assert a["infersight.coldstart.ended_by"] == "ready", (a, r.output[-3000:])
    assert a["infersight.ready.source"] == ("ready_url" if inner_url else "listen"), a
