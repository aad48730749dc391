"""A gunicorn master none of whose workers was ever ready, as an operator sees it (real gunicorn under
``infersight launch``).

The master listens before it forks, and sent its ``ready_wait`` at that listen. Made unready at its exit when
its worker failed to boot, it still had that span: its waterfall drew a ``ready_wait`` row beside "never
ready", and SIGKILLed while its worker loaded, the agent closed its root as ``ready`` at that span. Its
``ready_wait`` now waits for a worker to be ready: none here, so none is sent, and a master killed first is
closed as killed before any readiness. Its worker's row in its waterfall showed ``0.000`` s (the part of the
worker's life within the master's root, which had ended at the listen); it now shows the worker's whole cold
start, from its fork to its end, and how much of it came after the master's."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import INFERSIGHT, cmd_group, end_launch, launch, launch_env, pid, stage_name  # noqa: E402

from infersight.agent.commands.show import coldstarts, show_file, spans_from_lines  # noqa: E402

pytest.importorskip("gunicorn")

pytestmark = [pytest.mark.slow]

BIN = os.path.dirname(sys.executable)
FAILING_APP = "import time\ntime.sleep(0.5)\nraise OSError('model directory /models/gpt not found')\n"
# Fails to boot once its master is gone (SIGKILLed while it loaded): the test waits for nothing but events.
ORPHANED_APP = """
import os, time
master = os.getppid()
open(os.environ["LOADING_MARK"], "w").close()  # the worker loads its model now
deadline = time.monotonic() + 60  # (a bound, not a speed)
while os.getppid() == master and time.monotonic() < deadline:
    time.sleep(0.02)
raise OSError("model directory /models/gpt not found")
"""


def _show(otlp: Path) -> str:
    out = io.StringIO()
    assert show_file(str(otlp), out, "text", io.StringIO()) == 0
    return out.getvalue()


def _waterfall(text: str, process: int) -> str:
    found = re.search(r"^infersight cold start: .*\(pid %d\).*?(?=^infersight|\Z)" % process, text, re.M | re.S)
    assert found, text[-3000:]
    return found.group(0)


def test_a_master_whose_worker_failed_to_boot_has_no_ready_wait(tmp_path: Path) -> None:
    from conftest import free_port

    (tmp_path / "failing_app.py").write_text(FAILING_APP)
    argv = [os.path.join(BIN, "gunicorn"), "-w", "1", "-b", "127.0.0.1:%d" % free_port(), "failing_app:app"]
    r = launch(str(tmp_path), argv, "--agent", "embedded", result=False, timeout=120,
               env={"PYTHONWARNINGS": "ignore"})
    assert r.rc == 3, r.output[-3000:]  # gunicorn: "Worker failed to boot"
    (master,) = [cs for cs in coldstarts(r.spans) if cs.root.parent_span_id is None]
    assert master.root.attributes["infersight.coldstart.ended_by"] == "exit", master.root.attributes
    assert [stage_name(s) for s in master.stages if stage_name(s) == "ready_wait"] == []  # it waited for nobody
    for text in (r.output, _show(tmp_path / "out.otlp.jsonl")):  # launch's closing waterfall, and show's
        shown = _waterfall(text, pid(master))
        assert "never ready" in shown and " ready_wait " not in shown, shown
        (row,) = [ln for ln in shown.splitlines() if ln.startswith("  worker pid ")]
        (w,) = master.workers
        assert float(row.split()[4]) == pytest.approx((w.end_ns - w.start_ns) / 1e9, abs=0.0015), row


def test_a_master_killed_while_its_worker_loaded_was_not_ready(tmp_path: Path) -> None:
    from conftest import free_port

    (tmp_path / "orphaned_app.py").write_text(ORPHANED_APP)
    mark = tmp_path / "loading"
    otlp = tmp_path / "out.otlp.jsonl"
    argv = [os.path.join(BIN, "gunicorn"), "-w", "1", "-b", "127.0.0.1:%d" % free_port(), "orphaned_app:app"]
    env = launch_env(str(tmp_path), {"LOADING_MARK": str(mark), "PYTHONWARNINGS": "ignore"})
    with open(tmp_path / "launch.log", "w+", encoding="utf-8") as log:
        p = subprocess.Popen([*INFERSIGHT, "launch", "--agent", "embedded", "--otlp-file", str(otlp), "--", *argv],
                             cwd=str(tmp_path), env=env, stdout=log, stderr=subprocess.STDOUT)
        group = 0
        try:
            deadline = time.monotonic() + 60
            while not mark.exists():
                assert p.poll() is None and time.monotonic() < deadline, "the worker never started to load"
                time.sleep(0.05)
            group = cmd_group(p.pid)  # the master leads CMD's process group
            os.kill(group, signal.SIGKILL)  # the master only: its worker fails to boot once it is gone
            assert p.wait(timeout=60) == 128 + signal.SIGKILL
        finally:
            end_launch(p, group)
        log.seek(0)
        output = log.read()
    with open(otlp, encoding="utf-8") as f:
        spans = spans_from_lines(f.readlines())
    (master,) = [cs for cs in coldstarts(spans) if cs.root.parent_span_id is None]
    (w,) = master.workers
    assert w.attributes["infersight.coldstart.ended_by"] == "exit", (w.attributes, output[-3000:])
    a = master.root.attributes
    # closed by the agent, as a process killed before any readiness (it was "ready", at its listen's ready_wait)
    assert a["infersight.coldstart.ended_by"] == "producer_lost", (a, output[-3000:])
    assert "infersight.coldstart.ready_s" not in a
    assert not [s for s in master.stages if stage_name(s) == "ready_wait"]
    assert w.end_ns > master.root.end_ns  # its worker failed after the master was gone
    shown = _waterfall(_show(otlp), pid(master))
    assert "never ready: the process was killed" in shown, shown
    (row,) = [ln for ln in shown.splitlines() if ln.startswith("  worker pid ")]
    # its whole cold start (it showed 0.000 within a root that ended at the listen), and what came after
    assert float(row.split()[4]) == pytest.approx((w.end_ns - w.start_ns) / 1e9, abs=0.0015), row
    assert "s of it after this cold start's end" in row, row


# A worker that loads its model (until the test says go), then serves.
GATED_APP = """
import os, time
open(os.environ["LOADING_MARK"], "w").close()
deadline = time.monotonic() + 60  # (a bound, not a speed)
while not os.path.exists(os.environ["LOADING_GO"]) and time.monotonic() < deadline:
    time.sleep(0.02)


