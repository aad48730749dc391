"""Events from producers -> telemetry items (pure: no sockets, no clocks).

Validates every event against schema 1. A malformed event is counted and dropped;
nothing here raises on bad input. Cold-start stage spans are kept (bounded) until
their root arrives, so the root can carry the time that no stage covers.
"""

from __future__ import annotations

import re
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infersight import __version__
from infersight.agent.daemon.checkpoint import Checkpoint, gap_spans
from infersight.agent.daemon.sequence import SeqTracker
from infersight.agent.errors import AgentError
from infersight.coldstart_stages import covered_ns, merge, named_intervals
from infersight.redact import mask_value
from infersight.sanitize import clean_key, clean_text
from infersight.telemetry import (
    Attributes,
    AttrValue,
    ColdStart,
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
MAX_PENDING_SPANS = 4096
MAX_STR = 4096
MAX_ATTRS = 128
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_EVENTS_PER_SPAN = 128
MAX_OPEN_STAGES = 64  # open runs in one cold-start checkpoint
MAX_TICK_SAMPLES = 4096  # samples in one checkpoint (about 40 s at 10 ms: a tick carries 100 ms)
DEFAULT_MAX_PENDING_BYTES = 8 << 20  # per producer: stage spans waiting for their root
SEVERITY = {"TRACE": 1, "DEBUG": 5, "INFO": 9, "WARN": 13, "WARNING": 13, "ERROR": 17, "FATAL": 21}


class Malformed(AgentError, ValueError):  # noqa: N818 - reads as "raise Malformed(...)"
    """An event or hello that does not follow the schema."""



# ready_wait sources at which the hooks end a root (hooks/_coldstart.py READY_SIGNALS)
# (and "fork": a forked worker's readiness, sent when it enters its loop, for when it is killed later)
ROOT_ENDING_READY = frozenset({"mark_ready", "listen", "ready_url", "listening_socket", "stage_rule", "fork"})

@dataclass(slots=True)
class Producer:
    id: str
    info: dict[str, Any]
    resource: Resource
    seq: SeqTracker = field(default_factory=SeqTracker)
    pending: list[SpanItem] = field(default_factory=list)
    malformed: int = 0
    dropped_buffer: int = 0
    dropped_spool: int = 0
    events: int = 0
    # Span events derived in the agent (an OOM verdict, say) for a span not yet ended.
    span_events: dict[str, list[SpanEvent]] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # per-producer state of kind handlers
    # Cold-start bookkeeping: stage spans wait in ``pending`` (bounded by bytes) for the root.
    pending_bytes: int = 0
    pending_dropped: int = 0  # stage spans not kept for the summary (bound reached)
    stages_seen: int = 0
    root_closed: bool = False
    lost_root_made: bool = False  # the agent closed the root for it (producer_lost)
    last_ns: int = 0  # the latest event time seen
    gone: bool = False  # the process has ended; its pending state was freed
    uid: int | None = None  # the kernel's word (SO_PEERCRED, a spool file's owner); None in-process
    hello_cut: int = 0  # hello keys, values and resource attributes cut to their bounds
    spool_vanished: int = 0  # its spool files that someone else removed (the hook rescued them)
    # The hooks' cold-start checkpoint (cs_tick): open runs and samples, for a root it never sends.
    checkpoint: Checkpoint | None = None

    def attach_event(self, span_id: str | None, event: SpanEvent) -> None:
        """Attach ``event`` to span ``span_id`` when it arrives (bounded)."""
        if not span_id or (self.root_closed and span_id == self.info.get("root_span_id")):
            return  # that span has ended already: the event stays a log record only
        evs = self.span_events.get(span_id)
        if evs is None:
            if len(self.span_events) >= MAX_PENDING_SPANS:
                return
            evs = self.span_events[span_id] = []
        if len(evs) < MAX_EVENTS_PER_SPAN:
            evs.append(event)


def _s(v: Any, name: str, limit: int = MAX_STR) -> str:
    if not isinstance(v, str):
        raise Malformed("%s must be a string" % name)
    return v[:limit]


def _i(v: Any, name: str) -> int:
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


def producer_resource(info: dict[str, Any], host_name: str | None, cut: list[int] | None = None) -> Resource:
    """``Resource.create()`` semantics: env attributes, then what we detect, wins. The uid is
    the kernel's (``info["uid"]`` as :meth:`Assembler.hello` sets it), never the hello's."""
    attrs: Attributes = {
        "telemetry.sdk.name": "infersight",
        "telemetry.sdk.language": "python",
        "telemetry.sdk.version": __version__,
    }
    attrs.update(parse_resource_env(str(info.get("resource_attributes") or ""), cut))
    attrs.pop("process.user.id", None)
    service = str(info.get("service_name") or "") or str(attrs.get("service.name") or "")
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
    return Resource.of({k: (mask_value(k, v) if isinstance(v, str) else v) for k, v in attrs.items()})


def validate_hello(info: Any, cut: list[int] | None = None) -> dict[str, Any]:
    """The hello's producer object, checked, and bounded (cuts counted in ``cut[0]``)."""
    if not isinstance(info, dict):
        raise Malformed("producer must be an object")
    out, cuts = bound_hello(info)
    if cut is not None:
        cut[0] += cuts
    out["id"] = _s(info.get("id"), "producer.id", 128)
    out["pid"] = _i(info.get("pid"), "producer.pid")
    out["start_ns"] = _i(info.get("start_ns"), "producer.start_ns")
    out["acked"] = _i(info.get("acked", 0), "producer.acked")
    out["root_ended"] = info.get("root_ended") is True  # its root went out before this hello
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


MAX_RECENT_ROOTS = 1024

# A handler for an event kind beyond schema 1's core: (producer, origin, t_ns, data, out).
# It appends items to ``out`` and raises Malformed on bad data.
KindHandler = Callable[[Producer, Origin, int, dict[str, Any], list[Item]], None]
# Sees each finished cold start (its summary, and the event time it finished at) and returns
# items that go out in the same batch, right after the summary (the fleet metrics).
ColdStartObserver = Callable[[ColdStart, int], Iterable[Item]]


class Assembler:
    """Owns the producers this agent has seen and turns their events into items."""

    def __init__(
        self,
        host_name: str | None = None,
        handlers: dict[str, KindHandler] | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        coldstart_observers: Sequence[ColdStartObserver] = (),
    ) -> None:
        self.host_name = host_name
        self.handlers: dict[str, KindHandler] = dict(handlers or {})
        self.coldstart_observers: list[ColdStartObserver] = list(coldstart_observers)
        self.producers: OrderedDict[str, Producer] = OrderedDict()
        self.max_pending_bytes = max_pending_bytes
        self.malformed = 0
        self.lost_of_forgotten = 0  # gaps of producers evicted from the table
        self.gaps_forgotten_of_forgotten = 0
        self.pending_dropped_of_forgotten = 0
        self.roots_closed_for_lost = 0  # cold-start roots the agent closed for a producer that died
        self.late_roots_of_lost = 0  # a producer's own root that arrived after that (not exported)
        self.recent_roots: OrderedDict[str, SpanItem] = OrderedDict()  # for supervisors' workers
        self.identity_conflicts = 0  # a producer id presented by a second uid: kept apart
        self.hello_cut = 0  # hello keys, values and resource attributes cut to their bounds
        self.recent_covered: OrderedDict[str, list[tuple[int, int]]] = OrderedDict()  # their trees' stages

    def hello(self, raw: Any, uid: int | None = None) -> Producer:
        """The producer this hello names, made on first sight. ``uid`` is the kernel's word
        (the peer's SO_PEERCRED, a spool file's owner): the hello's own ``uid`` is replaced
        by it, and a producer id already held by another uid gets its own entry,
        ``<id>@<uid>``, so that two uids never share one sequence space (counted). A producer
        made in-process (no uid: tests, ``launch``'s own) matches any uid."""
        cut = [0]
        info = validate_hello(raw, cut)
        info.pop("uid", None)
        if uid is not None:
            info["uid"] = uid
        key = info["id"]
        p = self.producers.get(key)
        if p is not None and p.uid is not None and uid is not None and p.uid != uid:
            self.identity_conflicts += 1
            key = "%s@%d" % (info["id"], uid)
            p = self.producers.get(key)
        if p is None:
            p = Producer(key, info, producer_resource(info, self.host_name, cut), uid=uid)
            info.pop("resource_attributes", None)  # it lives on in the resource: not kept twice
            p.hello_cut = cut[0]
            self.hello_cut += cut[0]
            p.seq.resume_after(info["acked"])
            self.producers[p.id] = p
            if len(self.producers) > MAX_PRODUCERS:
                _old_id, old = self.producers.popitem(last=False)
                self.lost_of_forgotten += old.seq.lost
                self.gaps_forgotten_of_forgotten += old.seq.gaps_forgotten
                self.pending_dropped_of_forgotten += old.pending_dropped + len(old.pending)
        else:
            self.producers.move_to_end(p.id)
            p.gone = False
            p.info["root_ended"] = p.info.get("root_ended") or info["root_ended"]
        return p

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
            sev = _s(sev, "sev", 16).upper()
            out.append(
                LogItem(
                    p.resource, t_ns, SEVERITY.get(sev, 9), sev, _s(d.get("body", ""), "body"),
                    attributes(d.get("a")),
                    p.info["trace_id"] if isinstance(span_id, str) and HEX16.match(span_id) else None,
                    span_id if isinstance(span_id, str) and HEX16.match(span_id) else None,
                    _s(d.get("name", ""), "name", 64) or None, origin,
                )
            )
        elif kind == "metric":
            v = d.get("v")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise Malformed("metric value must be a number")
            k = d.get("k", "gauge")
            if k not in ("gauge", "sum"):
                raise Malformed("metric kind must be gauge or sum")
            out.append(
                MetricItem(
                    p.resource, _s(d.get("n"), "n", 255), k, _s(d.get("u", ""), "u", 32), "",
                    t_ns, int(p.info["start_ns"]), [NumberPoint(v, attributes(d.get("a")))],
                )
            )
        elif isinstance(kind, str) and kind in self.handlers:
            self.handlers[kind](p, origin, t_ns, d, out)
        elif kind == "cs_tick":
            self._checkpoint(p, d)
        elif kind == "drops":
            p.dropped_buffer = max(p.dropped_buffer, _i(d.get("buffer", 0), "buffer"))
            p.dropped_spool = max(p.dropped_spool, _i(d.get("spool", 0), "spool"))
            p.spool_vanished = max(p.spool_vanished, _i(d.get("vanished", 0), "vanished"))
        else:
            raise Malformed("unknown event kind %r" % (kind,))

    def _span(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], out: list[Item]) -> None:
        name = _s(d.get("n"), "n", 255)
        span_id = d.get("id")
        if not isinstance(span_id, str) or not HEX16.match(span_id):
            raise Malformed("span id must be 16 lowercase hex digits")
        parent = d.get("p")
        if parent is not None and (not isinstance(parent, str) or not HEX16.match(parent)):
            raise Malformed("parent span id must be 16 lowercase hex digits")
        trace = d.get("tr") or p.info["trace_id"]
        if not isinstance(trace, str) or not HEX32.match(trace):
            raise Malformed("trace id must be 32 lowercase hex digits")
        start = _i(d.get("s"), "s")
        end = _i(d.get("e", t_ns), "e")
        if end < start:
            raise Malformed("span ends before it starts")
        err = d.get("err")
        events = [SpanEvent(_s(e[0], "event name", 255), _i(e[1], "event time"), attributes(e[2]))
                  for e in _event_list(d.get("ev"))]
        events += p.span_events.pop(span_id, [])
        span = SpanItem(
            p.resource, trace, span_id, parent, name, start, end, attributes(d.get("a")), events,
            str(err)[:MAX_STR] if err is not None else None, origin,
        )
        if name == "coldstart":
            if span_id == p.info.get("root_span_id"):
                if p.lost_root_made:
                    # Its own root came after all (a spool file replayed late): the agent's
                    # stand-in went out under the same span id, and one span id is one span.
                    self.late_roots_of_lost += 1
                    return
                p.root_closed = True
            self._close_root(p, span, out, t_ns=t_ns)
            return
        if name.startswith("coldstart."):
            p.last_ns = max(p.last_ns, end)
            p.stages_seen += 1
            if not p.root_closed:  # else its summary went out already
                self._keep_pending(p, span)
        out.append(span)

    def _checkpoint(self, p: Producer, d: dict[str, Any]) -> None:
        """A ``cs_tick``: the open runs replace the last ones; the samples add up (bounded)."""
        if p.root_closed:
            return
        opened, times, ids, labels = d.get("open", []), d.get("t", []), d.get("i", []), d.get("l", [])
        if not isinstance(opened, list) or len(opened) > MAX_OPEN_STAGES:
            raise Malformed("open must be a list of at most %d stages" % MAX_OPEN_STAGES)
        if (not isinstance(times, list) or not isinstance(ids, list) or not isinstance(labels, list)
                or len(times) != len(ids) or len(times) > MAX_TICK_SAMPLES or len(labels) > len(times)):
            raise Malformed("samples must be lists t and i of one length, and their labels l")
        stages: dict[str, SpanItem] = {}
        for o in opened:
            if type(o) is not list or len(o) != 6:
                raise Malformed("an open stage is [stage, span id, parent id, start, end, attributes]")
            stage, span_id, parent = _s(o[0], "stage", 64), o[1], o[2]
            if not isinstance(span_id, str) or not HEX16.match(span_id) or not isinstance(parent, str) \
                    or not HEX16.match(parent):
                raise Malformed("open stage ids must be 16 lowercase hex digits")
            start, end = _i(o[3], "start"), _i(o[4], "end")
            if end < start:
                raise Malformed("an open stage ends before it starts")
            attrs = attributes(o[5])
            attrs["infersight.stage"] = stage
            stages[span_id] = SpanItem(p.resource, p.info["trace_id"], span_id, parent, "coldstart." + stage,
                                       start, end, attrs, [], None, Origin(p.id, 0))
        label_list = [_s(lab, "label", 512) for lab in labels]
        if any(type(t) is not int or not 0 <= t <= INT64_MAX for t in times) or any(
                type(i) is not int or not 0 <= i < len(label_list) for i in ids):
            raise Malformed("sample times must be integers and their label indices in range")
        cp = p.checkpoint = p.checkpoint or Checkpoint()
        cp.open = stages
        cp.add_samples(times, ids, label_list)

    def _close_root(
        self, p: Producer, root: SpanItem, out: list[Item], stages: list[SpanItem] | None = None,
        *, t_ns: int | None = None,
    ) -> None:
        """Export ``root``, the cold-start summary of the stages under it, and what the
        cold-start observers add (its fleet metrics)."""
        if stages is None:
            stages = descendants(root.span_id, p.pending)
        workers = self._workers_of(root, stages)
        # An explicit ``unattributed`` span explains a gap; it never counts as covered. A
        # worker's root is no stage of ours: its named stages cover our time in the tree's
        # figure only, and never its whole lifetime.
        worker_covered = [iv for w in workers for iv in self.recent_covered.get(w.span_id, ())]
        total = root.end_ns - root.start_ns
        root.attributes["infersight.coldstart.unattributed_s"] = (total - covered_ns(stages, root)) / 1e9
        if workers:
            root.attributes["infersight.coldstart.tree_unattributed_s"] = (
                total - covered_ns(stages, root, worker_covered)) / 1e9
        root.attributes.setdefault("faas.coldstart", True)
        self._remember_covered(root, named_intervals(stages), worker_covered)
        done = {s.span_id for s in stages}
        p.pending = [s for s in p.pending if s.span_id not in done]
        p.checkpoint = None  # the root came (or was made): no more use for it
        p.pending_bytes = sum(span_bytes(s) for s in p.pending)
        out.append(root)
        cs = ColdStart(root, sorted(stages, key=lambda s: s.start_ns), workers, merge(worker_covered))
        out.append(cs)
        out.extend(self.observe_coldstart(cs, root.end_ns if t_ns is None else t_ns))

    def observe_coldstart(self, cs: ColdStart, t_ns: int) -> list[Item]:
        """What the cold-start observers add for ``cs``, finished at ``t_ns``: called for each
        root closed here, and by ``launch`` for a root only the launcher saw."""
        return [item for observer in self.coldstart_observers for item in observer(cs, t_ns)]

    def _keep_pending(self, p: Producer, span: SpanItem) -> None:
        """Keep a stage span for its root's summary, within the per-producer byte bound:
        the oldest pending spans give way (counted); the span itself is exported anyway."""
        size = span_bytes(span)
        p.pending.append(span)
        p.pending_bytes += size
        drop, n = 0, len(p.pending)
        while drop < n and (p.pending_bytes > self.max_pending_bytes or n - drop > MAX_PENDING_SPANS):
            p.pending_bytes -= span_bytes(p.pending[drop])
            drop += 1
        if drop:
            del p.pending[:drop]
            p.pending_dropped += drop

    def producer_lost(self, p: Producer) -> list[Item]:
        """The producer's process has ended. If it sent cold-start stages but never its root
        (killed before its exit handlers ran), close the root here: ended at the last event
        seen, ``infersight.coldstart.ended_by=producer_lost``; a stage still open then (seen
        only as the missing parent of a stage that ended) is closed with it. Then free the
        producer's pending state. Returns the items to export."""
        out: list[Item] = []
        if p.gone:
            return out
        p.gone = True
        root_id = p.info.get("root_span_id")
        # A root that went out before an agent restart (its hello says so) is not made again.
        cp = p.checkpoint
        if ((p.stages_seen or cp is not None) and not p.root_closed and not p.info.get("root_ended")
                and isinstance(root_id, str)):
            p.root_closed = p.lost_root_made = True
            self.roots_closed_for_lost += 1
            end = max(p.last_ns, int(p.info["start_ns"]))
            ready = [s.end_ns for s in p.pending if s.name == "coldstart.ready_wait"
                     and s.attributes.get("infersight.ready.source") in ROOT_ENDING_READY]
            attrs: Attributes = {"faas.coldstart": True, "infersight.coldstart.ended_by": "producer_lost"}
            if ready and min(ready) <= end:
                # the hooks would have ended it at readiness: what it sent later (its first
                # request) lies after the root, and the wait for traffic is in no share
                end = min(ready)
                attrs["infersight.coldstart.ended_by"] = "ready"
            parent = p.info.get("root_parent")
            root = SpanItem(p.resource, p.info["trace_id"], root_id,
                            parent if isinstance(parent, str) and HEX16.match(parent) else None,
                            "coldstart", int(p.info["start_ns"]), end, attrs,
                            p.span_events.pop(root_id, []), None, Origin(p.id, 0))
            if cp is not None:  # the runs it had open at its last checkpoint, as they were then
                seen = {s.span_id for s in p.pending}
                for s in cp.open.values():
                    if s.span_id not in seen:
                        s.end_ns = min(s.end_ns, end)
                        s.start_ns = min(s.start_ns, s.end_ns)
                        s.events = p.span_events.pop(s.span_id, [])
                        p.pending.append(s)
                        out.append(s)
            stages = self._close_open_stages(p, root, out)
            if cp is not None:  # and the gaps, explained by the samples it had sent
                gaps = gap_spans(cp, root, stages)
                out.extend(gaps)
                stages.extend(gaps)
            self._close_root(p, root, out, stages)
        p.checkpoint = None
        p.pending_dropped += len(p.pending)  # stages of a root that never comes
        p.pending = []
        p.pending_bytes = 0
        p.span_events = {}
        return out

    @staticmethod
    def _close_open_stages(p: Producer, root: SpanItem, out: list[Item]) -> list[SpanItem]:
        """Stages under ``root``, plus a closed stand-in for every stage that was still open:
        the missing parent of a stage that ended (its name was never sent)."""
        known = {s.span_id for s in p.pending} | {root.span_id}
        children: dict[str, list[SpanItem]] = {}
        for s in p.pending:
            if s.parent_span_id is not None and s.parent_span_id not in known:
                children.setdefault(s.parent_span_id, []).append(s)
        stages = list(p.pending)
        for span_id, kids in children.items():
            stand_in = SpanItem(
                p.resource, root.trace_id, span_id, root.span_id, "coldstart.interrupted",
                min(k.start_ns for k in kids), root.end_ns,
                {"infersight.stage": "interrupted", "infersight.coldstart.ended_by": "producer_lost"},
                p.span_events.pop(span_id, []), "the process ended inside this stage", Origin(p.id, 0),
            )
            out.append(stand_in)
            stages.append(stand_in)
        return stages

    def _remember_covered(self, root: SpanItem, own: list[tuple[int, int]],
                          workers: list[tuple[int, int]]) -> None:
        """What a closed root's tree covers, for its supervisor (merged intervals, bounded
        like the roots)."""
        self.recent_covered[root.span_id] = merge([*own, *workers])
        while len(self.recent_covered) > MAX_RECENT_ROOTS:
            self.recent_covered.popitem(last=False)

    def _workers_of(self, root: SpanItem, stages: list[SpanItem]) -> list[SpanItem]:
        """Roots of other processes (not helpers) already seen under this root or its stages;
        remembers this root for its own parent."""
        ids = {root.span_id, *(s.span_id for s in stages)}
        workers = [r for r in self.recent_roots.values()
                   if r.trace_id == root.trace_id and r.parent_span_id in ids
                   and r.attributes.get("infersight.process.role") != "helper"]
        self.recent_roots[root.span_id] = root
        if len(self.recent_roots) > MAX_RECENT_ROOTS:
            self.recent_roots.popitem(last=False)
        return sorted(workers, key=lambda r: r.start_ns)

    def lost_total(self) -> int:
        return self.lost_of_forgotten + sum(p.seq.lost for p in self.producers.values())

    def gaps_forgotten_total(self) -> int:
        return self.gaps_forgotten_of_forgotten + sum(p.seq.gaps_forgotten for p in self.producers.values())

    def pending_dropped_total(self) -> int:
        return self.pending_dropped_of_forgotten + sum(p.pending_dropped for p in self.producers.values())

    def pending_bytes_total(self) -> int:
        return sum(p.pending_bytes for p in self.producers.values())

    def stats(self) -> dict[str, int]:
        """For ``infersight status --json`` and the agent's own metrics."""
        return {
            "producers": len(self.producers),
            "pending_bytes": self.pending_bytes_total(),
            "pending_stages_dropped": self.pending_dropped_total(),
            "coldstart_roots_closed_for_lost": self.roots_closed_for_lost,
            "coldstart_late_roots_of_lost": self.late_roots_of_lost,
            "gaps_forgotten": self.gaps_forgotten_total(),
            "identity_conflicts": self.identity_conflicts,
            "hello_cut": self.hello_cut,
        }
