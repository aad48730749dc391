"""Wire protocol between hooks and agent (stdlib only; the agent imports it too).

A stream of frames over a Unix stream socket. Each frame is a 4-byte big-endian
length followed by a UTF-8 JSON object. The producer speaks first:

    {"t": "hello", "schema": 1, "producer": {...}}      producer -> agent
    {"t": "welcome", "schema": 1}                        agent -> producer
    {"t": "refuse", "schema": 1, "error": "..."}         agent -> producer, then close
    {"t": "b", "n": N, "l": last seq, "e": [[seq, t_ns, kind, data], ...]}
                                                         producer -> agent (a batch)
    {"t": "ack", "seq": N}                               agent -> producer

``ack`` means every event up to ``seq`` was exported or spooled to disk by every
exporter, so the producer may forget it. A spool file is the same frame stream,
starting with the hello frame. ``{"t": "status"}`` asks the agent for its health.
``{"t": "urgent"}``, alone on a fresh connection, is a doorbell: the producer has just sent
an urgent event (an OOM) on its own connection, and the agent reads every producer now
rather than at the end of its read gate's window. An older agent closes such a connection
as a malformed hello, which costs nothing.
"""

from __future__ import annotations

import struct

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple
    Event = Tuple[int, int, str, Dict[str, Any]]


SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 1 << 20
MAX_BATCH_EVENTS = 512  # events a hook puts in one batch frame, at most; a batch whose frame would pass
# MAX_FRAME_BYTES is split by size (``encode_batches``), and an event no frame can hold is dropped and counted.
# A batch of more events is no hook's: the agent refuses it whole (350,000 empty events in one 1 MiB frame
# had cost 0.3 s of the agent's event loop to refuse one at a time).
MAX_BATCH_EVENTS_READ = 4 * MAX_BATCH_EVENTS
HEADER = struct.Struct("!I")

# The event kinds schema 1 defines. Data is a JSON object; keys per kind:
#   span:   n name, id span id, p parent span id, tr trace id, s start ns, a attributes,
#           e end ns (default: the event time), err error text, ev [[name, t_ns, attrs], ...]
#   other kinds (oom, mem, req, ...) are handled by agent-side kind handlers.
#   log:    body, sev (INFO|WARN|ERROR|...), a attributes, name (event family), sp span id
#   metric: n name, v value, k kind (gauge|sum), u unit, a attributes
#   drops:  buffer, spool (what the producer dropped, its totals so far); vanished, texts, fds when not 0
#   cs_tick: open [[stage, span id, parent id, start, end, attrs], ...] (runs not emitted yet),
#           t [sample ns, ...], i [label index, ...], l [labels of this tick] (``_checkpoint``)
EVENT_KINDS = ("span", "log", "metric", "drops", "cs_tick")


def _make_dumps() -> Any:
    """A compact JSON encoder without importing the ``json`` package (which pulls in ``re``
    and ``enum``: ~7 ms of the hooks' import). ``_json.make_encoder`` is the C encoder that
    ``json.dumps`` itself uses, with the same arguments on CPython 3.9 through 3.13."""
    try:
        import _json

        def make(markers: Any) -> Any:
            return _json.make_encoder(
                markers, str, _json.encode_basestring_ascii, None, ":", ",", False, False, True
            )

        # Without circular-reference markers (a fifth faster per event, which keeps the drain
        # thread ahead of a host logging in a tight loop); a cycle recurses until
        # RecursionError, and then the checked encoder says what is wrong, as json.dumps does.
        fast = make(None)

        def dumps(obj: Any) -> str:
            try:
                return "".join(fast(obj, 0))
            except RecursionError:
                return "".join(make({})(obj, 0))

        dumps({"probe": [1, 2.5, None, True, "x"]})
        return dumps
    except Exception:  # another Python implementation: the plain json module
        import json

        return lambda obj: json.dumps(obj, separators=(",", ":"), default=str)


_dumps: Callable[[Any], str] = _make_dumps()


def encode_frame(obj: Dict[str, Any]) -> bytes:
    payload = _dumps(obj).encode("ascii")
    return HEADER.pack(len(payload)) + payload


# -- the frames each side sends: built here only ----------------------------------------