def app(environ, start_response):
    start_response("200 OK", [("Content-Length", "0")])
    return []
"""


def test_a_healthy_master_is_warming_while_its_worker_loads_and_ready_once_it_serves(tmp_path: Path,
                                                                                    agent_factory) -> None:  # type: ignore[no-untyped-def]
    """No request is sent: the master is ready when its worker is, not at its first request."""
    from conftest import free_port, hook_env, read_otlp_lines, spans, terminate, wait_for

    (tmp_path / "gated_app.py").write_text(GATED_APP)
    mark, go = tmp_path / "loading", tmp_path / "go"
    agent = agent_factory().start()
    env = hook_env(agent.sock, agent.spool, LOADING_MARK=str(mark), LOADING_GO=str(go), PYTHONWARNINGS="ignore")
    port = free_port()
    log = open(tmp_path / "gunicorn.log", "wb")  # noqa: SIM115
    p = subprocess.Popen([os.path.join(BIN, "gunicorn"), "-w", "1", "-b", "127.0.0.1:%d" % port, "gated_app:app"],
                         env=env, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT)

    def warming() -> set[int]:
        return {int(w["pid"]) for w in agent.status().get("coldstarts", [])}

    try:
        assert wait_for(mark.exists, 60), (tmp_path / "gunicorn.log").read_text()
        # the worker loads (it sent its imports): its master, which listened long before, is warming with it
        assert wait_for(lambda: len(warming()) == 2, 30), agent.status().get("coldstarts")
        assert p.pid in warming()  # (was ready at its listen: it served nobody yet)
        go.touch()
        assert wait_for(lambda: not warming(), 30), agent.status().get("coldstarts")  # both ready, no request
    finally:
        terminate(p)
        log.close()

    def roots() -> list[dict]:  # type: ignore[type-arg]
        return [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart"]

    assert wait_for(lambda: len(roots()) == 2, 30), (tmp_path / "gunicorn.log").read_text()
    assert agent.stop() == 0
    everything = spans(read_otlp_lines(agent.out))
    (master,) = [r for r in roots() if not r.get("parentSpanId")]
    waits = [s for s in everything if s["name"] == "coldstart.ready_wait" and s.get("parentSpanId") == master["spanId"]]
    assert len(waits) == 1, waits
    (worker,) = [r for r in roots() if r.get("parentSpanId")]
    # ready at its listen (before it forked its worker), as it was; only sent once its worker was ready
    assert int(waits[0]["endTimeUnixNano"]) <= int(worker["startTimeUnixNano"])
