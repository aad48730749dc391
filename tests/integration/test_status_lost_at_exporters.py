"""``infersight status``'s ``lost`` line counts what the agent's exporters lost too: items that reached
the agent and no sink because the exporter could not hold them (a full disk under the file exporter and
its spool). It said only the producers' sequence gaps ("lost 0") while the file exporter dropped every
batch: the loss was in the problem line (for ``exporter_stall_s``), in STATUS= and in ``dropped=`` only."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

from conftest import wait_for
from test_exporter_faults import fill, tiny_tmpfs

LOST_LINE = re.compile(r"^  lost +(\d+) event\(s\) in producers' sequence gaps; (\d+) item\(s\) exporters could "
                       r"neither deliver nor keep \(file (\d+)\)$", re.M)


def status(agent, *flags: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(agent.sock), *flags],
                          capture_output=True, text=True, timeout=60)


def test_full_disk_losses_are_in_the_lost_line_json_and_status_line(agent_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                    monkeypatch) -> None:
    with tiny_tmpfs(tmp_path / "fs", "512k") as fs:
        agent = agent_factory("", root=fs / "a")  # its file exporter writes on the small disk
        monkeypatch.setenv("INFERSIGHT_STATE_DIR", str(fs / "state"))  # the exporters' spools too
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(tmp_path / "notify"))
        notify.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
        agent.start()

        def file_exp() -> dict:  # type: ignore[type-arg]
            return next(e for e in agent.status()["exporters"] if e["name"] == "file")

        said: list[str] = []

        def said_loss() -> bool:
            with contextlib.suppress(BlockingIOError):
                while True:
                    said.extend(ln[7:] for ln in notify.recv(65536).decode().split("\n") if ln.startswith("STATUS="))
            return any("item(s) lost at exporters" in t for t in said)

        try:
            assert wait_for(lambda: file_exp()["exported_items"] > 0, 20), file_exp()
            fill(fs)
            # Each poll takes up again whatever a truncated write freed: the disk stays full.
            assert wait_for(lambda: fill(fs) is not None and file_exp()["dropped_items"] > 0, 30), file_exp()
            before = agent.status()
            text = status(agent)
            after = json.loads(status(agent, "--json").stdout)
            m = LOST_LINE.search(text.stdout)
            assert m is not None, text.stdout
            gaps, at_exporters, at_file = map(int, m.groups())
            assert gaps == 0 and at_exporters == at_file, text.stdout  # the agent's own metrics: no producer
            assert before["lost_at_exporters"] <= at_exporters <= after["lost_at_exporters"], (before, text.stdout)
            # The JSON keeps its keys (``lost``: the producers' gaps) and adds the exporters' figure beside them.
            assert after["lost"] == 0
            (fe,) = [e for e in after["exporters"] if e["name"] == "file"]
            assert fe["lost_items"] == after["lost_at_exporters"] > 0
            assert fe["lost_items"] == fe["dropped_items"] - fe["rejected_items"]  # nothing was refused by a peer
            assert wait_for(said_loss, 20), said
        finally:
            agent.stop()
            notify.close()