def hello_frame(producer: Dict[str, Any], acked: Optional[int] = None) -> bytes:
    """The producer's first frame, on a connection and at the head of a spool file.
    ``acked``: the last sequence number an agent acked (the spool's reader, or an agent
    after a restart, does not count those events as lost)."""
    if acked is not None:
        producer = dict(producer)
        producer["acked"] = acked
    return encode_frame({"t": "hello", "schema": SCHEMA_VERSION, "producer": producer})


def welcome_frame() -> bytes:
    return encode_frame({"t": "welcome", "schema": SCHEMA_VERSION})


def refuse_frame(error: str) -> bytes:
    """The agent's answer to a hello (or a subscription) it will not take; it then closes."""
    return encode_frame({"t": "refuse", "schema": SCHEMA_VERSION, "error": error})


def subscribe_frame(session: str, kinds: List[str], relay: bool = False,
                    log_events: Optional[List[str]] = None, relay_pending: bool = False) -> bytes:
    """launch -> agent: stream this session's items of ``kinds`` (``agent/daemon/sessions.py``);
    ``relay``: launch copies CMD's stderr and will send its captures (``stderr`` frames);
    ``relay_pending``: it keeps them until it sends ``relaying`` (its event loop runs only after CMD's spawn);
    ``log_events``: of the log records, only those of these event names (an older agent sends all)."""
    msg: Dict[str, Any] = {"t": "subscribe", "schema": SCHEMA_VERSION, "session": session, "kinds": kinds}
    if relay:
        msg["relay"] = True
        if relay_pending:
            msg["relay_pending"] = True
    if log_events is not None:
        msg["log_events"] = log_events
    return encode_frame(msg)


def subscribed_frame(info: Dict[str, Any]) -> bytes:
    """The agent's answer to a subscription it takes: its pid, version and sinks."""
    return encode_frame({"t": "subscribed", "schema": SCHEMA_VERSION, **info})


def ack_frame(seq: int) -> bytes:
    """``encode_frame({"t": "ack", "seq": seq})``, formatted directly: one per frame read."""
    payload = b'{"t":"ack","seq":%d}' % seq
    return HEADER.pack(len(payload)) + payload


def health_frame(health: Dict[str, Any]) -> bytes:
    """The agent's answer to ``STATUS_FRAME``."""
    return encode_frame({"t": "health", **health})


def encode_batch(events: List[Event]) -> bytes:
    # "n" (count) and "l" (last seq) lead the frame so a spool replay reads only this prefix.
    return encode_frame({"t": "b", "n": len(events), "l": events[-1][0] if events else 0, "e": events})


# Bytes of a batch frame's payload besides its events: '{"t":"b","n":N,"l":L,"e":[' and ']}', with N and L
# of up to 20 digits each.
BATCH_OVERHEAD = 72


def _batch_payload(parts: List[bytes], last: int) -> bytes:
    """The payload ``encode_batch`` makes of the events whose encodings are ``parts``."""
    return b'{"t":"b","n":%d,"l":%d,"e":[' % (len(parts), last) + b",".join(parts) + b"]}"


def encode_batches(
    events: List[Event], max_bytes: int = MAX_FRAME_BYTES
) -> Tuple[List[Tuple[List[Event], bytes]], List[Tuple[Event, str, str]]]:
    """Batch frames of ``events``, in order, each payload at most ``max_bytes``: ``(frames, bad)``,
    ``frames`` a list of (the frame's events, the frame), ``bad`` the events no frame holds, as
    (event, why, detail): ``why`` is ``"oversize"`` (its encoding alone is over the bound) or the
    name of the exception encoding it raised (a value JSON cannot hold: a cycle, a key of another
    type, an object whose ``__str__`` raises, ...). Never raises for what the events hold.

    The whole batch is encoded once, as before; only a batch that fails or is too large is
    encoded event by event and packed into frames by size."""
    if not events:
        return [], []
    try:
        frame = encode_batch(events)
        if len(frame) - HEADER.size <= max_bytes:
            return [(events, frame)], []
    except Exception:  # (a RecursionError too) one event spoils the batch: find it below
        pass
    frames: List[Tuple[List[Event], bytes]] = []
    bad: List[Tuple[Event, str, str]] = []
    parts: List[bytes] = []
    taken: List[Event] = []
    size = BATCH_OVERHEAD
    for ev in events:
        try:
            part = _dumps(ev).encode("ascii")
        except Exception as exc:
            try:
                detail = "%s: %s" % (type(exc).__name__, str(exc)[:200])
            except Exception:
                detail = type(exc).__name__
            bad.append((ev, type(exc).__name__, detail))
            continue
        if len(part) + BATCH_OVERHEAD > max_bytes:
            bad.append((ev, "oversize", "%d bytes encoded, over the %d-byte frame bound" % (len(part), max_bytes)))
            continue
        if parts and size + len(part) + 1 > max_bytes:
            frames.append((taken, _frame(_batch_payload(parts, taken[-1][0]))))
            parts, taken, size = [], [], BATCH_OVERHEAD
        parts.append(part)
        taken.append(ev)
        size += len(part) + 1
    if parts:
        frames.append((taken, _frame(_batch_payload(parts, taken[-1][0]))))
    return frames, bad


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


