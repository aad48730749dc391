"""MQTT topic tree and JSON payloads for telemetry items (pure: no sockets, no clocks).

Topic tree under ``<prefix>/<host>/``:

=========================  =======  ==========================================================
topic                      retained  payload
=========================  =======  ==========================================================
``status``                 yes      ``online`` / ``offline`` (plain text; last will ``offline``)
``birth``                  yes      :func:`birth_payload` (daemon only)
``launch/<pid>/status``    yes      ``online`` / last will ``offline``; cleared on clean exit
``launch/<pid>/birth``     no       :func:`birth_payload` of an embedded ``launch`` agent
``coldstart``              no       one completed cold start: root span + every stage, and
                                    ``stage_durations_s`` (the seconds the duration histogram
                                    observes: per stage, ``unattributed``, ``total``)
``coldstart/<svc>/progress`` yes    a warming process: stage, elapsed, ETA; cleared (empty) at readiness/exit
``routing/<svc>/<port>``   yes      a serving instance's routing hint (weight ratio, settled, the
                                    agent-check reply); cleared (empty) when the instance is gone
``oom``                    no       an OOM result (log record, ``infersight.oom.*`` attributes)
``memory``                 no       memory events and memory metric snapshots of producers
``device/<hw.id>``         no       one device's metric snapshot (or a device event)
``agent``                  no       the agent's own health metrics (one snapshot per sample)
=========================  =======  ==========================================================

Every JSON payload carries ``schema`` (:data:`SCHEMA_VERSION`), ``type``, ``producer`` and
``seq`` (the dedupe key of an event: QoS 1 is at-least-once), ``host.name`` and ``resource``
with OTel attribute names, so one dashboard reads MQTT and OTLP alike. Metric snapshots have
no producer sequence number (``seq`` is null); they are idempotent, keyed by topic and
``time_unix_nano``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from infersight.coldstart_stages import ended_by, stage_durations
from infersight.telemetry import (
    Attributes,
    ColdStart,
    ColdStartProgress,
    HistogramPoint,
    Item,
    LogItem,
    MetricItem,
    NumberPoint,
    Resource,
    RoutingHint,
    SpanItem,
)

SCHEMA_VERSION = 1
ONLINE = b"online"
OFFLINE = b"offline"
EVENT_FAMILIES = ("coldstart", "oom", "memory", "device", "agent")
# Characters percent-encoded in a topic level: '%' itself (so that the mapping is one to one),
# the wildcards and the level separator, whitespace, control characters (mosquitto drops a
# client that publishes C0/C1 or DEL in a topic) and lone surrogates (not UTF-8 at all).
_UNSAFE = re.compile("[%+#/\\s\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
MAX_LEVEL = 128  # characters of one topic level; a longer value keeps a prefix and a hash
AGENT_RESOURCE_MARK = "infersight.agent.mode"  # set on the agent's own resource only


class Outgoing(NamedTuple):
    """One MQTT message to publish: topic, UTF-8 JSON bytes, retain flag, dedupe key.

    A named tuple: one is made per event, and a tuple is made several times faster than a
    frozen dataclass."""

    topic: str
    payload: bytes
    retain: bool = False
    producer: str | None = None
    seq: int | None = None
    items: int = 1  # telemetry items this message carries (for counters)


def _percent(m: re.Match[str]) -> str:
    return "".join("%%%02X" % b for b in m.group().encode("utf-8", "surrogatepass"))


def topic_level(value: str) -> str:
    """A value as one topic level, one to one: no wildcard, no '/', no control character,
    valid UTF-8, not starting with '$'.

    Unsafe characters (and '%') are percent-encoded as their UTF-8 bytes, so ``m+l``, ``m#l``
    and ``m\\x00l`` stay three topics (``m%2Bl``, ``m%23l``, ``m%00l``) and an ordinary name
    (``eta-svc``, ``GPU-5c1a``) is unchanged. The empty value is ``%``; a value longer than
    :data:`MAX_LEVEL` keeps its first characters and ``%~`` with a hash of the whole (neither
    form can come out of the encoding otherwise)."""
    if not value:
        return "%"
    out = _UNSAFE.sub(_percent, value)
    if out.startswith("$"):
        out = "%24" + out[1:]
    if len(out) > MAX_LEVEL:
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        head = out[: MAX_LEVEL - 18]
        cut = head.rfind("%", len(head) - 2)  # never cut an escape in two
        out = (head[:cut] if cut >= 0 else head) + "%~" + digest
    return out


def validate_prefix(prefix: str) -> str:
    """A topic prefix may have several levels, but no wildcard, no empty level, no '$' start."""
    p = prefix.strip().strip("/")
    if not p:
        raise ValueError("topic prefix must not be empty")
    if any(c in p for c in "+#") or _CONTROL.search(p) or p.startswith("$") or "//" in p:
        raise ValueError("topic prefix %r must not contain '+', '#', '//', a control character or start "
                         "with '$'" % prefix)
    return p


@dataclass(frozen=True, slots=True)
class Topics:
    """The topic names of one agent on one host."""

    prefix: str
    host: str

    @staticmethod
    def of(prefix: str, host: str) -> Topics:
        return Topics(validate_prefix(prefix), topic_level(host))

    @property
    def base(self) -> str:
        return "%s/%s" % (self.prefix, self.host)

    @property
    def status(self) -> str:
        return self.base + "/status"

    @property
    def birth(self) -> str:
        return self.base + "/birth"

    def launch_status(self, pid: int) -> str:
        return "%s/launch/%d/status" % (self.base, pid)

    def launch_birth(self, pid: int) -> str:
        return "%s/launch/%d/birth" % (self.base, pid)

    def family(self, name: str) -> str:
        return "%s/%s" % (self.base, name)

    def device(self, hw_id: str) -> str:
        return "%s/device/%s" % (self.base, topic_level(hw_id))

    def coldstart_progress(self, service: str) -> str:
        return "%s/coldstart/%s/progress" % (self.base, topic_level(service))

    def routing(self, service: str, port: int) -> str:
        return "%s/routing/%s/%d" % (self.base, topic_level(service), port)


# -- JSON ------------------------------------------------------------------------------------


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_finite(x) for x in v]
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _json_text_function() -> Callable[[Any], str]:
    """``_ENCODER.encode`` (ValueError on NaN), with one C encoder made once: ``encode`` makes
    a new one on every call, which is half the cost of a small dict. No cycle check: our
    payloads are trees."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _ENCODER.encode
    encode = make(None, _ENCODER.default, json.encoder.encode_basestring,  # type: ignore[attr-defined]
                  None, ":", ",", False, False, False)
    return lambda obj: "".join(encode(obj, 0))


