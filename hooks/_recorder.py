"""The cold-start recorder: what every instrumenter uses (stdlib only).

The base of the cold-start hooks. ``_imports``, ``_build``, ``_torch``, ``_weights``,
``_stagerules``, ``_checkpoint``, ``_readiness`` and ``_coldstart`` build on it; it imports
none of them. It holds:

- this process's cold-start state (``state()``: ``_state.current.coldstart``);
- stages: ``begin``/``end`` (an ``Open`` stage made current; one ended out of order is
  skipped when the current span is restored), ``emit_stage``,
  ``end_runtime_init``, and the
  notes every stage leaves while the cold start is collected (``note_begin``, ...);
- ``timed``: a wrapper that runs a call inside one stage;
- wrapping with undo (``patch``, ``add_undo``) and post-import callbacks (``on_import``);
- run sources: instrumenters that hold runs not yet emitted (import runs, ``nn.init``
  runs) register here, so that readiness flushes them and checkpoints send them
  without knowing who they are (``add_run_source``, ``flush_runs``, ``open_runs``);
- the storage ceiling cached by the agent, for weights spans.

Nothing here raises into user code: every entry point catches and calls ``_runtime.fail``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from itertools import islice

from . import _contract, _mainstart, _paths, _runtime, _state

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

    from ._state import ColdStart

    Stage = Tuple[str, str, str, int, int, Dict[str, Any]]  # (stage, span, parent, start, end, attributes)


def state() -> ColdStart:
    """This process's cold-start state (a forked child gets a new one: ``_state``)."""
    return _state.current.coldstart


# -- stages ---------------------------------------------------------------------------


class Open:
    """A stage in progress, opened by ``begin`` and closed by ``end``."""

    __slots__ = ("attrs", "name", "owner", "parent", "prev", "span", "start")

    def __init__(self, name: str, parent: str, prev: Optional[str], start: int, attrs: Dict[str, Any]) -> None:
        self.name = name
        self.span = _runtime.new_span_id()
        self.parent = parent
        self.prev = prev
        self.start = start
        self.attrs = attrs
        self.owner = state()  # this process's: a forked child has another


def set_current(span: Optional[str]) -> None:
    """Make ``span`` the current span (children get it at spawn: ``_spawn``)."""
    _runtime.current_span.set(span)
    hs = _state.current
    if threading.get_ident() == hs.main_ident:
        hs.main_span = span


def note_begin(at: int = 0) -> None:
    """A stage starts on this thread at ``at`` (builtin or user's): it splits import runs
    and warmups."""
    st = state()
    st.stage_mark = object()  # a new value (hooks.stage sets its span id)
    imp = st.imports
    if imp is not None and st.collecting:
        try:
            imp.pause(at)
        except Exception as exc:
            _runtime.fail(exc)


def note_stage_exit(at: int = 0) -> None:
    """The stage that ``note_begin`` announced ended on this thread at ``at``."""
    imp = state().imports
    if imp is not None:
        try:
            imp.resume(at)
        except Exception as exc:
            _runtime.fail(exc)


def note_end(end_ns: int) -> None:
    """A stage that ``emit_stage`` sends ended at ``end_ns``."""
    st = state()
    st.last_end_ns = max(st.last_end_ns, end_ns)


def last_end() -> int:
    """The end of the latest stage that finished (where ``ready_wait`` starts): noted by
    ``note_end``, or read here from the intervals covered since the last call and from
    ``hooks.stage``'s still queued (it stores no end of its own: one store less per stage)."""
    st = state()
    queued = queued_intervals()  # first: what the drain thread takes meanwhile is in covered by then
    covered = st.covered
    n = len(covered) & ~1  # whole pairs
    seen = st.covered_seen
    if n > seen:
        latest = max(covered[seen + 1:n:2])  # the ends of the intervals added since
        st.last_end_ns = max(st.last_end_ns, latest)
        st.covered_seen = n
    if queued:
        st.last_end_ns = max(st.last_end_ns, *queued[1::2])
    return st.last_end_ns


def begin(name: str, attrs: Optional[Dict[str, Any]] = None, start: Optional[int] = None) -> Open:
    """Open a stage under the current span and make it current."""
    prev = _runtime.current_span.get()
    o = Open(name, prev or _runtime.state().root_span_id, prev, start or time.time_ns(), dict(attrs or {}))
    note_begin(o.start)
    set_current(o.span)
    return o


