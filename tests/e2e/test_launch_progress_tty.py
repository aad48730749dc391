"""``launch`` shares the cold-start history and shows one updating ``warming:`` line on a terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from infersight.agent.coldstart import history as ch

INFERSIGHT = [os.path.join(os.path.dirname(sys.executable), "infersight")]
WORKLOAD = """
import time
from infersight import hooks
with hooks.stage("model_build"):
    time.sleep(0.2)
with hooks.stage("weights_load"):
    time.sleep(2.5)
hooks.mark_ready()
"""


def _launch(tmp: Path, script: Path, *, tty: bool) -> tuple[int, str]:
    env = {**os.environ, "INFERSIGHT_STATE_DIR": str(tmp / "state"), "INFERSIGHT_MEASURE_STORAGE": "0"}
    cmd = [*INFERSIGHT, "launch", "--otlp-file", str(tmp / "out.otlp.jsonl"), "--", sys.executable, str(script)]
    if not tty:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp, env=env)
        return p.returncode, p.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=slave, cwd=tmp, env=env)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(60), out.decode("utf-8", "replace")


def test_history_is_shared_and_the_terminal_shows_warming(tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(WORKLOAD)
    for _ in range(2):
        rc, err = _launch(tmp_path, script, tty=False)
        assert rc == 0, err
        assert "warming:" not in err  # not a terminal: the log stays clean
    lines = (tmp_path / "state" / ch.FILE_NAME).read_text().splitlines()
    assert len(lines) == 2
    assert [s[0] for s in json.loads(lines[-1])["stages"]][-3:] == ["model_build", "weights_load", "ready_wait"]

    rc, out = _launch(tmp_path, script, tty=True)
    assert rc == 0, out
    assert "warming: weights_load" in out
    assert "left (2 runs)" in out
    assert "\r\x1b[K" in out  # the line is rewritten in place, then erased
    assert len((tmp_path / "state" / ch.FILE_NAME).read_text().splitlines()) == 3
