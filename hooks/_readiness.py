"""Readiness and the end of the cold start (stdlib only).

Built on ``_recorder``; the instrumenters that see readiness or requests call in here
(``_torch``'s forwards, ``asgi``, ``_stagerules``), and ``_coldstart`` sets it up. It owns:

- readiness (``mark_ready()``, the first TCP ``listen()``, launch's ``--ready-url`` file, a
  listening socket in the kernel's tables, a stage rule), ``ready_wait``, ``warmup`` runs and
  ``first_request``;
- the end of the ``coldstart`` root: at readiness when a signal said when (``READY_SIGNALS``),
  else at the end of ``first_request`` (else at exit). The root goes out once the first request
  is answered (``first_request`` follows the wait for traffic, after the root), after which
  every wrapper is removed (``uninstall``) so the served process pays nothing in steady state;
- ``unattributed`` spans for the gaps (``_sampler``), and a worker's report to its supervisor.

Nothing here raises into user code: every entry point catches and calls ``_runtime.fail``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from . import _contract, _env, _lazy, _proc, _runtime, _state, _workers
from ._recorder import (  # noqa: F401
    add_undo,
    covered_pairs,
    emit_stage,
    end_runtime_init,
    flush_runs,
    last_end,
    on_import,
    open_runs,
    root_open,
    state,
)

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Dict, Optional, Set, Tuple

REPORT_FLUSH_S = 1.0  # a worker waits this long at most for the agent's ack before telling its supervisor
FINISH_WAIT_S = 2.0  # the exit handler waits this long at most for another thread that ends the root
REPORT_JOIN_S = REPORT_FLUSH_S + 1.0  # ... and for a report to the supervisor in flight (its flush, one write)
# Readiness signals: the root ends at readiness when one of these said when it came. A
# request that arrives first ("request") is no signal: the first response ends the root then.
READY_SIGNALS = _contract.READY_SIGNALS


class _Warm:
    """A run of outermost forwards before readiness with no other stage in between, in one span: its parent,
    the span its first forward ran in (a stage, such as BentoML's ``service_init`` around a service's warmup in
    its constructor; else the root). A forward in another span starts a new run once this one has none in
    flight; one that comes while it has, joins it, and the run is then the root's (``forward_begin``)."""

    __slots__ = ("end", "first_end", "inflight", "n", "parent", "seq", "span", "start")

    def __init__(self, start: int, parent: str) -> None:
        self.span = _runtime.new_span_id()
        self.parent = parent
        self.start = start
        self.end = start
        self.first_end = 0
        self.inflight = 0
        self.n = 0
        self.seq = state().stage_mark


class _First:
    """The first request: visible (ASGI, first_response) or the first forward after readiness."""

    __slots__ = ("attrs", "forward_end", "source", "span", "start")

    def __init__(self, start: int, source: str, attrs: Optional[Dict[str, Any]] = None) -> None:
        self.span = _runtime.new_span_id()
        self.start = start
        self.source = source
        self.attrs: Dict[str, Any] = dict(attrs or {})
        self.forward_end = 0  # explicit mode: the forward ended, first_response() pending


# -- readiness, warmup, first request ---------------------------------------------------


def _close_warm_locked(now: int) -> Optional[Tuple[str, str, int, int, Dict[str, Any]]]:
    st = state()
    w = st.warm
    if w is None:
        return None
    st.warm = None
    end_ns = w.end if w.inflight == 0 else now
    attrs: Dict[str, Any] = {"infersight.warmup.forwards": w.n}
    if w.first_end:
        attrs["infersight.warmup.first_forward_s"] = (w.first_end - w.start) / 1e9
    return (w.span, w.parent, w.start, end_ns, attrs)


def _emit_warm(closed: Optional[Tuple[str, str, int, int, Dict[str, Any]]]) -> None:
    if closed is not None:
        span, parent, start, end_ns, attrs = closed
        emit_stage("warmup", span, parent, start, end_ns, attrs)


