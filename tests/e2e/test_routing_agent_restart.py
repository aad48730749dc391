"""Routing across an agent restart (a real agent, SIGKILLed and started again; real hooked uvicorn servers).

FAKE DEVICE: the backends stand in for GPUs (tests/support/routing_backend.py).

The new agent gets none of the ready servers' cold-start spans (they went to the one before): each
server's hello says when it became ready and on which port, so it is an instance again, ready on its
port, and when it later restarts, its restart is drained on that port as before. A review found every
port answering the fail-open reply for good after a restart: the slow backend's weight lost, restarts
not drained.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent_check import ask
from conftest import AgentProcess, free_port, hook_env, wait_for

BACKEND = Path(__file__).resolve().parents[1] / "support" / "routing_backend.py"


def _check_port(agent: AgentProcess) -> int:
    port = agent.status()["routing"]["agent_check_port"]
    assert isinstance(port, int) and port > 0
    return port


def _held(agent: AgentProcess) -> dict[int, int | None]:
    return {i["pid"]: i["port"] for i in agent.status()["routing"]["instances"]}


def test_a_restarted_agent_knows_the_ready_servers_and_drains_their_restarts(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory("[routing]\nenabled = true\nagent_check_port = 0\n").start()
    procs: list[subprocess.Popen[bytes]] = []

    def backend(name: str, port: int, **env: str) -> subprocess.Popen[bytes]:
        e = hook_env(agent.sock, agent.spool, OTEL_SERVICE_NAME="llm-restart", NAME=name, PORT=str(port), **env)
        p = subprocess.Popen([sys.executable, str(BACKEND)], env=e, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / (name + ".log"), "ab"))  # noqa: SIM115
        procs.append(p)
        return p

    try:
        a_port, b_port = free_port(), free_port()
        a = backend("a", a_port)  # ready by its listen
        b = backend("b", b_port, EARLY_LISTEN="1", INFERSIGHT_READY_ON_LISTEN="0")  # ready by mark_ready()
        check = _check_port(agent)
        assert wait_for(lambda: _held(agent) == {a.pid: a_port, b.pid: b_port}, 60), agent.status()["routing"]

        agent.kill()  # SIGKILL: nothing of its table survives
        agent.start()
        check = _check_port(agent)
        # both servers reconnect; their hellos say ready, and where
        assert wait_for(lambda: _held(agent) == {a.pid: a_port, b.pid: b_port}, 30), agent.status()["routing"]
        for port in (a_port, b_port):
            assert ask(check, port).split()[:2] == ["up", "ready"]

        # b restarts: the new agent drains it on b's port while it loads, as the first one would have
        b.kill()
        b.wait(10)
        ready_file = tmp_path / "b2.ready"
        b2 = backend("b2", b_port, EARLY_LISTEN="1", INFERSIGHT_READY_ON_LISTEN="0", COLD_S="4",
                     READY_FILE=str(ready_file))
        assert wait_for(lambda: ask(check, b_port) == "drain\n", 30), ask(check, b_port)
        assert not ready_file.exists()
        assert wait_for(ready_file.exists, 60)
        assert wait_for(lambda: ask(check, b_port).split()[:2] == ["up", "ready"], 30), ask(check, b_port)
        assert _held(agent).get(b2.pid) == b_port
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
