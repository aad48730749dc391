"""A supervisor's record of its workers' readiness, shown. A gunicorn master writes on its root how many of
its workers reported and how many of those were ever ready (``infersight.coldstart.workers`` and
``infersight.coldstart.workers_ready``, hooks/_readiness.py); no waterfall said it: launch's and
``show``'s text printed no line, the report no word. Here a real gunicorn whose only worker fails to
boot (exit 3, "Worker failed to boot"): its master's waterfall says none of its workers was ever ready."""

from __future__ import annotations

import io
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import launch  # noqa: E402

from infersight.agent.cli import main  # noqa: E402
from infersight.agent.commands.show import show_file  # noqa: E402

pytest.importorskip("gunicorn")

pytestmark = [pytest.mark.slow]

BIN = os.path.dirname(sys.executable)
FAILING_APP = "import time\ntime.sleep(0.5)\nraise OSError('model directory /models/gpt not found')\n"
SAID = "workers: 1 reported, none ever ready (each exited first: failed to boot, or stopped while loading)"


def master_waterfall(text: str) -> str:
    """The master's waterfall in a text of several: the one whose rows include a worker's."""
    (master,) = [w for w in text.split("infersight cold start: ") if "  worker pid " in w]
    return master


def test_gunicorn_master_says_none_of_its_workers_was_ready(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import free_port

    (tmp_path / "failing_app.py").write_text(FAILING_APP)
    argv = [os.path.join(BIN, "gunicorn"), "-w", "1", "-b", "127.0.0.1:%d" % free_port(), "failing_app:app"]
    r = launch(str(tmp_path), argv, "--agent", "embedded", result=False, timeout=120, env={"PYTHONWARNINGS": "ignore"})
    assert r.rc == 3, r.output[-3000:]
    assert SAID in master_waterfall(r.output).splitlines(), r.output[-3000:]  # launch's closing waterfall
    out = io.StringIO()
    assert show_file(str(tmp_path / "out.otlp.jsonl"), out, "text", io.StringIO()) == 0
    assert SAID in master_waterfall(out.getvalue()).splitlines(), out.getvalue()
    assert out.getvalue().count("workers: ") == 1  # the worker is no supervisor
    page = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "out.otlp.jsonl"), "-o", str(page)]) == 0
    assert page.read_text().count(SAID) == 1
