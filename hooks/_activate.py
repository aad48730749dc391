"""Starting the hooks in a process, and what happens at its exit and its forks (stdlib only).

``activate`` makes the producer (``_state.current.runtime``: the client, the trace, the
cold-start root) and wraps the spawn paths (``_spawn``); ``activate_process`` is what the
bootstrap runs in each hooked process: that, then cold-start detection (``_coldstart``):
runtime_init, framework imports, readiness, and torch instrumentation once (and only if)
the user imports torch.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

from . import (
    _client,
    _coldstart,
    _contract,
    _env,
    _fds,
    _forkexit,
    _lazy,
    _paths,
    _proc,
    _readiness,
    _recorder,
    _runtime,
    _spawn,
    _state,
)
from ._client import Client

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Dict, Optional


def _producer_info(launched: bool, exec_ns: int = 0) -> Dict[str, Any]:
    env = os.environ
    rs = _runtime.state()
    return {
        "id": _proc.producer_id(exec_ns=exec_ns),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "uid": os.getuid(),
        "start_ns": rs.root_start_ns,
        "exe": os.path.basename(sys.executable or "python"),
        "argv0": _proc.command_name(_proc.command_argv()),  # not sys.argv: see command_argv
        "python": "%d.%d.%d" % sys.version_info[:3],
        "host": os.uname().nodename,
        "service_name": env.get("OTEL_SERVICE_NAME", ""),
        "resource_attributes": env.get("OTEL_RESOURCE_ATTRIBUTES", ""),
        "trace_id": rs.trace_id,
        "root_span_id": rs.root_span_id,
        # The root's parent (TRACEPARENT): a root the agent closes for this process, should it
        # die before sending its own, nests where this one would (a supervisor's worker).
        "root_parent": rs.root_parent,
        "launched": launched,
        # A joined launch's token: its subscription on the agent gets this process's items
        # (children inherit it, so workers are in the waterfall too).
        "session": _env.get("INFERSIGHT_LAUNCH_SESSION", env) or "",
    }


def _exec_start(env: Any) -> Optional[int]:
    """When a hooked program exec'd this one in this process (``_spawn.note_exec``): the
    exec's time, if it is this pid's and lies between the process's fork and now."""
    pid = _env.get("INFERSIGHT_EXEC_PID", env)
    ns = _env.get("INFERSIGHT_EXEC_NS", env)
    env.pop("INFERSIGHT_EXEC_PID", None)  # not for this program's children
    env.pop("INFERSIGHT_EXEC_NS", None)
    if pid != os.getpid() or not ns:
        return None
    fork_ns = _proc.process_start_ns() or 0
    return ns if fork_ns - 20_000_000 <= ns <= time.time_ns() else None  # (fork_ns: clock ticks)


def activate() -> bool:
    """Start the hooks in this process. Returns False (and stays inert) on any trouble."""
    rs = _runtime.state()
    if rs.client is not None:
        return True
    try:
        env = os.environ
        launched = False
        spawn = _env.get("INFERSIGHT_LAUNCH_SPAWN_NS")
        env.pop("INFERSIGHT_LAUNCH_SPAWN_NS", None)
        exec_ns = _exec_start(env)
        if spawn:
            rs.root_start_ns = spawn  # launched: the launcher's spawn time
            launched = True
        else:  # an exec'd program's cold start begins at the exec, else at the fork
            rs.root_start_ns = exec_ns or _proc.process_start_ns() or time.time_ns()
        parent = _runtime.parse_traceparent(env.get("TRACEPARENT", ""))
        if parent:
            rs.trace_id, rs.root_parent = parent
            parent_dir = _env.get("INFERSIGHT_CHILDREN_DIR")
            if parent_dir:  # started on the hooked parent's behalf (Ray's raylet): its span now
                from . import _workers

                rs.root_parent = _workers.parent_current(parent_dir, os.getppid()) or rs.root_parent
        else:
            rs.trace_id, rs.root_parent = os.urandom(16).hex(), None
        rs.root_span_id = _runtime.new_span_id()
        # Children join this trace under our root; a spawn puts its current span here.
        env["TRACEPARENT"] = _runtime.traceparent(rs.root_span_id)
        spool_max = _env.get("INFERSIGHT_SPOOL_MAX_BYTES")
        max_buffer = _env.get("INFERSIGHT_BUFFER_EVENTS") or _client.MAX_BUFFER_EVENTS
        rs.client = Client(
            _paths.socket_path(),
            _paths.spool_dir(),
            _producer_info(launched, exec_ns or 0),
            max_buffer=max_buffer,
            spool_max_bytes=spool_max,
            batch_events=_env.get("INFERSIGHT_BATCH_EVENTS"),
            batch_delay_s=_env.get("INFERSIGHT_BATCH_DELAY_MS") / 1e3,
        )
        atexit.register(at_exit)
        rs.exit_flush = at_exit
        _spawn.install()
        rs.publish_env = _spawn.publish
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=_before_fork, after_in_child=_after_fork_child)
        return True
    except Exception as exc:
        _runtime.fail(exc)
        return False


