"""Cold-start stage detection inside the served process (stdlib only).

Installed by the bootstrap once the runtime is active. It owns:

- the stage emitter that every stage goes through (builtin or custom);
- ``runtime_init`` (process start -> the bootstrap's first line);
- ``framework_import`` (every outermost import, ``_imports``) and post-import hooks;
  torch itself is instrumented by ``_torch`` when, and only if, the user imports it, and
  transformers/tokenizers by ``_build`` (``model_build``, ``tokenizer_load``);
- the stack sampler (``_sampler``) and, at the end, ``unattributed`` spans for the gaps;
- the process role (``helper`` for resource trackers, compile workers, ``python -c``);
- readiness (``mark_ready()``, the first TCP ``listen()``, launch's ``--ready-url`` file),
  ``ready_wait``, ``warmup`` runs and ``first_request``;
- the end of the ``coldstart`` root: at readiness when a signal said when (``READY_SIGNALS``),
  else at the end of ``first_request`` (else at exit). The root goes out once the first request
  is answered (``first_request`` follows the wait for traffic, after the root), after which
  every wrapper is removed so the served process pays nothing in steady state.

Nothing here raises into user code: every entry point catches and calls ``_runtime.fail``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from . import _env, _proc, _runtime, _state, _workers

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple

    from ._state import ColdStart

REPORT_FLUSH_S = 1.0  # a worker waits this long at most for the agent's ack before telling its supervisor
# Readiness signals: the root ends at readiness when one of these said when it came. A
# request that arrives first ("request") is no signal: the first response ends the root then.
READY_SIGNALS = ("mark_ready", "listen", "ready_url", "listening_socket", "stage_rule", "fork_served")


def state() -> ColdStart:
    """This process's cold-start state (a forked child gets a new one: ``_state``)."""
    return _state.current.coldstart


class _Warm:
    """A run of outermost forwards before readiness with no other stage in between."""

    __slots__ = ("end", "first_end", "inflight", "n", "seq", "span", "start")

    def __init__(self, start: int) -> None:
        self.span = _runtime.new_span_id()
        self.start = start
        self.end = start
        self.first_end = 0
        self.inflight = 0
        self.n = 0
        self.seq = state().stage_seq


class _First:
    """The first request: visible (ASGI, first_response) or the first forward after readiness."""

    __slots__ = ("attrs", "forward_end", "source", "span", "start")

    def __init__(self, start: int, source: str, attrs: Optional[Dict[str, Any]] = None) -> None:
        self.span = _runtime.new_span_id()
        self.start = start
        self.source = source
        self.attrs: Dict[str, Any] = dict(attrs or {})
        self.forward_end = 0  # explicit mode: the forward ended, first_response() pending


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
    st.stage_seq += 1
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
    st = state()
    st.last_end_ns = max(st.last_end_ns, end_ns)


def begin(name: str, attrs: Optional[Dict[str, Any]] = None, start: Optional[int] = None) -> Open:
    """Open a stage under the current span and make it current."""
    prev = _runtime.current_span.get()
    o = Open(name, prev or _runtime.root_span_id, prev, start or time.time_ns(), dict(attrs or {}))
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
    """Close ``o``: restore the previous span, then emit it (unless ``keep`` is False)."""
    try:
        end_ns = end_ns or time.time_ns()
        if _runtime.current_span.get() == o.span:
            set_current(o.prev)
        note_stage_exit(end_ns)
        if not keep or o.owner is not state():  # opened by the parent before a fork
            return
        if attrs:
            o.attrs.update(attrs)
        emit_stage(o.name, o.span, o.parent, o.start, end_ns, o.attrs,
                   type(err).__name__ if err is not None else None)
    except Exception as exc:
        _runtime.fail(exc)


def emit_stage(
    name: str, span: str, parent: str, start: int, end_ns: int, attrs: Dict[str, Any],
    err: Optional[str] = None,
) -> None:
    data = stage_data(name, span, parent, start, end_ns, attrs, err)
    note_end(data["e"])
    note_covered(name, start, data["e"])
    _runtime.emit("span", data)


