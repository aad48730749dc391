"""The end of a child forked from a thread other than the main program's (stdlib only).

In a child that ``os.fork()`` made on any thread but the one running the main program, the forking thread
is the child's only thread, but it is no main program: when its function ends (it returns, ``sys.exit()``
raises SystemExit there, an exception ends it) the interpreter does not exit. There is no finalization, no
``atexit``, no ``threading._shutdown``: the thread exits like any other, and the process ends when its LAST
thread does (as by ``exit(0)``). Without the hooks that thread is the last one, so the child ends at once.
With them, the hooks' own threads (the drain thread, the cold-start sampler, the allocator thread), daemon
threads or not (daemon only means anything to a finalization that never comes), kept such a child alive
forever, its parent's ``waitpid`` with it, and its events were never flushed.

So, in such a child, a watcher thread (``watch``) waits (blocked, no wake-ups) for the forking thread's
end: a thread-local object of that thread is freed when its thread state is cleared, and the weak
reference's callback releases the lock the watcher waits on (``Thread.join`` does not do on every version:
a thread that ``_thread.start_new_thread`` started cannot be joined, and 3.13 never marks a forked
``_MainThread``'s handle done). Then, as the child would without the hooks, it waits for the user's other
threads, runs the hooks' exit flush (bounded: ``INFERSIGHT_EXIT_FLUSH_S``), stops the hooks' threads and
ends last; a hooks thread that does not stop within ``STOP_WAIT_S`` does not keep the process: then
``os._exit(0)``, the status the child would have had. A child forked from the main program's thread is
left alone (its interpreter exits as usual), and so is one that leaves by ``os._exit`` (multiprocessing's
forked workers: their finalizers flush, ``_activate._register_finalizer``).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, List, Optional

STOP_WAIT_S = 3.0  # after the exit flush, how long the hooks' threads have to end
PREFIX = "infersight-"  # the hooks' threads' names

# The ident of this process's main program's thread; None where there is none (forked from another thread,
# or from such a child's only thread). A fork keeps the forking thread's ident (pthread_self) in the child.
_main_ident: List[Optional[int]] = [threading.main_thread().ident]


class _Token:
    """Held only by the forking thread's thread-local storage: freed when that thread ends."""

    __slots__ = ("__weakref__",)


_keep: List[Any] = []  # this process's watch (the local and the weak reference must outlive the thread)


def after_fork_child(exit_flush: Callable[[], None]) -> None:
    """In a forked child (an at-fork handler, on the forking thread): watch the forking thread's end if it
    was not the main program's. Never raises."""
    try:
        if _main_ident[0] is not None and threading.get_ident() == _main_ident[0]:
            return  # forked from the main program: its interpreter exits as usual
        _main_ident[0] = None  # (and this child's own children, forked from any thread)
        del _keep[:]  # a watch inherited from the parent watched the parent's thread
        ended = threading.Lock()
        ended.acquire()
        local = threading.local()
        token = _Token()
        local.token = token
        release = ended.release
        ref = weakref.ref(token, lambda _r: release())
        _keep.extend((local, ref))
        del token
        main = threading.current_thread()
        threading.Thread(target=_watch, args=(ended, main, exit_flush), name=PREFIX + "fork-exit", daemon=True).start()
    except Exception:
        pass  # never disturb the host: no watch (the child behaves as before)


def _watch(ended: Any, main: Any, exit_flush: Callable[[], None]) -> None:
    try:
        ended.acquire()  # the forking thread has ended (its thread state cleared)
        _wait_user_threads(main)
        try:
            exit_flush()  # the exit flush the interpreter's exit would have run (bounded)
        except Exception:
            pass
        if not _stop_hooks_threads():
            os._exit(0)  # a hooks thread stuck: end as the child would have, not never
    except Exception:
        try:
            os._exit(0)  # hooks threads left with nothing to stop them: do not keep the process alive
        except Exception:
            pass
    # Returning ends this, the last thread: the process exits (status 0), as without the hooks.


def _others(main: Any) -> List[threading.Thread]:
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and t is not main and t.is_alive()]


def _wait_user_threads(main: Any) -> None:
    """Without the hooks the child lives on while any thread of the user's does (daemon or not)."""
    while True:
        users = [
            t for t in _others(main) if not t.name.startswith(PREFIX) and not isinstance(t, threading._DummyThread)
        ]  # (a foreign thread cannot be joined)
        if not users:
            return
        for t in users:
            t.join()


def _stop_hooks_threads() -> bool:
    """Stop what still runs of the hooks' threads (the exit flush stopped the drain thread); True when all
    ended within STOP_WAIT_S."""
    import time

    package = __name__.rpartition(".")[0]
    readiness = sys.modules.get(package + "._readiness")
    if readiness is not None:
        try:
            readiness._stop_sampler()
        except Exception:
            pass
    alloc = sys.modules.get(package + "._alloc")
    if alloc is not None:
        try:
            st = alloc.state()
            st.stop = True
            st.wake.set()
        except Exception:
            pass
    deadline = time.monotonic() + STOP_WAIT_S
    for t in threading.enumerate():
        if t is threading.current_thread() or not t.name.startswith(PREFIX):
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        t.join(left)
        if t.is_alive():
            return False
    return True
