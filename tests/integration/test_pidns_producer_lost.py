"""A producer the agent cannot see (another pid namespace: a sidecar's model server, without
``shareProcessNamespace``) killed mid cold start still gets its root closed, with
``ended_by=producer_lost``: its last connection ended and it did not connect again within
``liveness.PIDLESS_GRACE_S``. One that is only between connections is left alone.

The agent runs under ``unshare --pid --fork --mount-proc`` (root only), so ``SO_PEERCRED``
gives it pid 0 for the hooked process, which runs in the test's own namespace: the sidecar's
view of a model server in a container of its own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import AgentProcess, attr, hook_env, read_otlp_lines, spans, wait_for
from fleet_env import require_root

from infersight.agent.daemon.liveness import PIDLESS_GRACE_S
from infersight.hooks._client import IDLE_LONG_S
from infersight.hooks._connection import RECONNECT_MAX_S

# The agent, with the grace set (the kill test needs no real grace: only that the end comes).
AGENT = textwrap.dedent("""
    import sys
    from infersight.agent.daemon import liveness
    liveness.PIDLESS_GRACE_S = float(sys.argv[1])
    from infersight.agent.cli import main
    sys.exit(main(sys.argv[2:]))
""")

DIES_IN_A_STAGE = textwrap.dedent("""
    import os, signal, time
    from infersight import hooks
    with hooks.stage("model_setup"):
        with hooks.stage("tokenizer_load"):
            time.sleep(0.02)
        assert hooks.flush(10)
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
""")

# Cuts its own connection mid cold start with its backoff at the hooks' longest, so it is away
# for a while (its next idle wake-up, then its next try: see ``longest_way_back``), reconnects,
# then outlives the agent's grace before it exits cleanly. argv: how long it lives from the cut,
# then the hooks' IDLE_LONG_S and RECONNECT_MAX_S, scaled down as the agent's grace is: the same
# code paths, waits of the same shape, in a fifth of the time.
RECONNECTS = textwrap.dedent("""
    import socket, sys, time
    from infersight import hooks
    from infersight.hooks import _client, _connection, _state
    _client.IDLE_LONG_S = float(sys.argv[2])
    _connection.RECONNECT_MAX_S = RECONNECT_MAX_S = float(sys.argv[3])
    with hooks.stage("model_setup"):
        pass
    assert hooks.flush(10)
    c = _state.current.runtime.client
    with c._lock:
        old = c.conn.sock
        c.conn._backoff = RECONNECT_MAX_S
        old.shutdown(socket.SHUT_RDWR)
    cut = time.monotonic()
    print("cut", flush=True)
    while not (c.conn.sock is not None and c.conn.sock is not old):
        assert time.monotonic() - cut < 60, "never reconnected"
        time.sleep(0.05)
    print("back after %.1f s" % (time.monotonic() - cut), flush=True)
    while time.monotonic() - cut < float(sys.argv[1]):
        time.sleep(0.2)
    hooks.log("still here")
    assert hooks.flush(10)
    print("done", flush=True)