def mark_ready(source: str = "mark_ready", t_ns: Optional[int] = None, asked_ns: int = 0,
               attrs: Optional[Dict[str, Any]] = None) -> None:
    """Readiness: emit ``ready_wait`` (last stage end -> now) once; later calls do nothing.
    ``attrs`` go on ``ready_wait`` (``server.port``: the port that listens). A pre-fork master's
    ``ready_wait`` is held until one of its workers is ready (``check_workers``, ``_finish_root``).

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
        t = max(t, _runtime.state().root_start_ns)
        st.ready_ns, st.ready_source = t, source
        if source == "mark_ready":
            st.explicit = True
        closed = _close_warm_locked(now)
    _emit_warm(closed)
    flush_runs(t)  # import and nn.init runs so far end before ready_wait starts
    start, stop = _ready_wait_span(t, asked_ns)
    a: Dict[str, Any] = {_contract.READY_SOURCE: source}
    if attrs:
        a.update(attrs)
    if source in PORT_LOOKUP_SOURCES and "server.port" not in a and "server.address" not in a:
        port = _own_port()
        if port is not None:
            a["server.port"] = port
    if st.supervising and st.children_ready and not _a_worker_ready(st):
        # A pre-fork master's listen queues connections for workers that may never serve (each failed to boot):
        # its ready_wait waits for one of them to be ready (``check_workers``), or for the end of its cold start
        # where its readiness stands (``at_exit``). Meanwhile it is warming, and killed, it was never ready.
        with st.lock:
            st.held_ready = (start, stop, a)
    else:
        _send_ready_wait(st, start, stop, a)
    _unlisten()
    _readiness_reached(st, start)  # (the sampler's tick goes on: only its stacks stop)
    _runtime.ring_launch()  # a launch that holds its agent back starts it now


def _send_ready_wait(st: _state.ColdStart, start: int, stop: int, a: Dict[str, Any]) -> None:
    """Readiness, said: ``ready_wait``, the hello's ready time, and to the supervisor."""
    emit_stage("ready_wait", _runtime.new_span_id(), _runtime.state().root_span_id, start, stop, a)
    if st.role != _contract.ROLE_HELPER:  # a helper serves nothing: no balancer routes to it
        _runtime.note_ready(stop, a.get("server.port"))
    _tell_parent_ready(st)


def _release_ready(st: _state.ColdStart) -> None:
    """Send a supervisor's held ``ready_wait`` (once)."""
    with st.lock:
        held, st.held_ready = st.held_ready, None
    if held is not None:
        _send_ready_wait(st, *held)


def _tell_parent_ready(st: _state.ColdStart) -> None:
    """This process is ready (not provisionally: a worker forked from a ready master once it serves): its
    supervisor's held readiness may go (``_workers.report_ready``)."""
    if st.parent_dir and st.role != _contract.ROLE_HELPER:
        _workers.report_ready(st.parent_dir)


# Readiness that names no port (the user's mark_ready(), launch's --ready-url, a stage rule's): the one TCP port this
# process listens on, if it listens on exactly one, so that a balancer's hints (agent/routing) find the server by the
# port it really serves on. Not for readiness by a request (its own thread: no table read in a request's path).
PORT_LOOKUP_SOURCES = ("mark_ready", "ready_url", "stage_rule")


def _own_port() -> Optional[int]:
    try:
        if not _lazy.fresh("_listening", "the serving port of an explicit readiness"):
            return None
        from . import _listening

        ports = _listening.own_tcp_ports(state().side_sockets)  # a metrics exporter's port is none
    except Exception:
        return None
    return ports[0] if len(ports) == 1 else None


def _ready_wait_span(t: int, asked_ns: int) -> Tuple[int, int]:
    """``ready_wait``'s interval for readiness at ``t`` (see ``mark_ready``)."""
    st = state()
    start = min(last_end() or t, t)
    if not asked_ns or asked_ns >= t or start <= asked_ns:
        return start, t
    covered = covered_pairs(st)
    if any(s < asked_ns < e for s, e in covered):
        return start, t  # a stage was running when the request came: no idle wait to cover
    before = [e for s, e in covered if e <= asked_ns]
    start = max(before) if before else min(_runtime.state().root_start_ns or asked_ns, asked_ns)
    after = [s for s, e in covered if s >= start and e > asked_ns]
    return start, max(start, min(min(after, default=t), t))


def _check_ready_file() -> None:
    """launch --ready-url writes the readiness time to a file; pick it up once. In a process that
    launch's child started (``ready_file_inherited``: a spawned worker), only once it serves itself
    (``server_started``), and never before that: with several workers, the URL's answer says that
    one of them serves, not which."""
    st = state()
    path = st.ready_file
    if path is None or st.ready_ns is not None:
        return
    serving = st.serving_ns
    if st.ready_file_inherited and not serving:
        return
    try:
        with open(path, "rb") as f:  # bytes: an "ascii" text file imports that codec, in a request the app's import
            text = f.read().decode("ascii", "replace").strip()
    except OSError:
        return
    st.ready_file = None
    parts = text.split()  # "READY_NS [ASKED_NS]": the ready response, when the poll was sent
    ready_at = int(parts[0]) if parts and parts[0].isdigit() else None
    asked = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    attrs = None
    if st.ready_file_inherited:
        attrs = dict(st.serving_attrs)
        if ready_at is None or ready_at < serving:
            ready_at, asked = serving, 0  # the URL answered before this process served: another one did
    mark_ready("ready_url", ready_at, asked, attrs)


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
        # Forked from a ready server, a worker is ready only when its own work after the fork is
        # done: until something says so (fork_ready, a request), its forwards are warmup.
        if st.ready_ns is None or (st.ready_source == "fork" and not st.rule_fork_ready_sent):
            w = st.warm
            parent = _runtime.current_span.get() or _runtime.state().root_span_id
            if w is None or (w.inflight == 0 and (w.seq != st.stage_mark or w.parent != parent)):
                closed = _close_warm_locked(now)
                w = st.warm = _Warm(now, parent)
            elif w.parent != parent:
                # forwards of two spans at once (another thread's, outside the stage): the run holds both,
                # and would outlast the stage it ran in; only the root holds it whole
                w.parent = _runtime.state().root_span_id
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
            obj.seq = st.stage_mark
            if st.ready_source == "fork":  # a ready = "entry" rule's fork readiness comes after it
                st.last_end_ns = max(st.last_end_ns, now)
        return
    if st.explicit:  # first_response() decides; this forward's end is the fallback
        obj.forward_end = now
        return
    _finish(obj, now)


