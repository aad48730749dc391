"""``launch`` holds its embedded agent back while CMD starts (issue 23, point 10), as a user runs it.

CMD is a real hooked Python process under the real ``infersight launch``. Whether launch's
process has loaded its agent is read from the kernel: the agent side maps asyncio's C module
(``_asyncio``), which nothing before it loads (``/proc/<launch pid>/maps``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import attr, log_records, read_otlp_lines, spans

CLI = [sys.executable, "-m", "infersight"]

# Prints whether launch (the parent) has its agent loaded, at points of CMD's start.
PROBE = r"""
import os, time
def agent_loaded():
    with open("/proc/%d/maps" % os.getppid()) as f:
        return "_asyncio" in f.read()
def wait_loaded(limit_s=15.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if agent_loaded():
            return round(time.monotonic() - t0, 3)
        time.sleep(0.02)
    return None
"""


def launch(tmp_path: Path, code: str, *args: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out.otlp.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INFERSIGHT"))}
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(out), *args, "--", sys.executable, "-c",
                        PROBE + code], capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)
    return r, out


def results(r: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("{")))


def test_the_agent_loads_only_once_a_hooked_server_listens(tmp_path: Path) -> None:
    r, out = launch(tmp_path, r"""
import json, socket
from infersight import hooks
with hooks.stage("load_weights"):
    time.sleep(0.8)
before = agent_loaded()
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()   # readiness: the hooks ring launch
after = wait_loaded()
print(json.dumps({"before": before, "after": after}))
""", "--agent-hold", "60")
    assert r.returncode == 0, r.stderr
    got = results(r)
    assert got["before"] is False  # 0.8 s into its start, launch had not loaded its agent
    assert got["after"] is not None  # loaded at readiness (within 15 s), not at the 60 s limit
    names = {s["name"] for s in spans(read_otlp_lines(out))}
    assert {"coldstart", "coldstart.load_weights", "coldstart.ready_wait"} <= names
    assert "lost" not in r.stderr and "spooling instead" not in r.stderr, r.stderr


def test_a_hooked_cmd_that_exits_while_held_loses_nothing(tmp_path: Path) -> None:
    r, out = launch(tmp_path, r"""
import json, logging
from infersight import hooks
logging.basicConfig(level=logging.INFO)
with hooks.stage("load_weights"):
    for i in range(3000):
        hooks.log("line %d" % i)
print(json.dumps({"before": agent_loaded()}))
""")
    assert r.returncode == 0, r.stderr
    assert results(r)["before"] is False
    lines = read_otlp_lines(out)
    logged = [x for x in log_records(lines) if str(x.get("body", {}).get("stringValue", "")).startswith("line ")]
    assert len(logged) == 3000  # spooled while held, replayed by the agent after CMD exited
    assert any(s["name"] == "coldstart.load_weights" for s in spans(lines))
    assert "lost" not in r.stderr and "not delivered" not in r.stderr, r.stderr


def test_an_oom_while_held_starts_the_agent_at_once(tmp_path: Path) -> None:
    r, out = launch(tmp_path, r"""
import json, logging
logging.basicConfig(level=logging.INFO)
time.sleep(0.5)
before = agent_loaded()
logging.getLogger("vllm.engine").error(
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
    "when initializing the engine.")
after = wait_loaded()
time.sleep(1.0)
print(json.dumps({"before": before, "after": after}))
""", "--agent-hold", "60")
    assert r.returncode == 0, r.stderr
    got = results(r)
    assert got["before"] is False
    assert got["after"] is not None  # the doorbell (within 15 s), not the 60 s limit
    ooms = [x for x in log_records(read_otlp_lines(out)) if attr(x, "infersight.oom.engine") == "vllm"]
    assert len(ooms) == 1


def test_the_hold_ends_at_its_deadline_and_can_be_switched_off(tmp_path: Path) -> None:
    code = r"""
import json
time.sleep(1.2)
print(json.dumps({"at": agent_loaded()}))
"""
    r, _ = launch(tmp_path, code, "--agent-hold", "0.3")
    assert r.returncode == 0, r.stderr
    assert results(r)["at"] is True  # loaded 0.3 s after the spawn, while CMD still ran
    r, _ = launch(tmp_path, code, "--agent-hold", "0")
    assert r.returncode == 0, r.stderr
    assert results(r)["at"] is True
    r, _ = launch(tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert results(r)["at"] is False


def test_a_bad_hold_is_a_usage_error(tmp_path: Path) -> None:
    r = subprocess.run([*CLI, "launch", "--agent-hold", "-1", "--", "true"], capture_output=True, text=True,
                       timeout=30, cwd=tmp_path)
    assert r.returncode == 2
    assert "--agent-hold" in r.stderr and "seconds" in r.stderr


def test_a_connection_accepted_while_held_is_served_by_the_agent(tmp_path: Path) -> None:
    # A producer that does not know the mark (a raw one here) connects and says hello while
    # launch holds its agent back: launch accepts it unread, and the agent, once started by the
    # doorbell, answers it.
    r, _ = launch(tmp_path, r"""
import json, socket
from infersight.hooks import _wire
path = os.environ["INFERSIGHT_SOCKET"]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
s.sendall(_wire.encode_frame({"t": "hello", "schema": 1, "producer": {
    "id": "raw-1", "pid": os.getpid(), "start_ns": time.time_ns(), "trace_id": "a" * 32, "root_span_id": "b" * 16}}))
time.sleep(0.3)
before = agent_loaded()
d = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
d.connect(path)
d.sendall(_wire.URGENT_FRAME)
d.close()
s.settimeout(15)
reply = s.recv(4096)
print(json.dumps({"before": before, "welcome": b"welcome" in reply}))
""")
    assert r.returncode == 0, r.stderr
    got = results(r)
    assert got == {"before": False, "welcome": True}
