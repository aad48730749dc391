"""Import timing for the cold start: every outermost import on a thread (stdlib only).

One ``sys.meta_path`` finder, first on the path. For a module that is really loaded (not
already in ``sys.modules``) it wraps the loader, but only where that is needed:

- the outermost import on this thread (nothing else is being imported here): its time,
  from the search to the end of its execution, is import time;
- an import into another top-level package than the one being executed (``torch`` pulling
  in ``sympy``): its time moves to that package in the breakdown;
- a watched name (post-import callbacks, see ``_recorder.on_import``).

Anything else (``torch.nn`` inside ``torch``) is one set lookup and a string split.

Outermost imports that follow each other (same parent span, no stage in between, gaps
under ``MERGE_GAP_NS``) form one ``framework_import`` span with
``infersight.import.packages`` = ``["transformers 1.02 s", ...]``; its parent is the span
current when the first of them began: the root, or the stage they were made in (a nested
``framework_import``, part of that stage's time). A stage that starts inside an import (a
model loaded by a module imported by uvicorn) cuts the import time: the stage is a sibling,
not time of the import. The import's stack is set aside while the stage runs (the stage's
own imports start afresh, as outermost imports under the stage) and taken up again at its
end, counting from there.
"""

from __future__ import annotations

import sys
import threading
import time
from importlib.machinery import ModuleSpec

from . import _mainstart, _runtime, _state
from . import _recorder as cs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

    from ._state import Imports, ImportThread

MERGE_GAP_NS = 20_000_000  # outermost imports closer than this are one run
MIN_NS = 2_000_000  # runs and per-package pieces under this are dropped

_getframe = sys._getframe
_T_FIND = "_infersight_t_find"  # a timed spec's own entries (``_timed``), gone once it is loaded
_PUSHED = "_infersight_pushed"
# The hooks' own submodules (``infersight.hooks.``, or launch's stand-in package over the same folder): one
# they import while the program runs (``_listening`` at a --ready-url readiness found on a request's thread)
# is their cost, not the program's imports: no import run of its own (nested in an import, it is that one's).
_OWN = (__package__ or "infersight.hooks") + "."


def _imports() -> Imports:
    """This process's import-timing state (``_state``): the open runs, per-thread stacks."""
    return _state.current.imports


class _Run:
    """Consecutive outermost imports on one thread, not yet emitted."""

    __slots__ = ("end", "parent", "pkgs", "seq", "span", "start")

    def __init__(self, parent: str, start: int, end: int, pkgs: Dict[str, int], seq: object) -> None:
        self.span = _runtime.new_span_id()  # fixed now: a checkpoint names it before it is emitted
        self.parent = parent
        self.start = start
        self.end = end
        self.pkgs = pkgs
        self.seq = seq


def _top(name: str) -> str:
    return name.partition(".")[0]


def _thread() -> ImportThread:
    """This thread's import state (``_state.ImportThread``)."""
    return _state.current.imports.thread()


class _TimedSpec(ModuleSpec):
    """A found module's spec, while the import system loads it: ``_load_unlocked`` sets
    ``spec._initializing = True`` just before the loader's ``exec_module`` and ``False`` in the
    ``finally`` after it, so the timing begins and ends there, with the real loader left in
    place and no frame of ours under the module's body. (A wrapper loader added a frame per
    timed import, and CPython 3.11+ frees a thread's frame-stack chunk as soon as the frame at
    its base returns: with the body a little deeper, hot calls at a chunk's edge mapped and
    unmapped 16 KiB per call, about 13,000 times for ``import transformers``.) Once loaded,
    the spec is a plain ``ModuleSpec`` again."""

    def __setattr__(self, attr: str, value: Any) -> None:
        if attr != "_initializing":
            object.__setattr__(self, attr, value)
        elif value:
            object.__setattr__(self, attr, value)
            _begin(self)
        else:
            try:
                _end(self)
            finally:
                object.__setattr__(self, attr, value)


def _timed(spec: Any, t_find: int) -> None:
    """Time this spec's load: ``t_find`` is when its search began (0: inside another import)."""
    d = spec.__dict__
    d[_T_FIND] = t_find
    d[_PUSHED] = None
    spec.__class__ = _TimedSpec


def _plain(spec: Any) -> Any:
    """Undo ``_timed``; returns the stack ``_begin`` pushed onto (or None)."""
    d = spec.__dict__
    d.pop(_T_FIND, None)
    st = d.pop(_PUSHED, None)
    object.__setattr__(spec, "__class__", ModuleSpec)
    return st


