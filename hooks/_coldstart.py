"""Cold-start detection inside the served process: setting it up (stdlib only).

Installed by the bootstrap once the runtime is active (``_activate``). ``install`` starts:

- ``runtime_init`` (process start -> the main program's first line, ``_mainstart``);
- ``framework_import`` (every outermost import, ``_imports``) and post-import hooks that
  load each instrumenter when, and only if, its library is imported: torch (``_torch``,
  ``_weights``, ``_build``'s ``nn.init`` runs), transformers/tokenizers (``_build``:
  ``model_build``, ``tokenizer_load``), uvicorn (``asgi``), gunicorn, waitress
  (``_waitress``), ``http.server`` and ``wsgiref`` (``_http_server``), prometheus_client's
  exporter server (``_sideservers``: a side server, never readiness nor the first request),
  stage rules (``_stagerules``);
- the stack sampler (``_sampler``) with its checkpoints (``_checkpoint``);
- the process role (``helper`` for resource trackers, compile workers, ``python -c``);
- readiness and the root's end (``_readiness``).

The layers: ``_recorder`` (the stages and state every instrumenter uses) <- the
instrumenters and ``_readiness`` <- this module, which alone knows them all. Readiness
(``mark_ready``, ``first_response``, ``uninstall``) is ``_readiness``'s; ``state()`` and
``weights_attrs`` stay reachable here for tests and benches.

Nothing here raises into user code: every entry point catches and calls ``_runtime.fail``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from . import _env, _lazy, _mainstart, _proc, _readiness, _runtime, _state, _workers
from ._recorder import add_run_source, add_undo, emit_stage, end_runtime_init, on_import, state, weights_attrs

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Optional

__all__ = ["install", "on_import", "state", "weights_attrs"]


def _install_uvicorn(module: Any) -> None:
    if not _lazy.fresh("asgi", "ASGI request timing"):
        return
    from . import asgi  # every request of the served ASGI app is timed

    asgi.wrap_uvicorn(module)


def _install_gunicorn_asgi(module: Any) -> None:
    if not _lazy.fresh("asgi", "ASGI request timing"):
        return
    from . import asgi  # every request of gunicorn's own ASGI worker (-k asgi) is timed

    asgi.wrap_gunicorn_asgi(module)


def _install_uvicorn_server(module: Any) -> None:
    """uvicorn's ``Server.startup`` has run the app's lifespan startup and started serving on
    its sockets when it returns, whatever the event loop (uvloop listens in C): read the
    kernel's socket tables right then, instead of at the sampler's next tick (up to 100 ms
    later: most of a forked worker's short start, LitServe's uvicorn process). Its sockets
    count even where another process holds them too (a ``--workers`` worker's inherited
    socket, a forked copy), which the tables alone never say (``_readiness.server_started``)."""
    cls: Any = getattr(module, "Server", None)
    startup = getattr(cls, "startup", None)
    if cls is None or startup is None or getattr(startup, "__wrapped__", None) is not None:
        return

    async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = await startup(self, *args, **kwargs)
        try:
            if getattr(self, "started", True):
                # a worker forked from a ready server (gunicorn's UvicornWorker) serves now: its
                # app load and lifespan after the fork are done (its fork readiness was provisional)
                _readiness.fork_ready("uvicorn.Server.startup")
            # its sockets, passed in (a --workers worker's, inherited) or its own, serve now
            _readiness.server_started(self, args[0] if args else kwargs.get("sockets"), "uvicorn.Server.startup")
        except Exception as exc:
            _runtime.fail(exc)
        return out

    wrapped.__wrapped__ = startup  # type: ignore[attr-defined]
    cls.startup = wrapped
    add_undo(lambda: setattr(cls, "startup", startup) if cls.startup is wrapped else None)
    _install_uvicorn_signal_exit(module, cls)


def _install_uvicorn_signal_exit(module: Any, cls: Any) -> None:
    """uvicorn (0.29 and later) shuts down gracefully on SIGTERM, then restores the handlers it found
    and raises the signal again: with SIGTERM's default action that ends the process at once, without
    atexit, so the hooks' exit flush (the root's end, what is buffered or unacked spooled, the count of
    what was lost) never ran under `systemctl stop` or a pod's termination. Just before uvicorn gives the
    signal back, when the handler it restores is the default one (the process ends with it), the exit
    flush runs there."""
    capture = getattr(cls, "capture_signals", None)
    if capture is None or getattr(capture, "_infersight_exit", False):  # (contextmanager sets __wrapped__)
        return
    import contextlib  # uvicorn.server imported it already
    import signal

    handled = tuple(getattr(module, "HANDLED_SIGNALS", ()))

    @contextlib.contextmanager
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            before = {s: signal.getsignal(s) for s in handled}
        except Exception:
            before = {}
        with capture(self, *args, **kwargs):
            try:
                yield
            finally:
                try:
                    flush = _runtime.state().exit_flush
                    if flush is not None and any(before.get(s) == signal.SIG_DFL
                                                 for s in getattr(self, "_captured_signals", ())):
                        _readiness.at_exit()  # as at a normal exit: the cold start settles first
                        flush()
                except Exception as exc:
                    _runtime.fail(exc)

    wrapped._infersight_exit = True  # type: ignore[attr-defined]
    cls.capture_signals = wrapped
    add_undo(lambda: setattr(cls, "capture_signals", capture) if cls.capture_signals is wrapped else None)


def _install_hypercorn_app(module: Any) -> None:
    if not _lazy.fresh("asgi", "ASGI request timing"):
        return
    from . import asgi  # every request of the ASGI app hypercorn serves is timed

    asgi.wrap_hypercorn(module)


def _install_hypercorn_server(module: Any) -> None:
    """Hypercorn's asyncio and uvloop workers (``hypercorn.asyncio.run.worker_serve``) run the
    app's lifespan startup, then serve each socket with ``asyncio.start_server(..., sock=sock)``:
    when that returns, the worker listens on it (uvloop listens in C) and serves. The socket is
    the supervisor's (bound by hypercorn's main process, handed to each spawned worker), which the
    kernel's tables alone never make readiness: counted as uvicorn's ``Server.startup`` counts its
    own (``_readiness.server_started``). Hypercorn has no server object to wrap: the calls of
    ``asyncio.start_server`` made by ``worker_serve`` (its code, the caller's frame) are watched
    while the cold start runs; every other call passes through."""
    aio: Any = sys.modules.get("asyncio")  # hypercorn.asyncio.run imported it
    code = getattr(getattr(module, "worker_serve", None), "__code__", None)
    start = getattr(aio, "start_server", None)
    if aio is None or code is None or start is None or getattr(start, "_infersight", False):
        return

    async def serving(coro: Any, sock: Any) -> Any:
        server = await coro
        try:
            socks = [sock] if sock is not None else list(getattr(server, "sockets", None) or ())
            _readiness.server_started(None, socks, "hypercorn.asyncio.start_server")
        except Exception as exc:
            _runtime.fail(exc)
        return server

    def start_server(*args: Any, **kwargs: Any) -> Any:
        coro = start(*args, **kwargs)
        try:
            if sys._getframe(1).f_code is code:
                return serving(coro, kwargs.get("sock"))
        except Exception as exc:
            _runtime.fail(exc)
        return coro

    start_server._infersight = True  # type: ignore[attr-defined]
    start_server.__wrapped__ = start  # type: ignore[attr-defined]
    aio.start_server = start_server
    add_undo(lambda: setattr(aio, "start_server", start) if aio.start_server is start_server else None)


def _install_gunicorn_arbiter(module: Any) -> None:
    """gunicorn's arbiter (``Arbiter.run``: its listen, then its workers' forks and its wait) is a pre-fork
    master: ready at its exit only if a worker was (``_readiness.supervise``)."""
    _wrap_supervisor(getattr(module, "Arbiter", None), "run", lambda *_a, **_k: True)


def _install_hypercorn_run(module: Any) -> None:
    """Hypercorn's ``run`` with ``workers`` above 0 spawns workers that serve on its sockets and waits
    for them: a pre-fork master (``_readiness.supervise``). With 0 it serves in this process itself."""
    _wrap_supervisor(module, "run", lambda config, *_a, **_k: bool(getattr(config, "workers", 0)))


def _wrap_supervisor(owner: Any, name: str, supervises: Any) -> None:
    """Wrap ``owner.name``, a pre-fork master's main loop: a call that ``supervises`` (its arguments)
    marks this process a supervisor first."""
    orig = getattr(owner, name, None) if owner is not None else None
    if orig is None or getattr(orig, "__wrapped__", None) is not None:
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            if supervises(*args, **kwargs):
                _readiness.supervise()
        except Exception as exc:
            _runtime.fail(exc)
        return orig(*args, **kwargs)

    wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)
    add_undo(lambda: setattr(owner, name, orig) if getattr(owner, name, None) is wrapped else None)


def _install_hypercorn_trio(module: Any) -> None:
    """Hypercorn's trio worker (``hypercorn.trio.run.trio_worker``) listens on its supervisor's sockets
    first, then loads the app, and ``worker_serve`` runs the app's lifespan startup and only then serves
    them (``trio.serve_listeners`` with hypercorn's ``TCPServer`` per connection). The worker's own
    ``listen()`` calls are no readiness (``_readiness.listens_early``); the start of that serving is, on
    those sockets (``_readiness.server_started``, as the asyncio worker's ``start_server``). Other calls
    of ``trio.serve_listeners`` pass through."""
    trio: Any = sys.modules.get("trio")  # hypercorn.trio.run imported it
    worker = getattr(getattr(module, "trio_worker", None), "__code__", None)
    handler_cls = getattr(module, "TCPServer", None)
    serve = getattr(trio, "serve_listeners", None)
    if worker is None or handler_cls is None or serve is None or getattr(serve, "_infersight", False):
        return
    _readiness.listens_early(worker)

    async def serve_listeners(handler: Any, listeners: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if getattr(handler, "func", None) is handler_cls:  # partial(TCPServer, app, config, ...)
                socks = [getattr(getattr(lst, "transport_listener", lst), "socket", None) for lst in listeners]
                _readiness.server_started(None, [s for s in socks if s is not None], "hypercorn.trio.serve_listeners")
        except Exception as exc:
            _runtime.fail(exc)
        return await serve(handler, listeners, *args, **kwargs)

    serve_listeners._infersight = True  # type: ignore[attr-defined]
    serve_listeners.__wrapped__ = serve  # type: ignore[attr-defined]
    trio.serve_listeners = serve_listeners
    add_undo(lambda: setattr(trio, "serve_listeners", serve) if trio.serve_listeners is serve_listeners else None)
def _install_waitress(module: Any) -> None:
    if not _lazy.fresh("_waitress", "waitress's first request timing"):
        return
    from . import _waitress  # waitress's first request; every request of the app it serves is timed

    _waitress.install(module)


def _install_http_server(module: Any) -> None:
    if not _lazy.fresh("_http_server", "http.server's first request timing"):
        return
    from . import _http_server  # the first request of a BaseHTTPRequestHandler (http.server, werkzeug's)

    _http_server.install_http_server(module)


def _install_wsgiref(module: Any) -> None:
    if not _lazy.fresh("_http_server", "wsgiref's first request timing"):
        return
    from . import _http_server  # the first request of wsgiref.simple_server's handler

    _http_server.install_wsgiref(module)


def _install_prometheus(module: Any) -> None:
    if not _lazy.fresh("_sideservers", "the metrics exporter's server set aside"):
        return
    from . import _sideservers  # its start_http_server's socket: no readiness, its scrapes no first request

    _sideservers.install_prometheus(module)


class _GunicornRequest(threading.local):
    """The first request as one gunicorn worker thread handles it (the sync worker's one thread,
    or one of a gthread worker's pool threads)."""

    accepted = 0  # when the connection being handled was accepted, while the first request is pending
    sent = 0  # when the first request's response started to go out
    watching = False  # this thread handles the first request


_gunicorn = _GunicornRequest()


def _install_gunicorn_sync(module: Any) -> None:
    _install_gunicorn_worker(module, "SyncWorker")


def _install_gunicorn_gthread(module: Any) -> None:
    _install_gunicorn_worker(module, "ThreadWorker")


def _install_gunicorn_worker(module: Any, name: str) -> None:
    """gunicorn's sync and gthread workers (``--threads N`` above 1 picks gthread): ``handle``
    serves one accepted connection (gthread: in a pool thread, once per request of a kept-alive
    one), and calls ``handle_request`` once a request on it was parsed. The first connection that
    carried a request is the first request (a bare TCP connect, a load balancer's TCP check, a
    probe that hangs up: no request, never gets there), from the connection's accept (a forked
    worker's wait for it is then the wait for traffic, not its cold start) to the first bytes of
    its response (``Response.send_headers``; without a response, the end of ``handle_request``).
    A gthread connection that sent nothing within gthread's wait for data goes back to its poller
    and is timed from when its data came (its idle wait is the client's, not the server's).
    The times live per thread (``_GunicornRequest``); ``_readiness.request_begin`` hands the first
    request to one thread only. gthread's HTTP/2 connections have no ``handle_request``: their
    first forward is the first request."""
    cls: Any = getattr(module, name, None)
    if cls is not None and _lazy.fresh("wsgi", "gunicorn's request timing"):
        from . import wsgi  # every request of the worker is timed, for its life (not undone at readiness)

        wsgi.wrap_gunicorn_worker(cls)
    handle = getattr(cls, "handle", None)
    handle_request = getattr(cls, "handle_request", None)
    resp_cls: Any = getattr(getattr(module, "wsgi", None), "Response", None)
    send_headers = getattr(resp_cls, "send_headers", None)
    if (cls is None or handle is None or handle_request is None or send_headers is None
            or getattr(handle, "__wrapped__", None) is not None):
        return
    now = _gunicorn

    def wrapped_handle(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            now.accepted = time.time_ns() if _readiness.pending_first() else 0
        except Exception as exc:
            _runtime.fail(exc)
        return handle(self, *args, **kwargs)

    def wrapped_handle_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        first = None
        try:
            if now.accepted and _readiness.pending_first():
                first = _readiness.request_begin("gunicorn", None, now.accepted)
        except Exception as exc:
            _runtime.fail(exc)
        if first is None:
            return handle_request(self, *args, **kwargs)
        now.sent = 0
        now.watching = True
        err = ""
        try:
            return handle_request(self, *args, **kwargs)
        except BaseException as exc:
            err = type(exc).__name__
            raise
        finally:
            now.watching = False
            try:
                with _workers.DeferredSignals():  # a stop signal now waits for first_request to go out
                    _readiness.first_response(first, {"error.type": err} if err and not now.sent else None, now.sent)
            except Exception as exc:
                _runtime.fail(exc)

    def put(owner: Any, attr: str, orig: Any, new: Any) -> None:
        new.__wrapped__ = orig
        setattr(owner, attr, new)
        add_undo(lambda: setattr(owner, attr, orig) if owner.__dict__.get(attr) is new else None)

    put(cls, "handle", handle, wrapped_handle)
    put(cls, "handle_request", handle_request, wrapped_handle_request)
    if getattr(send_headers, "__wrapped__", None) is not None:
        return  # the other worker class's hook wrapped the shared Response already

    def wrapped_send_headers(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not now.watching or now.sent or getattr(self, "headers_sent", True):
            return send_headers(self, *args, **kwargs)
        out = send_headers(self, *args, **kwargs)
        now.sent = time.time_ns()  # ends first_request once handle_request returns: nothing delays the body
        return out

    put(resp_cls, "send_headers", send_headers, wrapped_send_headers)


def install(boot: int) -> None:
    """Start cold-start detection in this process (after ``_activate.activate``)."""
    st = state()
    if st.installed or not _runtime.active():
        return
    from . import _checkpoint, _sampler  # noqa: F401  (imported before the finder: not import time)
    from . import _imports as imports

    st.installed = st.collecting = True
    st.boot_ns = boot or time.time_ns()
    env = os.environ
    # launch --ready-url: the URL's answer is the readiness of launch's own child. The processes it starts
    # keep the file (a spawned worker serves that URL too), theirs only once they serve (_readiness).
    st.ready_file = _env.get("INFERSIGHT_READY_FILE")
    st.ready_file_inherited = st.ready_file is not None and not _readiness.launched()
    _set_children_dirs(_env.get(_workers.ENV))
    argv = _proc.command_argv()
    st.role = _proc.process_role(argv, _readiness.launched())
    if st.role and argv and any(p in argv[0] for p in _proc.HELPER_ENTRY_POINTS):
        env["INFERSIGHT_PROCESS_ROLE"] = st.role  # a compile worker's pool processes are helpers too
    _prepare_children()
    if _env.ready_on_listen():
        st.watch_listen = True  # the sampler thread also polls the kernel's listening sockets
        _readiness.note_inherited_listeners()
        _readiness.install_listen()
    on_import("torch", _install_torch)
    on_import("transformers", _install_transformers)
    on_import("tokenizers", _install_transformers)
    on_import("sentencepiece", _install_sentencepiece)
    on_import("uvicorn.config", _install_uvicorn)  # every request of the served ASGI app is timed
    on_import("uvicorn.server", _install_uvicorn_server)  # readiness as soon as it serves
    on_import("hypercorn.asyncio.run", _install_hypercorn_server)  # readiness as soon as a worker serves
    on_import("hypercorn.trio.run", _install_hypercorn_trio)  # ... a trio worker too, after its early listen
    on_import("hypercorn.app_wrappers", _install_hypercorn_app)  # every request of the served ASGI app is timed
    on_import("gunicorn.arbiter", _install_gunicorn_arbiter)  # a pre-fork master: ready only if a worker was
    on_import("hypercorn.run", _install_hypercorn_run)  # ... Hypercorn's main process with workers too
    on_import("gunicorn.workers.sync", _install_gunicorn_sync)  # a sync worker's first connection
    on_import("gunicorn.workers.gthread", _install_gunicorn_gthread)  # a gthread worker's (--threads)
    on_import("gunicorn.workers.gasgi", _install_gunicorn_asgi)  # gunicorn's own ASGI worker (-k asgi)
    on_import("waitress.server", _install_waitress)  # a waitress thread's first request
    on_import("http.server", _install_http_server)  # a BaseHTTPRequestHandler's first request
    on_import("wsgiref.simple_server", _install_wsgiref)  # wsgiref's (its handle() parses it itself)
    on_import("prometheus_client.exposition", _install_prometheus)  # a metrics exporter's server: a side server
    _install_stage_rules()
    st.imports = imports
    add_run_source(imports.flush_runs, imports.open_runs)
    st.finder = imports.Finder()
    sys.meta_path.insert(0, st.finder)
    _start_sampler()
    atexit.register(_readiness.at_exit)
    _register_main_end()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_child)


def set_up_done() -> None:
    """The bootstrap's set-up is over: ``runtime_init`` (interpreter start-up, these hooks'
    share apart) runs on to the main program's first line, which the rest of the
    interpreter's start-up still precedes (``_mainstart``)."""
    st = state()
    rs = _runtime.state()
    if not st.collecting or st.init_pending or not rs.root_start_ns or st.boot_ns <= rs.root_start_ns:
        return
    st.init_span = _runtime.new_span_id()
    st.init_pending.append(time.time_ns())
    if _interactive() or not _mainstart.watch(_program_started):
        end_runtime_init(0)


def _interactive() -> bool:
    """An interactive prompt: its first frame waits for what the user types, no start-up."""
    if _proc.command_argv():
        return False
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except Exception:
        return False


def _program_started(t_ns: int, seen: bool) -> None:
    """The watch's end (inside its profile callback). At the program's first frame, which no
    code of the hooks is under, ``runtime_init`` goes out; a give-up may come inside any call,
    the hooks' own (holding their locks) included, so it only notes the time for the root's end."""
    if seen:
        end_runtime_init(t_ns)
    else:
        state().init_gave_up.append(t_ns)


def _set_children_dirs(parent_dir: Optional[str]) -> None:
    st = state()
    st.parent_dir = parent_dir
    st.children_ready = False
    c = _runtime.state().client
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


def _register_main_end() -> None:
    """Note when the main script ends (threading's shutdown runs before atexit): what the
    interpreter does after that, at exit, is not part of the cold start."""
    reg = getattr(threading, "_register_atexit", None)
    if reg is None:
        return

    def main_ended() -> None:
        st = state()
        st.main_end_ns = time.time_ns()
        # The interpreter is exiting: a thread started from now on may never be joined (the exit handlers run
        # after threading's shutdown joined its threads), so a report to a supervisor is sent in line
        # (_readiness._report_to_parent).
        st.exiting = True

    try:
        reg(main_ended)
    except Exception:
        pass


def _start_sampler() -> None:
    """The sampler thread: stacks for the gaps (unless INFERSIGHT_SAMPLER=0), every TICK_S
    the checkpoint, and the supervisor check and the kernel's listening sockets (every
    IMPORT_TICK_S inside an import)."""
    st = state()
    if st.role == "helper":
        return
    from . import _checkpoint
    from . import _sampler as sampler

    checkpoint = _checkpoint.Checkpoint()
    s = sampler.Sampler(_state.current.main_ident or 0, sample=_env.get("INFERSIGHT_SAMPLER"),
                        in_import=lambda: bool(_state.current.imports.main.stack))  # as _import timing has it

    def ship() -> None:  # on the sampler thread, every TICK_S (inside imports too)
        try:
            checkpoint.tick(s.samples)
        except Exception as exc:
            _runtime.fail(exc)

    s.tick = _readiness.tick  # every TICK_S; every IMPORT_TICK_S inside an import
    s.ship = ship
    s.done = _close_netlink
    st.checkpoint = checkpoint
    st.sampler = s
    s.start()


def _close_netlink() -> None:
    """(Sampler thread, at its end) The polls of the kernel's tables are over: close their socket."""
    lst = sys.modules.get(__name__.rpartition(".")[0] + "._listening")  # imported only if it polled
    if lst is not None:
        lst.close_netlink()


def _install_sentencepiece(mod: Any) -> None:
    if not _lazy.fresh("_build", "tokenizer_load timing"):
        return
    from . import _build

    _build.install_sentencepiece(mod)


def _install_transformers(_mod: Any) -> None:
    if not _lazy.fresh("_build", "model_build and tokenizer_load timing"):
        return
    from . import _build  # model_build / tokenizer_load: only where transformers or tokenizers load

    _build.install_hf()


def _install_stage_rules() -> None:
    try:
        if not _lazy.fresh("_stagerules", "stage rules"):
            return
        from . import _stagerules  # rules/stages.toml and the rules directories: watch their modules

        _stagerules.install()
    except Exception as exc:
        _runtime.fail(exc)


def _install_torch(torch: Any) -> None:
    """Only in processes that import torch: its stages (``_torch``), its weights loads
    (``_weights``) and runs of ``torch.nn.init`` (``_build``)."""
    if not state().collecting:
        return
    if not all(_lazy.fresh(m, "torch's stages and weights_load") for m in ("_build", "_torch", "_weights")):
        return
    from . import _build, _torch, _weights

    _weights.install(torch)  # weights_load: loaders, load_state_dict, safetensors, transformers
    _torch.install(torch, _weights)
    _build.install_torch(torch)


def _after_fork_child() -> None:
    """A forked child starts its own cold start (its root: the fork, under our span), on the
    fresh state ``_state`` gave it (after ``_activate``'s handler, registered before ours;
    its locks are new: the sampler thread may have held the parent's at the fork)."""
    st = state()
    try:
        _set_children_dirs(st.parent_dir)
        was_collecting = st.collecting  # the parent's: its wrappers are still in place
        st.collecting = st.installed and _runtime.active()
        if st.collecting:
            _prepare_children()
        if st.collecting:
            _start_sampler()
        if st.collecting and st.imports is not None and st.finder is None:
            st.finder = st.imports.Finder()  # the parent's cold start ended: its finder is gone
            sys.meta_path.insert(0, st.finder)
        if st.collecting and not was_collecting and "torch" in sys.modules:
            _install_torch(sys.modules["torch"])  # the parent took its wrappers out: this child needs them again
        rs = _runtime.state()
        if st.collecting and rs.root_start_ns:
            # the fork (the root starts at its clock tick) and the at-fork handlers, ours
            # included: the child's runtime_init, as a new interpreter's start-up is
            now = time.time_ns()
            if now > rs.root_start_ns:
                emit_stage("runtime_init", _runtime.new_span_id(), rs.root_span_id,
                           rs.root_start_ns, now, {"infersight.runtime_init.forked": True})
    except Exception as exc:
        _runtime.fail(exc)
