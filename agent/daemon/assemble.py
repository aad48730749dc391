"""Events from producers -> telemetry items (pure: no sockets, no clocks).

Validates every event against schema 1. A malformed event is counted and dropped;
nothing here raises on bad input. The assembler knows spans, logs and metrics; a feature
adds event kinds (:data:`KindHandler`) and takes spans by name (:class:`SpanHandler`: the
cold-start extension keeps stages until their root arrives and closes the roots of
producers that died), both handed in by the agent's extensions.
"""

from __future__ import annotations

import functools
import os
import re
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from infersight import __version__
from infersight.agent.daemon.health import SPECS as SELF_METRICS
from infersight.agent.daemon.identity import PRODUCER_ID
from infersight.agent.daemon.sequence import SeqTracker
from infersight.agent.errors import AgentError
from infersight.metricspec import REGISTRY, MetricSpec, prometheus_name
from infersight.redact import mask_value
from infersight.sanitize import clean_key, clean_text
from infersight.telemetry import (
    Attributes,
    AttrValue,
    Item,
    LogItem,
    MetricItem,
    NumberPoint,
    Origin,
    Resource,
    SpanEvent,
    SpanItem,
)

HEX16 = re.compile(r"[0-9a-f]{16}\Z")
HEX32 = re.compile(r"[0-9a-f]{32}\Z")
MAX_PRODUCERS = 4096
# One uid (root and in-process producers aside) holds at most a quarter of the producer table:
# another user's flood of hellos evicts only its own entries, never yours.
MAX_PRODUCERS_PER_UID = MAX_PRODUCERS // 4
MAX_SPANS_WITH_WAITING_EVENTS = 4096  # per producer: spans not yet arrived that events wait for
MAX_STR = 4096
MAX_ATTRS = 128
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_EVENTS_PER_SPAN = 128
SEVERITY = {"TRACE": 1, "DEBUG": 5, "INFO": 9, "WARN": 13, "WARNING": 13, "ERROR": 17, "FATAL": 21}


def agents_name(name: str) -> bool:
    """Whether a producer's metric name falls in the agent's namespace (``infersight.*``, in any spelling
    Prometheus maps there: ``infersight_request.duration``): another user's gauge of that name had taken
    the type of ``infersight_request_duration_seconds`` and removed every other user's series from the scrape."""
    return name[:10].lower() == "infersight" and (len(name) == 10 or not name[10].isalnum())


def _exposed(spec: MetricSpec) -> set[str]:
    """The names a metric takes in the Prometheus exposition (lower case): its family's and its samples'
    (as ``exporters.prometheus_endpoint.exposition_names``)."""
    prom = prometheus_name(spec).lower()
    if spec.kind == "sum" and spec.monotonic:  # a counter
        base = prom.removesuffix("_total")
        return {base, base + "_total", base + "_created"}
    if spec.kind == "histogram":
        return {prom, prom + "_bucket", prom + "_count", prom + "_sum", prom + "_created"}
    return {prom}


def _otel_key(name: str) -> str:
    return re.sub(r"[^a-z0-9_:]", "_", name.lower())


@functools.lru_cache(maxsize=4)
def _agents_names(declared: int) -> frozenset[str]:
    """The agent's own metrics (its self-metrics, ``process.*`` included, and every other one declared in the
    metric registry: the device and request metrics of the extensions loaded), as OTel names and as every
    name they take in Prometheus. ``declared``: how many the registry holds (a module declares its own at
    import)."""
    out: set[str] = set()
    for spec in (*SELF_METRICS.values(), *REGISTRY):
        out.add(_otel_key(spec.name))
        out |= _exposed(spec)
    return frozenset(out)


@functools.lru_cache(maxsize=4096)
def _reserved(name: str, kind: str, unit: str, declared: int) -> bool:
    if _otel_key(name) in _agents_names(declared):
        return True
    spec = MetricSpec(name, kind, unit, "", monotonic=True)  # type: ignore[arg-type]  # (a producer's sum: a counter)
    return not _exposed(spec).isdisjoint(_agents_names(declared))


def agents_own_metric(name: str, kind: str, unit: str) -> bool:
    """Whether a producer's metric (``kind`` gauge or sum, as a producer sends them: a sum is a counter) is
    one of the agent's own, by its OTel name or by any name it would take in Prometheus: a member's gauge
    ``process.memory.usage`` had joined the agent's ``process_memory_usage_bytes`` as a series of
    ``service_name="infersight-agent"``, and a gauge ``process.cpu.time`` had made a second family
    ``process_cpu_time_seconds``, which made the OpenMetrics parser refuse the whole scrape."""
    return agents_name(name) or _reserved(name, kind, unit, len(REGISTRY))