def _begin(spec: Any) -> None:
    """The module's body is about to run: it is the package on top of this thread's stack."""
    try:
        if cs.state().collecting and not _mainstart.waiting():  # (a watched module before the program: no time)
            st = _thread()
            stack = st.stack
            now = time.time_ns()
            if not stack:  # outermost here: under the span current now (the root, or a stage)
                st.piece_start = st.t_last = spec.__dict__.get(_T_FIND) or now
                st.piece_parent = _runtime.current_span.get()
            else:
                _charge(st, now)
            stack.append(_top(spec.name))
            st.busy = True
            spec.__dict__[_PUSHED] = stack
    except Exception as exc:
        _runtime.fail(exc)


def _end(spec: Any) -> None:
    """The module's body returned, or raised (then the import system has taken it out of
    ``sys.modules``): the post-import callbacks of a loaded module (they are time of this
    import; a module that put another object in its place gets that one), then the pop."""
    name = spec.name
    try:
        module = sys.modules.get(name)
        if module is not None:
            cs.run_post_import(name, module)  # hooks installed because of this import: its time
    finally:
        stack = _plain(spec)
        if stack is not None:
            try:
                st = _thread()
                if stack is st.stack:
                    _pop(st)
                elif stack:  # set aside by a stage still open (its time since is the stage's), or a fork's
                    stack.pop()
            except Exception as exc:
                _runtime.fail(exc)


def _charge(st: ImportThread, now: int) -> None:
    """The time since ``t_last`` belongs to the package on top of the stack."""
    stack = st.stack
    if stack:
        pkgs = st.pkgs
        pkgs[stack[-1]] = pkgs.get(stack[-1], 0) + max(0, now - st.t_last)
    st.t_last = now


def _pop(st: ImportThread) -> None:
    stack = st.stack
    if not stack:
        return  # nothing pushed
    now = time.time_ns()
    _charge(st, now)
    stack.pop()
    if not stack:
        _piece(st, st.piece_start, now)


def _piece(st: ImportThread, start: int, end: int) -> None:
    """A stretch of import time ended on this thread: extend the open run or start one."""
    pkgs, st.pkgs = st.pkgs, {}
    if end <= start or not cs.root_open():
        return
    ident = threading.get_ident()
    parent = st.piece_parent or _runtime.state().root_span_id
    seq = cs.state().stage_mark
    done: Optional[_Run] = None
    imp = _imports()
    with imp.lock:
        runs = imp.runs
        run = runs.get(ident)
        if run is not None and run.parent == parent and run.seq == seq and start - run.end <= MERGE_GAP_NS:
            run.end = max(run.end, end)
            for k, v in pkgs.items():
                run.pkgs[k] = run.pkgs.get(k, 0) + v
            return
        done = run
        runs[ident] = _Run(parent, start, end, pkgs, seq)
        st.run_open = True  # the next stage on this thread emits it (``pause``)
        st.busy = True
    if done is not None:
        _emit(done)


def _seconds(pkg: str, ns: int) -> str:
    return ("%s %.2f s" if ns >= 10_000_000 else "%s %.3f s") % (pkg, ns / 1e9)


def _attrs(pkgs: Dict[str, int]) -> Dict[str, Any]:
    ranked = sorted(pkgs.items(), key=lambda kv: -kv[1])
    a: Dict[str, Any] = {
        "infersight.import.packages": [_seconds(k, v) for k, v in ranked if v >= MIN_NS],
    }
    if ranked:
        a["infersight.framework"] = ranked[0][0]
    return a


def _emit(run: _Run) -> None:
    if run.end - run.start < MIN_NS:
        return
    cs.emit_stage("framework_import", run.span, run.parent, run.start, run.end, _attrs(run.pkgs))


def open_runs() -> List[Tuple[str, str, str, int, int, Dict[str, Any]]]:
    """(Sampler thread) The runs not emitted yet, as stages so far: ``(stage, span, parent,
    start, end, attributes)``; the checkpoint that a killed process leaves the agent."""
    imp = _imports()
    with imp.lock:
        runs = [(r.span, r.parent, r.start, r.end, dict(r.pkgs)) for r in imp.runs.values()]
    return [("framework_import", span, parent, start, end, _attrs(pkgs))
            for span, parent, start, end, pkgs in runs if end - start >= MIN_NS]


def thread_run_end() -> int:
    """End of this thread's open import run (0: none). A stage built from runs elsewhere (the
    ``torch.nn.init`` runs of ``model_build``) must not be extended across it."""
    imp = _imports()
    with imp.lock:
        run = imp.runs.get(threading.get_ident())
    return run.end if run is not None else 0