def note_covered(name: str, start: int, end_ns: int) -> None:
    """Time a named stage covers, for the gap sampler (on the caller's thread: a stage whose
    span the drain thread builds later must already count when the root ends)."""
    st = state()
    if name != "unattributed" and st.collecting:
        st.covered.append((start, max(end_ns, start)))


def stage_data(
    name: str, span: str, parent: str, start: int, end_ns: int, attrs: Dict[str, Any],
    err: Optional[str] = None,
) -> Dict[str, Any]:
    """A stage's span event (pure: ``hooks.stage`` has the drain thread build it)."""
    a: Dict[str, Any] = {"infersight.stage": name}
    if name not in _runtime.BUILTIN_STAGES:
        a["infersight.stage.custom"] = True
    a.update(attrs)
    end_ns = max(end_ns, start)
    data: Dict[str, Any] = {"n": "coldstart." + name, "id": span, "p": parent or _runtime.root_span_id,
                            "tr": _runtime.trace_id, "s": start, "e": end_ns, "a": a}
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
    return state().collecting and not _runtime.root_ended and _runtime.active()


# -- weights: storage ceiling (measured by the agent, cached per device) -----------------


def _cache_file() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "infersight", "storage_ceiling.json")


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
        a["infersight.weights.path"] = path
    if nbytes > 0:
        a["infersight.weights.bytes"] = nbytes
        if seconds > 0:
            rate = nbytes / seconds
            a["infersight.weights.bytes_per_s"] = rate
            ceiling = storage_ceiling(path)
            if ceiling is not None:
                a["infersight.weights.storage_ceiling_bytes_per_s"] = ceiling
                a["infersight.weights.ceiling_ratio"] = rate / ceiling
    return a


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


# -- readiness, warmup, first request ---------------------------------------------------


def _close_warm_locked(now: int) -> Optional[Tuple[str, int, int, Dict[str, Any]]]:
    st = state()
    w = st.warm
    if w is None:
        return None
    st.warm = None
    end_ns = w.end if w.inflight == 0 else now
    attrs: Dict[str, Any] = {"infersight.warmup.forwards": w.n}
    if w.first_end:
        attrs["infersight.warmup.first_forward_s"] = (w.first_end - w.start) / 1e9
    return (w.span, w.start, end_ns, attrs)


def _emit_warm(closed: Optional[Tuple[str, int, int, Dict[str, Any]]]) -> None:
    if closed is not None:
        span, start, end_ns, attrs = closed
        emit_stage("warmup", span, _runtime.root_span_id, start, end_ns, attrs)


def mark_ready(source: str = "mark_ready", t_ns: Optional[int] = None, asked_ns: int = 0,
               attrs: Optional[Dict[str, Any]] = None) -> None:
    """Readiness: emit ``ready_wait`` (last stage end -> now) once; later calls do nothing.
    ``attrs`` go on ``ready_wait`` (``server.port``: the port that listens).

    ``asked_ns``: when launch's readiness request was sent. Stages that ran after it (a
    lazy import the health handler made) are its handling, not start-up: ``ready_wait``
    then runs from the last stage that ended before the request to the first stage the
    request caused, so the server's idle wait for the poll stays covered."""
    st = state()
    if not root_open():
        return
    now = time.time_ns()
    t = t_ns if t_ns is not None else now
    with st.lock:
        if st.ready_ns is not None:
            return
        t = max(t, _runtime.root_start_ns)
        st.ready_ns, st.ready_source = t, source
        if source == "mark_ready":
            st.explicit = True
        closed = _close_warm_locked(now)
    _emit_warm(closed)
    _flush_runs(t)  # import and nn.init runs so far end before ready_wait starts
    start, stop = _ready_wait_span(t, asked_ns)
    a: Dict[str, Any] = {"infersight.ready.source": source}
    if attrs:
        a.update(attrs)
    emit_stage("ready_wait", _runtime.new_span_id(), _runtime.root_span_id, start, stop, a)
    _unlisten()
    sampler = st.sampler
    if sampler is not None:  # the root ends here: later stacks explain no gap (its tick goes on)
        sampler.sample = False
    poll = st.callbacks.get("ready")
    if poll is not None:
        poll(start)