def request_begin(source: str, attrs: Optional[Dict[str, Any]] = None, t_ns: int = 0) -> Optional[_First]:
    """A visible request starts (ASGI middleware, gunicorn's sync worker), at ``t_ns`` (0: now).
    Returns a handle only for the first."""
    st = state()
    if not root_open() or st.first_done or st.first is not None:
        return None
    now = t_ns or time.time_ns()
    _check_ready_file()
    if st.ready_ns is None and st.watch_listen:
        check_listening()  # listening before this request came: that was readiness
    if st.ready_ns is None:
        mark_ready("request", now)  # a request arriving means the server is ready
    closed = None
    # (an import run not sent yet, a worker's app import, is work done too: as in fork_ready)
    runs_end = max((r[4] for r in open_runs()), default=0) if st.ready_source == "fork" else 0
    with st.lock:
        if st.first is not None or st.first_done:
            return None
        st.first = f = _First(now, source, attrs)
        unconfirmed = st.ready_source == "fork" and not st.rule_fork_ready_sent
        if st.ready_source == "fork" and st.ready_ns is not None:
            # forked from a ready server: ready once its own work after the fork was done (a
            # worker's app load and warmup, whose run ends here); the wait for this request is
            # the wait for traffic
            closed = _close_warm_locked(now)
            done = max(last_end(), runs_end, closed[3] if closed is not None else 0)
            st.ready_ns, st.ready_source = max(st.ready_ns, min(done, now)), "fork_served"
    _emit_warm(closed)
    if unconfirmed:  # (a confirmed one told its supervisor already)
        _tell_parent_ready(st)
    return f


def fork_ready(via: str = "", attrs: Optional[Dict[str, Any]] = None, at_last_stage: bool = False) -> bool:
    """A worker forked from a ready server serves now (uvicorn's ``Server.startup`` returned, it
    called ``listen()``, it entered a ``ready = "entry"`` rule's serving loop: ``at_last_stage``,
    ready when its last stage ended): its own work after the fork (a gunicorn worker's app load
    without ``--preload``, its lifespan, its warmup) is done. Until then its fork readiness was
    provisional and its forwards warmup. Sends that readiness as ``ready_wait`` (source ``fork``,
    ``via``): a worker killed later has its root ended there by the agent; its first request's
    arrival then makes it ``fork_served``, or its exit ends the root there. False: not a worker
    waiting for that (or it was sent already)."""
    st = state()
    if st.ready_source != "fork" or st.rule_fork_ready_sent or not root_open():
        return False
    now = time.time_ns()
    # the runs not emitted yet count as stages that ended: a gunicorn worker's app import (2 s, one run until
    # this flush_runs below) left its ready_wait at its runtime_init's end, before the whole load
    runs_end = max((r[4] for r in open_runs()), default=0) if at_last_stage else 0
    with st.lock:
        if st.ready_source != "fork" or st.rule_fork_ready_sent or st.ready_ns is None:
            return False
        st.rule_fork_ready_sent = True  # sent once, whichever signal comes first
        closed = _close_warm_locked(now)
        if at_last_stage:
            done = max(last_end(), runs_end, closed[3] if closed is not None else 0)
            ready = max(st.ready_ns, min(done, now))
        else:
            ready = max(st.ready_ns, now)
        st.ready_ns = ready
    _emit_warm(closed)
    flush_runs(ready)  # import and nn.init runs so far end before ready_wait starts
    start = max(_runtime.state().root_start_ns, min(last_end() or ready, ready))
    a: Dict[str, Any] = {_contract.READY_SOURCE: "fork"}
    if via:
        a["infersight.ready.via"] = via
    if attrs:
        a.update(attrs)
    _send_ready_wait(st, start, ready, a)
    _readiness_reached(st, start)
    return True


def _readiness_reached(st: _state.ColdStart, start: int) -> None:
    """What readiness ends, however it came: the stack sampler (the root ends here, or at the
    first request's readiness: no gap after it to explain), and the readiness callback (the CUDA
    context's state at ``start``)."""
    sampler = st.sampler
    if sampler is not None:
        sampler.sample = False
    poll = st.callbacks.get("ready")
    if poll is not None:
        poll(start)