def _install_allocator_hooks(torch: object) -> None:
    """Once the host imports torch: OOM capture and allocator telemetry (``_alloc``)."""
    if not _lazy.fresh("_alloc", "torch's OOM capture and allocator telemetry"):
        return
    from . import _alloc

    _alloc.install(torch)


def _install_engine_log(logging: object) -> None:
    """Serving engines' memory errors logged through ``logging`` (``_enginelog``)."""
    if not _lazy.fresh("_enginelog", "serving engines' memory errors in their logs"):
        return
    from . import _enginelog

    _enginelog.install_logging(logging)


# A serving engine's package's import (_contract.ENGINE_PACKAGES) ends launch's hold on its embedded agent: an
# engine's memory errors come while it starts, often within launch's hold, and held, the agent would start only
# at the OOM's doorbell and classify it a few hundred ms late. An engine's cold start runs for tens of seconds,
# so the agent's start (about 0.2 s of launch's CPU) is a small part of it. (An import done before launch's hold
# begins, 50 ms after the spawn, rings nothing: the OOM's own doorbell still does.)
def _engine_imported(module: object) -> None:
    _runtime.ring_launch(engine=True)  # a no-op unless launch holds its agent back


def activate_process() -> bool:
    if _proc.is_own_cli(_proc.command_argv()):
        return False  # infersight's own CLI (``INFERSIGHT=1 infersight status``) is no producer
    if not activate():
        return False
    if _coldstart.state().installed:
        return True  # the bootstrap ran again (the .pth line, then site's own sitecustomize import): set up once
    try:  # an INFERSIGHT_* name that nothing reads is a typo: said once per process, and ignored
        for name, suggestion in _env.unknown(os.environ):
            _env.say(_env.unknown_message(name, suggestion) + "; ignored")
    except Exception:
        pass  # a check that failed is no reason to stop the hooks
    try:
        # _enginelog before the import timing starts: the hooks' own set-up, not an import of the program
        from . import _BOOT_NS, _enginelog

        _coldstart.install(_BOOT_NS)
        _recorder.on_import("torch", _install_allocator_hooks)
        _recorder.on_import("logging", _install_engine_log)
        for name in _contract.ENGINE_PACKAGES:
            _recorder.on_import(name, _engine_imported)
        _enginelog.install_excepthooks()  # chained: an engine's uncaught memory error, torch or not
    except Exception as exc:
        _runtime.fail(exc)
    try:
        _coldstart.set_up_done()  # runtime_init goes on to the main program's first line
    except Exception as exc:
        _runtime.fail(exc)
    return True


# -- exit --------------------------------------------------------------------------------


_exit_done = [False]


def at_exit() -> None:
    """The exit flush, once per process: at exit, or earlier where the process is about to end without
    atexit (uvicorn giving SIGTERM back to its default action)."""
    if _exit_done[0]:
        return
    _exit_done[0] = True
    _at_exit()