def _ready_wait_span(t: int, asked_ns: int) -> Tuple[int, int]:
    """``ready_wait``'s interval for readiness at ``t`` (see ``mark_ready``)."""
    st = state()
    start = min(st.last_end_ns or t, t)
    if not asked_ns or asked_ns >= t or start <= asked_ns:
        return start, t
    if any(s < asked_ns < e for s, e in st.covered):
        return start, t  # a stage was running when the request came: no idle wait to cover
    before = [e for s, e in st.covered if e <= asked_ns]
    start = max(before) if before else min(_runtime.root_start_ns or asked_ns, asked_ns)
    after = [s for s, e in st.covered if s >= start and e > asked_ns]
    return start, max(start, min(min(after, default=t), t))


def _check_ready_file() -> None:
    """launch --ready-url writes the readiness time to a file; pick it up once."""
    st = state()
    path = st.ready_file
    if path is None or st.ready_ns is not None:
        return
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return
    st.ready_file = None
    parts = text.split()  # "READY_NS [ASKED_NS]": the ready response, when the poll was sent
    ready_at = int(parts[0]) if parts and parts[0].isdigit() else None
    asked = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    mark_ready("ready_url", ready_at, asked)


def forward_begin() -> Optional[Tuple[Any, ...]]:
    """An outermost forward starts in this thread. Returns a token for ``forward_end``."""
    st = state()
    if not root_open() or st.tls.__dict__.get("compile", 0):
        return None  # a forward run by jit.trace or a compiler is part of graph_compile
    if st.ready_ns is None and st.ready_file is not None:
        _check_ready_file()
    if st.ready_ns is None and st.watch_listen:
        check_listening(from_forward=True)
    now = time.time_ns()
    closed = None
    with st.lock:
        if st.ready_ns is None:
            w = st.warm
            if w is None or (w.inflight == 0 and w.seq != st.stage_seq):
                closed = _close_warm_locked(now)
                w = st.warm = _Warm(now)
            w.inflight += 1
            w.n += 1
            token: Optional[Tuple[Any, ...]] = ("w", w, _runtime.current_span.get())
        elif st.first is None and not st.first_done:
            st.first = _First(now, "forward")
            token = ("f", st.first, _runtime.current_span.get())
        else:
            token = None  # inside a visible first request, or after it
    _emit_warm(closed)
    if token is not None:
        _runtime.current_span.set(token[1].span)
        if st.imports is not None:
            st.imports.pause()  # a forward run by a module being imported is not import time
    return token


def forward_end(token: Tuple[Any, ...]) -> None:
    st = state()
    kind, obj, prev = token
    _runtime.current_span.set(prev)
    if st.imports is not None:
        st.imports.resume()
    now = time.time_ns()
    if kind == "w":
        with st.lock:
            obj.inflight -= 1
            obj.end = max(obj.end, now)
            if not obj.first_end:
                obj.first_end = now
            obj.seq = st.stage_seq
        return
    if st.explicit:  # first_response() decides; this forward's end is the fallback
        obj.forward_end = now
        return
    _finish(obj, now)


def request_begin(source: str, attrs: Optional[Dict[str, Any]] = None) -> Optional[_First]:
    """A visible request starts (ASGI middleware). Returns a handle only for the first."""
    st = state()
    if not root_open() or st.first_done or st.first is not None:
        return None
    now = time.time_ns()
    _check_ready_file()
    if st.ready_ns is None and st.watch_listen:
        check_listening()  # listening before this request came: that was readiness
    if st.ready_ns is None:
        mark_ready("request", now)  # a request arriving means the server is ready
    with st.lock:
        if st.first is not None or st.first_done:
            return None
        st.first = f = _First(now, source, attrs)
        if st.ready_source == "fork" and st.ready_ns is not None:
            # forked from a ready server: ready once its own work after the fork was done (a
            # worker's app load); the wait for this request is the wait for traffic
            st.ready_ns, st.ready_source = max(st.ready_ns, min(st.last_end_ns, now)), "fork_served"
    return f


def pending_first() -> bool:
    st = state()
    return st.first is None and not st.first_done and root_open()


