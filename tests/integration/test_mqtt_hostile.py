"""MQTT export against hostile records and a refusing broker (issue 22, points 4 and 6, and
the topic collisions), with a real mosquitto started by the test.

- A message the broker refuses (here: a topic its ACL denies, so MQTT 5 PUBACK reason 0x87,
  not authorised) is dropped and counted; the connection stays up and the messages around it
  arrive. aiomqtt alone completes the publish and drops the reason code.
- A record no MQTT message can carry (a lone surrogate reaches the exporter from inside the
  agent) is dropped and counted, and another producer's records behind it go out at once
  instead of waiting behind the worker's retries.
- Service names that differ only in characters a topic cannot hold keep their own retained
  progress topics.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mosquitto import MOSQUITTO, Collector, Mosquitto, retained, running_broker

from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.lifecycle import Agent
from infersight.exporters import mqtt_payload as mp
from infersight.exporters.mqtt import MqttExporter, MqttSettings
from infersight.telemetry import ColdStartProgress, LogItem, Origin, Resource

needs_mosquitto = pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto not installed")
HOST = "hostile-host"
DENIED_HW = "GPU-denied"


def oom(producer: str, seq: int, body: str = "CUDA out of memory") -> LogItem:
    res = Resource.of({"host.name": HOST, "service.name": "svc-" + producer, "service.instance.id": producer})
    return LogItem(res, time.time_ns(), 17, "ERROR", body, {"infersight.oom.class": "capacity"},
                   event_name="oom", origin=Origin(producer, seq))


def device_event(producer: str, seq: int, hw: str) -> LogItem:
    res = Resource.of({"host.name": HOST, "service.name": "svc-" + producer, "service.instance.id": producer})
    return LogItem(res, time.time_ns(), 13, "WARN", "Xid 79", {"hw.id": hw}, event_name="device",
                   origin=Origin(producer, seq))


def seqs(sub: Collector, producer: str) -> list[int]:
    return [m.json()["seq"] for m in sub.on("infersight/%s/oom" % HOST) if m.json()["producer"] == producer]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    acl = tmp_path / "acl"
    acl.write_text("topic readwrite infersight/#\ntopic deny infersight/%s/device/%s\n" % (HOST, DENIED_HW))
    with running_broker(tmp_path / "mosquitto", extra=("acl_file %s" % acl,)) as b:
        yield b


def _agent(broker: Mosquitto, tmp_path: Path) -> tuple[Agent, MqttExporter]:
    conf = cfg.load(None, env={}, flags={
        "agent.socket": str(tmp_path / "agent.sock"), "agent.spool_dir": str(tmp_path / "spool"),
        "agent.host_name": HOST, "agent.health_interval_s": 3600.0,
    })  # fmt: skip
    exporter = MqttExporter(MqttSettings(broker.url, host_name=HOST))
    return Agent(conf, [exporter], exporter_spool_root=str(tmp_path / "xspool")), exporter


@needs_mosquitto
async def test_a_message_the_broker_refuses_is_dropped_counted_and_the_rest_go_on(
    broker: Mosquitto, tmp_path: Path
) -> None:
    agent, exporter = _agent(broker, tmp_path)
    async with Collector(broker, "infersight/%s/oom" % HOST) as sub:
        await agent.start()
        assert await exporter.wait_connected(10)
        agent.broadcaster.publish([oom("a", 1), device_event("a", 2, DENIED_HW), oom("a", 3)])
        agent.broadcaster.publish([oom("b", 1)])
        assert await sub.wait_for(lambda: seqs(sub, "b") == [1], 20), exporter.state()
        assert seqs(sub, "a") == [1, 3]
        st = exporter.state()
        assert st["refused_messages"] == 1 and st["refused_items"] == 1, st
        assert st["connects"] == 1 and st["disconnects"] == 0 and st["failed_batches"] == 0, st
        assert st["delivered_items"] == 3, st  # the refused one is not counted as delivered
        w = agent.workers[0].state()
        assert w["export_errors"] == 0 and w["retries"] == 0, w
        assert await agent.shutdown(5)


@needs_mosquitto
async def test_an_unencodable_record_does_not_stall_another_producers_records(
    broker: Mosquitto, tmp_path: Path
) -> None:
    agent, exporter = _agent(broker, tmp_path)
    async with Collector(broker, "infersight/%s/oom" % HOST) as sub:
        await agent.start()
        assert await exporter.wait_connected(10)
        # A lone surrogate cannot be UTF-8: ingest cleans producers' strings, so this stands for
        # any record that no JSON payload or topic can carry.
        agent.broadcaster.publish([oom("bad", 1, "broken \ud800 text"), oom("bad", 2)])
        agent.broadcaster.publish([oom("victim", 1)])
        assert await sub.wait_for(lambda: seqs(sub, "victim") == [1], 20), agent.workers[0].state()
        assert seqs(sub, "bad") == [2]  # the one behind it in its own batch went too
        st = exporter.state()
        assert st["unencodable_items"] == 1 and st["failed_batches"] == 0, st
        w = agent.workers[0].state()
        assert w["export_errors"] == 0 and w["retries"] == 0 and w["dropped_items"] == 0, w
        assert await agent.shutdown(5)


@needs_mosquitto
async def test_services_that_differ_in_unsafe_characters_keep_their_own_progress_topics(
    broker: Mosquitto, tmp_path: Path
) -> None:
    exporter = MqttExporter(MqttSettings(broker.url, host_name=HOST))
    await exporter.start()
    try:
        assert await exporter.wait_connected(10)
        names = ["m+l", "m#l", "m\x00l", "m_l", "m/l", "m l", "m%l"]
        items = [ColdStartProgress(Resource.of({"service.name": n}), n, 1000 + i, time.time_ns(),
                                   {"service": n, "pid": 1000 + i, "stage": "weights_load"})
                 for i, n in enumerate(names)]
        await exporter.export(items)
        topics = {n: mp.Topics.of("infersight", HOST).coldstart_progress(n) for n in names}
        assert len(set(topics.values())) == len(names)
        assert topics["m_l"] == "infersight/%s/coldstart/m_l/progress" % HOST  # ordinary names unchanged
        for n, topic in topics.items():
            got = await retained(broker, topic)
            assert got is not None and mp.decode(got)["service"] == n, (n, topic)
    finally:
        await exporter.shutdown()


# -- the topic level (pure) ----------------------------------------------------------------------


@given(st.text(max_size=200), st.text(max_size=200))
def test_topic_level_is_one_to_one(a: str, b: str) -> None:
    if a != b:
        assert mp.topic_level(a) != mp.topic_level(b)


@given(st.text(max_size=100))
def test_topic_level_decodes_back_and_is_valid_utf8_without_controls(s: str) -> None:
    level = mp.topic_level(s)
    level.encode("utf-8")  # never a lone surrogate
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in level)
    assert not any(c in level for c in "+#/") and not level.startswith("$") and len(level) <= mp.MAX_LEVEL
    if s and "%~" not in level:
        assert urllib.parse.unquote_to_bytes(level).decode("utf-8", "surrogatepass") == s


def test_ordinary_names_are_unchanged_and_collisions_are_gone() -> None:
    for name in ("eta-svc", "GPU-5c1a0000-0000", "llama_3.1:8b", "svc.prod", "café"):
        assert mp.topic_level(name) == name
    assert [mp.topic_level(n) for n in ("m+l", "m#l", "m\x00l", "m_l", "$SYS", "")] == [
        "m%2Bl", "m%23l", "m%00l", "m_l", "%24SYS", "%"]
    long_a, long_b = "s" * 300 + "a", "s" * 300 + "b"
    assert mp.topic_level(long_a) != mp.topic_level(long_b) and len(mp.topic_level(long_a)) <= mp.MAX_LEVEL