AGENT_SERVICE = "infersight-agent"  # the agent's own service.name (the daemon's resource)


def agents_service(name: str) -> bool:
    """Whether a service name is the agent's own, in any case or spelling of its separators."""
    return re.sub(r"[^a-z0-9]", "", name.casefold()) == "infersightagent"


class Malformed(AgentError, ValueError):  # noqa: N818 - reads as "raise Malformed(...)"
    """An event or hello that does not follow the schema."""


class ProducerTableFull(AgentError):  # noqa: N818 - reads as "raise ProducerTableFull(...)"
    """A hello turned away for now: its uid holds its share of the producer table and none of it
    may go. Not a bad hello: the socket closes without a ``refuse`` (which would stop the hook
    trying for good: it retries later, and spools meanwhile), and a spool file stays on disk for a
    later scan."""


@dataclass(slots=True)
class Producer:
    id: str
    info: dict[str, Any]
    resource: Resource
    seq: SeqTracker = field(default_factory=SeqTracker)
    malformed: int = 0
    dropped_buffer: int = 0
    dropped_spool: int = 0
    dropped_texts: int = 0  # memory-error texts its logging hook did not send (over its budget)
    events: int = 0
    # Span events derived in the agent (an OOM verdict, say) for a span not yet ended.
    span_events: dict[str, list[SpanEvent]] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # per-producer state of kind and span handlers
    # Its root span (the hello's root_span_id) went out, or was closed for it: set by the span
    # handler that takes roots; events for the root then stay log records.
    root_closed: bool = False
    last_ns: int = 0  # the latest event time seen
    gone: bool = False  # the process has ended; its pending state was freed
    uid: int | None = None  # the kernel's word (SO_PEERCRED, a spool file's owner); None in-process
    # The kernel's word on its process: SO_PEERCRED's pid, in the agent's PID namespace (0: one the agent
    # cannot see); None in-process, or known from a spool file only.
    peer_pid: int | None = None
    hello_cut: int = 0  # hello keys, values and resource attributes cut to their bounds
    spool_vanished: int = 0  # its spool files that someone else removed (the hook rescued them)
    fds_lost: int = 0  # its hooks' descriptors its host closed or took over (os.closerange): reopened

    def attach_event(self, span_id: str | None, event: SpanEvent) -> None:
        """Attach ``event`` to span ``span_id`` when it arrives (bounded)."""
        if not span_id or (self.root_closed and span_id == self.info.get("root_span_id")):
            return  # that span has ended already: the event stays a log record only
        evs = self.span_events.get(span_id)
        if evs is None:
            if len(self.span_events) >= MAX_SPANS_WITH_WAITING_EVENTS:
                return
            evs = self.span_events[span_id] = []
        if len(evs) < MAX_EVENTS_PER_SPAN:
            evs.append(event)


def text_field(v: Any, name: str, limit: int = MAX_STR) -> str:
    """A string field of an event, cut to ``limit``; anything else is :class:`Malformed`."""
    if not isinstance(v, str):
        raise Malformed("%s must be a string" % name)
    return v[:limit]


def hint_key(producer_id: str, uid: int) -> str:
    """A producer's id and its kernel uid, as one key: the sequence state carried across a restart
    is keyed so, and the producer table so keys a second uid's producer of an id. No id holds "@"
    (:data:`~infersight.agent.daemon.identity.PRODUCER_ID`): only ``uid`` can name this key."""
    return "%s@%d" % (producer_id, uid)


def name_field(v: Any, name: str, limit: int = MAX_STR) -> str:
    """A name (a span's, a metric's): a string field on one line, no tab either (:func:`clean_key`)."""
    return clean_key(text_field(v, name, limit), limit)


