"""infersight.hooks: in-process instrumentation for the served process.

Imports only the standard library, works on Python 3.9+, never blocks and never
raises into user code. Every function here is a cheap no-op while the hooks are not
active (no ``infersight launch``, no ``INFERSIGHT=1`` bootstrap).

    from infersight import hooks
    with hooks.stage("tokenizer_load"):
        ...
    hooks.mark_ready()          # the server can take requests
    ...
    hooks.first_response()      # the first response's first byte went out
"""

from __future__ import annotations

import time

_BOOT_NS = time.time_ns()  # the bootstrap's first line: the end of runtime_init

import os  # noqa: E402

_time_ns = time.time_ns

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, TypeVar
    F = TypeVar("F", bound=Callable[..., Any])

from _thread import get_ident as _get_ident  # noqa: E402

from . import _buffer, _client, _coldstart, _lazy, _readiness, _recorder, _runtime, _state, _wire  # noqa: E402, F401
from ._request import Request, first_token, request  # noqa: E402
from ._runtime import BUILTIN_STAGES, active  # noqa: E402

_pop_span_id = _runtime.span_ids.pop
_set_span = _runtime.current_span.set
_get_span = _runtime.current_span.get
_reset_span = _runtime.current_span.reset
_client.builders["span"] = _recorder.stage_from_args
_buffer.before_take = _recorder.cover_queued
_HELD = _client.HELD

__all__ = [
    "BUILTIN_STAGES", "Request", "Stage", "active", "emit", "first_response", "first_token", "flush", "log",
    "mark_ready", "metric", "report_oom", "request", "stage",
]


def report_oom(exc: Optional[BaseException] = None) -> bool:
    """Report a ``torch.OutOfMemoryError`` the server caught (and so no excepthook sees).

    Call it in the ``except`` block; with no argument it takes the exception being handled.
    Returns True when an OOM was reported. A no-op while the hooks are inactive.
    """
    if _state.current.runtime.client is None:
        return False
    if not _lazy.fresh("_alloc", "hooks.report_oom()"):
        return False
    from . import _alloc

    return _alloc.report_oom(exc)



# What the host hands ``log``, ``metric`` and ``emit`` is made JSON-safe and bounded here, on the caller's
# thread (``_wire.safe_value``), so that one value cannot spoil a batch on the drain thread, nor make a frame
# the agent refuses. Flat values within bounds (the usual: a few short strings and numbers) are only checked,
# with ``type`` and ``len``: no copy, no encoding.
_MAX_STR = _wire.MAX_STR
_MAX_ITEMS = _wire.MAX_ITEMS
_INT_BOUND = _wire.INT_BOUND
_FLAT = frozenset((float, bool, type(None)))
_safe_value = _wire.safe_value


def _flat(d: Dict[str, Any]) -> bool:
    """Whether ``d`` (a dict of string keys: keyword arguments) needs no conversion: values strings,
    integers within INT_BOUND, floats, booleans or None; at most MAX_ITEMS of them and MAX_STR
    characters of strings in all (a few type checks and a ``len``: no copy, no encoding)."""
    if len(d) > _MAX_ITEMS:
        return False
    total = 0
    for v in d.values():
        t = type(v)
        if t is str:
            total += len(v)
        elif t is int:
            if not -_INT_BOUND < v < _INT_BOUND:
                return False
        elif t not in _FLAT:
            return False
    return total <= _MAX_STR


def _text(v: Any, limit: int) -> str:
    return v if type(v) is str and len(v) <= limit else _wire.text_of(v, limit)


def emit(kind: str, data: Dict[str, Any]) -> None:
    """Queue one raw event (see ``_wire`` for kinds). Never blocks, never raises. ``data`` is made
    JSON-safe and bounded as ``log``'s attributes are."""
    if _state.current.runtime.client is None:
        return
    try:
        if type(data) is not dict or not _flat(data) or not all(type(k) is str for k in data):
            data = _safe_value(data)
        _runtime.emit(_text(kind, 64), data)
    except Exception as exc:
        _runtime.fail(exc)


def log(body: str, severity: str = "INFO", name: str = "", **attributes: Any) -> None:
    """Queue one log record, linked to the current span.

    Never raises for what it is given: a string longer than 4096 characters is cut (it ends with
    ``...[cut N chars]``), attribute values JSON cannot hold become JSON-safe (non-string keys and
    other objects their ``str()``, integers past 2**64 their digits, nesting past 8 levels, 128
    items or 64 Ki characters in all cut, a cycle ``"<cycle>"``)."""
    if _state.current.runtime.client is None:
        return
    if type(body) is not str or type(severity) is not str or type(name) is not str or len(body) > _MAX_STR \
            or len(severity) > 16 or len(name) > 64:
        body, severity, name = _text(body, _MAX_STR), _text(severity, 16), _text(name, 64)
    if attributes and not _flat(attributes):
        attributes = _safe_value(attributes)
    _runtime.emit(
        "log",
        {"body": body, "sev": severity, "name": name, "a": attributes, "sp": _runtime.current_span.get()},
    )