def first_response(handle: Optional[_First] = None, attrs: Optional[Dict[str, Any]] = None) -> None:
    """The first response byte left the server: end first_request and the root."""
    st = state()
    if not root_open() or st.first_done:
        return
    now = time.time_ns()
    with st.lock:
        f = st.first
        if handle is not None and f is not handle:
            return
        if f is None:  # no request or forward seen since readiness: a marker at this point
            f = st.first = _First(now, "first_response")
    if attrs:
        f.attrs.update(attrs)
    f.attrs.setdefault("infersight.first_request.ttfb_s", (now - f.start) / 1e9)
    _finish(f, now)


def _finish(f: _First, end_ns: int, ended_by: str = "first_request") -> None:
    """Emit first_request, end the root at its end, and take every hook out."""
    st = state()
    with st.lock:
        if st.first_done:
            return
        st.first_done = True
    attrs = {"infersight.first_request.source": f.source}
    attrs.update(f.attrs)
    emit_stage("first_request", f.span, _runtime.root_span_id, f.start, end_ns, attrs)
    finish_root(end_ns, ended_by, at_readiness=True)


def _flush_runs(end_ns: int, final: bool = False) -> None:
    """Emit the import and ``nn.init`` runs still open (they are emitted when they end)."""
    st = state()
    try:
        if st.imports is not None:
            st.imports.flush()
        build = sys.modules.get(__name__.rsplit(".", 1)[0] + "._build")
        if build is not None:
            build.flush(end_ns, final)
    except Exception as exc:
        _runtime.fail(exc)


def ready_end() -> Optional[int]:
    """When the root ends if readiness is known (a signal in READY_SIGNALS said when), else None."""
    st = state()
    return st.ready_ns if st.ready_ns is not None and st.ready_source in READY_SIGNALS else None


def finish_root(end_ns: Optional[int], ended_by: str, at_readiness: bool = False) -> None:
    """End the root at ``end_ns`` (now if None), or, ``at_readiness``, at readiness when it is
    known: the wait for traffic and the first request (emitted before, from its arrival) then
    lie after the root. ``ended_by`` is what happened (``first_request``, ``exit``): the root
    says ``ready`` when it ended at readiness; a supervisor is told what happened."""
    st = state()
    now = time.time_ns()
    with st.lock:
        closed = _close_warm_locked(now)
    _emit_warm(closed)
    ready = ready_end() if at_readiness else None
    if ready is not None:
        end_ns = ready
    end_at = end_ns if end_ns is not None else now
    try:
        _flush_runs(end_at, final=True)
        children = _workers.reports(st.children_dir) if st.children_dir else []
        st.covered.extend((r[0], r[1]) for r in children)  # the workers' roots nest under ours
        _emit_unattributed(end_at)
        if children:
            _runtime.root_attrs["infersight.coldstart.workers"] = len(children)
        if st.children_ready:
            _workers.cleanup(st.children_dir)
    except Exception as exc:
        _runtime.fail(exc)
    st.collecting = False
    attrs: Dict[str, Any] = {"infersight.coldstart.ended_by": "ready" if ready is not None else ended_by}
    final_role = st.role or _proc.process_role(_proc.command_argv(), _launched())
    if final_role:
        attrs["infersight.process.role"] = final_role
    if st.ready_ns is not None:
        attrs["infersight.coldstart.ready_s"] = (st.ready_ns - _runtime.root_start_ns) / 1e9
        attrs["infersight.ready.source"] = st.ready_source
    start_ns = _runtime.root_start_ns
    _runtime.end_root(end_ns, attrs)
    uninstall()
    if st.parent_dir and st.role != "helper":
        _report_to_parent(st.parent_dir, start_ns, end_at, ended_by)