def uint64_field(v: Any, name: str) -> int:
    """A non-negative 64-bit integer field of an event (not a bool); else :class:`Malformed`."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > INT64_MAX:
        raise Malformed("%s must be a non-negative 64-bit integer" % name)
    return v


def _int64(x: Any) -> bool:
    return type(x) is int and INT64_MIN <= x <= INT64_MAX


def _attr_value(v: Any) -> AttrValue:
    if type(v) is int and not _int64(v):
        return str(v)  # OTLP integers are int64: keep the digits as a string
    if isinstance(v, (str, bool, int, float)):
        return v[:MAX_STR] if isinstance(v, str) else v
    if isinstance(v, list) and v and len(v) <= 256:
        if all(isinstance(x, str) for x in v):
            return [x[:MAX_STR] for x in v]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return list(v) if all(_int64(x) for x in v) else [str(x) for x in v]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            if all(isinstance(x, float) or _int64(x) for x in v):
                return [float(x) for x in v]
            return [str(x) for x in v]
    return str(v)[:MAX_STR]


_SCALARS = (int, float, bool)


def attributes(v: Any) -> Attributes:
    if v is None:
        return {}
    if type(v) is not dict or len(v) > MAX_ATTRS:
        raise Malformed("attributes must be an object of at most %d keys" % MAX_ATTRS)
    # Fast path (the common case): short keys and scalar or short string values, as decoded.
    for k, x in v.items():
        if len(k) > 256 or not (type(x) in _SCALARS or (type(x) is str and len(x) <= MAX_STR)):
            break
        if type(x) is int and not INT64_MIN <= x <= INT64_MAX:
            break
    else:
        return v  # type: ignore[no-any-return]
    out: Attributes = {}
    for k, x in v.items():
        out[str(k)[:256]] = _attr_value(x)
    return out


# A hello is kept for as long as its producer is in the table (MAX_PRODUCERS), connected or
# not: each is bounded, and what is cut is counted (``hello_cut``).
MAX_HELLO_KEYS = 32
MAX_HELLO_KEY = 64
MAX_HELLO_STR = 1024
MAX_HELLO_LIST = 64
MAX_RESOURCE_ENV = 4096  # OTEL_RESOURCE_ATTRIBUTES as sent
MAX_RESOURCE_ATTRS = 64
MAX_RESOURCE_KEY = 128
MAX_RESOURCE_VALUE = 1024
MAX_HELLO_BYTES = 8 << 10  # about what one producer's hello may cost, all included


def parse_resource_env(value: str, cut: list[int] | None = None) -> Attributes:
    """OTEL_RESOURCE_ATTRIBUTES: ``k=v,k2=v2`` with percent-encoded values; at most
    MAX_RESOURCE_ATTRS attributes, keys and values cut to their bounds (each cut counted
    in ``cut[0]``)."""
    out: Attributes = {}
    cuts = 0
    if len(value) > MAX_RESOURCE_ENV:
        value, cuts = value[:MAX_RESOURCE_ENV], cuts + 1
    for part in value.split(","):
        if "=" not in part:
            continue
        k, _, v = part.partition("=")
        k = clean_key(k.strip())
        if not k:
            continue
        if len(out) >= MAX_RESOURCE_ATTRS and k not in out:
            cuts += 1
            continue
        # percent-decoding makes characters the ingest check never saw: clean them too
        v = clean_text(urllib.parse.unquote(v.strip()))
        if len(k) > MAX_RESOURCE_KEY or len(v) > MAX_RESOURCE_VALUE:
            k, v, cuts = k[:MAX_RESOURCE_KEY], v[:MAX_RESOURCE_VALUE], cuts + 1
        out[k] = v
    if cut is not None:
        cut[0] += cuts
    return out


def _bounded_value(v: Any) -> tuple[Any, bool]:
    """A hello value within its bounds, and whether it was cut (nested objects are dropped)."""
    if v is None or isinstance(v, (bool, int, float)):
        return v, False
    if isinstance(v, str):
        return (v[:MAX_HELLO_STR], True) if len(v) > MAX_HELLO_STR else (v, False)
    if isinstance(v, list):
        items = [x[:MAX_HELLO_STR] if isinstance(x, str) else x for x in v[:MAX_HELLO_LIST]
                 if x is None or isinstance(x, (str, bool, int, float))]
        return items, len(items) != len(v) or any(isinstance(x, str) and len(x) > MAX_HELLO_STR for x in v)
    return None, True


def bound_hello(info: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``info`` within the hello bounds (keys, value lengths, total), and how many cuts."""
    out: dict[str, Any] = {}
    cuts, total = 0, 0
    for k, v in info.items():
        if not isinstance(k, str) or len(k) > MAX_HELLO_KEY or len(out) >= MAX_HELLO_KEYS:
            cuts += 1
            continue
        limit = MAX_RESOURCE_ENV if k == "resource_attributes" else None
        if limit is not None and isinstance(v, str):
            value, was_cut = (v[:limit], True) if len(v) > limit else (v, False)
        else:
            value, was_cut = _bounded_value(v)
        size = len(k) + len(repr(value))
        if total + size > MAX_HELLO_BYTES:
            cuts += 1
            continue
        total += size
        cuts += was_cut
        out[k] = value
    return out, cuts


# Resource attributes producer_resource always sets from what it detects (and the kernel's uid).
DETECTED = frozenset({
    "host.name", "process.pid", "process.parent_pid", "process.executable.name", "process.runtime.name",
    "process.runtime.version", "service.instance.id", "process.user.id",
})