def ready_for_request() -> bool:
    """(uvicorn's own wrap of the app, ``asgi``) Whether a request that arrives now is the first
    request: readiness is known already, from a signal other than a request (a listening socket,
    ``--ready-url``, a mark, a stage rule, the fork of a ready server). A readiness probe that
    arrives before is not: it would end the cold start at the probe."""
    st = state()
    if st.ready_ns is None:
        if st.ready_file is not None:
            _check_ready_file()
        if st.ready_ns is None and st.watch_listen:
            check_listening(from_forward=True)  # at most every LISTEN_POLL_MIN_NS
    return st.ready_ns is not None and st.ready_source != "request"


def pending_first() -> bool:
    st = state()
    return st.first is None and not st.first_done and root_open()


def first_response(handle: Optional[_First] = None, attrs: Optional[Dict[str, Any]] = None, t_ns: int = 0) -> None:
    """The first response byte left the server (at ``t_ns``; 0: now): end first_request and the root."""
    st = state()
    if not root_open() or st.first_done:
        return
    now = t_ns or time.time_ns()
    with st.lock:
        f = st.first
        if handle is not None and f is not handle:
            return
        if f is None:  # no request or forward seen since readiness: a marker at this point
            f = st.first = _First(now, "first_response")
    if attrs:
        f.attrs.update(attrs)
    f.attrs.setdefault(_contract.FIRST_REQUEST_TTFB_S, (now - f.start) / 1e9)
    _finish(f, now)


def _finish(f: _First, end_ns: int, ended_by: str = "first_request") -> None:
    """Emit first_request, end the root at its end, and take every hook out."""
    st = state()
    with st.lock:
        if st.first_done:
            return
        st.first_done = True
    attrs = {_contract.FIRST_REQUEST_SOURCE: f.source}
    attrs.update(f.attrs)
    emit_stage("first_request", f.span, _runtime.state().root_span_id, f.start, end_ns, attrs)
    finish_root(end_ns, ended_by, at_readiness=True)


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
    with st.lock:
        second = st.finishing
        st.finishing = True
    if second:  # another thread ends it (the sampler's tick, the exit handler): once is enough
        st.finished.wait(FINISH_WAIT_S)
        return
    done = st.finished
    try:
        _finish_root(st, end_ns, ended_by, at_readiness)
    except BaseException:
        if not _runtime.state().root_ended:  # interrupted half way (a signal's exception): the next may end it
            with st.lock:
                st.finishing = False
                st.finished = threading.Event()
        raise
    finally:
        done.set()


def _finish_root(st: _state.ColdStart, end_ns: Optional[int], ended_by: str, at_readiness: bool) -> None:
    end_runtime_init(0)  # the main program's start was not seen: up to the hooks' set-up
    if st.ready_ns is not None:
        _release_ready(st)  # a supervisor's readiness stands (a worker was ready, or none said otherwise)
    now = time.time_ns()
    with st.lock:
        closed = _close_warm_locked(now)
    _emit_warm(closed)
    ready = ready_end() if at_readiness else None
    if ready is not None:
        end_ns = ready
    end_at = end_ns if end_ns is not None else now
    covered_s: Optional[float] = None
    try:
        flush_runs(end_at, final=True)
        covered_s = _own_covered_s(st, end_at)  # before the workers' roots join the covered intervals
        children = _workers.reports(st.children_dir) if st.children_dir else []
        for r in children:  # the workers' roots nest under ours
            st.covered += (r[0], r[1])
        _emit_unattributed(end_at)
        if children:
            _runtime.state().root_attrs[_contract.WORKERS] = len(children)
            # how many of them were ever ready (a worker that failed to boot, or was stopped while it
            # loaded, reports "exit"): none, and this process's own readiness (its listen) served nobody
            _runtime.state().root_attrs[_contract.WORKERS_READY] = sum(1 for r in children if _was_ready(r))
        if st.children_ready:
            _workers.cleanup(st.children_dir)
    except Exception as exc:
        _runtime.fail(exc)
    st.collecting = False
    attrs: Dict[str, Any] = {_contract.ENDED_BY: "ready" if ready is not None else ended_by}
    if covered_s is not None:
        attrs[_contract.COVERED_S] = covered_s
    final_role = st.role or _proc.process_role(_proc.command_argv(), launched())
    if final_role:
        attrs[_contract.PROCESS_ROLE] = final_role
    if st.ready_ns is not None:
        attrs[_contract.READY_S] = (st.ready_ns - _runtime.state().root_start_ns) / 1e9
        attrs[_contract.READY_SOURCE] = st.ready_source
    start_ns = _runtime.state().root_start_ns
    _runtime.end_root(end_ns, attrs)
    uninstall()
    if st.parent_dir and st.role != "helper":
        # What happened (first_request, workers: it served), else how its root ended: "ready" for one that
        # was ready and exited without serving, "exit" for one that never was (WORKERS_READY counts the others)
        _report_to_parent(st.parent_dir, start_ns, end_at,
                          ended_by if ended_by in _workers.SERVED else attrs[_contract.ENDED_BY])