def end(
    o: Open,
    attrs: Optional[Dict[str, Any]] = None,
    err: Optional[BaseException] = None,
    end_ns: Optional[int] = None,
    keep: bool = True,
) -> None:
    """Close ``o``: restore the previous span, then emit it (unless ``keep`` is False). Ended
    before a stage opened inside it (out of order), it leaves the current span on that stage,
    and that stage's end skips it: the current span never goes back to one that has ended."""
    try:
        end_ns = end_ns or time.time_ns()
        if _runtime.current_span.get() == o.span:
            set_current(still_open(o.prev))
        else:
            state().ended_early[o.span] = o.prev  # this process's (a child ends what its parent opened)
        note_stage_exit(end_ns)
        if not keep or o.owner is not state():  # opened by the parent before a fork
            return
        if attrs:
            o.attrs.update(attrs)
        emit_stage(o.name, o.span, o.parent, o.start, end_ns, o.attrs,
                   type(err).__name__ if err is not None else None)
    except Exception as exc:
        _runtime.fail(exc)


def still_open(span: Optional[str]) -> Optional[str]:
    """``span``, or the innermost span around it still open where it (and those around it)
    ended out of order (``ended_early``); None at the top."""
    early = state().ended_early
    while span in early:
        span = early[span]
    return span


def emit_stage(
    name: str, span: str, parent: str, start: int, end_ns: int, attrs: Dict[str, Any],
    err: Optional[str] = None,
) -> None:
    data = stage_data(name, span, parent, start, end_ns, attrs, err)
    note_end(data["e"])
    note_covered(name, start, data["e"])
    _runtime.emit("span", data)


def runtime_init_extent(st: ColdStart, hooks_end: int, end_ns: int) -> Tuple[int, Dict[str, Any]]:
    """Where ``runtime_init`` ends and its attributes: at ``end_ns`` (the program's first frame), or with
    ``end_ns`` 0 where the watch gave up (``init_gave_up``), else at the end of the hooks' set-up."""
    attrs: Dict[str, Any] = {"infersight.runtime_init.hooks_s": (hooks_end - st.boot_ns) / 1e9}
    end = hooks_end
    gave_up = st.init_gave_up[:1]
    if not end_ns and gave_up:
        end_ns = gave_up[0]
        attrs["infersight.runtime_init.program_start_seen"] = False
    if end_ns > hooks_end:
        end = end_ns
        attrs["infersight.runtime_init.after_hooks_s"] = (end_ns - hooks_end) / 1e9
    return end, attrs


def end_runtime_init(end_ns: int) -> None:
    """Emit ``runtime_init``, once: from the root's start to the main program's first frame
    (``end_ns``, from ``_mainstart``); with ``end_ns`` 0 (the root ends first), to where that
    watch gave up (``init_gave_up``: its imports were not timed either), else to the end of the
    hooks' set-up. Claims with one ``list.pop``, no lock of its own (it runs inside a profile
    callback at the program's first frame)."""
    try:
        st = state()
        try:
            hooks_end = st.init_pending.pop()  # the claim: whoever pops it emits
        except IndexError:
            return
        if not end_ns:
            _mainstart.abandon()  # the root's end came first: a watch put back later must not resume
        rs = _runtime.state()
        end, attrs = runtime_init_extent(st, hooks_end, end_ns)
        emit_stage("runtime_init", st.init_span or _runtime.new_span_id(), rs.root_span_id, rs.root_start_ns, end,
                   attrs)
    except Exception as exc:
        _runtime.fail(exc)


def covered_pairs(st: ColdStart) -> List[Tuple[int, int]]:
    """Every stage interval so far as (start, end) pairs: ``st.covered`` (flat: start, end,
    start, end, ...) and ``hooks.stage``'s still queued. The queue is read first: a stage the
    drain thread takes meanwhile was noted in ``covered`` before it left (``cover_queued``).
    An interval may come twice (noted, and still queued): every reader takes a union or a
    bound, which that does not change."""
    q = queued_intervals()
    c = st.covered
    return [(c[i], c[i + 1]) for i in range(0, len(c) - 1, 2)] + [(q[i], q[i + 1]) for i in range(0, len(q), 2)]


def stage_intervals(events: Iterable[Tuple[Any, ...]]) -> List[int]:
    """The intervals (flat: start, end, ...) of the named stages ``hooks.stage`` queued among
    ``events``: its flat ``(seq, t_ns, "span", name, span, parent, start, end, ...)`` tuples
    (other span events are dicts, four items)."""
    out: List[int] = []
    for ev in events:
        if len(ev) > 8 and ev[2] == "span" and ev[3] != "unattributed":
            out += ev[6:8]
    return out