def resource_defaults(env: Mapping[str, str]) -> Attributes:
    """The agent's own ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` (``env``: the
    agent's environment, read once at start), as defaults under every producer's resource:
    within the same bounds and cleaning as a producer's, without what the agent detects for
    each producer (:data:`DETECTED`: ``process.user.id`` is the kernel's word); ``service.name``
    is ``OTEL_SERVICE_NAME`` when set (Resource.create() semantics), else the attribute's."""
    out = parse_resource_env(str(env.get("OTEL_RESOURCE_ATTRIBUTES") or ""))
    for k in DETECTED:  # what the agent detects for each producer wins anyway: no slot taken
        out.pop(k, None)
    service = clean_text(str(env.get("OTEL_SERVICE_NAME") or "").strip(), MAX_RESOURCE_VALUE)
    if service:
        out["service.name"] = service
    elif not out.get("service.name"):
        out.pop("service.name", None)
    return out


def producer_resource(info: dict[str, Any], host_name: str | None, cut: list[int] | None = None,
                      defaults: Mapping[str, AttrValue] | None = None, refused: list[int] | None = None) -> Resource:
    """``Resource.create()`` semantics: env attributes, then what we detect, wins. The uid is
    the kernel's (``info["uid"]`` as :meth:`Assembler.hello` sets it), never the hello's.

    ``defaults`` (:func:`resource_defaults`: the agent's own ``OTEL_*`` variables) lie under
    the producer's own attributes: a key the producer set keeps the producer's value, and the
    env-given attributes stay within MAX_RESOURCE_ATTRS (the producer's first). The agent's
    ``service.name`` replaces only the default ``unknown_service:<exe>``: a producer that named
    its service (``OTEL_SERVICE_NAME``, or ``service.name`` in its attributes) keeps it.

    No producer is the agent: a ``service.name`` of ``infersight-agent`` (:func:`agents_service`, however
    it came) becomes ``unknown_service:<exe>``, as if none was set (counted in ``refused[0]``); a member's
    series had sat beside the agent's own under its service name."""
    attrs: Attributes = {
        "telemetry.sdk.name": "infersight",
        "telemetry.sdk.language": "python",
        "telemetry.sdk.version": __version__,
    }
    own = parse_resource_env(str(info.get("resource_attributes") or ""), cut)
    if defaults:
        room = MAX_RESOURCE_ATTRS - len(own)
        for k, v in defaults.items():
            if k == "service.name" or k in own:
                continue
            if room <= 0:
                break
            attrs[k] = v
            room -= 1
    attrs.update(own)
    attrs.pop("process.user.id", None)
    service = str(info.get("service_name") or "") or str(own.get("service.name") or "")
    if not service and defaults:
        service = str(defaults.get("service.name") or "")
    if service and agents_service(clean_key(service, MAX_RESOURCE_VALUE)):
        service = ""
        if refused is not None:
            refused[0] += 1
    attrs["service.name"] = service or "unknown_service:%s" % (info.get("exe") or "python")
    attrs.update(
        {
            "host.name": host_name or str(info.get("host") or ""),
            "process.pid": int(info["pid"]),
            "process.parent_pid": int(info.get("ppid") or 0),
            "process.executable.name": str(info.get("exe") or ""),
            "process.runtime.name": "cpython",
            "process.runtime.version": str(info.get("python") or ""),
            "service.instance.id": str(info["id"]),
        }
    )
    if info.get("argv0"):
        attrs["process.command"] = str(info["argv0"])
    if type(info.get("uid")) is int:
        attrs["process.user.id"] = info["uid"]
    # A resource attribute names something (a service, a host, a command): one line, so that no name can
    # forge lines where an operator reads it (``infersight show`` printed a service name's newline as is).
    return Resource.of({k: (mask_value(k, clean_key(v, MAX_RESOURCE_VALUE)) if isinstance(v, str) else v)
                        for k, v in attrs.items()})


def validate_hello(info: Any, cut: list[int] | None = None) -> dict[str, Any]:
    """The hello's producer object, checked, and bounded (cuts counted in ``cut[0]``)."""
    if not isinstance(info, dict):
        raise Malformed("producer must be an object")
    out, cuts = bound_hello(info)
    if cut is not None:
        cut[0] += cuts
    pid_id = info.get("id")
    if not isinstance(pid_id, str) or not PRODUCER_ID.match(pid_id):
        raise Malformed("producer.id must be 1-128 characters of A-Z a-z 0-9 . _ : -")
    out["id"] = pid_id
    out["pid"] = uint64_field(info.get("pid"), "producer.pid")
    out["start_ns"] = uint64_field(info.get("start_ns"), "producer.start_ns")
    out["acked"] = uint64_field(info.get("acked", 0), "producer.acked")
    out["root_ended"] = info.get("root_ended") is True  # its root went out before this hello
    # when it became ready, and on which TCP port (a hello after readiness: routing knows it after a restart);
    # a value out of range is left out, never a refusal (an optional field)
    ready_ns, ready_port = info.get("ready_ns"), info.get("ready_port")
    out.pop("ready_ns", None)
    out.pop("ready_port", None)
    if type(ready_ns) is int and 0 < ready_ns <= INT64_MAX:
        out["ready_ns"] = ready_ns
        if type(ready_port) is int and 0 < ready_port < 65536:
            out["ready_port"] = ready_port
    for key, pattern in (("trace_id", HEX32), ("root_span_id", HEX16)):
        if not isinstance(info.get(key), str) or not pattern.match(info[key]):
            raise Malformed("producer.%s must be lowercase hex" % key)
    return out


