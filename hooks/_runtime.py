"""Process-wide hook state: the client, the trace, the cold-start root (stdlib only).

Nothing here raises into user code: public entry points go through ``guard``, which
disables the hooks and prints one line on the first internal error.
"""

from __future__ import annotations

import _random  # the C generator: the random module costs ~1 ms of imports
import atexit
import contextvars
import os
import sys
import time

from . import _client, _env, _paths, _proc, _state
from ._client import Client, _say

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

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

client: Optional[Client] = None
trace_id = ""
root_span_id = ""
root_parent: Optional[str] = None
root_start_ns = 0
root_ended = False
root_attrs: Dict[str, Any] = {}
current_span: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "infersight_span", default=None
)
_failed = False
_publish_env: Optional[Callable[[], None]] = None  # _spawn.publish once active
# Span ids: a per-process generator seeded from the OS (reseeded in a forked child), not
# one os.urandom call per id. Ids only need to be unique, not secret. They are drawn and
# formatted 256 at a time (one hex string, split): a stage takes one with a list pop.
_rng = _random.Random(int.from_bytes(os.urandom(16), "big"))
_IDS_PER_DRAW = 256
_ZERO_ID = "0" * 16  # invalid in W3C trace context
_ZERO_BYTES = bytes(8)
span_ids: List[str] = []


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
    raw = _rng.getrandbits(64 * _IDS_PER_DRAW).to_bytes(8 * _IDS_PER_DRAW, "big")
    ids = raw.hex(" ", 8).split(" ")
    if _ZERO_BYTES in raw:  # one C search, not a string comparison per id; all but never true
        ids = [i for i in ids if i != _ZERO_ID]
    span_ids.extend(ids)  # one call: atomic against a pop on another thread
    return span_ids.pop()


def _reseed() -> None:
    """In a forked child: else parent and child would draw the same ids."""
    _rng.seed(int.from_bytes(os.urandom(16), "big"))
    del span_ids[:]


def active() -> bool:
    return client is not None and client.enabled and not _failed


def fail(exc: BaseException) -> None:
    """Disable the hooks after an internal error; say so once."""
    global _failed
    if not _failed:
        _failed = True
        _say("hooks disabled after an internal error: %r" % (exc,))
    if client is not None:
        client.enabled = False


def emit(kind: str, data: Dict[str, Any]) -> None:
    c = client
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
    c = client
    if c is not None and c.enabled:
        try:
            c.urgent()  # sets flags and an event: never blocks; the agent is rung once it is sent
        except Exception as exc:
            fail(exc)


def emit_soon(kind: str, data: Dict[str, Any]) -> None:
    """``emit``, and send it now rather than at the end of the batch delay, without ringing
    the agent's doorbell (that is for OOMs): a cold-start checkpoint must leave the process
    before it may be killed, not jump the agent's read gate."""
    emit(kind, data)
    c = client
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
    return "00-%s-%s-01" % (trace_id, span_id or current_span.get() or root_span_id)


def _producer_info(launched: bool) -> Dict[str, Any]:
    env = os.environ
    return {
        "id": _proc.producer_id(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "uid": os.getuid(),
        "start_ns": root_start_ns,
        "exe": os.path.basename(sys.executable or "python"),
        "argv0": _proc.command_name(_proc.command_argv()),  # not sys.argv: see command_argv
        "python": "%d.%d.%d" % sys.version_info[:3],
        "host": os.uname().nodename,
        "service_name": env.get("OTEL_SERVICE_NAME", ""),
        "resource_attributes": env.get("OTEL_RESOURCE_ATTRIBUTES", ""),
        "trace_id": trace_id,
        "root_span_id": root_span_id,
        # The root's parent (TRACEPARENT): a root the agent closes for this process, should it
        # die before sending its own, nests where this one would (a supervisor's worker).
        "root_parent": root_parent,
        "launched": launched,
        # A joined launch's token: its subscription on the agent gets this process's items
        # (children inherit it, so workers are in the waterfall too).
        "session": _env.get("INFERSIGHT_LAUNCH_SESSION", env) or "",
    }


def activate() -> bool:
    """Start the hooks in this process. Returns False (and stays inert) on any trouble."""
    global client, trace_id, root_span_id, root_parent, root_start_ns, _publish_env
    if client is not None:
        return True
    try:
        env = os.environ
        launched = False
        spawn = _env.get("INFERSIGHT_LAUNCH_SPAWN_NS")
        env.pop("INFERSIGHT_LAUNCH_SPAWN_NS", None)
        if spawn:
            root_start_ns = spawn  # launched: the launcher's spawn time
            launched = True
        else:
            root_start_ns = _proc.process_start_ns() or time.time_ns()
        parent = parse_traceparent(env.get("TRACEPARENT", ""))
        if parent:
            trace_id, root_parent = parent
            parent_dir = _env.get("INFERSIGHT_CHILDREN_DIR")
            if parent_dir:  # started on the hooked parent's behalf (Ray's raylet): its span now
                from . import _workers

                root_parent = _workers.parent_current(parent_dir, os.getppid()) or root_parent
        else:
            trace_id, root_parent = os.urandom(16).hex(), None
        root_span_id = new_span_id()
        # Children join this trace under our root; a spawn puts its current span here.
        env["TRACEPARENT"] = traceparent(root_span_id)
        spool_max = _env.get("INFERSIGHT_SPOOL_MAX_BYTES")
        max_buffer = _env.get("INFERSIGHT_BUFFER_EVENTS") or _client.MAX_BUFFER_EVENTS
        client = Client(
            _paths.socket_path(),
            _paths.spool_dir(),
            _producer_info(launched),
            max_buffer=max_buffer,
            spool_max_bytes=spool_max,
            batch_events=_env.get("INFERSIGHT_BATCH_EVENTS"),
            batch_delay_s=_env.get("INFERSIGHT_BATCH_DELAY_MS") / 1e3,
        )
        atexit.register(_at_exit)
        from . import _spawn

        _spawn.install()
        _publish_env = _spawn.publish
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=_before_fork, after_in_child=_after_fork_child)
        return True
    except Exception as exc:
        fail(exc)
        return False


