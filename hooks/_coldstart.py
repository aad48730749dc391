"""Cold-start stage detection inside the served process (stdlib only).

Installed by the bootstrap once the runtime is active. It owns:

- the stage emitter that every stage goes through (builtin or custom);
- ``runtime_init`` (process start -> the bootstrap's first line);
- ``framework_import`` and post-import hooks, through one ``sys.meta_path`` finder that
  only looks at a handful of module names (torch, transformers, ...); torch itself is
  instrumented by ``_torch`` when, and only if, the user imports it;
- readiness (``mark_ready()``, the first TCP ``listen()``, launch's ``--ready-url`` file),
  ``ready_wait``, ``warmup`` runs and ``first_request``;
- the end of the ``coldstart`` root at the end of ``first_request`` (else at exit), after
  which every wrapper is removed so the served process pays nothing in steady state.

Nothing here raises into user code: every entry point catches and calls ``_runtime.fail``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from . import _runtime

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

# Top-level imports timed as ``framework_import`` (the outermost one wins; nested ones
# are listed on it). Extend with INFERSIGHT_FRAMEWORKS=a,b,c.
FRAMEWORKS = (
    "torch",
    "torch._dynamo",
    "transformers",
    "vllm",
    "sglang",
    "diffusers",
    "tensorrt",
    "tensorrt_llm",
    "onnxruntime",
    "tensorflow",
    "jax",
)

_lock = threading.Lock()
_tls = threading.local()

installed = False
collecting = False  # True from install until the root ends: wrappers check this first
boot_ns = 0
ready_ns: Optional[int] = None
ready_source = ""
last_end_ns = 0  # end of the latest stage that finished (start of ready_wait)
stage_seq = 0  # bumped at every stage start (splits warmup runs)
explicit = False  # the user called mark_ready(): first_request ends at first_response()
_main_ident = threading.main_thread().ident
_ready_file: Optional[str] = None
_undo: List[Callable[[], None]] = []
_post_import: Dict[str, List[Callable[[Any], None]]] = {}
_frameworks: Tuple[str, ...] = FRAMEWORKS
_finder: Optional[_Finder] = None
_ceilings: Optional[Dict[str, Any]] = None


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
        self.seq = stage_seq


class _First:
    """The first request: visible (ASGI, first_response) or the first forward after readiness."""

    __slots__ = ("attrs", "forward_end", "source", "span", "start")

    def __init__(self, start: int, source: str, attrs: Optional[Dict[str, Any]] = None) -> None:
        self.span = _runtime.new_span_id()
        self.start = start
        self.source = source
        self.attrs: Dict[str, Any] = dict(attrs or {})
        self.forward_end = 0  # explicit mode: the forward ended, first_response() pending


_warm: Optional[_Warm] = None
_first: Optional[_First] = None
_first_done = False


# -- stages ---------------------------------------------------------------------------


class Open:
    """A stage in progress, opened by ``begin`` and closed by ``end``."""

    __slots__ = ("attrs", "name", "parent", "pid", "prev", "span", "start")

    def __init__(self, name: str, parent: str, prev: Optional[str], start: int, attrs: Dict[str, Any]) -> None:
        self.name = name
        self.span = _runtime.new_span_id()
        self.parent = parent
        self.prev = prev
        self.start = start
        self.attrs = attrs
        self.pid = os.getpid()


def is_main_thread() -> bool:
    return threading.get_ident() == _main_ident


def set_current(span: Optional[str]) -> None:
    """Make ``span`` the current span (children get it at spawn: ``_spawn``)."""
    _runtime.current_span.set(span)
    if threading.get_ident() == _runtime.main_ident:
        _runtime.main_span = span


def note_begin() -> None:
    global stage_seq
    stage_seq += 1


def note_end(end_ns: int) -> None:
    global last_end_ns
    last_end_ns = max(last_end_ns, end_ns)


def begin(name: str, attrs: Optional[Dict[str, Any]] = None, start: Optional[int] = None) -> Open:
    """Open a stage under the current span and make it current."""
    prev = _runtime.current_span.get()
    o = Open(name, prev or _runtime.root_span_id, prev, start or time.time_ns(), dict(attrs or {}))
    note_begin()
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
        if _runtime.current_span.get() == o.span:
            set_current(o.prev)
        if not keep or o.pid != os.getpid():  # opened by the parent before a fork
            return
        if attrs:
            o.attrs.update(attrs)
        emit_stage(o.name, o.span, o.parent, o.start, end_ns or time.time_ns(), o.attrs,
                   type(err).__name__ if err is not None else None)
    except Exception as exc:
        _runtime.fail(exc)


def emit_stage(
    name: str, span: str, parent: str, start: int, end_ns: int, attrs: Dict[str, Any],
    err: Optional[str] = None,
) -> None:
    data = stage_data(name, span, parent, start, end_ns, attrs, err)
    note_end(data["e"])
    _runtime.emit("span", data)


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


def root_open() -> bool:
    return collecting and not _runtime.root_ended and _runtime.active()


# -- weights: storage ceiling (measured by the agent, cached per device) -----------------


def _cache_file() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "infersight", "storage_ceiling.json")


def weights_attrs(path: str, nbytes: int, seconds: float) -> Dict[str, Any]:
    """``infersight.weights.*`` for one load; the ceiling ratio when one is cached."""
    global _ceilings
    a: Dict[str, Any] = {}
    if path:
        a["infersight.weights.path"] = path
    if nbytes > 0:
        a["infersight.weights.bytes"] = nbytes
        if seconds > 0:
            rate = nbytes / seconds
            a["infersight.weights.bytes_per_s"] = rate
            try:
                if _ceilings is None:
                    _ceilings = {}
                    import json

                    with open(_cache_file(), encoding="utf-8") as f:
                        loaded = json.load(f)
                    if isinstance(loaded, dict) and isinstance(loaded.get("devices"), dict):
                        _ceilings = loaded["devices"]
                if path and _ceilings:
                    st = os.stat(path)
                    entry = _ceilings.get("%d:%d" % (os.major(st.st_dev), os.minor(st.st_dev)))
                    ceiling = entry.get("bytes_per_s") if isinstance(entry, dict) else None
                    if isinstance(ceiling, (int, float)) and ceiling > 0:
                        a["infersight.weights.storage_ceiling_bytes_per_s"] = float(ceiling)
                        a["infersight.weights.ceiling_ratio"] = rate / float(ceiling)
            except (OSError, ValueError):
                pass
    return a


# -- readiness, warmup, first request ---------------------------------------------------


def _close_warm_locked(now: int) -> Optional[Tuple[str, int, int, Dict[str, Any]]]:
    global _warm
    w = _warm
    if w is None:
        return None
    _warm = None
    end_ns = w.end if w.inflight == 0 else now
    attrs: Dict[str, Any] = {"infersight.warmup.forwards": w.n}
    if w.first_end:
        attrs["infersight.warmup.first_forward_s"] = (w.first_end - w.start) / 1e9
    return (w.span, w.start, end_ns, attrs)


def _emit_warm(closed: Optional[Tuple[str, int, int, Dict[str, Any]]]) -> None:
    if closed is not None:
        span, start, end_ns, attrs = closed
        emit_stage("warmup", span, _runtime.root_span_id, start, end_ns, attrs)


def mark_ready(source: str = "mark_ready", t_ns: Optional[int] = None) -> None:
    """Readiness: emit ``ready_wait`` (last stage end -> now) once; later calls do nothing."""
    global ready_ns, ready_source, explicit
    if not root_open():
        return
    now = time.time_ns()
    t = t_ns if t_ns is not None else now
    with _lock:
        if ready_ns is not None:
            return
        t = max(t, _runtime.root_start_ns)
        ready_ns, ready_source = t, source
        if source == "mark_ready":
            explicit = True
        closed = _close_warm_locked(now)
    _emit_warm(closed)
    start = min(last_end_ns or t, t)
    emit_stage("ready_wait", _runtime.new_span_id(), _runtime.root_span_id, start, t,
               {"infersight.ready.source": source})
    _unlisten()
    poll = callbacks.get("ready")
    if poll is not None:
        poll(start)


def _check_ready_file() -> None:
    """launch --ready-url writes the readiness time to a file; pick it up once."""
    global _ready_file
    path = _ready_file
    if path is None or ready_ns is not None:
        return
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return
    _ready_file = None
    mark_ready("ready_url", int(text) if text.isdigit() else None)


def forward_begin() -> Optional[Tuple[Any, ...]]:
    """An outermost forward starts in this thread. Returns a token for ``forward_end``."""
    global _warm, _first
    if not root_open() or _tls.__dict__.get("compile", 0):
        return None  # a forward run by jit.trace or a compiler is part of graph_compile
    if ready_ns is None and _ready_file is not None:
        _check_ready_file()
    now = time.time_ns()
    closed = None
    with _lock:
        if ready_ns is None:
            w = _warm
            if w is None or (w.inflight == 0 and w.seq != stage_seq):
                closed = _close_warm_locked(now)
                w = _warm = _Warm(now)
            w.inflight += 1
            w.n += 1
            token: Optional[Tuple[Any, ...]] = ("w", w, _runtime.current_span.get())
        elif _first is None and not _first_done:
            _first = _First(now, "forward")
            token = ("f", _first, _runtime.current_span.get())
        else:
            token = None  # inside a visible first request, or after it
    _emit_warm(closed)
    if token is not None:
        _runtime.current_span.set(token[1].span)
    return token


def forward_end(token: Tuple[Any, ...]) -> None:
    kind, obj, prev = token
    _runtime.current_span.set(prev)
    now = time.time_ns()
    if kind == "w":
        with _lock:
            obj.inflight -= 1
            obj.end = max(obj.end, now)
            if not obj.first_end:
                obj.first_end = now
            obj.seq = stage_seq
        return
    if explicit:  # first_response() decides; this forward's end is the fallback
        obj.forward_end = now
        return
    _finish(obj, now)


def request_begin(source: str, attrs: Optional[Dict[str, Any]] = None) -> Optional[_First]:
    """A visible request starts (ASGI middleware). Returns a handle only for the first."""
    global _first
    if not root_open() or _first_done or _first is not None:
        return None
    now = time.time_ns()
    _check_ready_file()
    if ready_ns is None:
        mark_ready("request", now)  # a request arriving means the server is ready
    with _lock:
        if _first is not None or _first_done:
            return None
        _first = f = _First(now, source, attrs)
    return f


def pending_first() -> bool:
    return _first is None and not _first_done and root_open()


def first_response(handle: Optional[_First] = None, attrs: Optional[Dict[str, Any]] = None) -> None:
    """The first response byte left the server: end first_request and the root."""
    global _first
    if not root_open() or _first_done:
        return
    now = time.time_ns()
    with _lock:
        f = _first
        if handle is not None and f is not handle:
            return
        if f is None:  # no request or forward seen since readiness: a marker at this point
            f = _first = _First(now, "first_response")
    if attrs:
        f.attrs.update(attrs)
    f.attrs.setdefault("infersight.first_request.ttfb_s", (now - f.start) / 1e9)
    _finish(f, now)


def _finish(f: _First, end_ns: int, ended_by: str = "first_request") -> None:
    """Emit first_request, end the root at its end, and take every hook out."""
    global _first_done
    with _lock:
        if _first_done:
            return
        _first_done = True
    attrs = {"infersight.first_request.source": f.source}
    attrs.update(f.attrs)
    emit_stage("first_request", f.span, _runtime.root_span_id, f.start, end_ns, attrs)
    finish_root(end_ns, ended_by)


def finish_root(end_ns: Optional[int], ended_by: str) -> None:
    global collecting
    now = time.time_ns()
    with _lock:
        closed = _close_warm_locked(now)
    _emit_warm(closed)
    collecting = False
    attrs: Dict[str, Any] = {"infersight.coldstart.ended_by": ended_by}
    if ready_ns is not None:
        attrs["infersight.coldstart.ready_s"] = (ready_ns - _runtime.root_start_ns) / 1e9
        attrs["infersight.ready.source"] = ready_source
    _runtime.end_root(end_ns, attrs)
    uninstall()


def _at_exit() -> None:
    """Before the runtime's own exit handler: settle what is still open, then end the root."""
    try:
        if not root_open():
            uninstall()
            return
        _check_ready_file()
        f = _first
        if f is not None and not _first_done:
            _finish(f, f.forward_end or time.time_ns(), "exit")
            return
        finish_root(None, "exit")
    except Exception as exc:
        _runtime.fail(exc)