def _event_list(v: Any) -> list[list[Any]]:
    """Span events from the wire: [[name, t_ns, attributes], ...]."""
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > 128 or not all(isinstance(e, list) and len(e) == 3 for e in v):
        raise Malformed("span events must be [[name, t_ns, attributes], ...]")
    return v


def _value_bytes(v: Any) -> int:
    if isinstance(v, str):
        return 49 + len(v)
    if isinstance(v, list):
        return 56 + sum(8 + _value_bytes(x) for x in v)
    return 32


def span_bytes(s: SpanItem) -> int:
    """About what a span holds in memory (strings, attributes, events): for byte bounds."""
    n = 400 + len(s.name) + len(s.error or "")
    for k, v in s.attributes.items():
        n += 100 + len(k) + _value_bytes(v)
    for e in s.events:
        n += 150 + len(e.name) + sum(100 + len(k) + _value_bytes(v) for k, v in e.attributes.items())
    return n


def descendants(root_id: str, spans: list[SpanItem]) -> list[SpanItem]:
    by_parent: dict[str | None, list[SpanItem]] = {}
    for s in spans:
        by_parent.setdefault(s.parent_span_id, []).append(s)
    out: list[SpanItem] = []
    todo = [root_id]
    while todo:
        for child in by_parent.pop(todo.pop(), []):
            out.append(child)
            todo.append(child.span_id)
    return out


# A handler for an event kind beyond schema 1's core: (producer, origin, t_ns, data, out).
# It appends items to ``out`` and raises Malformed on bad data.
KindHandler = Callable[[Producer, Origin, int, dict[str, Any], list[Item]], None]


class SpanHandler(Protocol):
    """A feature's part in span assembly (the cold-start extension's roots and stages).

    It takes the spans whose name starts with one of its ``prefixes``, after they are
    validated, and keeps per-producer state in ``Producer.state`` under a key of its own.
    Quick; raises nothing but :class:`Malformed`.
    """

    prefixes: tuple[str, ...]  # span names it takes (``str.startswith``)

    def span(self, p: Producer, span: SpanItem, t_ns: int, out: list[Item]) -> None:
        """A span it takes: append to ``out`` what goes out (the span itself, as a rule,
        and what it adds), or nothing to drop it."""

    def producer_lost(self, p: Producer) -> list[Item]:
        """``p``'s process has ended (once): the items that close what it left open; free its state."""

    def awaits_end(self, p: Producer) -> bool:
        """Whether :meth:`producer_lost` would still do something for ``p`` (ingest then
        watches its process)."""

    def forget(self, p: Producer) -> None:
        """``p`` leaves the producer table (bounded): fold its counters into the totals."""

    def stats(self, producers: Iterable[Producer]) -> Mapping[str, int]:
        """Its counters over the producers in the table, added to :meth:`Assembler.stats`."""