def _copy(queue: Deque[Tuple[Any, ...]], k: Optional[int] = None) -> List[Tuple[Any, ...]]:
    """The first ``k`` (or all) items of a deque other threads append to. One C call holds the GIL,
    but a garbage collection inside it can run Python code and let another thread append: the
    iteration then raises RuntimeError ("deque mutated during iteration"), and a second try copies it."""
    for _ in range(8):
        try:
            return list(islice(queue, k)) if k is not None else list(queue)
        except RuntimeError:
            continue
    return []


def queued_intervals() -> List[int]:
    """``stage_intervals`` of this process's queue, copied in one call (other threads append)."""
    buf = getattr(_runtime.state().client, "_buf", None)  # None while inactive
    return stage_intervals(_copy(buf)) if buf else []


def cover_queued(queue: Deque[Tuple[Any, ...]], k: int) -> None:
    """(Drain thread, ``_buffer.before_take``) The first ``k`` events are about to leave the
    queue: while the cold start is collected, note the intervals of the stages among them in
    ``covered`` (after the root's end nothing reads them)."""
    try:
        st = state()
        if st.collecting:
            out = stage_intervals(_copy(queue, k))  # one copy: other threads append meanwhile
            if out:
                st.covered += out  # one atomic extend
    except Exception as exc:
        _runtime.fail(exc)


def note_covered(name: str, start: int, end_ns: int) -> None:
    """Time a named stage covers, for the gap sampler (on the caller's thread: a stage whose
    span the drain thread builds later must already count when the root ends)."""
    st = state()
    if name != "unattributed" and st.collecting:
        st.covered += (start, max(end_ns, start))


def stage_data(
    name: str, span: str, parent: str, start: int, end_ns: int, attrs: Dict[str, Any],
    err: Optional[str] = None,
) -> Dict[str, Any]:
    """A stage's span event (pure: ``hooks.stage`` has the drain thread build it)."""
    a: Dict[str, Any] = {_contract.STAGE: name}
    if name not in _runtime.BUILTIN_STAGES:
        a[_contract.STAGE_CUSTOM] = True
    a.update(attrs)
    end_ns = max(end_ns, start)
    rs = _runtime.state()
    data: Dict[str, Any] = {"n": "coldstart." + name, "id": span, "p": parent or rs.root_span_id,
                            "tr": rs.trace_id, "s": start, "e": end_ns, "a": a}
    if err:
        data["err"] = err
    return data


def stage_from_args(
    name: str, span: str, parent: str, start: int, end_ns: int, err: Optional[str], *attrs: Any,
) -> Dict[str, Any]:
    """``stage_data`` of a stage that ``hooks.stage`` queued as one flat tuple of atomic
    values, the attribute names and then their values: no dict or nested tuple that would
    keep it tracked by the caller's garbage collector while it waits in the buffer."""
    n = len(attrs) // 2
    names, values = attrs[:n], attrs[n:]
    return stage_data(name, span, parent, start, end_ns, {k: values[i] for i, k in enumerate(names)}, err)


def root_open() -> bool:
    return state().collecting and not _runtime.state().root_ended and _runtime.active()


# -- weights: storage ceiling (measured by the agent, cached per device) -----------------


def _cache_file() -> str:
    return _paths.storage_ceiling_file()


def storage_ceiling(path: str) -> Optional[float]:
    """The storage ceiling (bytes/s) cached by the agent for ``path``'s device."""
    st = state()
    try:
        if st.ceilings is None:
            st.ceilings = {}
            import json

            with open(_cache_file(), encoding="utf-8") as f:
                loaded = json.load(f)
            if isinstance(loaded, dict) and isinstance(loaded.get("devices"), dict):
                st.ceilings = loaded["devices"]
        if not path or not st.ceilings:
            return None
        dev = os.stat(path).st_dev
        entry = st.ceilings.get("%d:%d" % (os.major(dev), os.minor(dev)))
        ceiling = entry.get("bytes_per_s") if isinstance(entry, dict) else None
        if isinstance(ceiling, (int, float)) and ceiling > 0:
            return float(ceiling)
    except (OSError, ValueError):
        pass
    return None