# -- listen() readiness heuristic --------------------------------------------------------

_orig_listen: Any = None
_listen_owned = False


def _install_listen(socket: Any = None) -> None:
    """Wrap ``socket.socket.listen`` once the host imports ``socket`` (never before: ~4 ms)."""
    global _orig_listen, _listen_owned
    if socket is None:
        if "socket" not in sys.modules:
            on_import("socket", _install_listen)
            return
        socket = sys.modules["socket"]
    cls = socket.socket
    _listen_owned = "listen" in cls.__dict__
    _orig_listen = cls.listen
    orig = _orig_listen

    def listen(self: Any, *args: Any) -> None:
        orig(self, *args)
        try:
            if (collecting and ready_ns is None and self.family in (socket.AF_INET, socket.AF_INET6)
                    and self.type == socket.SOCK_STREAM):
                mark_ready("listen")
        except Exception as exc:
            _runtime.fail(exc)

    cls.listen = listen  # type: ignore[method-assign,assignment]


def _unlisten() -> None:
    global _orig_listen
    if _orig_listen is None:
        return
    socket = sys.modules["socket"]
    try:
        if _listen_owned:
            socket.socket.listen = _orig_listen  # type: ignore[method-assign]
        elif "listen" in socket.socket.__dict__:
            del socket.socket.listen
    except Exception as exc:
        _runtime.fail(exc)
    _orig_listen = None


