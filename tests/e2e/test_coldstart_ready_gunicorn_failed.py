"""A gunicorn arbiter whose only worker never booted (its app's import raises in the worker: no
``--preload``) was never ready, under ``infersight launch``: its ``listen()`` queued connections that
no worker would ever serve. Its root ends as an unready process's does, at its exit (``ended_by=exit``,
no ``ready_s``, the waterfall says "never ready"), and says that none of its workers was ready."""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import launch  # noqa: E402

from infersight.agent.commands.show import coldstarts  # noqa: E402

pytest.importorskip("gunicorn")

pytestmark = [pytest.mark.slow]

BIN = os.path.dirname(sys.executable)
FAILING_APP = "import time\ntime.sleep(0.5)\nraise OSError('model directory /models/gpt not found')\n"


def waterfall_of(output: str, pid: int) -> str:
    """The waterfall launch printed for ``pid`` (up to the next one, or launch's own lines)."""
    found = re.search(r"^infersight cold start: .*\(pid %d\).*?(?=^infersight|\Z)" % pid, output, re.M | re.S)
    assert found, output[-3000:]
    return found.group(0)


def test_a_gunicorn_master_whose_worker_never_booted_was_never_ready(tmp_path) -> None:
    from conftest import free_port

    (tmp_path / "failing_app.py").write_text(FAILING_APP)
    argv = [os.path.join(BIN, "gunicorn"), "-w", "1", "-b", "127.0.0.1:%d" % free_port(), "failing_app:app"]
    r = launch(str(tmp_path), argv, "--agent", "embedded", result=False, timeout=120)
    assert r.rc == 3, r.output[-3000:]  # gunicorn: "Worker failed to boot"
    css = coldstarts(r.spans)
    (master,) = [cs for cs in css if cs.root.parent_span_id is None]
    (worker,) = [cs for cs in css if cs.root.parent_span_id is not None]
    assert worker.root.attributes["infersight.coldstart.ended_by"] == "exit", worker.root.attributes
    a = master.root.attributes
    assert a["infersight.coldstart.ended_by"] == "exit", a  # was "ready", at its listen
    assert "infersight.coldstart.ready_s" not in a, a
    assert "infersight.ready.source" not in a, a
    assert a["infersight.coldstart.workers"] == 1 and a["infersight.coldstart.workers_ready"] == 0, a
    assert master.root.end_ns >= worker.root.end_ns  # its cold start ran on while its worker tried to boot
    shown = waterfall_of(r.output, int(master.root.resource.get("process.pid") or 0))
    assert "never ready" in shown, shown
    assert "ended by ready" not in shown, shown
