"""``TRACEPARENT`` for child processes, written only when one is spawned (stdlib only).

A stage must not write the environment: ``setenv`` costs microseconds and glibc keeps
every distinct value it was given (+53 MiB after 500k stages). Instead, every way a
child can start (fork, exec, ``posix_spawn``, ``system`` and ``_posixsubprocess``,
which ``subprocess`` and ``multiprocessing``'s spawn and forkserver go through) first
puts the spawning thread's current span in ``os.environ``, once per distinct value. An
explicit ``env`` that carries our trace (a copy of ``os.environ``) gets the current span
too, in a copy; one carrying another trace, or none, is left as the caller made it.

Nothing here raises into the caller: a failure disables the hooks and spawns anyway.
"""

from __future__ import annotations

import os
import sys
import time

from . import _runtime

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, List

installed = False  # process-wide, not per state: the wrappers stay in a forked child


def _exec_traceparent() -> str:
    """For an exec, which replaces this process: a forked child that has not opened a span
    of its own never emits its root, so the new program joins where the fork happened."""
    rs = _runtime.state()
    if _runtime.current_span.get() is None and rs.root_parent and not rs.root_ended \
            and rs.root_attrs.get("infersight.process.forked"):
        return _runtime.traceparent(rs.root_parent)
    return _runtime.traceparent()


def note_exec(env: Any) -> None:
    """An exec keeps this pid and its fork time: the new program's cold start begins now (its
    hooks read this), not at the fork, or its root would cover this program's whole life."""
    env["INFERSIGHT_EXEC_PID"] = str(os.getpid())
    env["INFERSIGHT_EXEC_NS"] = str(time.time_ns())


def _tracing() -> bool:
    rs = _runtime.state()
    return bool(rs.trace_id) and rs.client is not None


def publish(for_exec: bool = False) -> None:
    """Put the calling thread's current span in ``os.environ["TRACEPARENT"]``, if changed."""
    try:
        if not _tracing():
            return
        tp = _exec_traceparent() if for_exec else _runtime.traceparent()
        env = os.environ
        if env.get("TRACEPARENT") != tp:
            env["TRACEPARENT"] = tp
        if for_exec:
            note_exec(env)
    except Exception as exc:
        _runtime.fail(exc)


def _ours(value: Any) -> bool:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    parsed = _runtime.parse_traceparent(value) if isinstance(value, str) else None
    return parsed is not None and parsed[0] == _runtime.state().trace_id


def fix_env(env: Any, for_exec: bool = False) -> Any:
    """``env`` for a child, with our current span if it carries our trace (else as given)."""
    try:
        if env is None or env is os.environ or not _tracing():
            return env
        for key in ("TRACEPARENT", b"TRACEPARENT"):
            if key in env and _ours(env[key]):
                tp = _exec_traceparent() if for_exec else _runtime.traceparent()
                env = dict(env)
                env[key] = tp if isinstance(key, str) else tp.encode("ascii")
                if for_exec and isinstance(key, str):
                    note_exec(env)
                break
    except Exception as exc:
        _runtime.fail(exc)
    return env


def fix_env_list(env_list: Any) -> Any:
    """The ``[b"K=V", ...]`` list ``_posixsubprocess.fork_exec`` takes, likewise."""
    try:
        if not isinstance(env_list, list) or not _tracing():
            return env_list
        for i, item in enumerate(env_list):
            if isinstance(item, bytes) and item.startswith(b"TRACEPARENT=") and _ours(item[12:]):
                out: List[Any] = list(env_list)
                out[i] = b"TRACEPARENT=" + _runtime.traceparent().encode("ascii")
                return out
    except Exception as exc:
        _runtime.fail(exc)
    return env_list


def _wrap_env_at(
    fn: Callable[..., Any], index: int, fix: Callable[[Any], Any], for_exec: bool = False,
) -> Callable[..., Any]:
    """``fn`` that publishes first and fixes its positional argument ``index`` (an env)."""

    @_runtime.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        publish(for_exec)
        if len(args) > index:
            args = (*args[:index], fix(args[index]), *args[index + 1:])
        elif "env" in kwargs:
            kwargs["env"] = fix(kwargs["env"])
        return fn(*args, **kwargs)

    wrapper.__infersight_spawn__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_plain(fn: Callable[..., Any], for_exec: bool = False) -> Callable[..., Any]:
    @_runtime.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        publish(for_exec)
        return fn(*args, **kwargs)

    wrapper.__infersight_spawn__ = True  # type: ignore[attr-defined]
    return wrapper


def _patch(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    fn = getattr(owner, name, None)
    if fn is None or getattr(fn, "__infersight_spawn__", False):
        return
    setattr(owner, name, make(fn))


def install() -> None:
    """Wrap every spawn path (once per process; forked children inherit the wrappers)."""
    global installed
    if installed:
        return
    installed = True
    for name in ("posix_spawn", "posix_spawnp"):
        _patch(os, name, lambda fn: _wrap_env_at(fn, 2, fix_env))
    _patch(os, "execve", lambda fn: _wrap_env_at(fn, 2, lambda env: fix_env(env, True), True))
    _patch(os, "execv", lambda fn: _wrap_plain(fn, True))
    _patch(os, "system", _wrap_plain)
    try:
        import _posixsubprocess  # a small C module: subprocess and multiprocessing fork through it
    except ImportError:
        return
    _patch(_posixsubprocess, "fork_exec", lambda fn: _wrap_env_at(fn, 5, fix_env_list))
    sub = sys.modules.get("subprocess")  # imported before us: it bound the C function already
    if sub is not None and getattr(sub, "_fork_exec", None) is not None:
        _patch(sub, "_fork_exec", lambda fn: _wrap_env_at(fn, 5, fix_env_list))