def metric(name: str, value: float, kind: str = "gauge", unit: str = "", **attributes: Any) -> None:
    """Queue one metric point (gauge or monotonic sum). Values are made safe as ``log``'s are."""
    if _state.current.runtime.client is None:
        return
    if type(name) is not str or len(name) > 255:
        name = _wire.text_of(name, 255)
    if type(value) is not float and (type(value) is not int or not -_INT_BOUND < value < _INT_BOUND):
        value = _safe_value(value)
    if type(kind) is not str or len(kind) > 16:
        kind = _wire.text_of(kind, 16)
    if type(unit) is not str or len(unit) > 32:
        unit = _wire.text_of(unit, 32)
    if attributes and not _flat(attributes):
        attributes = _safe_value(attributes)
    _runtime.emit("metric", {"n": name, "v": value, "k": kind, "u": unit, "a": attributes})


def flush(timeout_s: float = 2.0) -> bool:
    """Wait until what was emitted so far reached the agent (or the spool)."""
    c = _state.current.runtime.client
    if c is None:
        return True
    try:
        return c.flush(timeout_s)
    except Exception as exc:
        _runtime.fail(exc)
        return False


class Stage:
    """What ``stage(...)`` returns: the context manager and decorator of one stage.
    ``_span`` is None until entered while the hooks are active."""

    __slots__ = ("_attrs", "_main", "_name", "_parent", "_span", "_st", "_start", "_token")

    def __init__(self, name: str, **attrs: Any) -> None:  # ``hooks.Stage(...)``; ``stage()`` skips the call
        self._name = name
        self._attrs = attrs
        self._span: Optional[str] = None

    def __enter__(self) -> Stage:
        st = _state.current  # this process's (a fork replaces it)
        if st.runtime.client is None:
            return self
        try:
            try:
                span = _pop_span_id()  # _runtime.new_span_id(), inlined
            except IndexError:
                span = _runtime.draw_span_ids()
            self._parent = _get_span()  # None at the top: the root (the drain thread fills it in)
            self._token = _set_span(span)
            self._span = span
            self._st = st
            self._start = start = _time_ns()
            cs = st.coldstart
            # While collecting: _recorder.note_begin(start), inlined (it splits import runs and
            # warmups): the stage mark ("a stage started since": its span id, a value already
            # made) and _imports.pause(start) (the main thread's count and flag are on cs).
            if _get_ident() == st.main_ident:  # a stage exits on the thread it entered
                self._main = True
                st.main_span = span  # no environment write: children get it at spawn
                if cs.collecting:
                    cs.stage_mark = span
                    cs.main_paused = paused = cs.main_paused + 1
                    if cs.main_busy:  # (an import in progress or set aside, or a run open)
                        cs.imports.stage_begins(st.imports.main, start, paused)
            else:
                self._main = False
                if cs.collecting:
                    cs.stage_mark = span
                    it = st.imports.thread()
                    it.paused = paused = it.paused + 1
                    if it.busy:
                        cs.imports.stage_begins(it, start, paused)
        except Exception as exc:
            _runtime.fail(exc)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        span = self._span
        if span is None:
            return
        end = _time_ns()
        self._span = None
        try:
            st = self._st
            parent = self._parent
            cs = st.coldstart
            # Back to the span current at its entry, as _recorder.end does. Ended before a stage
            # opened inside it (out of order), it leaves that one current and is noted, so that
            # no end makes it current again: one whose parent is noted goes back to the innermost
            # stage still open (the notes are empty unless one ended out of order: a truth test
            # per exit; a fork's child shares its parent's).
            if _get_span() != span:  # out of order
                cs.ended_early[span] = parent
                back = st.main_span
            elif cs.ended_early and parent in cs.ended_early:
                back = _recorder.still_open(parent)
                _set_span(back)
            else:
                try:
                    _reset_span(self._token)
                except ValueError:  # exited in another context than its entry's (a task made inside it)
                    _set_span(parent)
                back = parent
            name = self._name
            start = self._start
            # While collecting (else the root ended: nothing is left to split or cover):
            # _imports.resume(end), inlined.
            if self._main:
                st.main_span = back
                if cs.collecting:
                    paused = cs.main_paused
                    if paused > 0:
                        cs.main_paused = paused - 1
                        if cs.main_busy:
                            cs.imports.stage_ends(st.imports.main, end, paused)
            elif cs.collecting:
                it = st.imports.thread()
                paused = it.paused
                if paused > 0:
                    it.paused = paused - 1
                    if it.busy:
                        cs.imports.stage_ends(it, end, paused)
            # The interval it covers (for the gap sampler and ``ready_wait``) is read from the
            # queued tuple: by ``_recorder.covered_pairs`` while it waits, and noted in
            # ``cs.covered`` by the drain thread before it leaves the queue
            # (``_recorder.cover_queued``); here only when it is not queued.
            c = st.runtime.client
            if c is not None and c.enabled:
                # One flat tuple of atomic values: the drain thread builds the span's dict
                # (``_recorder.stage_from_args``). The attributes wait beside it, in
                # ``c.held`` (a dict store), where the append cannot be refused; else they
                # are flattened into it (names, then values).
                err = None if exc_type is None else getattr(exc_type, "__name__", "error")
                attrs = self._attrs
                seq = next(c._seq)
                buf = c._buf
                n = len(buf)
                if 0 < n < c.calm or c.calm_from <= n < c.calm_to:  # c.queue(event), inlined:
                    if attrs:  # nothing to wake, spill or drop
                        c.held[seq] = attrs
                        buf.append((seq, end, "span", name, span, parent, start, end, err, _HELD))
                    else:
                        buf.append((seq, end, "span", name, span, parent, start, end, err))
                else:
                    queued = c.queue((seq, end, "span", name, span, parent, start, end, err, *attrs,
                                      *attrs.values()))
                    if not queued and cs.collecting and name != "unattributed":  # a full buffer refused it
                        cs.covered += (start, end)  # flat, one atomic extend: threads share it
            elif cs.collecting and name != "unattributed":
                cs.covered += (start, end)
        except Exception as e:
            _runtime.fail(e)

    def __call__(self, fn: F) -> F:
        name, attrs = self._name, self._attrs

        @_runtime.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with stage(name, **attrs):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class _Made(Stage):
    """What ``stage()`` makes: a ``Stage`` without ``__init__``, so that ``_Made()`` is one
    type call with no Python frame (``object.__new__(Stage)`` goes through a slot wrapper
    and an argument tuple: about 300 instructions more per stage)."""

    __slots__ = ()
    __init__ = object.__init__  # type: ignore[assignment]