def _report_to_parent(parent_dir: str, start_ns: int, end_ns: int, ended_by: str) -> None:
    """Tell the supervisor that this worker's cold start ended, once the agent has acked our
    root: the supervisor's root then ends, and the agent counts our root as covering the
    supervisor's wait only if it has seen ours first. Off the caller's thread (the ack may take
    a batch delay); at exit, in line and bounded."""
    c = _runtime.client

    def send() -> None:
        try:
            if c is not None and c.enabled:
                c.flush(REPORT_FLUSH_S)
            _workers.report(parent_dir, start_ns, end_ns, ended_by)
        except Exception as exc:
            _runtime.fail(exc)

    if ended_by == "exit":
        send()
        return
    try:
        # Not a daemon: a worker that exits right after its first response still reports
        # (the interpreter joins it before exit handlers run; bounded by REPORT_FLUSH_S).
        threading.Thread(target=send, name="infersight-report", daemon=False).start()
    except RuntimeError:  # no new threads (interpreter shutting down)
        send()


def _at_exit() -> None:
    """Before the runtime's own exit handler: settle what is still open, then end the root."""
    st = state()
    try:
        if not root_open():
            uninstall()
            return
        _check_ready_file()
        f = st.first
        if f is not None and not st.first_done:
            _finish(f, f.forward_end or time.time_ns(), "exit")
            return
        end_ns = None
        if st.ready_source == "fork" and st.ready_ns is not None:
            # forked from a ready server, never served: ready once its own work after the fork
            # was done (a gunicorn worker's app load); the wait for traffic is no cold start
            end_ns = max(st.ready_ns, st.last_end_ns)
        elif st.main_end_ns and os.getpid() == st.main_pid:
            end_ns = max(st.main_end_ns, st.last_end_ns)  # exit handlers that ran since are not start-up
        finish_root(end_ns, "exit", at_readiness=True)
    except Exception as exc:
        _runtime.fail(exc)


def _install_uvicorn(module: Any) -> None:
    from . import asgi

    asgi.wrap_uvicorn(module)


def _install_gunicorn_sync(module: Any) -> None:
    """gunicorn's sync worker: ``SyncWorker.handle`` serves one accepted connection. The first
    one is the first request, from its arrival (a forked worker's wait for it is then the wait
    for traffic, not its cold start) to its response."""
    cls: Any = getattr(module, "SyncWorker", None)
    handle = getattr(cls, "handle", None)
    if cls is None or handle is None or getattr(handle, "__wrapped__", None) is not None:
        return

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        first = request_begin("gunicorn") if pending_first() else None
        try:
            return handle(self, *args, **kwargs)
        finally:
            if first is not None:
                with _workers.DeferredSignals():  # a stop signal now waits for first_request to go out
                    first_response(first)

    wrapped.__wrapped__ = handle  # type: ignore[attr-defined]
    cls.handle = wrapped
    add_undo(lambda: setattr(cls, "handle", handle) if cls.handle is wrapped else None)


# -- listen() readiness heuristic --------------------------------------------------------

def _install_listen(socket: Any = None) -> None:
    """Wrap ``socket.socket.listen`` once the host imports ``socket`` (never before: ~4 ms)."""
    st = state()
    if socket is None:
        if "socket" not in sys.modules:
            on_import("socket", _install_listen)
            return
        socket = sys.modules["socket"]
    cls = socket.socket
    st.listen_owned = "listen" in cls.__dict__
    st.orig_listen = cls.listen
    orig = st.orig_listen

    def listen(self: Any, *args: Any) -> None:
        orig(self, *args)
        try:
            st = state()
            if (st.collecting and st.ready_ns is None and self.family in (socket.AF_INET, socket.AF_INET6)
                    and self.type == socket.SOCK_STREAM):
                mark_ready("listen", attrs={"server.port": self.getsockname()[1]})
        except Exception as exc:
            _runtime.fail(exc)

    cls.listen = listen  # type: ignore[method-assign,assignment]


def _unlisten() -> None:
    st = state()
    if st.orig_listen is None:
        return
    socket = sys.modules["socket"]
    try:
        if st.listen_owned:
            socket.socket.listen = st.orig_listen  # type: ignore[method-assign]
        elif "listen" in socket.socket.__dict__:
            del socket.socket.listen
    except Exception as exc:
        _runtime.fail(exc)
    st.orig_listen = None


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


# -- install / uninstall ----------------------------------------------------------------

def add_undo(fn: Callable[[], None]) -> None:
    state().undo.append(fn)