def end_root(end_ns: Optional[int] = None, attrs: Optional[Dict[str, Any]] = None) -> None:
    """Close the cold-start root span once (at readiness/first request, or at exit)."""
    global root_ended
    if root_ended or client is None:
        return
    root_ended = True
    a: Dict[str, Any] = {"faas.coldstart": True}
    a.update(root_attrs)
    if attrs:
        a.update(attrs)
    data = {"n": "coldstart", "id": root_span_id, "tr": trace_id, "s": root_start_ns, "a": a}
    if root_parent:
        data["p"] = root_parent
    if end_ns is not None:
        data["e"] = end_ns
    emit("span", data)
    # Every later hello says so: an agent that restarts after it must not take this
    # process's later stages for a cold start, nor close a root for it when it dies.
    client.producer["root_ended"] = True


def _exit_flush_s() -> float:
    return float(_env.get("INFERSIGHT_EXIT_FLUSH_S"))


def _at_exit() -> None:
    try:
        end_root(attrs={"infersight.coldstart.ended_by": "exit"})
        if client is not None:
            client.close(_exit_flush_s())
    except Exception as exc:
        fail(exc)


def _at_process_end() -> None:
    """End of a forked multiprocessing worker: it leaves through os._exit, which skips
    atexit, but runs multiprocessing's finalizers first. Idempotent with ``_at_exit``."""
    coldstart = sys.modules.get(__name__.rsplit(".", 1)[0] + "._coldstart")
    if coldstart is not None:
        try:
            coldstart._at_exit()
        except Exception as exc:
            fail(exc)
    _at_exit()


class _MpToken:
    """A weak-referenceable anchor for multiprocessing's after-fork registry."""


_mp_token = _MpToken()
_mp_registered = False


def _register_finalizer(_token: object = None) -> None:
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        mp_util.Finalize(None, _at_process_end, exitpriority=-100)  # after the user's finalizers


def _before_fork() -> None:
    """In the parent, before a fork: if multiprocessing is in use, have its worker bootstrap
    (which clears the finalizers inherited from the parent, then runs after-fork callbacks)
    register our flush as one of the worker's finalizers."""
    global _mp_registered
    if client is None:
        return
    client.hurry()  # send what is queued now, not at the end of a batch delay
    if _publish_env is not None:
        _publish_env()  # the child's environment: this thread's current span
    if _mp_registered:
        return
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        try:
            mp_util.register_after_fork(_mp_token, _register_finalizer)
            _mp_registered = True
        except Exception as exc:
            fail(exc)


def _after_fork_child() -> None:
    """A forked child is a new producer: fresh buffer, thread and root under our span."""
    global client, root_span_id, root_parent, root_start_ns, root_ended, root_attrs
    try:
        _reseed()  # else parent and child draw the same span ids
        old = client
        if old is None:
            return
        parent_span = current_span.get() or root_span_id
        client = None
        old.close_inherited()  # the child's copies only: the parent's connection and lock stay
        root_parent = parent_span
        root_span_id = new_span_id()
        root_start_ns = time.time_ns()
        root_ended = False
        root_attrs = {"infersight.process.forked": True}
        current_span.set(None)
        os.environ["TRACEPARENT"] = traceparent(root_span_id)
        client = Client(
            old.socket_path,
            old.spool_dir,
            _producer_info(False),
            max_buffer=old.max_buffer,
            spool_max_bytes=old.spool_max_bytes,
            batch_events=old.batch_events,
            batch_delay_s=old.batch_delay_s,
        )
    except Exception as exc:
        fail(exc)
    finally:
        # The hooks' state of this process: a new instance, before _coldstart's and
        # _alloc's own after-fork handlers (registered after this one) restart on it.
        _state.replace_after_fork(root_start_ns)