# -- values the host hands the hooks (``hooks.log``, ``metric``, ``emit``): made JSON-safe -----------
#
# The agent cuts strings at 4096 characters and takes at most 128 attributes (``agent/daemon/assemble.py``);
# the hooks cut before sending, with a marker, so that a value the host hands them costs a bounded frame.
MAX_STR = 4096  # characters of a string value, the marker included
MAX_KEY = 256  # characters of a key
MAX_ITEMS = 128  # keys of an object, items of a list
MAX_DEPTH = 8  # nested objects and lists
MAX_VALUE_CHARS = 64 << 10  # characters in all of one value (strings and keys), then the rest is cut
INT_BOUND = 1 << 64  # an integer at or past this (in magnitude) is sent as its digits, a string
CUT = "...[cut %d chars]"  # the marker at the end of a string cut to MAX_STR


def cut_str(s: str, limit: int = MAX_STR) -> str:
    """``s`` (a str, or a subclass: made a plain str) cut to ``limit`` characters with the marker."""
    if len(s) <= limit:
        return str.__str__(s)
    keep = max(0, limit - len(CUT % len(s)))  # (the marker's longest)
    return str.__str__(s[:keep]) + CUT % (len(s) - keep)


def text_of(v: Any, limit: int = MAX_STR) -> str:
    """A string for any object, cut to ``limit``: its ``str()``, else its ``repr()``, else its type's
    name. Never raises (the object's own ``__str__`` or ``__repr__`` may)."""
    for conv in (str, repr):
        try:
            s = conv(v)
            if isinstance(s, str):
                return cut_str(s, limit)
        except Exception:
            pass
    try:
        return "<unprintable %s>" % (type(v).__name__,)
    except Exception:
        return "<unprintable>"


def _int_text(v: int) -> str:
    try:
        if v.bit_length() <= 12000:  # ~3600 digits: under sys.int_info's default str() limit (4300)
            return cut_str(int.__repr__(v))
        return "<int of %d bits>" % v.bit_length()
    except Exception:
        return "<int>"


def safe_value(v: Any) -> Any:
    """``v`` as a value JSON holds and the agent takes, within bounds: strings cut to MAX_STR
    (with the marker), integers past INT_BOUND as strings, objects and lists at most MAX_ITEMS
    items and MAX_DEPTH deep (deeper: their text), keys made strings, a cycle cut (the repeated
    container becomes its text), MAX_VALUE_CHARS characters in all, other objects their text
    (``text_of``). Never raises. The caller's thread runs it, only for values that are not flat
    and small already (``hooks.log`` checks those with ``len``)."""
    try:
        return _safe(v, MAX_DEPTH, [MAX_VALUE_CHARS], set())
    except Exception:  # (a RecursionError, a dict changed while read by another thread, ...)
        return text_of(v)