_json_text = _json_text_function()


def dumps(obj: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON; NaN and infinities become null (they are not JSON)."""
    try:
        return _json_text(obj).encode()
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), ensure_ascii=False).encode()


def _resource(r: Resource) -> dict[str, Any]:
    return dict(r.as_dict())


def _producer_of(r: Resource) -> str | None:
    inst = r.get("service.instance.id")
    if isinstance(inst, str) and inst:
        return inst
    name, pid = r.get("service.name"), r.get("process.pid")
    if name is not None and pid is not None:
        return "%s:%s" % (name, pid)
    return None


def _envelope(kind: str, resource: Resource, host: str, producer: str | None, seq: int | None) -> dict[str, Any]:
    res = _resource(resource)
    return {
        "schema": SCHEMA_VERSION,
        "type": kind,
        "producer": producer,
        "seq": seq,
        "host.name": res.get("host.name") or host,
        "service.name": res.get("service.name"),
        "process.pid": res.get("process.pid"),
    }


def span_dict(s: SpanItem) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": s.name,
        "trace_id": s.trace_id,
        "span_id": s.span_id,
        "parent_span_id": s.parent_span_id,
        "start_time_unix_nano": s.start_ns,
        "end_time_unix_nano": s.end_ns,
        "duration_s": (s.end_ns - s.start_ns) / 1e9,
        "attributes": dict(s.attributes),
        "error": s.error,
    }
    if s.events:
        d["events"] = [{"name": e.name, "time_unix_nano": e.time_ns, "attributes": e.attributes} for e in s.events]
    return d


def coldstart_payload(cs: ColdStart, host: str) -> dict[str, Any]:
    o = cs.root.origin
    d = _envelope(
        "coldstart", cs.root.resource, host, o.producer if o else _producer_of(cs.root.resource), o.seq if o else None
    )
    d["time_unix_nano"] = cs.root.end_ns
    d["trace_id"] = cs.root.trace_id
    d["root"] = span_dict(cs.root)
    d["stages"] = [span_dict(s) for s in cs.stages]
    # The values the infersight.coldstart.duration histogram observes, for MQTT-side aggregation.
    d["stage_durations_s"] = stage_durations(cs)
    d["ended_by"] = ended_by(cs)
    d["resource"] = _resource(cs.root.resource)
    return d


# -- the log fast path: OOM and memory events are most of the messages -------------------------

_encode_str = json.encoder.encode_basestring  # type: ignore[attr-defined]  # the C one, ensure_ascii=False


def _scalar(v: Any) -> str:
    """One JSON value as :func:`dumps` writes it, without an encoder per call for the usual types."""
    if v is None:
        return "null"
    t = type(v)
    if t is str:
        return str(_encode_str(v))
    if t is int:
        return int.__repr__(v)
    if t is bool:
        return "true" if v else "false"
    if t is float:
        return float.__repr__(v) if math.isfinite(v) else "null"
    return dumps(v).decode() if isinstance(v, dict) else dumps({"v": v}).decode()[5:-1]


# Per Resource: its envelope fields and its JSON, held with the object (so its id stays its own).
_resource_parts: dict[int, tuple[Resource, str, str, str]] = {}


def _parts_of(r: Resource, host: str) -> tuple[str, str]:
    e = _resource_parts.get(id(r))
    if e is None or e[0] is not r or e[1] != host:
        res = r.as_dict()
        env = '"host.name":%s,"service.name":%s,"process.pid":%s' % (
            _scalar(res.get("host.name") or host), _scalar(res.get("service.name")), _scalar(res.get("process.pid")))
        if len(_resource_parts) >= 1024:
            _resource_parts.clear()
        e = _resource_parts[id(r)] = (r, host, env, dumps(res).decode())
    return e[2], e[3]


def _attributes_json(attrs: Attributes) -> str:
    if not attrs:
        return "{}"
    try:
        return _json_text(attrs)
    except ValueError:  # NaN or an infinity
        return dumps(attrs).decode()


def log_message(item: LogItem, host: str) -> tuple[bytes, str | None, int | None]:
    """A log record's message, (payload, producer, seq): the envelope, the record's fields and
    its resource, the same bytes :func:`dumps` writes for them as a dict (a test holds them
    equal), built directly.

    The per-event cost of the MQTT path: the fields whose types the item fixes are written
    without :func:`_scalar`'s dispatch (strings through the C string encoder, inline), and
    the text is encoded once."""
    o = item.origin
    producer, seq = (o.producer, o.seq) if o else (_producer_of(item.resource), None)
    env, res = _parts_of(item.resource, host)
    name, sev, trace, span = item.event_name, item.severity_text, item.trace_id, item.span_id
    attrs = item.attributes
    text = (
        f'{{"schema":{SCHEMA_VERSION},"type":"log","producer":{"null" if producer is None else _encode_str(producer)},'
        f'"seq":{"null" if seq is None else int.__repr__(seq)},{env},'
        f'"event.name":{"null" if name is None else _encode_str(name)},"time_unix_nano":{int.__repr__(item.time_ns)},'
        f'"severity_number":{int.__repr__(item.severity_number)},'
        f'"severity_text":{"null" if sev is None else _encode_str(sev)},"body":{_scalar(item.body)},'
        f'"attributes":{_attributes_json(attrs) if attrs else "{}"},'
        f'"trace_id":{"null" if trace is None else _encode_str(trace)},'
        f'"span_id":{"null" if span is None else _encode_str(span)},"resource":{res}}}'
    )
    return text.encode(), producer, seq


def _point(p: NumberPoint | HistogramPoint) -> dict[str, Any]:
    if isinstance(p, HistogramPoint):
        return {
            "count": p.count, "sum": p.sum, "min": p.min, "max": p.max, "bounds": p.bounds,
            "bucket_counts": p.bucket_counts, "attributes": dict(p.attributes),
        }  # fmt: skip
    return {"value": p.value, "attributes": dict(p.attributes)}


def _metric_family(m: MetricItem, point_attrs: Attributes) -> str | None:
    hw = point_attrs.get("hw.id")
    if isinstance(hw, str) and hw:
        return "device"
    if m.resource.get(AGENT_RESOURCE_MARK) is not None:
        return "agent"
    if "memory" in m.name:
        return "memory"
    return None


_FAMILY_OF = {name: name for name in EVENT_FAMILIES}


def log_family(item: LogItem) -> str | None:
    name = item.event_name
    fam = _FAMILY_OF.get(name) if name else None  # the usual spelling: one lookup
    if fam is None and name:
        fam = _FAMILY_OF.get(name.strip().lower())
    return fam


def progress_payload(item: ColdStartProgress, host: str) -> dict[str, Any]:
    """The retained progress message: the fields of ``status --json``, plus the envelope."""
    assert item.state is not None
    return {"schema": SCHEMA_VERSION, "type": "coldstart_progress", "host.name": host,
            "time_unix_nano": item.time_ns, **item.state}


def routing_payload(item: RoutingHint, host: str) -> dict[str, Any]:
    """The retained routing hint of one instance: the agent's state for it, plus the envelope."""
    assert item.state is not None
    return {"schema": SCHEMA_VERSION, "type": "routing", "host.name": host, "time_unix_nano": item.time_ns,
            "service.name": item.service, "server.port": item.port, **item.state}


_new_tuple = tuple.__new__  # makes a named tuple without its Python-level __new__ (once per event)


class _Snapshot:
    __slots__ = ("metrics", "resource", "time_ns")

    def __init__(self, resource: Resource, time_ns: int) -> None:
        self.resource = resource
        self.time_ns = time_ns
        self.metrics: dict[str, dict[str, Any]] = {}


def _retain(out: list[Outgoing | tuple[str, _Snapshot] | None], retained: dict[str, int], msg: Outgoing) -> None:
    """Append a retained message; the older one of its topic in this batch, if any, goes."""
    before = retained.get(msg.topic)
    if before is not None:
        out[before] = None
    retained[msg.topic] = len(out)
    out.append(msg)


def encode_batch(batch: Sequence[Item], topics: Topics) -> tuple[list[Outgoing], int]:
    """The messages for one batch, in batch order, and the count of items with no topic.

    Cold starts, OOM/memory/device/agent log records and metric snapshots are published;
    plain spans (the root and stages travel inside their ``ColdStart``) and other items are
    not. Metrics of one batch that share topic, resource and time form one snapshot message.
    """
    out: list[Outgoing | tuple[str, _Snapshot] | None] = []
    # Retained state: only the newest per topic matters, so an older one in the same batch
    # is dropped (its slot emptied) and can never overwrite it on the broker.
    retained: dict[str, int] = {}  # topic -> the slot of its newest retained message
    snapshots: dict[tuple[str, Resource, int], _Snapshot] = {}
    skipped = 0
    host = topics.host
    family_topics: dict[str, str] = {}
    for item in batch:
        if isinstance(item, LogItem):  # first: most items are events
            fam = log_family(item)
            if fam is None:
                skipped += 1
                continue
            payload, producer, seq = log_message(item, host)
            if fam == "device":
                hw = item.attributes.get("hw.id")
                topic = topics.device(hw if isinstance(hw, str) and hw else "unknown")
            else:
                topic = family_topics.get(fam) or family_topics.setdefault(fam, topics.family(fam))
            out.append(_new_tuple(Outgoing, (topic, payload, False, producer, seq, 1)))  # Outgoing(...), in C
        elif isinstance(item, ColdStartProgress):
            topic = topics.coldstart_progress(item.service)
            payload = b"" if item.state is None else dumps(progress_payload(item, host))
            _retain(out, retained, Outgoing(topic, payload, True, None, None))
        elif isinstance(item, RoutingHint):
            topic = topics.routing(item.service, item.port)
            payload = b"" if item.state is None else dumps(routing_payload(item, host))
            _retain(out, retained, Outgoing(topic, payload, True, None, None))
        elif isinstance(item, ColdStart):
            d = coldstart_payload(item, host)
            out.append(
                Outgoing(topics.family("coldstart"), dumps(d), False, d["producer"], d["seq"], 1 + len(item.stages))
            )
        elif isinstance(item, MetricItem):
            routed = False
            for p in item.points:
                fam = _metric_family(item, p.attributes)
                if fam is None:
                    continue
                routed = True
                topic = topics.device(str(p.attributes["hw.id"])) if fam == "device" else topics.family(fam)
                key = (topic, item.resource, item.time_ns)
                snap = snapshots.get(key)
                if snap is None:
                    snap = snapshots[key] = _Snapshot(item.resource, item.time_ns)
                    out.append((topic, snap))
                m = snap.metrics.get(item.name)
                if m is None:
                    m = snap.metrics[item.name] = {
                        "name": item.name, "kind": item.kind, "unit": item.unit,
                        "monotonic": item.monotonic, "start_time_unix_nano": item.start_ns, "points": [],
                    }  # fmt: skip
                m["points"].append(_point(p))
            if not routed:
                skipped += 1
        else:  # SpanItem: cold-start spans travel inside ColdStart; others have no topic
            skipped += 1
    msgs: list[Outgoing] = []
    for o in out:
        if o is None:  # a retained message a newer one replaced
            continue
        if isinstance(o, Outgoing):
            msgs.append(o)
            continue
        topic, snap = o
        producer = _producer_of(snap.resource)
        d = _envelope("metrics", snap.resource, host, producer, None)
        d["time_unix_nano"] = snap.time_ns
        if "/device/" in topic:
            d["hw.id"] = topic.rsplit("/", 1)[1]
        d["metrics"] = list(snap.metrics.values())
        d["resource"] = _resource(snap.resource)
        msgs.append(Outgoing(topic, dumps(d), False, producer, None, len(snap.metrics)))
    return msgs, skipped


def birth_payload(
    *,
    host: str,
    version: str,
    mode: str,
    pid: int,
    client_id: str,
    started_ns: int,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The retained birth certificate: who publishes here, which devices, which schema."""
    d: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "type": "birth",
        "host.name": host,
        "service.name": "infersight-agent",
        "service.version": version,
        "infersight.agent.mode": mode,
        "process.pid": pid,
        "client_id": client_id,
        "started_unix_nano": started_ns,
        "topic_families": list(EVENT_FAMILIES),
        "devices": [],
    }
    if extra:
        d.update({k: v for k, v in extra.items() if k not in ("schema", "type")})
    return d


def decode(payload: bytes) -> dict[str, Any]:
    """Parse one event payload (for subscribers and tests); raises ValueError if not ours."""
    d = json.loads(payload)
    if not isinstance(d, dict) or not isinstance(d.get("schema"), int):
        raise ValueError("not an infersight payload (no schema)")
    return d