def stage(name: str, **attrs: Any) -> Stage:
    """``with stage("name", **attributes):`` or ``@stage("name")``: a ``coldstart.<name>`` span.

    Context manager and decorator; thread- and task-safe. Nesting follows the current span
    (a contextvar), so stages nest per thread and per asyncio task. A stage opened before a
    ``fork`` is emitted by the parent only. Costs the caller a span id, two clock reads, a
    contextvar set and reset, a few slot writes and one flat tuple appended to the queue: the
    span's dict is built on the drain thread, the cold-start bookkeeping (a stage mark and the
    thread's count of open stages) runs only while the cold start is collected, the interval
    the stage covers is read from the queued tuple (and noted by the drain thread as it takes
    it), and the environment is not touched (a child process gets ``TRACEPARENT`` when it is
    spawned).

    The queued tuple holds atomic values and, where the append cannot be refused, ends with a
    marker while the attributes dict waits in ``client.held``; else the attribute names and
    then their values are flattened into it. With atomic attribute values the garbage
    collector untracks it at its first pass, so a burst of queued stages never drives full
    collections of the served process's heap. A function that returns a ``Stage``: making the
    object without ``__init__`` saves a call per stage.
    """
    s: Stage = _Made()  # Stage(name, **attrs), without the __init__ call
    s._name = name
    s._attrs = attrs
    s._span = None
    return s


def mark_ready() -> None:
    """The server can take requests now: ends ``ready_wait`` and the cold start (the root ends
    here). The first call counts.

    After an explicit ``mark_ready()``, ``first_request`` runs from the first forward (or
    visible request) after readiness until ``first_response()``, or until exit; the wait for
    traffic before it is in no total.
    """
    if _state.current.runtime.client is None:
        return
    try:
        _readiness.mark_ready("mark_ready")
    except Exception as exc:
        _runtime.fail(exc)


def first_response() -> None:
    """The first response's first byte is out: ends ``first_request`` (and the cold start, when
    no readiness signal came before the request)."""
    if _state.current.runtime.client is None:
        return
    try:
        _readiness.first_response()
    except Exception as exc:
        _runtime.fail(exc)


def _bootstrap_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