def _report_to_parent(parent_dir: str, start_ns: int, end_ns: int, ended_by: str) -> None:
    """Tell the supervisor that this worker's cold start ended, once the agent has acked our
    root: the supervisor's root then ends, and the agent counts our root as covering the
    supervisor's wait only if it has seen ours first. Off the caller's thread (the ack may take
    a batch delay); at exit, in line and bounded."""
    c = _runtime.state().client

    def send() -> None:
        try:
            if c is not None and c.enabled:
                c.flush(REPORT_FLUSH_S)
            _workers.report(parent_dir, start_ns, end_ns, ended_by)
        except Exception as exc:
            _runtime.fail(exc)

    if ended_by == "exit" or state().exiting:  # a thread started by an exit handler is never joined
        send()
        return
    try:
        # Not a daemon: a worker that exits right after its first response still reports
        # (the interpreter joins it before exit handlers run; bounded by REPORT_FLUSH_S).
        t = threading.Thread(target=send, name="infersight-report", daemon=False)
        t.start()
        state().reporting = t  # (only once started: a thread that never ran cannot be joined)
    except RuntimeError:  # no new threads (interpreter shutting down)
        send()


def _join_report(st: _state.ColdStart) -> None:
    """At exit: a report to the supervisor still in flight is written before the process goes. An exit by
    the interpreter has joined it already (it is no daemon); a uvicorn worker stopped by SIGTERM raises it
    again with its default action once it has shut down (the exit flush runs just before): that kills the
    process at once, and its supervisor, which joined it, found no report (its cold start then ended at its
    readiness, not by its workers) whenever the agent was slow to ack (the flush waits REPORT_FLUSH_S).
    The wait is part of the exit's delivery budget (``INFERSIGHT_EXIT_FLUSH_S``): at most that long, and the
    exit flush that follows gets what is left of it (``exit_waited_s``)."""
    t = st.reporting
    if t is None or t is threading.current_thread() or not t.is_alive():
        return
    t0 = time.monotonic()
    t.join(max(0.0, min(REPORT_JOIN_S, _env.exit_flush_s())))
    st.exit_waited_s += time.monotonic() - t0


def at_exit() -> None:
    """Before the runtime's own exit handler: settle what is still open, then end the root."""
    st = state()
    st.exiting = True
    try:
        _join_report(st)
        if not root_open():
            if st.finishing and not st.finished.wait(FINISH_WAIT_S):
                return  # the sampler's tick is still ending it (it uninstalls at its end)
            uninstall()
            return
        _check_ready_file()
        f = st.first
        if f is not None and not st.first_done:
            _finish(f, f.forward_end or time.time_ns(), "exit")
            return
        # A supervisor stopped after its worker served (it joined the worker, whose report is written by
        # then) may exit before the sampler's next tick reads that report: read it now.
        check_workers()
        if not root_open():
            return
        if st.supervising and st.ready_ns is not None and not _workers_were_ready(st):
            # a pre-fork master none of whose workers was ever ready (each failed to boot, or was stopped while
            # it loaded): its own listen (or a worker's on its socket) only queued connections nobody served:
            # never ready, its whole life its start
            with st.lock:
                st.ready_ns = None
                st.ready_source = ""
                st.held_ready = None  # nor the ready_wait it held
        end_ns, ended_by = None, "exit"
        if st.ready_source == "fork" and st.ready_ns is not None and not st.rule_fork_ready_sent:
            # provisional, never confirmed: it never reached its serving loop (a gunicorn worker whose
            # app failed to load, or that was stopped while loading): never ready, its whole life its start
            with st.lock:
                st.ready_ns = None
                st.ready_source = ""
        if st.ready_source == "fork" and st.ready_ns is not None:
            # forked from a ready server, never served: ready once its own work after the fork
            # was done (a gunicorn worker's app load and warmup, whose run ends here); the wait
            # for traffic is no cold start
            with st.lock:
                closed = _close_warm_locked(time.time_ns())
            _emit_warm(closed)
            end_ns = max(st.ready_ns, last_end(), closed[3] if closed is not None else 0)
            ended_by = "ready"  # its cold start ended there, as the agent says of one that dies unflushed
        elif st.main_end_ns and os.getpid() == st.main_pid:
            end_ns = max(st.main_end_ns, last_end())  # exit handlers that ran since are not start-up
        finish_root(end_ns, ended_by, at_readiness=True)
    except Exception as exc:
        _runtime.fail(exc)


# -- listen() readiness heuristic --------------------------------------------------------