# -- framework imports -------------------------------------------------------------------


class _TimedLoader:
    """Wraps one module's loader for the duration of its exec; puts the real one back."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        loader, name = self._loader, self._name
        try:
            module.__loader__ = loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = loader
        except Exception:
            pass
        o: Optional[Open] = None
        stack: Optional[List[Open]] = None
        try:
            if root_open() and name in _frameworks:
                stack = _tls.__dict__.setdefault("imports", [])
                if stack:
                    nested = stack[-1].attrs.setdefault("infersight.framework.nested", [])
                    nested.append(name)
                    stack = None
                else:
                    o = begin("framework_import", {"infersight.framework": name})
                    stack.append(o)
        except Exception as exc:
            _runtime.fail(exc)
        err: Optional[BaseException] = None
        try:
            loader.exec_module(module)
        except BaseException as e:
            err = e
            raise
        finally:
            try:
                if stack:
                    stack.pop()
                if o is not None:
                    end(o, err=err)
            except Exception as exc:
                _runtime.fail(exc)
        _run_post_import(name, module)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)


class _Finder:
    """A meta path finder that only answers for the watched names (a set lookup otherwise)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _watched or getattr(_tls, "finding", False):
            return None
        _tls.finding = True
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
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            spec.loader = _TimedLoader(spec.loader, fullname)
            return spec
        except Exception as exc:
            _runtime.fail(exc)
            return None
        finally:
            _tls.finding = False


