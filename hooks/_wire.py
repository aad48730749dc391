"""Wire protocol between hooks and agent (stdlib only; the agent imports it too).

A stream of frames over a Unix stream socket. Each frame is a 4-byte big-endian
length followed by a UTF-8 JSON object. The producer speaks first:

    {"t": "hello", "schema": 1, "producer": {...}}      producer -> agent
    {"t": "welcome", "schema": 1}                        agent -> producer
    {"t": "refuse", "schema": 1, "error": "..."}         agent -> producer, then close
    {"t": "b", "e": [[seq, t_ns, kind, data], ...]}      producer -> agent (a batch)
    {"t": "ack", "seq": N}                               agent -> producer

``ack`` means every event up to ``seq`` was exported or spooled to disk by every
exporter, so the producer may forget it. A spool file is the same frame stream,
starting with the hello frame. ``{"t": "status"}`` asks the agent for its health.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, List, Optional, Tuple

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 1 << 20
HEADER = struct.Struct("!I")

# The event kinds schema 1 defines. Data is a JSON object; keys per kind:
#   span:   n name, id span id, p parent span id, tr trace id, s start ns, a attributes,
#           e end ns (default: the event time), err error text, ev [[name, t_ns, attrs], ...]
#   other kinds (oom, mem, req, ...) are handled by agent-side kind handlers.
#   log:    body, sev (INFO|WARN|ERROR|...), a attributes, name (event family), sp span id
#   metric: n name, v value, k kind (gauge|sum), u unit, a attributes
#   drops:  buffer, spool (counts the producer dropped since it last reported)
EVENT_KINDS = ("span", "log", "metric", "drops")

Event = Tuple[int, int, str, Dict[str, Any]]


def encode_frame(obj: Dict[str, Any]) -> bytes:
    payload = json.dumps(obj, separators=(",", ":"), default=str).encode("utf-8")
    return HEADER.pack(len(payload)) + payload


def encode_batch(events: List[Event]) -> bytes:
    return encode_frame({"t": "b", "e": events})


def decode_payload(payload: bytes) -> Optional[Dict[str, Any]]:
    """The frame's object, or None when it is not a JSON object."""
    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


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