def install(boot: int, from_bootstrap: bool = True) -> None:
    """Start cold-start detection in this process (after ``_runtime.activate``)."""
    st = state()
    if st.installed or not _runtime.active():
        return
    from . import _checkpoint, _sampler  # noqa: F401  (imported before the finder: not import time)
    from . import _imports as imports

    st.installed = st.collecting = True
    st.boot_ns = boot or time.time_ns()
    env = os.environ
    st.ready_file = _env.get("INFERSIGHT_READY_FILE")
    env.pop("INFERSIGHT_READY_FILE", None)
    _set_children_dirs(_env.get(_workers.ENV))
    argv = _proc.command_argv()
    st.role = _proc.process_role(argv, _launched())
    if st.role and argv and any(p in argv[0] for p in _proc.HELPER_ENTRY_POINTS):
        env["INFERSIGHT_PROCESS_ROLE"] = st.role  # a compile worker's pool processes are helpers too
    _prepare_children()
    if _env.get("INFERSIGHT_READY_ON_LISTEN"):
        st.watch_listen = True  # the sampler thread also polls the kernel's listening sockets
        _note_inherited_listeners()
        _install_listen()
    on_import("torch", _install_torch)
    on_import("transformers", _install_transformers)
    on_import("tokenizers", _install_transformers)
    on_import("sentencepiece", _install_sentencepiece)
    on_import("uvicorn.config", _install_uvicorn)  # every request of the served ASGI app is timed
    on_import("gunicorn.workers.sync", _install_gunicorn_sync)  # a sync worker's first connection
    _install_stage_rules()
    st.imports = imports
    st.finder = imports.Finder()
    sys.meta_path.insert(0, st.finder)
    _start_sampler()
    atexit.register(_at_exit)
    _register_main_end()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_child)
    if from_bootstrap and _runtime.root_start_ns and st.boot_ns > _runtime.root_start_ns:
        # Interpreter start-up up to the end of these hooks' own set-up (their share apart).
        now = time.time_ns()
        emit_stage("runtime_init", _runtime.new_span_id(), _runtime.root_span_id,
                   _runtime.root_start_ns, now, {"infersight.runtime_init.hooks_s": (now - st.boot_ns) / 1e9})


def _set_children_dirs(parent_dir: Optional[str]) -> None:
    st = state()
    st.parent_dir = parent_dir
    st.children_ready = False
    c = _runtime.client
    if c is None:
        return
    st.children_dir = _workers.children_dir(c.spool_dir, str(c.producer.get("id") or os.getpid()))
    os.environ[_workers.ENV] = st.children_dir


def _prepare_children() -> None:
    """Make the directory where children report (a mkdir; removed when this cold start ends).
    Helpers have no workers."""
    st = state()
    if st.role != "helper" and st.children_dir:
        try:
            st.children_ready = _workers.prepare(st.children_dir)
        except Exception as exc:
            _runtime.fail(exc)


def check_workers() -> None:
    """(Sampler thread) A process with no request of its own whose worker served the first
    request: a supervisor. Its cold start ends there; the workers' roots cover it."""
    st = state()
    try:
        if st.first is not None or st.first_done or not root_open() or not st.children_dir:
            return
        if not st.children_ready:
            return
        done = [r for r in _workers.reports(st.children_dir) if r[2] in _workers.SERVED]
        if done:
            with st.lock:
                if st.first_done or st.first is not None:
                    return
                st.first_done = True  # no first_request of its own will end it any more
            finish_root(max(min(r[1] for r in done), st.last_end_ns), "workers")
    except Exception as exc:
        _runtime.fail(exc)


def _register_main_end() -> None:
    """Note when the main script ends (threading's shutdown runs before atexit): what the
    interpreter does after that, at exit, is not part of the cold start."""
    reg = getattr(threading, "_register_atexit", None)
    if reg is None:
        return

    def main_ended() -> None:
        state().main_end_ns = time.time_ns()

    try:
        reg(main_ended)
    except Exception:
        pass


def _launched() -> bool:
    c = _runtime.client
    return bool(c is not None and c.producer.get("launched"))