def _safe(v: Any, depth: int, budget: List[int], path: set) -> Any:  # type: ignore[type-arg]
    t = type(v)
    if t is str:
        s = cut_str(v, min(MAX_STR, max(budget[0], 32)))
        budget[0] -= len(s)
        return s
    if t is int:
        return v if -INT_BOUND < v < INT_BOUND else _int_text(v)
    if t is float or t is bool or v is None:
        return v
    if isinstance(v, (dict, list, tuple, set, frozenset)):
        if id(v) in path:
            return "<cycle>"
        if depth <= 0 or budget[0] <= 0:  # (not its str(): that walks all of it)
            try:
                return "<%s of %d items>" % (type(v).__name__, len(v))
            except Exception:
                return "<container>"
        path.add(id(v))
        try:
            if isinstance(v, dict):
                out: Dict[str, Any] = {}
                for k, x in v.items():
                    if len(out) >= MAX_ITEMS or budget[0] <= 0:
                        break
                    key = cut_str(k, MAX_KEY) if isinstance(k, str) else text_of(k, MAX_KEY)
                    budget[0] -= len(key) + 1
                    out[key] = _safe(x, depth - 1, budget, path)
                return out
            items: List[Any] = []
            for x in v:
                if len(items) >= MAX_ITEMS or budget[0] <= 0:
                    break
                budget[0] -= 1
                items.append(_safe(x, depth - 1, budget, path))
            return items
        finally:
            path.discard(id(v))
    if isinstance(v, str):
        return _safe(str.__str__(v), depth, budget, path)
    if isinstance(v, int):  # bool is handled above; an IntEnum, another subclass: its value
        return _safe(int.__index__(v), depth, budget, path)
    if isinstance(v, float):
        return float.__float__(v)
    s = text_of(v, min(MAX_STR, max(budget[0], 32)))
    budget[0] -= len(s)
    return s


URGENT_FRAME = encode_frame({"t": "urgent"})  # the doorbell, alone on a fresh connection
# The doorbell a process rings, while launch holds its agent back, when it imports a serving engine's package: the
# agent starts (niced: CMD is still starting) and loads its OOM rules. A running agent reads it as URGENT_FRAME.
ENGINE_FRAME = encode_frame({"t": "urgent", "w": "engine"})
# Beside launch's private socket while launch holds its agent back (CMD starts): the hooks
# ring at readiness (the agent starts then) and, exiting meanwhile, spool at once (no ack can come).
AGENT_HELD_MARK = "agent-held"
STATUS_FRAME = encode_frame({"t": "status"})  # asks the agent for its health


# -- reading frames ---------------------------------------------------------------------


def batch_header(payload: bytes) -> Optional[Dict[str, Any]]:
    """``{"t", "n", "l"}`` of a batch frame written by :func:`encode_batch`, without decoding events."""
    end = payload.find(b',"e":')
    return decode_reply(payload[:end] + b"}") if end > 0 else None


def decode_reply(payload: bytes) -> Optional[Dict[str, Any]]:
    """The agent's replies to a producer (welcome, refuse, ack): flat objects of strings,
    integers and booleans. Parsed without the ``json`` package; None when malformed."""
    try:
        import _json

        s = payload.decode("utf-8")
        out: Dict[str, Any] = {}
        i = s.index("{") + 1
        while True:
            while s[i] in " ,":
                i += 1
            if s[i] == "}":
                return out
            if s[i] != '"':
                return None
            key, i = _json.scanstring(s, i + 1)
            i = s.index(":", i) + 1
            while s[i] == " ":
                i += 1
            if s[i] == '"':
                out[key], i = _json.scanstring(s, i + 1)
            else:
                j = i
                while s[j] not in ",}":
                    j += 1
                token = s[i:j].strip()
                out[key] = {"true": True, "false": False, "null": None}.get(token, token)
                if isinstance(out[key], str):
                    out[key] = int(token)
                i = j
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


def decode_payload(payload: bytes) -> Optional[Dict[str, Any]]:
    """The frame's object, or None when it is not a JSON object (agent side)."""
    import json

    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def frame_size(header: bytes) -> int:
    """The payload size a 4-byte header announces (compare with ``MAX_FRAME_BYTES``)."""
    n: int = HEADER.unpack(header)[0]
    return n


def split_frames(buf: bytes) -> Tuple[List[bytes], bytes, bool]:
    """Split complete frames off ``buf``: (payloads, rest, oversized)."""
    out: List[bytes] = []
    pos = 0
    while len(buf) - pos >= HEADER.size:
        (n,) = HEADER.unpack_from(buf, pos)
        if n > MAX_FRAME_BYTES:
            return out, buf[pos:], True
        if len(buf) - pos - HEADER.size < n:
            break
        out.append(buf[pos + HEADER.size : pos + HEADER.size + n])
        pos += HEADER.size + n
    return out, buf[pos:], False
