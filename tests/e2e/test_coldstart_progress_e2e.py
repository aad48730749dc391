"""Cold-start progress end to end: a real agent, a real mosquitto, a scraped Prometheus endpoint.

Three runs of a hooked workload build the history; in the fourth, while it sits in its
``weights_load`` stage, ``status --json``, the retained MQTT progress topic and the
Prometheus gauges must all show the same process, stage and ETA. After readiness the topic
is cleared and the gauges are gone.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import httpx
import pytest
from conftest import free_port, hook_env, wait_for
from mosquitto import Collector, Mosquitto, retained, running_broker

from infersight.agent.coldstart import history as ch

WORKLOAD = """
import os, sys, time
from infersight import hooks
hold = os.environ.get("HOLD", "-")  # not in argv: argv is part of the service key
with hooks.stage("model_build"):
    time.sleep(0.3)
with hooks.stage("weights_load"):
    if hold != "-":
        open(hold + ".in", "w").close()
        while not os.path.exists(hold + ".go"):
            time.sleep(0.02)
    else:
        time.sleep(0.6)
hooks.mark_ready()
hooks.flush()
"""


@pytest.fixture
def broker(tmp_path: Path):  # type: ignore[no-untyped-def]
    with running_broker(tmp_path / "mosquitto") as b:
        yield b


def _load_gateway():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[2] / "examples" / "gateway_eta.py"
    spec = importlib.util.spec_from_file_location("gateway_eta", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Backend(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"answer": 42}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _gauges(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("infersight_coldstart_eta_seconds{", "infersight_coldstart_progress_ratio{")):
            name_labels, value = line.rsplit(" ", 1)
            out[name_labels] = float(value)
    return out


async def test_progress_agrees_across_status_mqtt_and_prometheus(
    agent_factory, broker: Mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    host = "eta-host"
    port = free_port()
    state = tmp_path / "state"
    agent = agent_factory(
        f'[exporters.mqtt]\nurl = "{broker.url}"\n'
        f"[exporters.prometheus]\nenabled = true\nport = {port}\n"
    )
    agent.config.write_text(agent.config.read_text().replace("[agent]\n", f'[agent]\nhost_name = "{host}"\n'))
    monkeypatch.setenv("INFERSIGHT_STATE_DIR", str(state))
    agent.start()
    script = tmp_path / "serve.py"
    script.write_text(WORKLOAD)
    env = hook_env(agent.sock, agent.spool, OTEL_SERVICE_NAME="eta-svc")
    for _ in range(3):
        subprocess.run([sys.executable, str(script), "-"], env=env, check=True, timeout=60)
    history = state / ch.FILE_NAME
    assert wait_for(lambda: history.exists() and len(history.read_text().splitlines()) == 3, 15)

    topic = "infersight/%s/coldstart/eta-svc/progress" % host
    hold = tmp_path / "hold"
    async with Collector(broker, topic) as sub:
        proc = subprocess.Popen([sys.executable, str(script), "-"], env={**env, "HOLD": str(hold)})
        try:
            assert wait_for(lambda: Path(str(hold) + ".in").exists(), 30)
            warming: list[dict] = []  # type: ignore[type-arg]

            def in_weights() -> bool:
                warming[:] = [c for c in agent.status().get("coldstarts", []) if c["pid"] == proc.pid]
                return bool(warming) and warming[0]["stage"] == "weights_load" and warming[0]["eta_s"] is not None

            # (on failure: the full rows and the runs the estimate read: twice in full runs of 2026-12-05 it said
            # framework_import here, not reproduced alone or beside CPU hogs)
            assert wait_for(in_weights, 15), (json.dumps(agent.status().get("coldstarts")), history.read_text())
            st = warming[0]
            assert st["service"] == "eta-svc" and st["eta_runs"] == 3
            assert 0 < st["progress"] < 1
            assert 0 < st["eta_s"] < 5  # weights_load typically 0.6 s, nothing but readiness after it

            def ours_in_weights(payload: bytes) -> bool:  # not a stale retained state of an earlier run
                d = json.loads(payload) if payload else {}
                return d.get("pid") == proc.pid and d.get("stage") == "weights_load"

            assert await sub.wait_for(lambda: any(ours_in_weights(m.payload) for m in sub.messages), 10)
            msg = json.loads(await retained(broker, topic) or b"{}")
            assert msg["pid"] == proc.pid and msg["stage"] == "weights_load"
            assert msg["eta_runs"] == 3 and msg["service"] == "eta-svc"
            assert abs(msg["eta_s"] - st["eta_s"]) < 1.5  # both published within a second

            # The example gateway answers 503 with an honest Retry-After while the backend warms.
            backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Backend)
            threading.Thread(target=backend.serve_forever, daemon=True).start()
            gw = _load_gateway().Gateway("http://127.0.0.1:%d" % backend.server_address[1], "eta-svc",
                                         str(agent.sock))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), base_url="http://gw") as c:
                r = await c.get("/v1/answer")
                assert r.status_code == 503
                body = r.json()
                assert body["status"] == "warming" and body["stage"] == "weights_load"
                assert int(r.headers["retry-after"]) == max(1, math.ceil(body["eta_s"]))

            g = _gauges("http://127.0.0.1:%d/metrics" % port)
            assert 'infersight_coldstart_eta_seconds{service="eta-svc"}' in g
            assert abs(g['infersight_coldstart_eta_seconds{service="eta-svc"}'] - st["eta_s"]) < 1.5
            assert 0 < g['infersight_coldstart_progress_ratio{service="eta-svc"}'] < 1
        finally:
            Path(str(hold) + ".go").touch()
            proc.wait(60)
        assert proc.returncode == 0
        # Readiness clears the retained topic (an empty retained message) and the gauges.
        assert await sub.wait_for(lambda: sub.messages and sub.messages[-1].payload == b"", 10)
        assert await retained(broker, topic) is None
        assert wait_for(lambda: not _gauges("http://127.0.0.1:%d/metrics" % port), 10)
        assert not [c for c in agent.status().get("coldstarts", []) if c["pid"] == proc.pid]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw), base_url="http://gw") as c:
            r = await c.get("/v1/answer")
            assert r.status_code == 200 and r.json() == {"answer": 42}  # ready: proxied
        backend.shutdown()
    assert wait_for(lambda: len(history.read_text().splitlines()) == 4, 15)
    assert agent.stop() == 0
    assert os.path.exists(history)


SERVES_ACROSS_A_RESTART = """
import os, sys, time
from infersight import hooks
with hooks.stage("model_build"):
    time.sleep(0.1)