def install_listen(socket: Any = None) -> None:
    """Wrap ``socket.socket.listen`` once the host imports ``socket`` (never before: ~4 ms)."""
    st = state()
    if socket is None:
        if "socket" not in sys.modules:
            on_import("socket", install_listen)
            return
        socket = sys.modules["socket"]
    cls = socket.socket
    st.listen_owned = "listen" in cls.__dict__
    st.orig_listen = cls.listen
    orig = st.orig_listen

    def listen(self: Any, *args: Any) -> None:
        early = side = False
        try:
            # held before it listens: no poll of the tables sees it first
            side = _side_listen(self)
            early = not side and _early_listen(self)
        except Exception as exc:
            _runtime.fail(exc)
        orig(self, *args)
        if early or side:
            return  # its server says when it serves (server_started); a side server's never does
        try:
            st = state()
            if (st.collecting and (st.ready_ns is None or st.ready_source == "fork")
                    and self.family in (socket.AF_INET, socket.AF_INET6) and self.type == socket.SOCK_STREAM):
                if st.ready_ns is None:
                    mark_ready("listen", attrs={"server.port": self.getsockname()[1]})
                else:  # a worker forked from a ready server listens on its own: it serves now
                    fork_ready("listen", {"server.port": self.getsockname()[1]})
        except Exception as exc:
            _runtime.fail(exc)

    cls.listen = listen  # type: ignore[method-assign,assignment]


def listens_early(code: Any) -> None:
    """``listen()`` calls made by ``code`` (its own frame) come before its server has loaded its app
    (Hypercorn's ``trio_worker`` listens on its supervisor's sockets, then imports the app): they are no
    readiness, nor are those sockets in the kernel's tables, until the server says it serves on them
    (``server_started``, which claims them)."""
    state().early_listen_codes.add(code)


def _early_listen(sock: Any) -> bool:
    """(The ``listen()`` wrapper, before the socket listens) Whether its caller listens early
    (``listens_early``): the socket is then held as shared, as one inherited is."""
    st = state()
    if not st.early_listen_codes or not st.collecting or sys._getframe(2).f_code not in st.early_listen_codes:
        return False
    inode = os.fstat(sock.fileno()).st_ino
    poll = st.listen_poll
    got = poll.acquire(True, 0.1)  # a poll in progress (milliseconds) makes its watch first: both get it
    try:
        st.inherited_sockets.add(inode)
        w = st.listen_watch
        if w is not None:
            w.shared.add(inode)
    finally:
        if got:
            poll.release()
    return True


def _side_listen(sock: Any) -> bool:
    """(The ``listen()`` wrapper, before the socket listens) Whether a side server starts on this thread
    (``_sideservers``: a metrics exporter's): its socket is then a side socket, never readiness."""
    st = state()
    if not st.tls.__dict__.get("side", 0):
        return False
    st.side_sockets.add(os.fstat(sock.fileno()).st_ino)
    return True


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


# -- supervisors, the kernel's listening sockets (the sampler thread's tick) ------------


def check_workers() -> None:
    """(Sampler thread; the exit handler too) A process with no request of its own whose worker served the first
    request: a supervisor. Its cold start ends there; the workers' roots cover it."""
    st = state()
    try:
        if st.first is not None or st.first_done or not root_open() or not st.children_dir:
            return
        if st.held_ready is not None and _a_worker_ready(st):
            _release_ready(st)  # a pre-fork master: one of its workers is ready
        if not st.children_ready or st.ready_rules_open:
            return  # a ``ready = true`` call (serve.run deploying) decides this process's readiness: its return
        done = [r for r in _workers.reports(st.children_dir) if r[2] in _workers.SERVED]
        if done:
            # a worker served once ready: under --ready-url the URL had answered (this process reads the
            # answer only at a forward, a request or its exit: none in a supervisor), its readiness too
            _check_ready_file()
            with st.lock:
                if st.first_done or st.first is not None:
                    return
                st.first_done = True  # no first_request of its own will end it any more
            finish_root(max(min(r[1] for r in done), last_end()), _contract.ENDED_BY_WORKERS)
    except Exception as exc:
        _runtime.fail(exc)


def supervise() -> None:
    """This process is a pre-fork master (gunicorn's arbiter, Hypercorn's main process with workers): its
    workers serve for it. Its own readiness (its ``listen()``, or the kernel's tables once a worker listens
    on its socket) stands at its exit only if one of its workers that reported was ever ready."""
    state().supervising = True


def _was_ready(report: Tuple[int, int, str]) -> bool:
    """A worker's report (``_workers.reports``) says it was ready at some point (it served, or ended its
    cold start at readiness); "exit": it never was (it failed to boot, or was stopped while it loaded)."""
    return report[2] != _contract.ENDED_BY_EXIT


def _a_worker_ready(st: _state.ColdStart) -> bool:
    """Whether one of this process's workers said it is ready, or reported that it was."""
    if not st.children_dir:
        return False
    return _workers.ready_children(st.children_dir) > 0 or any(_was_ready(r) for r in _workers.reports(st.children_dir))


def _workers_were_ready(st: _state.ColdStart) -> bool:
    """Whether this supervisor's workers were ever ready, as far as they said: one said it was ready (also one
    SIGKILLed since, which never reports its end), or reported it; True as well when none reported (nothing
    says it was not)."""
    return _a_worker_ready(st) or not (_workers.reports(st.children_dir) if st.children_dir else [])


def launched() -> bool:
    c = _runtime.state().client
    return bool(c is not None and c.producer.get("launched"))


