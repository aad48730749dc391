"""When the main program's first line runs: the end of the interpreter's start-up (stdlib only).

The bootstrap runs inside ``site``. After it, the interpreter still finishes its start-up on
the main thread before the program runs: ``usercustomize``, the check whether the script is a
zip application (zipimport reads the script's tail; a page-cache miss costs tens of ms on a
loaded host), reading and compiling the script (a main script is never cached as bytecode),
or importing ``runpy`` for ``-m``. ``watch`` sets a profile function on the main thread that
sees the first Python frame of the program: the script's (or ``-c``'s) ``<module>`` code in
``__main__``, or ``runpy._run_module_as_main`` for ``-m`` and zip applications. It then takes
itself out, so nothing is profiled once the program runs. It gives up after ``MAX_EVENTS``
callbacks (an embedding host or a REPL, which run no ``__main__`` frame at first).
"""

from __future__ import annotations

import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, List

__all__ = ["MAX_EVENTS", "abandon", "is_program_start", "pause", "resume", "waiting", "watch"]

# Profile callbacks before giving up (~150 ns each here: 15 ms at most). Under launch a script
# starts after ~450 and -m after ~570; with the .pth line, the site's later .pth files count too
# (one that imports ssl: ~27,000). bench/mainstart_watch.py measures both.
MAX_EVENTS = 100_000
_profile: List[Any] = [None]  # the watch's profile function while it waits
_left = [0]  # callbacks left before it gives up; 0: over (seen, given up, or displaced)
_paused = [False]  # taken out for a while by the hooks themselves (pause/resume): still waiting
_main = [0]  # the watched thread's ident


def is_program_start(frame: Any) -> bool:
    """Whether ``frame`` is the first frame of the main program (pure: read only)."""
    co_name: str = frame.f_code.co_name
    name: object = frame.f_globals.get("__name__")
    if co_name == "<module>":
        return name == "__main__"
    return co_name == "_run_module_as_main" and name == "runpy"


def waiting() -> bool:
    """Whether this thread is the main thread before its program's first line, watched: the
    import timing leaves such imports (``usercustomize``, ``runpy`` for ``-m``) to runtime_init.
    False once a profiler displaced the watch, and from then on: the watch is over, even where
    that profiler later puts it back (a save-and-restore), which would find it inside the program."""
    f = _profile[0]
    if f is None:
        return False
    if sys.getprofile() is f or (_paused[0] and threading.get_ident() == _main[0]):
        return True
    if threading.get_ident() == _main[0]:
        abandon()  # displaced on its own thread
    return False


def pause() -> bool:
    """Take the watch out while the bootstrap runs the environment's own ``sitecustomize`` (it may import a
    large package: each call would cost a callback and use up the budget meant for the interpreter's own
    start-up). Still waiting: its imports stay start-up. True when paused (``resume`` then)."""
    f = _profile[0]
    if f is None or _paused[0] or sys.getprofile() is not f:
        return False
    sys.setprofile(None)
    _paused[0] = True
    return True


def resume() -> None:
    """Put the paused watch back; where a profiler was set meanwhile, it displaced the watch: over."""
    if not _paused[0]:
        return
    _paused[0] = False
    f = _profile[0]
    if f is None:
        return
    if sys.getprofile() is None:
        sys.setprofile(f)
    else:
        abandon()


def abandon() -> None:
    """End the watch without a verdict (displaced, or the cold start ended first): a profile call
    that still reaches it takes it out and does nothing else."""
    _left[0] = 0
    _profile[0] = None
    _paused[0] = False


def watch(on_start: Callable[[int, bool], None]) -> bool:
    """Call ``on_start(t_ns, True)`` on the main thread when the main program starts, or
    ``on_start(t_ns, False)`` when the watch gives up after ``MAX_EVENTS`` callbacks without it
    (an embedding host, a REPL: what ran until then was start-up all the same, and its imports
    were not timed). Returns False where nothing can be watched: not the main thread, or a
    profile function is already set (a profiler's: never displaced). Where a profiler replaces
    this one first, no call comes: the caller's fallback (the root's end) covers that.
    ``on_start`` runs inside a profile callback, at the program's first frame (none of the hooks'
    code below it) or at the give-up (anywhere): it must not take a lock the hooks hold."""
    if threading.current_thread() is not threading.main_thread() or sys.getprofile() is not None:
        return False
    left = _left
    left[0] = MAX_EVENTS
    _main[0] = threading.get_ident()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if left[0] <= 0:  # over: abandoned, or put back by a profiler that had displaced it
            try:
                if sys.getprofile() is profile:
                    sys.setprofile(None)
            except Exception:
                pass
            return
        try:
            if event == "call" and is_program_start(frame):
                seen = True
            else:
                left[0] -= 1
                if left[0] > 0:
                    return
                seen = False
            left[0] = 0
            _stop(profile)
            on_start(time.time_ns(), seen)
        except Exception:  # never into the program: the watch ends instead
            left[0] = 0
            try:
                _stop(profile)
            except Exception:
                pass

    _profile[0] = profile
    sys.setprofile(profile)
    return True


def _stop(profile: Any) -> None:
    _profile[0] = None
    if sys.getprofile() is profile:
        sys.setprofile(None)