def _start_sampler() -> None:
    """The sampler thread: stacks for the gaps (unless INFERSIGHT_SAMPLER=0), and every
    TICK_S the supervisor check and the kernel's listening sockets."""
    st = state()
    if st.role == "helper":
        return
    from . import _checkpoint
    from . import _sampler as sampler

    checkpoint = _checkpoint.Checkpoint()
    s = sampler.Sampler(_state.current.main_ident or 0, sample=_env.get("INFERSIGHT_SAMPLER"))

    def tick() -> None:  # on the sampler thread, every TICK_S
        _tick()
        try:
            checkpoint.tick(s.samples)
        except Exception as exc:
            _runtime.fail(exc)

    s.tick = tick
    _checkpoint.current = checkpoint
    st.sampler = s
    s.start()


def _note_inherited_listeners() -> None:
    """Sockets that already listen when the hooks start (socket activation, a re-exec) say
    nothing of readiness: the watch ignores them. Held but not yet listening (a supervisor's
    bound socket that a uvicorn worker gets at spawn) they still count when they start to.
    The table is read only when the process holds a socket besides the hooks' own."""
    from . import _listening

    st = state()
    held = _listening.socket_inodes("self")
    c = _runtime.client
    own = getattr(c, "_sock", None) if c is not None else None
    if own is not None:
        try:
            held.discard(os.fstat(own.fileno()).st_ino)
        except OSError:
            pass
    if held:
        st.inherited_sockets = held & set(_listening.ListenWatch(lambda: ["self"]).tables("self"))


def _tick() -> None:
    check_workers()
    check_listening()


LISTEN_POLL_MIN_NS = 20_000_000  # a forward asks the kernel at most this often
_listen_poll = threading.Lock()  # one poll at a time (acquired without waiting)


def check_listening(from_forward: bool = False) -> None:
    """Readiness from the kernel's socket tables: a listening socket this process owns
    (``_listening``). A server whose socket is opened in C (uvloop) never calls
    ``socket.listen``; the ``listen()`` wrapper is exact where it does (it comes first).
    Polled by the sampler thread every TICK_S, and by a forward or a request that comes
    before readiness (at most every LISTEN_POLL_MIN_NS): a request served within a tick of
    the listen is the first request, not warmup."""
    st = state()
    if st.ready_ns is not None or not st.watch_listen:
        return
    now = time.time_ns()
    if from_forward and now - st.listen_polled_ns < LISTEN_POLL_MIN_NS:
        return
    if not _listen_poll.acquire(False):
        return
    try:
        st.listen_polled_ns = now
        if not root_open():
            return
        w = st.listen_watch
        if w is None:
            from . import _listening

            w = st.listen_watch = _listening.ListenWatch(lambda: ["self"], inherited=st.inherited_sockets)
        if st.rule_stages_open:
            return  # listening inside a start-up call is that call's own (rule_stage_closed)
        found = w.poll()
        if found is not None and st.ready_ns is None and not st.rule_stages_open:
            kind, where = found
            mark_ready("listening_socket", attrs={"server.port": where} if kind == "tcp" else
                       {"server.address": where, "network.transport": "unix"})
    except Exception as exc:
        _runtime.fail(exc)
    finally:
        _listen_poll.release()


def rule_stage_opened(span: str) -> None:
    """A stage rule's call starts (``_stagerules``) in ``span``: no readiness from the
    kernel's tables until every such call has returned; children started meanwhile by
    another process on our behalf nest under it (``_workers.publish_current``)."""
    st = state()
    with st.lock:
        st.rule_stages_open += 1
    if st.children_ready and st.children_dir:
        _workers.publish_current(st.children_dir, span)


