"""The producer's primitives: span ids, the trace, emitting, failing safely (stdlib only).

The state they work on is ``_state.current.runtime`` (``state()``): the client, the trace
and the cold-start root. Activation, at-exit and after-fork handling live in
``_activate``, which sets that state up.

Nothing here raises into user code: public entry points go through ``fail``, which
disables the hooks and prints one line on the first internal error.
"""

from __future__ import annotations

import contextvars
import os

from . import _state
from ._client import _say

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

    from ._state import Runtime

    G = TypeVar("G", bound=Callable[..., Any])

BUILTIN_STAGES = (
    "runtime_init",
    "framework_import",
    "cuda_init",
    "weights_load",
    "weights_to_device",
    "graph_compile",
    "graph_capture",
    "warmup",
    "ready_wait",
    "first_request",
    "model_build",
    "tokenizer_load",
    "unattributed",
)

current_span: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "infersight_span", default=None
)
# Span ids: drawn from the OS 256 at a time (one ``os.urandom`` read of 2 KiB, formatted as
# one hex string and split), not one call per id; a stage takes one with a list pop. Ids
# only need to be unique, not secret; the OS's bytes need no per-process seed (a forked
# child only drops the pool it inherited), and cost the caller no big-int work.
# (Module-level on purpose: ``hooks.stage`` binds ``span_ids.pop`` once, at import.)
_random_bytes = os.urandom
_IDS_PER_DRAW = 256
_ZERO_ID = "0" * 16  # invalid in W3C trace context
_ZERO_BYTES = bytes(8)
span_ids: List[str] = []


def state() -> Runtime:
    """This process's producer state (a forked child gets a new one: ``_state``)."""
    return _state.current.runtime


def wraps(fn: Callable[..., Any]) -> Callable[[G], G]:
    """``functools.wraps`` without importing functools (~3.5 ms of the hooks' import)."""

    def apply(wrapper: G) -> G:
        for name in ("__module__", "__name__", "__qualname__", "__doc__"):
            try:
                setattr(wrapper, name, getattr(fn, name))
            except AttributeError:
                pass
        wrapper.__dict__.update(getattr(fn, "__dict__", {}))
        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    return apply


def new_span_id() -> str:
    try:
        return span_ids.pop()
    except IndexError:
        return draw_span_ids()


def draw_span_ids() -> str:
    """Refill the span id pool; returns one more id."""
    raw = _random_bytes(8 * _IDS_PER_DRAW)
    ids = raw.hex(" ", 8).split(" ")
    if _ZERO_BYTES in raw:  # one C search, not a string comparison per id; all but never true
        ids = [i for i in ids if i != _ZERO_ID]
    span_ids.extend(ids)  # one call: atomic against a pop on another thread
    return span_ids.pop()


def reseed() -> None:
    """In a forked child: else parent and child would hand out the same pooled ids."""
    del span_ids[:]


def active() -> bool:
    rs = _state.current.runtime
    c = rs.client
    return c is not None and c.enabled and not rs.failed


def fail(exc: BaseException) -> None:
    """Disable the hooks after an internal error; say so once."""
    rs = _state.current.runtime
    if not rs.failed:
        rs.failed = True
        _say("hooks disabled after an internal error: %r" % (exc,))
    if rs.client is not None:
        rs.client.enabled = False


def emit(kind: str, data: Dict[str, Any]) -> None:
    c = _state.current.runtime.client
    if c is None or not c.enabled:
        return
    try:
        c.emit(kind, data)
    except Exception as exc:
        fail(exc)


def emit_urgent(kind: str, data: Dict[str, Any]) -> None:
    """``emit``, and send it now rather than at the end of the batch delay (an OOM: the
    process may be about to die, and the report has a latency budget)."""
    emit(kind, data)
    c = _state.current.runtime.client
    if c is not None and c.enabled:
        try:
            c.urgent()  # sets flags and an event: never blocks; the agent is rung once it is sent
        except Exception as exc:
            fail(exc)


def ring_launch(engine: bool = False) -> None:
    """Under ``launch``: send what is queued and ring the agent's doorbell, which starts an
    agent that launch holds back while CMD starts (this process is ready). ``engine``: this
    process imported a serving engine's package instead; the ring is ``_wire.ENGINE_FRAME`` (the
    agent starts niced and loads its OOM rules). Never blocks."""
    c = _state.current.runtime.client
    if c is not None and c.enabled and c.conn.held():
        try:
            if engine:
                c.engine_imported()
            else:
                c.urgent()
        except Exception as exc:
            fail(exc)


def emit_soon(kind: str, data: Dict[str, Any]) -> None:
    """``emit``, and send it now rather than at the end of the batch delay, without ringing
    the agent's doorbell (that is for OOMs): a cold-start checkpoint must leave the process
    before it may be killed, not jump the agent's read gate."""
    emit(kind, data)
    c = _state.current.runtime.client
    if c is not None and c.enabled:
        try:
            c.hurry()  # sets a flag and an event: never blocks
        except Exception as exc:
            fail(exc)


def parse_traceparent(value: str) -> Optional[Tuple[str, str]]:
    parts = value.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        int(parts[1], 16)
        int(parts[2], 16)
    except ValueError:
        return None
    if parts[1] == "0" * 32 or parts[2] == "0" * 16:
        return None
    return parts[1], parts[2]


def traceparent(span_id: Optional[str] = None) -> str:
    rs = _state.current.runtime
    return "00-%s-%s-01" % (rs.trace_id, span_id or current_span.get() or rs.root_span_id)


def note_ready(ready_ns: int, port: Any = None) -> None:
    """Every later hello says when this process became ready, and on which TCP port if known: an agent that
    restarts after it knows the server (its routing hints) without its cold start's spans, which went to the one
    before."""
    producer = getattr(_state.current.runtime.client, "producer", None)
    if not isinstance(producer, dict):
        return
    producer["ready_ns"] = int(ready_ns)
    if type(port) is int and 0 < port < 65536:
        producer["ready_port"] = port


def end_root(end_ns: Optional[int] = None, attrs: Optional[Dict[str, Any]] = None) -> None:
    """Close the cold-start root span once (at readiness/first request, or at exit)."""
    rs = _state.current.runtime
    client = rs.client
    if rs.root_ended or client is None:
        return
    rs.root_ended = True
    a: Dict[str, Any] = {"faas.coldstart": True}
    a.update(rs.root_attrs)
    if attrs:
        a.update(attrs)
    data = {"n": "coldstart", "id": rs.root_span_id, "tr": rs.trace_id, "s": rs.root_start_ns, "a": a}
    if rs.root_parent:
        data["p"] = rs.root_parent
    if end_ns is not None:
        data["e"] = end_ns
    emit("span", data)
    # Every later hello says so: an agent that restarts after it must not take this
    # process's later stages for a cold start, nor close a root for it when it dies.
    client.producer["root_ended"] = True