def note_inherited_listeners() -> None:
    """Sockets the process holds when the hooks start are inherited: already listening
    (socket activation, a re-exec) they say nothing of readiness; held but not yet listening
    (a supervisor's bound socket that a ``uvicorn --workers`` worker gets at spawn) the kernel
    shows them listening, and held here, as soon as *any* holder listens (the first worker),
    whatever this process is doing. Either way the kernel's tables are no readiness for them:
    this process's own signal is (its ``listen()`` call, uvicorn's ``Server.startup``
    returning: ``server_started``). No table is read here."""
    if not _lazy.fresh("_listening", "readiness by listening sockets"):
        return
    from . import _listening

    st = state()
    held = _listening.socket_inodes("self")
    c = _runtime.state().client
    own = c.conn.sock if c is not None else None
    if own is not None:
        try:
            held.discard(os.fstat(own.fileno()).st_ino)
        except OSError:
            pass
    st.inherited_sockets = held


def server_started(server: Any, sockets: Any = None, via: str = "") -> None:
    """(uvicorn's ``Server.startup`` returned; hypercorn's ``asyncio.start_server`` in its worker)
    The server serves now on its sockets: the ones passed in (a ``--workers`` worker's,
    inherited) and its servers'. They count as this process's readiness even where another
    process holds them too; then the tables are read at once (uvloop listens in C), not at the
    sampler's next tick. In a process that launch's child started, under ``--ready-url``
    (``ready_file_inherited``), the URL's answer counts from now on (``_check_ready_file``)."""
    try:
        st = state()
        if st.ready_ns is not None:
            return
        if not getattr(server, "started", True):
            return  # it did not start serving (an exit requested during start-up)
        socks = list(sockets or ())
        for srv in getattr(server, "servers", None) or ():
            socks.extend(getattr(srv, "sockets", None) or ())
        if st.ready_file is not None and st.ready_file_inherited and not st.serving_ns:
            attrs: Dict[str, Any] = {"infersight.ready.via": via} if via else {}
            port = _tcp_port(socks)
            if port is not None:
                attrs["server.port"] = port
            st.serving_attrs = attrs
            st.serving_ns = time.time_ns()
            _check_ready_file()  # the URL answered already (another worker's answer): ready now
        if st.ready_ns is not None or not st.watch_listen:
            return
        inodes = set()
        for sock in socks:
            try:
                inodes.add(os.fstat(sock.fileno()).st_ino)
            except (OSError, AttributeError, TypeError, ValueError):
                continue
        check_listening(claim=inodes)
    except Exception as exc:
        _runtime.fail(exc)


def _tcp_port(socks: Any) -> Optional[int]:
    """The port of the first TCP socket of ``socks`` (a server's), if any."""
    for sock in socks:
        try:
            name = sock.getsockname()
        except (OSError, AttributeError, TypeError, ValueError):
            continue
        if isinstance(name, tuple) and len(name) >= 2 and isinstance(name[1], int):
            return name[1]
    return None


def tick() -> None:
    check_workers()
    st = state()
    if st.serving_ns and st.ready_ns is None and st.ready_file is not None:
        _check_ready_file()  # a spawned worker that serves, waiting for launch's --ready-url to answer
    check_listening()


LISTEN_POLL_MIN_NS = 20_000_000  # a forward asks the kernel at most this often


def check_listening(from_forward: bool = False, claim: Optional[Set[int]] = None) -> None:
    """Readiness from the kernel's socket tables: a listening socket this process owns
    (``_listening``). A server whose socket is opened in C (uvloop) never calls
    ``socket.listen``; the ``listen()`` wrapper is exact where it does (it comes first).
    Polled by the sampler thread every TICK_S, and by a forward or a request that comes
    before readiness (at most every LISTEN_POLL_MIN_NS): a request served within a tick of
    the listen is the first request, not warmup. ``claim``: inodes this process now serves
    on (``server_started``), counted even where shared (inherited, or the parent's too)."""
    st = state()
    if st.ready_ns is not None or not st.watch_listen:
        return
    now = time.time_ns()
    if from_forward and now - st.listen_polled_ns < LISTEN_POLL_MIN_NS:
        return
    poll = st.listen_poll
    if claim:
        with st.lock:  # kept until a poll takes it: this one, or the sampler's next (never lost)
            st.claims_pending = st.claims_pending | set(claim)
    # A claim waits for a poll of the sampler thread in progress (milliseconds), never long.
    if not (poll.acquire(True, 0.1) if claim else poll.acquire(False)):
        return
    try:
        st.listen_polled_ns = now
        if not root_open():
            return
        w = st.listen_watch
        if w is None:
            if not _lazy.fresh("_listening", "readiness by listening sockets"):
                return
            from . import _listening

            w = st.listen_watch = _listening.ListenWatch(lambda: ["self"], inherited=st.inherited_sockets,
                                                         side=st.side_sockets)
        if st.claims_pending:
            with st.lock:
                pending, st.claims_pending = st.claims_pending, set()
            w.claim(pending)  # kept: a poll held back by a rule's call counts them later
        if st.rule_absorb_owed:  # a rule's call returned and its sockets are not absorbed yet
            st.rule_absorb_owed = False
            w.absorb()
        if st.rule_stages_open:
            return  # listening inside a start-up call is that call's own (rule_stage_closed)
        found = w.poll()
        if st.rule_absorb_owed:
            # A rule's call returned while the tables were read: what they showed may have
            # listened inside it. Its sockets are the call's, never readiness.
            st.rule_absorb_owed = False
            w.absorb()
            return
        if found is not None and st.ready_ns is None and not st.rule_stages_open:
            kind, where = found
            mark_ready("listening_socket", attrs={"server.port": where} if kind == "tcp" else
                       {"server.address": where, "network.transport": "unix"})
    except Exception as exc:
        _runtime.fail(exc)
    finally:
        poll.release()


