"""The MQTT exporter against a real mosquitto started by the test on a free 127.0.0.1 port.

Delivery is **at least once** (QoS 1, and a batch cut by a disconnect is replayed whole), so
these tests dedupe on (producer, seq) and require: no gap, first occurrences in order.
"""

from __future__ import annotations

import asyncio
import os
import time
import tracemalloc
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from mosquitto import MOSQUITTO, Collector, Mosquitto, make_tls, retained, running_broker

from infersight.agent.coldstart.assembly import ColdStartAssembly
from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.assemble import KindHandler, SpanHandler
from infersight.agent.daemon.broadcast import Completion, ExporterWorker
from infersight.agent.daemon.extension import Extension
from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.daemon.spool import DiskSpool
from infersight.exporters.base import ExportError
from infersight.exporters.mqtt import MqttExporter, MqttSettings, wait_delivered
from infersight.hooks._client import Client as HookClient
from infersight.telemetry import LogItem, MetricItem, NumberPoint, Origin, Resource

pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto not installed")
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with running_broker(tmp_path / "mosquitto") as b:
        yield b


def oom_item(producer: str, seq: int) -> LogItem:
    res = Resource.of({"host.name": "h", "service.name": "svc", "service.instance.id": producer})
    return LogItem(res, time.time_ns(), 17, "ERROR", "CUDA out of memory (%d)" % seq,
                   {"infersight.oom.class": "capacity"}, event_name="oom", origin=Origin(producer, seq))