def flush(this_thread_only: bool = False) -> None:
    """Emit the open runs (all threads, or this one): a stage starts, or the root ends."""
    imp = _imports()
    if this_thread_only:
        with imp.lock:
            run = imp.runs.pop(threading.get_ident(), None)
        if run is not None:
            _emit(run)
        return
    with imp.lock:
        runs = list(imp.runs.values())
        imp.runs.clear()
    for run in sorted(runs, key=lambda r: r.start):
        _emit(run)


def flush_runs(_end_ns: int, _final: bool) -> None:
    """``_recorder``'s run source: readiness or the root's end emits every open run."""
    flush()


def pause(at: int = 0) -> None:
    """A stage starts on this thread (at ``at``). ``hooks.stage`` inlines it: the thread's count
    of open stages goes up, and only a ``busy`` thread calls ``stage_begins``."""
    st = _thread()
    st.paused = depth = st.paused + 1
    if st.busy:
        stage_begins(st, at, depth)


def stage_begins(st: ImportThread, at: int, depth: int) -> None:
    """A stage started at ``at`` on this ``busy`` thread, the ``depth``-th open on it: an import
    in progress is cut there (its piece so far goes to its run) and its stack set aside until
    the stage ends, so that the stage's own imports are outermost imports under it; the
    thread's open run is emitted (a stage splits runs)."""
    stack = st.stack
    if stack:
        now = at or time.time_ns()
        _charge(st, now)
        _piece(st, st.piece_start, now)
        st.saved.append((depth, stack, now))
        st.stack = []
    if st.run_open:  # else nothing of this thread's to emit: no lock taken
        st.run_open = False
        flush(this_thread_only=True)
    settle(st)


def settle(st: ImportThread) -> None:
    """``busy`` as it is now: a stage's start or end on the thread has nothing to do while it
    is False (only this thread's stages and imports change these fields)."""
    if st.busy and not (st.stack or st.run_open or st.saved):
        st.busy = False


def resume(at: int = 0) -> None:
    """The stage ended (at ``at``). ``hooks.stage`` inlines it as ``pause``."""
    st = _thread()
    depth = st.paused
    if depth <= 0:
        return
    st.paused = depth - 1
    if st.busy:
        stage_ends(st, at, depth)


def stage_ends(st: ImportThread, at: int, depth: int) -> None:
    """The stage that was the ``depth``-th open on this ``busy`` thread ended at ``at`` (the
    current span is its parent again). Its imports are over: their run is emitted. An import
    it began that still runs (a stage ended by another call than the one that began it) is
    cut there and goes on under the parent. The import it was opened in, if any, counts again
    from here; stages that ended out of order (begun and ended by separate calls) leave their
    set-aside stacks to the first stage end at or below their depth."""
    now = at or time.time_ns()
    if st.stack:
        _charge(st, now)
        _piece(st, st.piece_start, now)
    if st.run_open:
        st.run_open = False
        flush(this_thread_only=True)
    saved = st.saved
    if saved and saved[-1][0] >= depth:
        _d, stack, cut = saved.pop()
        while saved and saved[-1][0] >= depth:
            _d, stack, cut = saved.pop()
        st.stack = stack  # (emptied meanwhile when that import ended inside the stage)
        now = max(now, cut)
    if st.stack:
        st.t_last = st.piece_start = now
        st.piece_parent = _runtime.current_span.get()
    settle(st)


class Finder:
    """The meta path finder; answers only where timing or a callback needs a wrapped loader."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        st = _thread()
        if st.finding:
            return None
        stack = st.stack
        if fullname not in cs.state().watched:
            if not cs.state().collecting or _mainstart.waiting():
                return None  # (before the program's first line: runtime_init's, runpy's for -m)
            if stack and fullname.partition(".")[0] == stack[-1]:
                return None
            if not stack and fullname.startswith(_OWN):
                return None
        try:
            # Only imports run by the import system; importlib.util.find_spec() and friends
            # get the real spec (their caller may check the loader's type).
            if _getframe(2).f_code.co_name != "_find_and_load_unlocked":
                return None
        except ValueError:
            return None
        t_find = 0 if stack else time.time_ns()
        st.finding = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self:
                    continue
                fs = getattr(finder, "find_spec", None)
                if fs is None:
                    continue
                spec = fs(fullname, path, target)
                if spec is not None:
                    break
            if (spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module")
                    or type(spec) is not ModuleSpec):
                return spec
            _timed(spec, t_find)
            return spec
        except Exception as exc:
            _runtime.fail(exc)
            return None
        finally:
            st.finding = False