def rule_stage_opened(span: str, awaits_ready: bool = False) -> None:
    """A stage rule's call starts (``_stagerules``) in ``span``: no readiness from the
    kernel's tables until every such call has returned; children started meanwhile by
    another process on our behalf nest under it (``_workers.publish_current``). A call whose
    return is readiness (``awaits_ready``: Serve's deploy) also keeps a served worker from
    ending this process's cold start (``check_workers``): a request a client sent as soon as
    the port opened can be served by a replica while the deploy is still under way."""
    st = state()
    with st.lock:
        st.rule_stages_open += 1
        st.ready_rules_open += 1 if awaits_ready else 0
    if st.children_ready and st.children_dir:
        _workers.publish_current(st.children_dir, span)


def rule_stage_closed(awaited_ready: bool = False) -> None:
    """A stage rule's call returned. When it was the last one running, the sockets that
    started to listen meanwhile are the call's own machinery (Ray's core worker RPC server
    inside ``ray.init``, a worker's inside ``connect``), never readiness: the watch takes
    them as foreign. One table read per outermost rule call, before readiness only."""
    st = state()
    with st.lock:
        if awaited_ready:
            st.ready_rules_open = max(0, st.ready_rules_open - 1)
        n = max(0, st.rule_stages_open - 1)
        if n == 0:
            # Owed before the count drops: a poll that sees no call running absorbs first
            # (it may hold the watch now, or take it before this thread does).
            st.rule_absorb_owed = True
        st.rule_stages_open = n
    if st.children_ready and st.children_dir:
        _workers.publish_current(st.children_dir, _runtime.current_span.get() or _runtime.state().root_span_id)
    if n or st.ready_ns is not None or not st.watch_listen or not root_open():
        return
    poll = st.listen_poll
    if not poll.acquire(True, 0.1):  # the sampler thread polls (milliseconds): never wait long
        return  # that poll, or the next one, absorbs before it reads anything (owed)
    try:
        if not st.rule_absorb_owed:
            return  # a poll absorbed meanwhile
        st.rule_absorb_owed = False
        w = st.listen_watch
        if w is None:
            if not _lazy.fresh("_listening", "readiness by listening sockets"):
                return
            from . import _listening

            w = st.listen_watch = _listening.ListenWatch(lambda: ["self"], inherited=st.inherited_sockets,
                                                         side=st.side_sockets)
        w.absorb()
    except Exception as exc:
        _runtime.fail(exc)
    finally:
        poll.release()


def _stop_sampler() -> Any:
    s = state().sampler
    if s is not None:
        s.stop()
    return s


def _own_covered_s(st: _state.ColdStart, end_ns: int) -> Optional[float]:
    """Seconds of the root, up to ``end_ns``, that this process's stages covered (their union)."""
    if not _lazy.fresh("_sampler", "the cold start's covered share"):
        return None
    from . import _sampler as sampler

    lo = _runtime.state().root_start_ns
    if not lo or end_ns <= lo:
        return None
    gaps = sampler.uncovered([(s, e) for s, e in covered_pairs(st) if e > s], lo, end_ns, min_ns=0)
    return (end_ns - lo - sum(b - a for a, b in gaps)) / 1e9


def _emit_unattributed(end_ns: int) -> None:
    """Every stretch of the root that no stage covers (>= 50 ms): a span with the sampler's top."""
    st = state()
    s = _stop_sampler()
    if st.role == "helper":
        return
    if not _lazy.fresh("_sampler", "unattributed spans"):
        return
    from . import _sampler as sampler

    samples = s.samples if s is not None else []
    covered = [(s, e if e > s else s) for s, e in covered_pairs(st)]  # hooks.stage leaves a clock step as it came
    for start, stop in sampler.uncovered(covered, _runtime.state().root_start_ns, end_ns):
        a: Dict[str, Any] = {_contract.UNATTRIBUTED_SAMPLES: sum(1 for t, _ in samples if start <= t < stop)}
        top = sampler.top_labels(samples, start, stop)
        if top:
            a[_contract.UNATTRIBUTED_TOP] = top
        emit_stage("unattributed", _runtime.new_span_id(), _runtime.state().root_span_id, start, stop, a)


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