class Assembler:
    """Owns the producers this agent has seen and turns their events into items."""

    def __init__(
        self,
        host_name: str | None = None,
        handlers: Mapping[str, KindHandler] | None = None,
        span_handlers: Sequence[SpanHandler] = (),
        resource_env: Mapping[str, str] | None = None,
    ) -> None:
        self.host_name = host_name
        self.handlers: dict[str, KindHandler] = dict(handlers or {})
        self.span_handlers = tuple(span_handlers)
        self._prefixes = tuple(p for h in self.span_handlers for p in h.prefixes)
        self.producers: OrderedDict[str, Producer] = OrderedDict()
        # What the previous agent had taken of each producer's numbers (its sequence state, carried across a
        # restart: :meth:`sequences`), taken by the producer's next hello: what it sends again is a duplicate.
        self.resume_hints: dict[str, object] = {}
        self.resumed = 0  # producers whose numbers went on from the previous agent's
        # The same producers by uid, oldest first (the per-uid budget, MAX_PRODUCERS_PER_UID).
        self._by_uid: dict[int | None, OrderedDict[str, None]] = {}
        # Whether a producer has a connection open now (the ingest's liveness, wired in by the
        # agent: the ingest sets it); a connected producer is not evicted.
        self.live: Callable[[str], bool] | None = None
        # The agent's own OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME, read once, here: the
        # defaults under every producer's resource (:func:`producer_resource`).
        self.resource_defaults = resource_defaults(os.environ if resource_env is None else resource_env)
        self.malformed = 0
        self.lost_of_forgotten = 0  # gaps of producers evicted from the table
        self.gaps_forgotten_of_forgotten = 0
        self.identity_conflicts = 0  # a producer id presented by a second uid: kept apart
        self.hello_cut = 0  # hello keys, values and resource attributes cut to their bounds
        self.producers_evicted = 0  # producers that left the table for a newer one (all reasons)
        self.producers_evicted_uid_budget = 0  # of those, a uid at its budget evicting its own oldest
        self.producers_evicted_protected = 0  # of those, connected or in a cold start: nothing else could go
        self.over_uid_producers = 0  # hellos refused: the uid held its budget, none of it could go
        self.metric_names_reserved = 0  # producers' metrics refused: named as the agent's own (malformed too)
        self.service_names_refused = 0  # hellos whose service.name claimed the agent's: renamed

    def sequences(self) -> dict[str, object]:
        """Each producer's sequence state, for the next agent (:attr:`resume_hints`), keyed by its id and
        its kernel uid (:func:`hint_key`): only a hello of the same id from the same uid takes it, so another
        user who says hello with a victim's id (first, in either agent) neither takes nor gives a state."""
        out: dict[str, object] = {}
        for p in self.producers.values():
            st = p.seq.state()
            if st is not None and p.uid is not None:
                out[hint_key(str(p.info.get("id")), p.uid)] = st
        return out

    def hello(self, raw: Any, uid: int | None = None) -> Producer:
        """The producer this hello names, made on first sight. ``uid`` is the kernel's word
        (the peer's SO_PEERCRED, a spool file's owner): the hello's own ``uid`` is replaced
        by it, and a producer id already held by another uid gets its own entry,
        ``<id>@<uid>`` (:func:`hint_key`), so that two uids never share one sequence space
        (counted). No id can spell that key (:func:`validate_hello`): a spool file of one uid
        had said hello as ``<victim id>@<victim uid>``, and the victim's events then counted as
        its duplicates. A producer made in-process (no uid: tests, ``launch``'s own) matches any
        uid (:meth:`find`).

        The table is bounded (:data:`MAX_PRODUCERS`) and so is each uid's part of it
        (:data:`MAX_PRODUCERS_PER_UID`, root and in-process producers aside): a new producer
        of a uid at its budget evicts that uid's oldest entry that is neither connected nor
        waiting for its process's end (a cold start open, stages kept); when it has none, the
        hello is refused (:class:`ProducerTableFull`, counted as ``over_uid_producers``)."""
        cut = [0]
        info = validate_hello(raw, cut)
        info.pop("uid", None)
        if uid is not None:
            info["uid"] = uid
        key = info["id"]
        p = self.find(key, uid)
        if p is None and uid is not None and key in self.producers:
            self.identity_conflicts += 1  # held by another uid: this one's entry is its own
            key = hint_key(key, uid)
        if p is None:
            self._make_room(uid)
            refused = [0]
            p = Producer(key, info, producer_resource(info, self.host_name, cut, self.resource_defaults, refused),
                         uid=uid)
            self.service_names_refused += refused[0]
            info.pop("resource_attributes", None)  # it lives on in the resource: not kept twice
            p.hello_cut = cut[0]
            self.hello_cut += cut[0]
            p.seq.resume_after(info["acked"])
            hint = self.resume_hints.pop(hint_key(info["id"], uid), None) if uid is not None else None
            if hint is not None and p.seq.restore(hint, info["acked"]):
                self.resumed += 1
            self.producers[p.id] = p
            self._by_uid.setdefault(uid, OrderedDict())[p.id] = None
        else:
            self.producers.move_to_end(p.id)
            self._by_uid.setdefault(p.uid, OrderedDict())[p.id] = None
            self._by_uid[p.uid].move_to_end(p.id)
            p.gone = False
            p.info["root_ended"] = p.info.get("root_ended") or info["root_ended"]
        return p

    def find(self, producer_id: str, uid: int | None) -> Producer | None:
        """The producer of ``producer_id`` from ``uid`` (the kernel's word): its own entry
        (``<id>@<uid>`` once another uid held the id first, else the id), never another uid's.
        In-process producers (no uid) and an in-process caller (``uid`` None) match any uid."""
        if uid is not None:
            p = self.producers.get(hint_key(producer_id, uid))
            if p is not None:
                return p
        p = self.producers.get(producer_id)
        if p is not None and p.uid is not None and uid is not None and p.uid != uid:
            return None
        return p

    # -- the producer table's bounds -------------------------------------------------------

    def protected(self, p: Producer) -> bool:
        """Whether ``p`` must stay while another entry could go: it is connected, or its
        process's end still matters (a cold start open, stages kept, events waiting)."""
        return (self.live is not None and self.live(p.id)) or self.awaits_end(p)

    def _oldest_evictable(self, ids: Iterable[str]) -> str | None:
        for pid in ids:
            p = self.producers.get(pid)
            if p is not None and not self.protected(p):
                return pid
        return None

    def _make_room(self, uid: int | None) -> None:
        """Before a producer of ``uid`` is added: its uid's budget, then the table's bound."""
        mine = self._by_uid.get(uid)
        if uid not in (None, 0) and mine is not None and len(mine) >= MAX_PRODUCERS_PER_UID:
            victim = self._oldest_evictable(mine)
            if victim is None:
                self.over_uid_producers += 1
                raise ProducerTableFull(
                    "uid %s holds its share of the producer table (%d producers), all connected or in "
                    "a cold start" % (uid, MAX_PRODUCERS_PER_UID))
            self.producers_evicted_uid_budget += 1
            self._evict(victim)
        if len(self.producers) < MAX_PRODUCERS:
            return
        # The table is full: the uid holding the most entries gives up its oldest that may go;
        # a connected producer, or one in its cold start, goes only when none other could.
        heaviest = sorted(self._by_uid.items(), key=lambda kv: len(kv[1]), reverse=True)
        for _uid, ids in heaviest:
            victim = self._oldest_evictable(ids)
            if victim is not None:
                self._evict(victim)
                return
        self.producers_evicted_protected += 1
        self._evict(next(iter(heaviest[0][1])))

    def _evict(self, producer_id: str) -> None:
        old = self.producers.pop(producer_id)
        ids = self._by_uid.get(old.uid)
        if ids is not None:
            ids.pop(producer_id, None)
            if not ids:
                del self._by_uid[old.uid]
        self.producers_evicted += 1
        self.lost_of_forgotten += old.seq.lost
        self.gaps_forgotten_of_forgotten += old.seq.gaps_forgotten
        for h in self.span_handlers:
            h.forget(old)

    def events(self, p: Producer, raw_events: Any) -> list[Item]:
        """Items from one batch. Bad events are counted on the producer and skipped."""
        if not isinstance(raw_events, list):
            p.malformed += 1
            self.malformed += 1
            return []
        items: list[Item] = []
        tracker = p.seq
        accepted = 0
        for ev in raw_events:
            try:
                if type(ev) is not list or len(ev) != 4:
                    raise Malformed("event must be [seq, t_ns, kind, data]")
                seq, t_ns, kind, data = ev
                if type(seq) is not int or seq < 1:
                    raise Malformed("seq must be a positive integer")
                if seq == tracker.next_expected:  # the common case, inlined
                    tracker.next_expected = seq + 1
                elif not tracker.observe(seq):
                    continue  # duplicate after a resend
                if type(t_ns) is not int or t_ns < 0 or t_ns > INT64_MAX:
                    raise Malformed("t_ns must be a non-negative integer")
                if t_ns > p.last_ns:  # noqa: PLR1730 - hot loop: a compare beats a call
                    p.last_ns = t_ns
                if type(data) is not dict:
                    raise Malformed("data must be an object")
                self._event(p, Origin(p.id, seq), t_ns, kind, data, items)
                accepted += 1
            except Malformed:
                p.malformed += 1
                self.malformed += 1
        p.events += accepted
        return items

    def _event(
        self, p: Producer, origin: Origin, t_ns: int, kind: Any, d: dict[str, Any], out: list[Item]
    ) -> None:
        if kind == "span":
            self._span(p, origin, t_ns, d, out)
        elif kind == "log":
            sev = d.get("sev", "INFO")
            body = d.get("body", "")
            span_id = d.get("sp")
            name = d.get("name") or None
            if (
                type(body) is str and len(body) <= MAX_STR and sev in SEVERITY and span_id is None
                and (name is None or (type(name) is str and len(name) <= 64))
            ):  # fast path: nothing to normalise
                out.append(LogItem(p.resource, t_ns, SEVERITY[sev], sev, body, attributes(d.get("a")),
                                   None, None, name, origin))
                return
            sev = text_field(sev, "sev", 16).upper()
            out.append(
                LogItem(
                    p.resource, t_ns, SEVERITY.get(sev, 9), sev, text_field(d.get("body", ""), "body"),
                    attributes(d.get("a")),
                    p.info["trace_id"] if isinstance(span_id, str) and HEX16.match(span_id) else None,
                    span_id if isinstance(span_id, str) and HEX16.match(span_id) else None,
                    text_field(d.get("name", ""), "name", 64) or None, origin,
                )
            )
        elif kind == "metric":
            v = d.get("v")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise Malformed("metric value must be a number")
            k = d.get("k", "gauge")
            if k not in ("gauge", "sum"):
                raise Malformed("metric kind must be gauge or sum")
            name = name_field(d.get("n"), "n", 255)
            unit = text_field(d.get("u", ""), "u", 32)
            if agents_own_metric(name, k, unit):
                self.metric_names_reserved += 1
                raise Malformed("metric %r is the agent's own (infersight.*, or one of its self-metrics)" % name)
            out.append(
                MetricItem(
                    p.resource, name, k, unit, "",
                    t_ns, int(p.info["start_ns"]), [NumberPoint(v, attributes(d.get("a")))],
                )
            )
        elif isinstance(kind, str) and kind in self.handlers:
            self.handlers[kind](p, origin, t_ns, d, out)
        elif kind == "drops":
            p.dropped_buffer = max(p.dropped_buffer, uint64_field(d.get("buffer", 0), "buffer"))
            p.dropped_spool = max(p.dropped_spool, uint64_field(d.get("spool", 0), "spool"))
            p.spool_vanished = max(p.spool_vanished, uint64_field(d.get("vanished", 0), "vanished"))
            p.dropped_texts = max(p.dropped_texts, uint64_field(d.get("texts", 0), "texts"))
            p.fds_lost = max(p.fds_lost, uint64_field(d.get("fds", 0), "fds"))
        else:
            raise Malformed("unknown event kind %r" % (kind,))

    def _span(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], out: list[Item]) -> None:
        name = name_field(d.get("n"), "n", 255)
        span_id = d.get("id")
        if not isinstance(span_id, str) or not HEX16.match(span_id):
            raise Malformed("span id must be 16 lowercase hex digits")
        parent = d.get("p")
        if parent is not None and (not isinstance(parent, str) or not HEX16.match(parent)):
            raise Malformed("parent span id must be 16 lowercase hex digits")
        trace = d.get("tr") or p.info["trace_id"]
        if not isinstance(trace, str) or not HEX32.match(trace):
            raise Malformed("trace id must be 32 lowercase hex digits")
        start = uint64_field(d.get("s"), "s")
        end = uint64_field(d.get("e", t_ns), "e")
        if end < start:
            raise Malformed("span ends before it starts")
        err = d.get("err")
        events = [SpanEvent(text_field(e[0], "event name", 255), uint64_field(e[1], "event time"), attributes(e[2]))
                  for e in _event_list(d.get("ev"))]
        events += p.span_events.pop(span_id, [])
        span = SpanItem(
            p.resource, trace, span_id, parent, name, start, end, attributes(d.get("a")), events,
            str(err)[:MAX_STR] if err is not None else None, origin,
        )
        if name.startswith(self._prefixes):  # one test for the spans no handler takes
            for h in self.span_handlers:
                if name.startswith(h.prefixes):
                    h.span(p, span, t_ns, out)
                    return
        out.append(span)

    def awaits_end(self, p: Producer) -> bool:
        """Whether the end of ``p``'s process still matters: events wait for a span, or a span
        handler would close something for it (:meth:`producer_lost`)."""
        return bool(p.span_events) or any(h.awaits_end(p) for h in self.span_handlers)

    def producer_lost(self, p: Producer) -> list[Item]:
        """The producer's process has ended: what the span handlers close for it (a cold
        start it never ended), once; then its pending state is freed. Returns the items to
        export."""
        out: list[Item] = []
        if p.gone:
            return out
        p.gone = True
        for h in self.span_handlers:
            out.extend(h.producer_lost(p))
        p.span_events = {}
        return out

    def lost_total(self) -> int:
        return self.lost_of_forgotten + sum(p.seq.lost for p in self.producers.values())

    def gaps_forgotten_total(self) -> int:
        return self.gaps_forgotten_of_forgotten + sum(p.seq.gaps_forgotten for p in self.producers.values())

    def stats(self) -> dict[str, int]:
        """For ``infersight status --json`` and the agent's own metrics: its counters, and
        those of its span handlers."""
        out = {"producers": len(self.producers)}
        for h in self.span_handlers:
            out.update(h.stats(self.producers.values()))
        out.update({
            "gaps_forgotten": self.gaps_forgotten_total(),
            "identity_conflicts": self.identity_conflicts,
            "hello_cut": self.hello_cut,
            "producers_evicted": self.producers_evicted,
            "producers_evicted_uid_budget": self.producers_evicted_uid_budget,
            "producers_evicted_protected": self.producers_evicted_protected,
            "over_uid_producers": self.over_uid_producers,
            "metric_names_reserved": self.metric_names_reserved,
            "service_names_refused": self.service_names_refused,
        })
        return out