def seqs_by_producer(c: Collector, topic: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for m in c.on(topic):
        d = m.json()
        out.setdefault(d["producer"], []).append(d["seq"])
    return out


def first_occurrences(seqs: list[int]) -> list[int]:
    seen: set[int] = set()
    return [s for s in seqs if not (s in seen or seen.add(s))]


# -- delivery round trip through the agent ----------------------------------------------------


class ColdStartSummaries(Extension):
    """Only the cold-start extension's span assembly: the summary that goes out on .../coldstart."""

    name = "coldstart"

    def __init__(self) -> None:
        self.assembly = ColdStartAssembly()

    def kinds(self) -> Mapping[str, KindHandler]:
        return {"cs_tick": self.assembly.checkpoint}

    def spans(self) -> SpanHandler:
        return self.assembly



async def test_round_trip_through_agent(broker: Mosquitto, tmp_path: Path) -> None:
    host = "rt-host"
    conf = cfg.load(None, env={}, flags={
        "agent.socket": str(tmp_path / "agent.sock"), "agent.spool_dir": str(tmp_path / "spool"),
        "agent.host_name": host, "agent.health_interval_s": 3600.0,
    })  # fmt: skip
    exporter = MqttExporter(MqttSettings(broker.url, host_name=host,
                                         birth={"devices": [{"hw.id": "GPU-rt", "hw.name": "T"}]}))
    agent = Agent(conf, [exporter], [ColdStartSummaries()], exporter_spool_root=str(tmp_path / "xspool"))
    base = "infersight/%s/" % host
    async with Collector(broker, "infersight/#") as sub:
        await agent.start()
        # A real hook client (the producer side) talks to the agent's socket.
        trace, root_id = "1" * 32, "2" * 16
        hook = HookClient(str(tmp_path / "agent.sock"), str(tmp_path / "spool"), {
            "id": "prod-rt", "pid": os.getpid(), "start_ns": time.time_ns() - 10**9, "trace_id": trace,
            "root_span_id": root_id, "exe": "python", "host": host,
        })  # fmt: skip
        now = time.time_ns()
        hook.emit("span", {"n": "coldstart.weights_load", "id": "3" * 16, "p": root_id, "s": now - 9 * 10**8,
                           "e": now - 5 * 10**8, "a": {"infersight.stage": "weights_load"}})
        hook.emit("span", {"n": "coldstart.warmup", "id": "4" * 16, "p": root_id, "s": now - 4 * 10**8,
                           "e": now - 10**8, "a": {"infersight.stage": "warmup"}})
        hook.emit("span", {"n": "coldstart", "id": root_id, "s": now - 10**9, "e": now})
        hook.emit("log", {"name": "oom", "sev": "ERROR", "body": "torch.OutOfMemoryError: CUDA out of memory.",
                          "a": {"infersight.oom.class": "capacity", "infersight.oom.rule": "cap-1"}})
        assert await asyncio.to_thread(hook.flush, 10)
        agent.broadcaster.publish([MetricItem(agent.resource, "hw.gpu.utilization", "gauge", "1", "", now, now,
                                         [NumberPoint(0.25, {"hw.id": "GPU-rt", "hw.type": "gpu"})])])
        agent.publish_health()
        assert await sub.wait_for(lambda: sub.on(base + "coldstart") and sub.on(base + "oom")
                                  and sub.on(base + "agent") and sub.on(base + "device/GPU-rt"))
        [cs] = sub.on(base + "coldstart")
        [om] = sub.on(base + "oom")
        assert cs.qos == 1 and om.qos == 1 and not cs.retain
        d = cs.json()
        assert d["schema"] == 1 and d["producer"] == "prod-rt" and d["seq"] == 3
        assert d["root"]["attributes"]["faas.coldstart"] is True and d["trace_id"] == trace
        assert [s["name"] for s in d["stages"]] == ["coldstart.weights_load", "coldstart.warmup"]
        assert d["root"]["attributes"]["infersight.coldstart.unattributed_s"] == pytest.approx(0.3, abs=1e-6)
        # What the infersight.coldstart.duration histogram observed, for MQTT-side aggregation.
        assert d["stage_durations_s"] == pytest.approx(
            {"weights_load": 0.4, "warmup": 0.3, "unattributed": 0.3, "total": 1.0}, abs=1e-6)
        assert d["ended_by"] == "unknown"
        o = om.json()
        assert (o["schema"], o["producer"], o["seq"], o["event.name"]) == (1, "prod-rt", 4, "oom")
        assert o["attributes"]["infersight.oom.class"] == "capacity" and o["resource"]["host.name"] == host
        health = sub.on(base + "agent")[0].json()
        assert "infersight.events.received" in {m["name"] for m in health["metrics"]}
        assert sub.on(base + "device/GPU-rt")[0].json()["metrics"][0]["points"][0]["value"] == 0.25
        # Retained: status and birth, as a late subscriber sees them.
        assert await retained(broker, base + "status") == b"online"
        birth = await retained(broker, base + "birth")
        assert birth is not None
        import json

        b = json.loads(birth)
        assert b["schema"] == 1 and b["devices"][0]["hw.id"] == "GPU-rt" and b["infersight.agent.mode"] == "daemon"
        hook.close(1)
        assert await agent.shutdown(5)
        assert await retained(broker, base + "status") == b"offline"
    assert exporter.state()["connected"] == 0 and exporter.state()["failed_batches"] == 0


async def test_embedded_presence_and_no_kick_off(broker: Mosquitto) -> None:
    """launch has its own client id and clean session; the daemon is not kicked off."""
    host = "emb-host"
    daemon = MqttExporter(MqttSettings(broker.url, host_name=host))
    launch = MqttExporter(MqttSettings(broker.url, host_name=host, embedded=True, launch_pid=4242, protocol="3.1.1"))
    status = "infersight/%s/launch/4242/status" % host
    async with Collector(broker, "infersight/#") as sub:
        await daemon.start()
        await launch.start()
        assert await daemon.wait_connected(5) and await launch.wait_connected(5)
        assert launch.client_id == "infersight-emb-host-launch-4242"
        assert await retained(broker, status) == b"online"
        await launch.export([oom_item("p-emb", 1)])
        await asyncio.sleep(0.3)
        assert daemon.state()["connects"] == 1 and launch.state()["connects"] == 1
        assert daemon.connected and launch.connected
        await launch.shutdown()
        assert await sub.wait_for(lambda: [m.payload for m in sub.on(status)][-1:] == [b""])
        assert [m.payload for m in sub.on(status)] == [b"online", b"offline", b""]
        assert await retained(broker, status, timeout=0.3) is None  # cleared on clean exit
        assert daemon.connected
        await daemon.shutdown()


async def test_embedded_exit_wait_is_bounded_and_counts_undelivered(tmp_path: Path) -> None:
    """Broker away at exit: launch waits exit_wait_s, then reports what it could not deliver."""
    absent = Mosquitto(tmp_path / "absent")  # configured, never started: nothing listens
    exp = MqttExporter(MqttSettings(absent.url, host_name="h", embedded=True, exit_wait_s=0.5, connect_timeout_s=1))
    worker = ExporterWorker(exp, DiskSpool(str(tmp_path / "xs")), retry_initial_s=0.05, retry_max_s=0.2)
    await exp.start()
    worker.start()
    c = Completion()
    c.pending = 1
    worker.submit([oom_item("p", i) for i in range(1, 8)], c)
    t0 = time.monotonic()
    left = await asyncio.wait_for(wait_delivered(exp, worker), 60)  # bounded: it gives up, broker away
    assert time.monotonic() - t0 > 0.4  # after waiting exit_wait_s for it
    assert left == 7 and exp.state()["undelivered_at_exit"] == 7
    assert worker.state()["spooled_items_pending"] == 7
    await worker.drain(0.2)
    await exp.shutdown()


# -- broker restart without loss --------------------------------------------------------------


async def test_broker_restart_mid_stream_loses_nothing(broker: Mosquitto, tmp_path: Path) -> None:
    host = "rs-host"
    topic = "infersight/%s/oom" % host
    exp = MqttExporter(MqttSettings(broker.url, host_name=host, reconnect_initial_s=0.1, reconnect_max_s=0.5))
    worker = ExporterWorker(exp, DiskSpool(str(tmp_path / "xs")), retry_initial_s=0.05, retry_max_s=0.5)
    sent = {"p-a": 0, "p-b": 0}
    async with Collector(broker, topic, client_id="rs-collector") as sub:
        await exp.start()
        worker.start()
        assert await exp.wait_connected(5)

        async def feed(until: float) -> None:
            while time.monotonic() < until:
                for p in sent:  # two producers, interleaved batches
                    batch = [oom_item(p, sent[p] + i + 1) for i in range(10)]
                    sent[p] += 10
                    c = Completion()
                    c.pending = 1
                    worker.submit(batch, c)
                await asyncio.sleep(0.1)

        t0 = time.monotonic()
        feeder = asyncio.ensure_future(feed(t0 + 7.5))
        await asyncio.sleep(1.0)
        broker.stop()
        down = time.monotonic()
        await asyncio.sleep(5.2)
        for _ in range(600):  # the outage really went to the spool (however long the worker took)
            if worker.state()["spooled_items_pending"] > 0:
                break
            await asyncio.sleep(0.1)
        assert worker.state()["spooled_items_pending"] > 0
        broker.start()
        up = time.monotonic()
        await feeder
        assert up - down >= 5.0
        assert await sub.wait_for(lambda: all(
            set(seqs_by_producer(sub, topic).get(p, [])) >= set(range(1, n + 1)) for p, n in sent.items()), 20)
        got = seqs_by_producer(sub, topic)
        for p, n in sent.items():
            assert first_occurrences(got[p]) == list(range(1, n + 1)), p  # in order, no gap
        dups = sum(len(v) for v in got.values()) - sum(sent.values())
        st = {**worker.state(), **exp.state()}
        assert st["disconnects"] >= 1 and st["spilled_items"] > 0 and st["dropped_items"] == 0
        print("broker restart: %d events per producer, %d duplicate(s) (at-least-once)" % (sent["p-a"], dups))
        await worker.drain(2)
        await exp.shutdown()


# -- TLS and auth -----------------------------------------------------------------------------


async def test_tls_and_password_auth(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tls = make_tls(tmp_path / "tls")
    users = {"agent": "right-pw-123", "watcher": "watch-pw"}
    with Mosquitto(tmp_path / "mq", tls=tls, users=users) as b:
        topic = "infersight/tls-host/oom"
        async with Collector(b, topic, username="watcher", password="watch-pw") as sub:
            good = MqttExporter(MqttSettings(b.url, username="agent", password="right-pw-123", ca_file=str(tls.ca),
                                host_name="tls-host"))
            await good.start()
            assert await good.wait_connected(5), good.state()
            await good.export([oom_item("p-tls", 1)])
            assert await sub.wait_for(lambda: len(sub.on(topic)) == 1)
            await good.shutdown()

        caplog.set_level("DEBUG")
        bad = MqttExporter(MqttSettings(b.url.replace("mqtts://", "mqtts://agent:wrong-pw-456@"), ca_file=str(tls.ca),
                           host_name="tls-host", connect_timeout_s=3))
        await bad.start()
        with pytest.raises(ExportError) as ei:
            await bad.export([oom_item("p-tls", 2)])
        msg = str(ei.value)
        assert "Bad user name or password" in msg or "Not authorized" in msg, msg
        assert "username / password" in msg and "agent:***@" in msg
        st = bad.state()
        assert st["connected"] == 0 and st["connect_failures"] >= 1
        await bad.shutdown()

        untrusted = MqttExporter(MqttSettings(b.url, username="agent", password="right-pw-123", host_name="tls-host",
                                 connect_timeout_s=3))  # no ca_file: the self-signed CA is not trusted
        await untrusted.start()
        with pytest.raises(ExportError, match="certificate did not verify"):
            await untrusted.export([oom_item("p-tls", 3)])
        await untrusted.shutdown()
        for secret in ("wrong-pw-456", "right-pw-123"):
            assert secret not in caplog.text and secret not in repr(bad.state()) + repr(untrusted.state())


# -- bounded spool ----------------------------------------------------------------------------


async def test_full_spool_drops_oldest_counts_them_and_memory_stays_bounded(tmp_path: Path) -> None:
    b = Mosquitto(tmp_path / "mq")  # started only after the spool overflowed
    host = "sp-host"
    topic = "infersight/%s/oom" % host
    exp = MqttExporter(MqttSettings(b.url, host_name=host, reconnect_initial_s=0.1, reconnect_max_s=0.3))
    spool = DiskSpool(str(tmp_path / "xs"), max_bytes=256 << 10)
    worker = ExporterWorker(exp, spool, queue_max_items=800, retry_initial_s=0.05, retry_max_s=0.2)
    worker.start()  # the exporter is not started yet: every export fails, as with no broker
    total, batch = 10_000, 100
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for start in range(1, total + 1, batch):
            c = Completion()
            c.pending = 1
            worker.submit([oom_item("p-sp", s) for s in range(start, start + batch)], c)
            if start % 1000 == 1:
                await asyncio.sleep(0)  # let the worker run
        await asyncio.sleep(0.3)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    st = worker.state()
    assert st["dropped_items"] > 0 and spool.dropped_items == st["dropped_items"]
    assert spool.size_bytes() <= spool.max_bytes + spool.segment_bytes + (64 << 10)
    assert grown < 4 << 20, grown  # ~3.5 MB of JSON went through the spool; memory did not follow
    pending = st["spooled_items_pending"]
    assert pending > 0 and pending + st["dropped_items"] == total
    b.start()
    try:
        async with Collector(b, topic) as sub:
            await exp.start()
            assert await sub.wait_for(lambda: worker.idle() and len({m.payload for m in sub.on(topic)}) >= pending, 20)
            seqs = [m.json()["seq"] for m in sub.on(topic)]
        # Exactly the kept events arrive, and they are the newest, in order: the full queue
        # spills to the spool in order, and the spool drops its oldest segments.
        assert len(set(seqs)) == pending and set(seqs) <= set(range(1, total + 1))
        first = list(dict.fromkeys(seqs))
        assert first == sorted(first) and first == list(range(total - pending + 1, total + 1))
        assert worker.state()["dropped_items"] + len(set(seqs)) == total
        await worker.drain(1)
        await exp.shutdown()
    finally:
        b.stop()
