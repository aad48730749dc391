"""An agent restarted while a collector is down, its producer alive: each event is exported once.

A batch is acked once every exporter has it. With the collector down, the OTLP exporter holds
the batch in its retries, so a restart closed the producer's connection before the ack went out;
the live producer sent the batch again to the next agent, which exported it a second time beside
the copy the first agent spooled at its drain (a review of the systemd path saw a running
server's cold start twice in OTLP and MQTT, 3 times in 4). The agent now carries what it had taken
of each producer's numbers across the restart (its state directory), so what the producer sends
again is a duplicate there.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from conftest import hook_env, read_otlp_lines, spans, wait_for
from otlp_receiver import OtlpReceiver

WORKLOAD = """
import time
from infersight import hooks
with hooks.stage("model_build"):
    time.sleep(0.05)
hooks.mark_ready()
hooks.first_response()
hooks.flush(0.3)
print("ready", flush=True)
time.sleep(120)
"""


def _roots(path: Path) -> list[str]:
    return [s["spanId"] for s in spans(read_otlp_lines(path)) if s["name"] == "coldstart"]


def test_a_restart_during_a_collector_outage_exports_a_live_producers_cold_start_once(
        agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rx = OtlpReceiver(grpc_=False)  # not started yet: the collector is down
    state = tmp_path / "state"
    # The default OTLP timeout (10 s, the SDK retrying inside it) against the default shutdown timeout (10 s):
    # the drain gives up on the batch in flight, which is spooled, not lost.
    agent = agent_factory('[exporters.otlp]\nendpoint = "%s"\nprotocol = "http/protobuf"\n' % rx.http_endpoint)
    agent.config.write_text(agent.config.read_text().replace("[agent]\n", '[agent]\nstate_dir = "%s"\n' % state))
    agent.start()
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    p = subprocess.Popen([sys.executable, str(script)], env=hook_env(agent.sock, agent.spool), stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        assert wait_for(lambda: len(_roots(agent.out)) == 1, 20), agent.log.read_text()
        assert agent.stop() == 0  # the OTLP batch still in its retries: not acked to the producer
        rx.start()  # the collector is back when the next agent starts: it sends the spooled copy
        agent.start()
        assert wait_for(lambda: agent.status()["counters"]["duplicates"] > 0, 20), agent.log.read_text()
        assert rx.wait_for(lambda: any(s.name == "coldstart" for _r, _sc, s in rx.spans()), 60), agent.log.read_text()
        time.sleep(2.0)
        assert len(_roots(agent.out)) == 1, _roots(agent.out)  # the file: the first agent's export only
        assert [s.name for _r, _sc, s in rx.spans()].count("coldstart") == 1  # OTLP: the spooled copy only
    finally:
        p.kill()
        rx.stop()


RESTARTED_MIDWAY = """
import os, sys, time
from infersight import hooks
with hooks.stage("model_build"):
    time.sleep(0.4)
hooks.flush(2.0)
print("built", flush=True)
while not os.path.exists(sys.argv[1]):  # the agent restarts meanwhile
    time.sleep(0.01)
with hooks.stage("warmup"):
    time.sleep(0.1)
hooks.mark_ready()
hooks.first_response()
hooks.flush(2.0)
print("ready", flush=True)
time.sleep(120)
"""


def test_an_agent_restarted_during_a_cold_start_counts_the_stages_sent_before_it(
        agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The stages a process sent to the agent before a restart were exported by it; the next agent closed the
    root with only the later ones and called the earlier stages' time unattributed (0.4 s of model_build here),
    though the file held them all. The hooks now say what their stages covered, and the agent takes it."""
    agent = agent_factory("")
    agent.start()
    script, go = tmp_path / "w.py", tmp_path / "go"
    script.write_text(RESTARTED_MIDWAY)
    p = subprocess.Popen([sys.executable, str(script), str(go)], env=hook_env(agent.sock, agent.spool),
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"built"
        names = lambda: [s["name"] for s in spans(read_otlp_lines(agent.out))]  # noqa: E731
        assert wait_for(lambda: "coldstart.model_build" in names(), 20), agent.log.read_text()
        assert agent.stop() == 0
        agent.start()
        go.touch()
        assert p.stdout.readline().strip() == b"ready"
        assert wait_for(lambda: "coldstart" in names(), 30), agent.log.read_text()
        every = spans(read_otlp_lines(agent.out))
        (root,) = [s for s in every if s["name"] == "coldstart"]
        attrs = {a["key"]: a["value"] for a in root.get("attributes", [])}
        unattributed = float(attrs["infersight.coldstart.unattributed_s"]["doubleValue"])
        start, end = int(root["startTimeUnixNano"]), int(root["endTimeUnixNano"])
        stages = [(max(start, int(s["startTimeUnixNano"])), min(end, int(s["endTimeUnixNano"])))
                  for s in every if s["name"].startswith("coldstart.") and s["name"] != "coldstart.unattributed"]
        covered, cur = 0, start
        for a, b in sorted(stages):  # the union of every stage in the file, within the root
            if b > cur:
                covered += b - max(a, cur)
                cur = b
        assert abs(unattributed - (end - start - covered) / 1e9) < 0.02, (unattributed, (end - start - covered) / 1e9)
    finally:
        p.kill()
