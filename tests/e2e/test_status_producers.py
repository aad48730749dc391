"""``status`` says how many producers are connected now beside how many the table holds (it keeps those
that left: their sequence numbers, an open cold start). A README walkthrough read ``producers 3`` after its
three hooked processes had ended as three live ones."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from conftest import hook_env, wait_for

from infersight.hooks import _wire

ONE_SHOT = "from infersight import hooks\nhooks.log('once')\nassert hooks.flush(10)\n"


def test_status_tells_connected_producers_from_those_the_table_keeps(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    r = subprocess.run([sys.executable, "-c", ONE_SHOT], env=hook_env(agent.sock, agent.spool), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert wait_for(lambda: agent.status()["producers"] == 1 and agent.status()["producers_connected"] == 0, 20), \
        agent.status()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a producer that stays
        s.settimeout(10)
        s.connect(str(agent.sock))
        s.sendall(_wire.encode_frame({"t": "hello", "schema": 1, "producer": {
            "id": "stays", "pid": os.getpid(), "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}}))
        assert wait_for(lambda: agent.status()["producers_connected"] == 1, 20), agent.status()
        assert agent.status()["producers"] == 2
        text = subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(agent.sock)],
                              capture_output=True, text=True, timeout=30)
        assert text.returncode == 0, text.stderr
        (line,) = [ln for ln in text.stdout.splitlines() if ln.split()[:1] == ["producers"]]
        assert line.split(None, 1)[1] == "2 (1 connected)", line
        raw = json.loads(subprocess.run([sys.executable, "-m", "infersight", "status", "--json", "--socket",
                                         str(agent.sock)], capture_output=True, text=True, timeout=30).stdout)
        assert (raw["producers"], raw["producers_connected"]) == (2, 1)
