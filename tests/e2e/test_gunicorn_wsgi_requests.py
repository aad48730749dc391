"""Every request of a WSGI app under gunicorn's sync and gthread workers reaches a real agent as
the instance's latency (``requests.instances`` in ``infersight status --json``), with no code
change, as uvicorn's ASGI requests do: a 503 counts as failed, and a worker's requests are its
own instance. The app: ``workloads/fork_apps.py`` (no model: each request sleeps 0.3 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, hook_env, terminate, wait_for

pytest.importorskip("gunicorn")
pytestmark = [pytest.mark.slow]

WORKLOADS = Path(__file__).resolve().parents[1] / "support" / "workloads"
BIN = os.path.dirname(sys.executable)
SLEEP_S = 0.05


def get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except urllib.error.URLError:
        return 0  # not listening yet


@pytest.mark.parametrize("threads", [1, 4])
def test_every_request_of_a_gunicorn_wsgi_worker_is_timed(tmp_path: Path, agent_factory: Any,
                                                         threads: int) -> None:
    agent = agent_factory().start()
    port = free_port()
    env = hook_env(agent.sock, agent.spool, OTEL_SERVICE_NAME="flask-pool", FORK_APP_SLEEP=str(SLEEP_S),
                   PYTHONPATH=os.pathsep.join((hook_env(agent.sock, agent.spool)["PYTHONPATH"], str(WORKLOADS))))
    log = open(tmp_path / "gunicorn.log", "wb")  # noqa: SIM115
    p = subprocess.Popen([os.path.join(BIN, "gunicorn"), "-w", "1", "--threads", str(threads), "-b",
                          "127.0.0.1:%d" % port, "fork_apps:wsgi"], env=env, cwd=WORKLOADS, stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: get(port, "/") == 200, 60), (tmp_path / "gunicorn.log").read_text()
        codes = [get(port, "/") for _ in range(9)] + [get(port, "/fail") for _ in range(2)]
        assert codes == [200] * 9 + [503] * 2

        def timed() -> list[dict[str, Any]]:
            found = agent.status().get("requests", {}).get("instances", [])
            return [i for i in found if i["service"] == "flask-pool" and i["count"] + i["failed"] >= 12]

        assert wait_for(lambda: bool(timed()), 30), agent.status().get("requests")
        (inst,) = timed()  # one worker, one instance: the master serves nothing
        assert inst["pid"] != p.pid
        assert (inst["count"], inst["failed"]) == (10, 2)  # served (the probe's included), failed
        assert SLEEP_S * 0.9 <= inst["p50_s"] < 5  # the request's own sleep, not the 503s
    finally:
        terminate(p)
        log.close()