hooks.mark_ready()
hooks.first_response()
assert hooks.flush(60)
open(sys.argv[1] + ".ready", "w").close()
while not os.path.exists(sys.argv[1] + ".go"):  # the agent restarts meanwhile
    time.sleep(0.02)
for i in range(50):  # it serves: a stage per request
    with hooks.stage("preprocess", request=i):
        time.sleep(0.002)
assert hooks.flush(60)
open(sys.argv[1] + ".served", "w").close()
while not os.path.exists(sys.argv[1] + ".exit"):
    time.sleep(0.02)
os._exit(0)  # no exit handlers: the agent sees the process end with no root of its own
"""


def test_a_worker_serving_across_an_agent_restart_is_not_a_cold_start(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The new agent never saw the worker's root. Its hello says the root went out, so its
    per-request stages do not show it warming, and its end makes up no root for it (one
    that would enter the history as a cold start as long as the worker's life)."""
    agent = agent_factory().start()
    mark = str(tmp_path / "w")
    script = tmp_path / "serve.py"
    script.write_text(SERVES_ACROSS_A_RESTART)
    proc = subprocess.Popen([sys.executable, str(script), mark],
                            env=hook_env(agent.sock, agent.spool, OTEL_SERVICE_NAME="restart-worker"))
    try:
        assert wait_for(lambda: os.path.exists(mark + ".ready"), 60)
        assert agent.stop() == 0
        agent.start()
        # The worker is back on the new agent before it serves (else its stages wait in its spool,
        # which the agent replays only once the process has gone: not within this test).
        assert wait_for(lambda: agent.status()["producers"] >= 1, 30)
        open(mark + ".go", "w").close()
        assert wait_for(lambda: os.path.exists(mark + ".served"), 60)
        assert agent.status().get("coldstarts") == []
        open(mark + ".exit", "w").close()
        assert proc.wait(30) == 0
        # The agent saw it end: the stages it kept for a root that might still come are freed.
        assert wait_for(lambda: agent.status()["assembler"]["pending_bytes"] == 0, 30)
        assert agent.status()["assembler"]["coldstart_roots_closed_for_lost"] == 0
    finally:
        proc.kill()
    agent.stop()
    lines = [json.loads(x) for x in agent.out.read_text().splitlines() if x.strip()]
    names = [s["name"] for ln in lines for rs in ln.get("resourceSpans", []) for ss in rs["scopeSpans"]
             for s in ss["spans"]]
    assert names.count("coldstart") == 1, "only the worker's own root, from before the restart"
    assert names.count("coldstart.preprocess") == 50
    history = Path(os.environ["INFERSIGHT_STATE_DIR"]) / ch.FILE_NAME
    runs = [r for r in map(json.loads, history.read_text().splitlines()) if r["key"].startswith("restart-worker#")]
    assert len(runs) == 1, "its own cold start only, not one as long as its life: %s %s" % (
        runs, sorted({r["key"] for r in map(json.loads, history.read_text().splitlines())}))