def rule_stage_closed() -> None:
    """A stage rule's call returned. When it was the last one running, the sockets that
    started to listen meanwhile are the call's own machinery (Ray's core worker RPC server
    inside ``ray.init``, a worker's inside ``connect``), never readiness: the watch takes
    them as foreign. One table read per outermost rule call, before readiness only."""
    st = state()
    with st.lock:
        st.rule_stages_open = n = max(0, st.rule_stages_open - 1)
    if st.children_ready and st.children_dir:
        _workers.publish_current(st.children_dir, _runtime.current_span.get() or _runtime.root_span_id)
    if n or st.ready_ns is not None or not st.watch_listen or not root_open():
        return
    if not _listen_poll.acquire(True, 0.1):  # the sampler thread polls (milliseconds): never wait long
        return
    try:
        w = st.listen_watch
        if w is None:
            from . import _listening

            w = st.listen_watch = _listening.ListenWatch(lambda: ["self"], inherited=st.inherited_sockets)
        w.absorb()
    except Exception as exc:
        _runtime.fail(exc)
    finally:
        _listen_poll.release()


def _stop_sampler() -> Any:
    s = state().sampler
    if s is not None:
        s.stop()
    return s


def _emit_unattributed(end_ns: int) -> None:
    """Every stretch of the root that no stage covers (>= 50 ms): a span with the sampler's top."""
    st = state()
    s = _stop_sampler()
    if st.role == "helper":
        return
    from . import _sampler as sampler

    samples = s.samples if s is not None else []
    for start, stop in sampler.uncovered(st.covered, _runtime.root_start_ns, end_ns):
        a: Dict[str, Any] = {"infersight.unattributed.samples": sum(1 for t, _ in samples if start <= t < stop)}
        top = sampler.top_labels(samples, start, stop)
        if top:
            a["infersight.unattributed.top"] = top
        emit_stage("unattributed", _runtime.new_span_id(), _runtime.root_span_id, start, stop, a)


def _install_sentencepiece(mod: Any) -> None:
    from . import _build

    _build._install_sentencepiece(mod)


def _install_transformers(_mod: Any) -> None:
    from . import _build  # model_build / tokenizer_load: only where transformers or tokenizers load

    _build.install_hf()


def _install_stage_rules() -> None:
    try:
        from . import _stagerules  # rules/stages.toml and the rules directories: watch their modules

        _stagerules.install()
    except Exception as exc:
        _runtime.fail(exc)


def _install_torch(torch: Any) -> None:
    from . import _torch  # only in processes that import torch

    _torch.install(torch)


def uninstall() -> None:
    """Take every wrapper out (at the end of the root); safe to call twice."""
    st = state()
    st.collecting = False
    _unlisten()
    if st.finder is not None:
        try:
            sys.meta_path.remove(st.finder)
        except ValueError:
            pass
        st.finder = None
    _stop_sampler()
    st.post_import.clear()
    st.watched.clear()
    while st.undo:
        fn = st.undo.pop()
        try:
            fn()
        except Exception as exc:
            _runtime.fail(exc)


def _after_fork_child() -> None:
    """A forked child starts its own cold start (its root: the fork, under our span), on the
    fresh state ``_state`` gave it (after ``_runtime``'s handler, registered before ours)."""
    global _listen_poll
    _listen_poll = threading.Lock()  # the sampler thread may have held it at the fork
    st = state()
    try:
        _set_children_dirs(st.parent_dir)
        was_collecting = st.collecting  # the parent's: its wrappers are still in place
        st.collecting = st.installed and _runtime.active()
        if st.collecting:
            _prepare_children()
        if st.imports is not None:
            st.imports.after_fork_child()
        if st.collecting:
            _start_sampler()
        if st.collecting and st.imports is not None and st.finder is None:
            st.finder = st.imports.Finder()  # the parent's cold start ended: its finder is gone
            sys.meta_path.insert(0, st.finder)
        if st.collecting and not was_collecting and "torch" in sys.modules:
            from . import _torch  # the parent took its wrappers out: this child needs them again

            _torch.install(sys.modules["torch"])
        if st.collecting and _runtime.root_start_ns:
            # the fork (the root starts at its clock tick) and the at-fork handlers, ours
            # included: the child's runtime_init, as a new interpreter's start-up is
            now = time.time_ns()
            if now > _runtime.root_start_ns:
                emit_stage("runtime_init", _runtime.new_span_id(), _runtime.root_span_id,
                           _runtime.root_start_ns, now, {"infersight.runtime_init.forked": True})
    except Exception as exc:
        _runtime.fail(exc)