def _at_exit() -> None:
    """End the root and flush (or spool) what is left. The Python handlers of SIGINT, SIGTERM
    and SIGQUIT are held back meanwhile: a handler that raises SystemExit (most do) would
    otherwise stop the flush half way and lose what it had not spooled. A launch killed
    with SIGKILL sends one parent-death SIGTERM per thread it had, milliseconds apart, so a
    second signal during the exit flush is common. The held signals' handlers run after."""
    from ._workers import DeferredSignals

    try:
        with DeferredSignals():
            try:
                _runtime.end_root(attrs={_contract.ENDED_BY: "exit"})
                client = _runtime.state().client
                if client is not None:
                    # less what the cold start's exit handler waited already for a report in flight
                    client.close(max(0.0, _env.exit_flush_s() - _recorder.state().exit_waited_s))
            except Exception as exc:
                _runtime.fail(exc)
    except (SystemExit, KeyboardInterrupt):
        pass  # a held handler's: the interpreter is exiting already (its status is set)


def _at_process_end() -> None:
    """End of a forked multiprocessing worker: it leaves through os._exit, which skips
    atexit, but runs multiprocessing's finalizers first. Idempotent with ``_at_exit``
    (and the cold start's ``_readiness.at_exit``, which settles it first)."""
    try:
        _readiness.at_exit()
    except Exception as exc:
        _runtime.fail(exc)
    at_exit()


# -- forks -------------------------------------------------------------------------------


class _MpToken:
    """A weak-referenceable anchor for multiprocessing's after-fork registry."""


_mp_token = _MpToken()


def _register_finalizer(_token: object = None) -> None:
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        mp_util.Finalize(None, _at_process_end, exitpriority=-100)  # after the user's finalizers


def _before_fork() -> None:
    """In the parent, before a fork: if multiprocessing is in use, have its worker bootstrap
    (which clears the finalizers inherited from the parent, then runs after-fork callbacks)
    register our flush as one of the worker's finalizers."""
    rs = _runtime.state()
    if rs.client is None:
        return
    rs.client.hurry()  # send what is queued now, not at the end of a batch delay
    if rs.publish_env is not None:
        rs.publish_env()  # the child's environment: this thread's current span
    if rs.mp_registered:
        return
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        try:
            mp_util.register_after_fork(_mp_token, _register_finalizer)
            rs.mp_registered = True
        except Exception as exc:
            _runtime.fail(exc)


def _after_fork_child() -> None:
    """A forked child is a new producer: fresh buffer, thread and root under our span, on
    a new ``_state`` instance (made here, before ``_coldstart``'s and ``_alloc``'s own
    after-fork handlers, registered after this one, restart on it)."""
    parent = _runtime.state()
    old = parent.client
    root_start_ns = parent.root_start_ns
    parent_span = None
    try:
        _runtime.reseed()  # else parent and child draw the same span ids
        if old is not None:
            parent_span = _runtime.current_span.get() or parent.root_span_id
            root_start_ns = time.time_ns()
    except Exception as exc:
        _runtime.fail(exc)
    rs = _state.replace_after_fork(root_start_ns).runtime
    if old is None:
        return
    try:
        rs.client = None
        old.close_inherited()  # the child's copies only: the parent's connection and lock stay
        _fds.lost = 0  # a new producer: it reports the descriptors its own host takes, not its parent's
        rs.root_parent = parent_span
        rs.root_span_id = _runtime.new_span_id()
        rs.root_start_ns = root_start_ns
        rs.root_ended = False
        rs.root_attrs = {"infersight.process.forked": True}
        _runtime.current_span.set(None)
        os.environ["TRACEPARENT"] = _runtime.traceparent(rs.root_span_id)
        rs.client = Client(
            old.socket_path,
            old.spool_dir,
            _producer_info(False),
            max_buffer=old.max_buffer,
            spool_max_bytes=old.spool_max_bytes,
            batch_events=old.batch_events,
            batch_delay_s=old.batch_delay_s,
        )
    except Exception as exc:
        _runtime.fail(exc)
        return
    # Forked from a thread other than the main program's: when that thread ends, no interpreter exit comes,
    # and the hooks' threads would keep the child alive for ever (``_forkexit``). Its exit flush then.
    _forkexit.after_fork_child(_at_process_end)