def weights_attrs(path: str, nbytes: int, seconds: float) -> Dict[str, Any]:
    """``infersight.weights.*`` for one load; the ceiling ratio when one is cached."""
    a: Dict[str, Any] = {}
    if path:
        a[_contract.WEIGHTS_PATH] = path
    if nbytes > 0:
        a[_contract.WEIGHTS_BYTES] = nbytes
        if seconds > 0:
            rate = nbytes / seconds
            a[_contract.WEIGHTS_BYTES_PER_S] = rate
            ceiling = storage_ceiling(path)
            if ceiling is not None:
                a["infersight.weights.storage_ceiling_bytes_per_s"] = ceiling
                a[_contract.WEIGHTS_CEILING_RATIO] = rate / ceiling
    return a


# -- post-import callbacks (the loader wrapping lives in _imports) -------------------------


def on_import(name: str, callback: Callable[[Any], None]) -> None:
    """Run ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    st = state()
    mod = sys.modules.get(name)
    if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False) is False:
        _safe_call(callback, mod)
        return
    st.post_import.setdefault(name, []).append(callback)
    st.watched.add(name)


def run_post_import(name: str, module: Any) -> None:
    for cb in state().post_import.pop(name, ()):
        _safe_call(cb, module)


def _safe_call(cb: Callable[[Any], None], arg: Any) -> None:
    try:
        cb(arg)
    except Exception as exc:
        _runtime.fail(exc)


# -- wrapping, undone when the root ends ------------------------------------------------


def add_undo(fn: Callable[[], None]) -> None:
    state().undo.append(fn)


def patch(obj: Any, name: str, new: Any) -> Any:
    """Replace ``obj.name`` with ``new``; the undo puts the original back if ours is still
    there. Returns the original."""
    orig = getattr(obj, name)
    owned = name in getattr(obj, "__dict__", {})
    setattr(obj, name, new)

    def undo() -> None:
        if getattr(obj, name, None) is new:
            if owned:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)

    add_undo(undo)
    return orig


# -- a call timed as one stage ---------------------------------------------------------


def _flag(name: str) -> int:
    v: int = getattr(state().tls, name, 0)
    return v


def timed(
    stage: str,
    orig: Callable[..., Any],
    describe: Callable[[Tuple[Any, ...], Dict[str, Any]], Dict[str, Any]],
    guard: str,
    after: Optional[Callable[[Dict[str, Any], float, Any], None]] = None,
) -> Callable[..., Any]:
    """A wrapper that runs ``orig`` inside one stage; nested calls of the same ``guard`` (a
    per-thread flag) pass through. ``after(attrs, seconds, result)`` adds to the stage."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        o = None
        try:
            if state().collecting and not _flag(guard) and root_open():
                o = begin(stage, describe(args, kwargs))
                setattr(state().tls, guard, 1)
        except Exception as exc:
            _runtime.fail(exc)
        if o is None:
            return orig(*args, **kwargs)
        tls = o.owner.tls
        t0 = time.perf_counter()
        try:
            result = orig(*args, **kwargs)
        except BaseException as e:
            setattr(tls, guard, 0)
            end(o, err=e)
            raise
        setattr(tls, guard, 0)
        try:
            if after is not None:
                after(o.attrs, time.perf_counter() - t0, result)
        except Exception as exc:
            _runtime.fail(exc)
        end(o)
        return result

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(orig, "__name__", "wrapper")
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    return wrapper


# -- run sources -------------------------------------------------------------------------


def add_run_source(flush: Callable[[int, bool], None], open_runs: Callable[[], List[Stage]]) -> None:
    """An instrumenter that holds runs not yet emitted: ``flush(end_ns, final)`` emits them
    (at readiness; ``final`` at the root's end), ``open_runs()`` lists them as stages so far
    (for checkpoints, on the sampler thread). Once per instrumenter and process."""
    sources = state().run_sources
    if (flush, open_runs) not in sources:
        sources.append((flush, open_runs))


def flush_runs(end_ns: int, final: bool = False) -> None:
    """Emit the runs still open (they are emitted when they end), in registration order."""
    for flush, _open in list(state().run_sources):
        try:
            flush(end_ns, final)
        except Exception as exc:
            _runtime.fail(exc)


def open_runs() -> List[Stage]:
    """(Sampler thread) Every source's runs not emitted yet."""
    out: List[Stage] = []
    for _flush, runs in list(state().run_sources):
        out.extend(runs())
    return out