_watched: set[str] = set()


def on_import(name: str, callback: Callable[[Any], None]) -> None:
    """Run ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False) is False:
        _safe_call(callback, mod)
        return
    _post_import.setdefault(name, []).append(callback)
    _watched.add(name)


def _run_post_import(name: str, module: Any) -> None:
    for cb in _post_import.pop(name, ()):
        _safe_call(cb, module)


def _safe_call(cb: Callable[[Any], None], arg: Any) -> None:
    try:
        cb(arg)
    except Exception as exc:
        _runtime.fail(exc)


# -- install / uninstall ----------------------------------------------------------------

callbacks: Dict[str, Callable[[int], None]] = {}


def add_undo(fn: Callable[[], None]) -> None:
    _undo.append(fn)


def install(boot: int, from_bootstrap: bool = True) -> None:
    """Start cold-start detection in this process (after ``_runtime.activate``)."""
    global installed, collecting, boot_ns, _finder, _frameworks, _ready_file
    if installed or not _runtime.active():
        return
    installed = collecting = True
    boot_ns = boot or time.time_ns()
    env = os.environ
    extra = tuple(x.strip() for x in env.get("INFERSIGHT_FRAMEWORKS", "").split(",") if x.strip())
    _frameworks = FRAMEWORKS + extra
    _watched.update(_frameworks)
    _ready_file = env.pop("INFERSIGHT_READY_FILE", None) or None
    if from_bootstrap and _runtime.root_start_ns and boot_ns > _runtime.root_start_ns:
        emit_stage("runtime_init", _runtime.new_span_id(), _runtime.root_span_id,
                   _runtime.root_start_ns, boot_ns, {})
    if env.get("INFERSIGHT_READY_ON_LISTEN", "1").strip().lower() not in ("0", "false", "no", "off"):
        _install_listen()
    on_import("torch", _install_torch)
    _finder = _Finder()
    sys.meta_path.insert(0, _finder)
    atexit.register(_at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_child)


def _install_torch(torch: Any) -> None:
    from . import _torch  # only in processes that import torch

    _torch.install(torch)


def uninstall() -> None:
    """Take every wrapper out (at the end of the root); safe to call twice."""
    global collecting, _finder
    collecting = False
    _unlisten()
    if _finder is not None:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None
    _post_import.clear()
    _watched.clear()
    while _undo:
        fn = _undo.pop()
        try:
            fn()
        except Exception as exc:
            _runtime.fail(exc)


def _after_fork_child() -> None:
    """A forked child starts its own cold start (its root: the fork, under our span)."""
    global _main_ident, _warm, _first, _first_done, collecting, ready_ns, explicit, last_end_ns
    try:
        _main_ident = threading.get_ident()
        _warm = None
        _first = None
        _first_done = False
        explicit = False
        last_end_ns = _runtime.root_start_ns
        if ready_ns is not None:
            ready_ns = _runtime.root_start_ns  # it inherited a server that was already ready
        was_collecting = collecting
        collecting = installed and _runtime.active()
        _tls.__dict__.clear()
        if collecting and not was_collecting and "torch" in sys.modules:
            from . import _torch  # the parent took its wrappers out: this child needs them again

            _torch.install(sys.modules["torch"])
    except Exception as exc:
        _runtime.fail(exc)
