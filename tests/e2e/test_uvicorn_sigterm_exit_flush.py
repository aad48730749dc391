"""uvicorn stopped with SIGTERM (what `systemctl stop` and a pod's termination send) runs the hooks' exit flush.

uvicorn 0.29 and later shut down gracefully on SIGTERM, restore the handlers they found, and raise
the signal again: with SIGTERM's default action the process ends at once, without atexit, so the
hooks' exit flush never ran (a review saw the "N event(s) lost" line after SIGINT, never after
SIGTERM). The observable here is that line, for a process that can neither reach an agent nor spool.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, wait_for

APP = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_exit_flush_runs_when_uvicorn_gives_the_signal_back(tmp_path: Path, sig: int) -> None:
    pytest.importorskip("uvicorn")
    (tmp_path / "app.py").write_text(APP)
    port = free_port()
    bootstrap = Path(__file__).resolve().parents[2] / "hooks" / "bootstrap"
    env = dict(os.environ, INFERSIGHT="1", PYTHONPATH=str(bootstrap), INFERSIGHT_SOCKET=str(tmp_path / "none.sock"),
               INFERSIGHT_SPOOL_DIR="/proc/nonexistent/spool")  # no agent, no spool: events are lost, and said so
    env.pop("TRACEPARENT", None)
    p = subprocess.Popen([sys.executable, "-m", "uvicorn", "app:app", "--app-dir", str(tmp_path), "--port", str(port)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def answers() -> bool:
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=2) as r:  # noqa: S310
                    return r.status == 200
            except OSError:
                return False

        assert wait_for(answers, 30)
        time.sleep(0.5)
        p.send_signal(sig)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert "Finished server process" in out, out
    assert "lost in this process" in out, out
    if sig == signal.SIGTERM:
        assert p.returncode == -signal.SIGTERM  # uvicorn's own exit, unchanged: the signal's default action