""")


class PidnsAgent(AgentProcess):
    """The agent in a pid namespace of its own."""

    def __init__(self, root: Path, grace_s: float) -> None:
        super().__init__(root)
        self.grace_s = grace_s

    def start(self, wait: bool = True) -> PidnsAgent:
        env = dict(os.environ)
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
             sys.executable, "-c", AGENT, str(self.grace_s), "agent", "--config", str(self.config)],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
        )
        if wait:
            assert wait_for(self._listening, 30), self.log.read_text()
        return self

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # --kill-child: the agent (pid 1 there) goes with it
            self.proc.wait(10)


@pytest.fixture
def pidns_agent(tmp_path: Path):  # type: ignore[no-untyped-def]
    require_root()
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("cannot make a pid namespace here: %s" % probe.stderr.decode(errors="replace").strip())
    made: list[PidnsAgent] = []

    def make(grace_s: float) -> PidnsAgent:
        root = tmp_path / ("agent%d" % len(made))
        root.mkdir(parents=True, exist_ok=True)
        a = PidnsAgent(root, grace_s)
        made.append(a)
        return a.start()

    yield make
    for a in made:
        a.close()


def roots(agent: AgentProcess) -> list[dict]:  # type: ignore[type-arg]
    return [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart"]


def longest_way_back(idle_long_s: float, reconnect_max_s: float) -> float:
    """The hook's longest way back after the cut: it notices the close at its next idle wake-up
    (``idle_long_s`` at the most), then waits out its backoff (``reconnect_max_s``, jittered up
    to 1.5x), woken for that try (``Client._idle_wait``; it used to sleep ``idle_long_s`` at a
    time with nothing owed, and came back 10 or 15 s after the cut, not within 12.5 s)."""
    return idle_long_s + 1.5 * reconnect_max_s


LONGEST_WAY_BACK_S = longest_way_back(IDLE_LONG_S, RECONNECT_MAX_S)
# The reconnect test runs the hook with both waits scaled down alike (1 s each, as they are 5 s each:
# a way back of 2.5 s at most), and the agent's grace with them: the hook's code paths are the same.
SCALED_IDLE_LONG_S = SCALED_RECONNECT_MAX_S = 1.0


def test_grace_outlasts_the_hooks_reconnect() -> None:
    """A live hook is back within its longest jittered backoff after it noticed the close (at its
    next idle wake-up at the latest): the grace leaves room for that twice over."""
    assert PIDLESS_GRACE_S >= 2 * LONGEST_WAY_BACK_S


def test_unseen_producer_killed_mid_cold_start_gets_its_root_closed(pidns_agent) -> None:  # type: ignore[no-untyped-def]
    agent = pidns_agent(2.0)
    proc = subprocess.run([sys.executable, "-c", DIES_IN_A_STAGE], env=hook_env(agent.sock, agent.spool),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "ready" in proc.stdout, proc.stderr
    assert wait_for(lambda: roots(agent), 60, 0.2), "no root for the killed producer:\n" + agent.log.read_text()
    (root,) = roots(agent)
    assert attr(root, "infersight.coldstart.ended_by") == "producer_lost"
    by_name = {s["name"]: s for s in spans(read_otlp_lines(agent.out)) if s["traceId"] == root["traceId"]}
    assert by_name["coldstart.interrupted"]["parentSpanId"] == root["spanId"], "the stage it died in is closed"
    st = agent.status()
    assert st["counters"]["producers_lost_unseen"] == 1
    assert st["assembler"]["coldstart_roots_closed_for_lost"] == 1
    assert st["assembler"]["pending_bytes"] == 0, "the dead producer's pending state is freed"
    assert st.get("coldstarts", []) == [], "it is no longer shown as warming"


def test_unseen_producer_that_reconnects_is_not_closed(pidns_agent) -> None:  # type: ignore[no-untyped-def]
    # A grace 3 s above the hook's longest way back (a loaded machine's delays; at full scale, a 12 s grace
    # failed now and then).
    grace_s = longest_way_back(SCALED_IDLE_LONG_S, SCALED_RECONNECT_MAX_S) + 3
    assert grace_s <= PIDLESS_GRACE_S
    agent = pidns_agent(grace_s)
    alive_s = grace_s + 2.5  # from its hang-up: past the grace that its hang-up started
    proc = subprocess.run([sys.executable, "-c", RECONNECTS, str(alive_s), str(SCALED_IDLE_LONG_S),
                           str(SCALED_RECONNECT_MAX_S)], env=hook_env(agent.sock, agent.spool),
                          capture_output=True, text=True, timeout=alive_s + 120)
    assert proc.returncode == 0 and "back after" in proc.stdout and "done" in proc.stdout, proc.stdout + proc.stderr
    assert wait_for(lambda: roots(agent), 30, 0.2), agent.log.read_text()
    (root,) = roots(agent)
    assert attr(root, "infersight.coldstart.ended_by") == "exit", "its own root: the agent did not close it"
    st = agent.status()
    assert st["counters"]["producers_lost_unseen"] == 0
    assert st["assembler"]["coldstart_roots_closed_for_lost"] == 0
