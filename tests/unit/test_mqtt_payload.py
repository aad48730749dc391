"""MQTT topic tree, payloads and configuration: pure, no broker."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infersight.agent.daemon import config as cfg
from infersight.exporters import mqtt_payload as mp
from infersight.exporters.mqtt import (
    MQTT_KEYS,
    MqttConfigError,
    MqttExporter,
    MqttSettings,
    from_config,
    mqtt_requested,
    parse_url,
)
from infersight.settings import ConfigError
from infersight.telemetry import (
    ColdStart,
    HistogramPoint,
    LogItem,
    MetricItem,
    NumberPoint,
    Origin,
    Resource,
    SpanItem,
)

RES = Resource.of({"host.name": "gpu-1", "service.name": "svc", "process.pid": 42, "service.instance.id": "prod-1"})
AGENT_RES = Resource.of({"host.name": "gpu-1", "service.name": "infersight-agent", "process.pid": 7,
                         "infersight.agent.mode": "daemon"})
TOPICS = mp.Topics.of("infersight", "gpu-1")


def coldstart() -> ColdStart:
    root = SpanItem(RES, "a" * 32, "b" * 16, None, "coldstart", 1_000, 9_000,
                    {"faas.coldstart": True, "infersight.coldstart.unattributed_s": 1e-6}, origin=Origin("prod-1", 9))
    st1 = SpanItem(RES, "a" * 32, "c" * 16, "b" * 16, "coldstart.weights_load", 2_000, 5_000,
                   {"infersight.stage": "weights_load", "infersight.weights.bytes": 1 << 30},
                   origin=Origin("prod-1", 3))
    st2 = SpanItem(RES, "a" * 32, "d" * 16, "b" * 16, "coldstart.warmup", 5_000, 8_000,
                   {"infersight.stage": "warmup"}, origin=Origin("prod-1", 6))
    return ColdStart(root, [st1, st2])


def oom(seq: int = 11) -> LogItem:
    return LogItem(RES, 123, 17, "ERROR", "CUDA out of memory. Tried to allocate 2.00 GiB",
                   {"infersight.oom.class": "fragmentation", "infersight.oom.rule": "frag-1"},
                   "a" * 32, "c" * 16, "oom", Origin("prod-1", seq))


def test_topic_tree() -> None:
    assert TOPICS.status == "infersight/gpu-1/status"
    assert TOPICS.birth == "infersight/gpu-1/birth"
    assert TOPICS.launch_status(77) == "infersight/gpu-1/launch/77/status"
    assert TOPICS.family("coldstart") == "infersight/gpu-1/coldstart"
    assert TOPICS.device("GPU-1234-abcd") == "infersight/gpu-1/device/GPU-1234-abcd"
    assert mp.Topics.of("site/a/", "h").status == "site/a/h/status"


@pytest.mark.parametrize("bad", ["", "/", "a/+/b", "a/#", "$SYS", "a//b"])
def test_bad_prefix_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        mp.validate_prefix(bad)


@given(st.text(max_size=200))
def test_topic_level_is_always_one_safe_level(s: str) -> None:
    level = mp.topic_level(s)
    assert level and not any(c in level for c in "+#/\x00") and not level.startswith("$")


def test_coldstart_is_one_message_with_root_and_stages() -> None:
    cs = coldstart()
    msgs, skipped = mp.encode_batch([cs.root, *cs.stages, cs], TOPICS)
    assert skipped == 3  # the plain spans travel inside the ColdStart
    [m] = msgs
    assert m.topic == "infersight/gpu-1/coldstart" and not m.retain
    d = mp.decode(m.payload)
    assert d["schema"] == mp.SCHEMA_VERSION and d["type"] == "coldstart"
    assert (d["producer"], d["seq"]) == ("prod-1", 9) == (m.producer, m.seq)
    assert d["root"]["attributes"]["faas.coldstart"] is True
    assert d["root"]["span_id"] == "b" * 16 and d["trace_id"] == "a" * 32
    assert [s["attributes"]["infersight.stage"] for s in d["stages"]] == ["weights_load", "warmup"]
    assert d["stages"][0]["duration_s"] == pytest.approx(3e-6)
    assert d["stages"][0]["parent_span_id"] == "b" * 16
    assert d["resource"]["host.name"] == "gpu-1" and d["service.name"] == "svc"


def test_oom_log_payload_uses_otel_names() -> None:
    [m], skipped = mp.encode_batch([oom()], TOPICS)
    assert skipped == 0 and m.topic == "infersight/gpu-1/oom"
    d = json.loads(m.payload)
    assert d["type"] == "log" and d["event.name"] == "oom"
    assert (d["producer"], d["seq"]) == ("prod-1", 11)
    assert d["attributes"]["infersight.oom.class"] == "fragmentation"
    assert d["severity_text"] == "ERROR" and d["severity_number"] == 17
    assert d["time_unix_nano"] == 123 and d["span_id"] == "c" * 16


def test_log_families_and_unrouted() -> None:
    def log(name: str | None, **attrs: str) -> LogItem:
        return LogItem(RES, 1, 9, "INFO", "b", dict(attrs), event_name=name, origin=Origin("p", 1))

    msgs, skipped = mp.encode_batch(
        [log("memory"), log("device", **{"hw.id": "GPU-9"}), log("device"), log("agent"), log(None), log("request")],
        TOPICS,
    )
    assert [m.topic.split("gpu-1/")[1] for m in msgs] == ["memory", "device/GPU-9", "device/unknown", "agent"]
    assert skipped == 2


def test_metrics_become_snapshots_per_topic() -> None:
    def dev(name: str, hw: str, v: float) -> NumberPoint:
        return NumberPoint(v, {"hw.id": hw, "hw.type": "gpu"})

    items = [
        MetricItem(AGENT_RES, "hw.gpu.utilization", "gauge", "1", "", 50, 0,
                   [dev("u", "GPU-a", 0.5), dev("u", "GPU-b", 0.9)]),
        MetricItem(AGENT_RES, "hw.gpu.memory.usage", "gauge", "By", "", 50, 0, [dev("m", "GPU-a", 1.0)]),
        MetricItem(AGENT_RES, "infersight.events.received", "sum", "{event}", "", 60, 0, [NumberPoint(5)]),
        MetricItem(AGENT_RES, "process.memory.usage", "gauge", "By", "", 60, 0, [NumberPoint(1 << 20)]),
        MetricItem(RES, "torch.cuda.memory.allocated", "gauge", "By", "", 70, 0, [NumberPoint(3)]),
        MetricItem(RES, "app.requests", "sum", "1", "", 70, 0, [NumberPoint(3)]),
        MetricItem(AGENT_RES, "lat", "histogram", "s", "", 60, 0,
                   [HistogramPoint([1.0], [1, 2], 3, 4.5, 0.5, float("nan"))]),
    ]
    msgs, skipped = mp.encode_batch(items, TOPICS)
    assert skipped == 1  # app.requests: a producer metric that is not about memory
    by_topic = {m.topic: json.loads(m.payload) for m in msgs}
    assert set(by_topic) == {"infersight/gpu-1/device/GPU-a", "infersight/gpu-1/device/GPU-b",
                             "infersight/gpu-1/agent", "infersight/gpu-1/memory"}
    a = by_topic["infersight/gpu-1/device/GPU-a"]
    assert a["type"] == "metrics" and a["hw.id"] == "GPU-a" and a["seq"] is None
    assert [m["name"] for m in a["metrics"]] == ["hw.gpu.utilization", "hw.gpu.memory.usage"]
    assert by_topic["infersight/gpu-1/device/GPU-b"]["metrics"][0]["points"] == [
        {"value": 0.9, "attributes": {"hw.id": "GPU-b", "hw.type": "gpu"}}]
    agent = by_topic["infersight/gpu-1/agent"]
    assert [m["name"] for m in agent["metrics"]] == ["infersight.events.received", "process.memory.usage", "lat"]
    assert agent["metrics"][2]["points"][0]["max"] is None  # NaN is not JSON
    assert by_topic["infersight/gpu-1/memory"]["producer"] == "prod-1"


def test_birth_payload() -> None:
    d = mp.birth_payload(host="h", version="1.2", mode="daemon", pid=1, client_id="c", started_ns=5,
                         extra={"devices": [{"hw.id": "GPU-1"}], "schema": 99})
    assert d["schema"] == mp.SCHEMA_VERSION and d["service.version"] == "1.2"
    assert d["devices"] == [{"hw.id": "GPU-1"}] and "coldstart" in d["topic_families"]


# -- exporter construction and configuration ---------------------------------------------------


def test_parse_url() -> None:
    a = parse_url("mqtts://u%40x:p%3Aw@broker.example:9999")
    assert (a.tls, a.host, a.port, a.username, a.password) == (True, "broker.example", 9999, "u@x", "p:w")
    assert parse_url("mqtt://h").port == 1883 and parse_url("mqtts://h").port == 8883
    for bad in ("http://h", "mqtt://", "mqtt://h/topic", "mqtt://h:notaport"):
        with pytest.raises(MqttConfigError):
            parse_url(bad)


def test_identities_and_secrets() -> None:
    d = MqttExporter(MqttSettings("mqtt://user:hunter2@127.0.0.1:1", host_name="gpu-1.example.com"))
    assert d.client_id == "infersight-gpu-1.example.com-agent"
    assert d.status_topic == "infersight/gpu-1.example.com/status"
    e = MqttExporter(MqttSettings("mqtt://127.0.0.1:1", host_name="gpu-1", embedded=True, launch_pid=99,
                                  protocol="3.1.1"))
    assert e.client_id == "infersight-gpu-1-launch-99"
    assert e.status_topic == "infersight/gpu-1/launch/99/status" and not e.birth_retained
    st = d.state()
    assert "hunter2" not in repr(st) and "hunter2" not in repr(vars(d).get("url"))
    assert st["url"] == "mqtt://user:***@127.0.0.1:1"
    with pytest.raises(MqttConfigError):
        MqttExporter(MqttSettings("mqtt://h", ca_file="/nonexistent"))  # TLS files need mqtts://
    with pytest.raises(MqttConfigError):
        MqttExporter(MqttSettings("mqtts://h", ca_file="/nonexistent/ca.pem"))
    with pytest.raises(MqttConfigError):
        MqttExporter(MqttSettings("mqtt://h", qos=3))
    with pytest.raises(MqttConfigError):
        MqttExporter(MqttSettings("mqtt://h", protocol="4"))


def test_settings_are_checked_once_by_the_key_table_parsers() -> None:
    s = MqttSettings("mqtt://u:pw@h", protocol="v311", connect_timeout_s=2, host_name="box")
    assert (s.protocol, s.connect_timeout_s, s.credentials) == ("3.1.1", 2.0, ("u", "pw"))
    assert s.topics.status == "infersight/box/status" and "pw" not in repr(s)
    for bad in ({"keepalive": 70000}, {"qos": "2x"}, {"max_inflight": 0}, {"topic_prefix": "a/#"},
                {"password": "pw"}, {"key_file": "k.pem"}):
        with pytest.raises(MqttConfigError):
            MqttSettings("mqtt://h", **bad)  # type: ignore[arg-type]


def test_from_config_precedence_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "infersight.toml"
    f.write_text('[agent]\nhost_name = "box"\n[exporters.mqtt]\nurl = "mqtt://127.0.0.1:1884"\nqos = 0\n'
                 'topic_prefix = "fleet/site1"\nprotocol = "3.1.1"\n')
    for extra in ((), MQTT_KEYS):  # with or without the lead's extra_keys
        conf = cfg.load(str(f), env={}, extra_keys=extra)
        e = from_config(conf, env={"INFERSIGHT_MQTT_QOS": "1"})
        assert e is not None
        assert (e.qos, e.protocol, e.status_topic) == (1, "3.1.1", "fleet/site1/box/status")
        assert e.address.port == 1884 and e.client_id == "infersight-box-agent"
    assert from_config(cfg.load(None, env={}), env={}) is None
    assert not mqtt_requested(cfg.load(None, env={}), env={})
    assert mqtt_requested(cfg.load(None, env={}), env={"INFERSIGHT_MQTT_URL": "mqtt://h"})
    f.write_text('[exporters.mqtt]\nurl = "mqtt://h"\n\nqos = 7\n')
    with pytest.raises(ConfigError, match=r"infersight.toml:4: bad value for exporters.mqtt.qos"):
        cfg.load(str(f), env={}, extra_keys=MQTT_KEYS)
    with pytest.raises(ConfigError, match=r"infersight.toml:4: bad value for exporters.mqtt.qos"):
        from_config(cfg.load(str(f), env={}), env={})
    f.write_text('[exporters.mqtt]\nurl = "mqtt://h"\nqoss = 1\n')
    with pytest.raises(ConfigError, match="unknown key 'exporters.mqtt.qoss'"):
        from_config(cfg.load(str(f), env={}), env={})


def test_password_file_and_no_leak(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cr3t-from-file\n")
    conf = cfg.load(None, env={"INFERSIGHT_MQTT_URL": "mqtt://u@127.0.0.1:1",
                               "INFERSIGHT_MQTT_PASSWORD_FILE": str(pw)}, extra_keys=MQTT_KEYS)
    caplog.set_level(logging.DEBUG)
    e = from_config(conf, env={})
    assert e is not None and e._password == "s3cr3t-from-file"
    assert "s3cr3t" not in repr(e.state()) and "s3cr3t" not in caplog.text


async def test_oversized_message_is_dropped_and_counted_not_retried() -> None:
    e = MqttExporter(MqttSettings("mqtt://127.0.0.1:1", host_name="h", max_payload_bytes=300))
    big = oom()
    big.body = "x" * 1000
    await e.export([big])  # not started, no broker: an oversized message never reaches publish
    assert e.state()["oversized_messages"] == 1 and e.state()["published_messages"] == 0


def _mixed_batch(n: int) -> list:  # type: ignore[type-arg]
    """Logs, OOM events and metric snapshots whose groups straddle the chunk sizes tried."""
    from infersight.telemetry import ColdStartProgress

    out: list = []  # type: ignore[type-arg]
    for i in range(n):
        t = 1000 + i // 7  # seven items share a snapshot time
        if i % 3 == 0:
            out.append(MetricItem(AGENT_RES, "hw.gpu.utilization", "gauge", "1", "", t, 1,
                                  [NumberPoint(0.5, {"hw.type": "gpu", "hw.id": "GPU-%d" % (i % 2)})], False))
        elif i % 3 == 1:
            out.append(LogItem(RES, t, 17, "ERROR", "oom %d" % i, {"infersight.oom.class": "capacity"},
                               event_name="oom", origin=Origin("p", i + 1)))
        else:
            out.append(ColdStartProgress(RES, "svc-%d" % (i // 20), 42, t, {"phase": "loading", "i": i}))
    # the first snapshot's time again at the very end: no chunk may end before it
    out.append(MetricItem(AGENT_RES, "hw.gpu.memory.usage", "sum", "By", "", 1000, 1,
                          [NumberPoint(1, {"hw.type": "gpu", "hw.id": "GPU-0"})], False))
    return out


@pytest.mark.parametrize("size", [1, 5, 64])
def test_encoding_chunk_by_chunk_gives_the_whole_batch_messages(size: int) -> None:
    from infersight.exporters.mqtt import split_batch

    batch = _mixed_batch(300)
    whole, skipped = mp.encode_batch(batch, TOPICS)
    chunks = list(split_batch(batch, size))
    assert [it for c in chunks for it in c] == batch, "chunks cover the batch in order"
    parts = [mp.encode_batch(c, TOPICS) for c in chunks]
    assert [m for ms, _ in parts for m in ms] == whole
    assert sum(s for _, s in parts) == skipped
    tail = _mixed_batch(300)[:-1]
    assert len(list(split_batch(tail, size))) > 1, "without a group spanning the batch, it is cut"


def test_a_batch_of_events_only_is_cut_into_equal_chunks() -> None:
    from infersight.exporters.mqtt import split_batch

    batch = [oom(i) for i in range(1, 601)]
    chunks = list(split_batch(batch, 256))
    assert [len(c) for c in chunks] == [256, 256, 88] and [it for c in chunks for it in c] == batch
    assert [m for c in chunks for m in mp.encode_batch(c, TOPICS)[0]] == mp.encode_batch(batch, TOPICS)[0]


_values = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8),
                    st.lists(st.one_of(st.integers(), st.floats(), st.text(max_size=4)), max_size=3))


def _log_payload(item: LogItem, host: str) -> dict[str, Any]:
    """The dict a log message is, built as the other payloads are."""
    o = item.origin
    d = mp._envelope("log", item.resource, host, o.producer if o else mp._producer_of(item.resource),
                     o.seq if o else None)
    d.update({"event.name": item.event_name, "time_unix_nano": item.time_ns, "severity_number": item.severity_number,
              "severity_text": item.severity_text, "body": item.body, "attributes": dict(item.attributes),
              "trace_id": item.trace_id, "span_id": item.span_id, "resource": mp._resource(item.resource)})
    return d


@given(attrs=st.dictionaries(st.text(max_size=6), _values, max_size=4), body=st.text(max_size=10),
       event=st.one_of(st.none(), st.sampled_from(["oom", "memory", "device"])),
       ids=st.one_of(st.none(), st.text(max_size=4)), seq=st.one_of(st.none(), st.integers(1, 2**40)),
       res=st.dictionaries(st.sampled_from(["host.name", "service.name", "process.pid", "x"]), _values, max_size=4))
def test_the_log_fast_path_writes_the_same_bytes_as_the_dict_path(attrs, body, event, ids, seq, res) -> None:  # type: ignore[no-untyped-def]
    item = LogItem(Resource.of(res), 123, 17, "ERROR", body, attrs, ids, ids, event,
                   Origin("p", seq) if seq is not None else None)
    payload, producer, got_seq = mp.log_message(item, "gpu-1")
    want = _log_payload(item, "gpu-1")
    assert payload == mp.dumps(want)
    assert (producer, got_seq) == (want["producer"], want["seq"])


def test_an_event_message_is_the_named_tuple_it_would_be_built_as() -> None:
    """``encode_batch`` makes an event's ``Outgoing`` in C, from its six values in order: it
    must equal the one its constructor makes (a new field would break this first)."""
    item = LogItem(Resource.of({"service.name": "svc"}), 123, 17, "ERROR", "CUDA out of memory", {"k": 1}, None,
                   None, "oom", Origin("p", 7))
    (msg,), skipped = mp.encode_batch([item], mp.Topics.of("infersight", "h"))
    assert skipped == 0 and type(msg) is mp.Outgoing
    assert msg == mp.Outgoing(msg.topic, msg.payload, False, "p", 7) and msg.items == 1
    assert msg.topic == "infersight/h/oom"


class _CountingTopic(str):
    """A topic that counts how often it is compared (the dedupe's work)."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountingTopic.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


class _CountingTopics(mp.Topics):
    def coldstart_progress(self, service: str) -> str:
        return _CountingTopic(super().coldstart_progress(service))


def test_retained_messages_keep_the_newest_per_topic_in_linear_work() -> None:
    from infersight.telemetry import ColdStartProgress, RoutingHint

    n = 3000
    batch: list = []  # type: ignore[type-arg]
    for i in range(n):
        batch.append(ColdStartProgress(RES, "svc-%d" % (i % 1000), 42, i, {"phase": "loading", "i": i}))
        if i % 500 == 0:
            batch.append(oom(i + 1))
    batch.append(RoutingHint(RES, "svc-0", 8000, n, {"weight_ratio": 1.0}))
    batch.append(RoutingHint(RES, "svc-0", 8000, n + 1, None))  # gone: the newest clears the topic
    topics = _CountingTopics("infersight", "gpu-1")
    _CountingTopic.compared = 0
    msgs, skipped = mp.encode_batch(batch, topics)
    assert _CountingTopic.compared <= 2 * n, "dedupe compares each topic a bounded number of times"
    retained = [m for m in msgs if m.retain]
    assert len(retained) == 1000 + 1 and skipped == 0
    assert len({m.topic for m in retained}) == len(retained)
    progress = [json.loads(m.payload) for m in retained[:-1]]
    assert [p["i"] for p in progress] == list(range(n - 1000, n)), "the newest per topic, in batch order"
    assert retained[-1].topic.endswith("/routing/svc-0/8000") and retained[-1].payload == b""
    assert [m.retain for m in msgs].count(False) == 6  # the OOM events stay, in place
