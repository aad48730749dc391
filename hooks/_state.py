"""The hooks' per-process state: cold start and allocator, one ``HookState`` (stdlib only).

``current`` is the one instance of this process. A forked child does not reset fields of
its parent's state: ``_runtime``'s after-fork handler replaces ``current`` with
``current.forked(...)``, a fresh instance that carries over, by name, only what must
survive the fork (wrappers still installed, caches, the role). ``_coldstart`` and
``_alloc`` then restart their threads on the new instance. Tests install a fresh one in
its place (``monkeypatch.setattr(_state, "current", HookState())``).

The behaviour lives in ``_coldstart`` and ``_alloc``; this module holds data only.
"""

from __future__ import annotations

import os
import threading

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Set, Tuple


class ColdStart:
    """Cold-start detection (``_coldstart``): readiness, warmups, first request, wrappers."""

    __slots__ = (
        "boot_ns", "callbacks", "ceilings", "children_dir", "children_ready", "collecting", "covered",
        "explicit", "finder", "first", "first_done", "imports", "inherited_sockets", "installed", "last_end_ns",
        "listen_owned", "listen_polled_ns", "listen_watch", "lock", "main_end_ns", "main_pid", "orig_listen",
        "parent_dir", "post_import",
        "ready_file", "ready_ns", "ready_source", "role", "rule_stages_open", "sampler", "stage_seq", "tls", "undo",
        "warm", "watch_listen", "watched",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tls = threading.local()  # per thread: "compile" depth (jit.trace, torch.compile)
        self.installed = False
        self.collecting = False  # True from install until the root ends: wrappers check this first
        self.boot_ns = 0
        self.ready_ns: Optional[int] = None
        self.ready_source = ""
        self.last_end_ns = 0  # end of the latest stage that finished (start of ready_wait)
        self.stage_seq = 0  # bumped at every stage start while collecting (splits warmup runs)
        self.explicit = False  # the user called mark_ready(): first_request ends at first_response()
        self.main_pid = os.getpid()
        self.main_end_ns = 0  # when the main script ended (threading's shutdown, before atexit)
        self.ready_file: Optional[str] = None
        self.undo: List[Callable[[], None]] = []
        self.post_import: Dict[str, List[Callable[[Any], None]]] = {}
        self.watched: Set[str] = set()  # names with post-import callbacks: the Finder wraps their loader
        self.callbacks: Dict[str, Callable[[int], None]] = {}
        self.finder: Any = None  # the _imports.Finder on sys.meta_path
        self.imports: Any = None  # the _imports module, once installed
        self.sampler: Any = None  # the _sampler.Sampler while the cold start is collected
        self.covered: List[Tuple[int, int]] = []  # this process's stage intervals (for the gaps)
        self.role = ""  # "helper" for resource trackers, compile workers, ``python -c`` probes
        self.ceilings: Optional[Dict[str, Any]] = None  # storage ceilings, read once from the cache
        self.warm: Any = None  # the _coldstart._Warm run in progress
        self.first: Any = None  # the _coldstart._First request in progress
        self.first_done = False
        self.parent_dir: Optional[str] = None  # where this process reports its cold start's end
        self.children_dir: Optional[str] = None  # where this process's children report theirs
        self.children_ready = False  # that directory exists
        self.orig_listen: Any = None  # socket.socket.listen before our wrapper
        self.listen_owned = False  # ... and whether socket.socket defined it itself
        self.watch_listen = False  # poll the kernel's listening sockets (INFERSIGHT_READY_ON_LISTEN)
        self.listen_watch: Any = None  # the _listening.ListenWatch, made on the first poll
        self.listen_polled_ns = 0  # when it was last polled
        self.inherited_sockets: Set[int] = set()  # sockets held at start: their listening is no readiness
        self.rule_stages_open = 0  # outermost stage-rule spans running (a listen inside one is no readiness)

    def forked(self, root_start_ns: int) -> ColdStart:
        """The state of a child forked from this process: a cold start of its own, whose
        root starts at ``root_start_ns``. Carries over what the fork kept in memory (the
        wrappers and their undo list, the import finder, post-import callbacks) and what
        stays true (the role, the readiness file, cached ceilings)."""
        new = ColdStart()
        new.installed = self.installed
        new.collecting = self.collecting  # the parent's (its wrappers are in place); the child's is decided on start
        new.boot_ns = self.boot_ns
        new.stage_seq = self.stage_seq
        new.role = self.role
        new.ceilings = self.ceilings
        new.ready_file = self.ready_file
        if self.ready_ns is not None:
            # It inherited a server that was already ready: no readiness signal of its own
            # (its root ends at its first response, what it loads after the fork included).
            new.ready_ns = root_start_ns
            new.ready_source = "fork"
        new.last_end_ns = root_start_ns
        new.parent_dir = self.children_dir  # the parent's children dir is this child's parent dir
        new.undo = self.undo
        new.post_import = self.post_import
        new.watched = self.watched
        new.callbacks = self.callbacks
        new.finder = self.finder
        new.imports = self.imports
        new.orig_listen = self.orig_listen
        new.listen_owned = self.listen_owned
        new.watch_listen = self.watch_listen  # a new watch: the parent's foreign set is not this one's
        new.inherited_sockets = self.inherited_sockets
        return new


class Alloc:
    """Allocator telemetry (``_alloc``): the OOM observer, excepthooks, the sampler thread."""

    __slots__ = (
        "backend", "history", "installed", "last_obs", "lock", "meta", "observer_attached",
        "prev_sys_hook", "prev_thread_hook", "reported", "started", "status", "stop", "thread", "torch", "wake",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.torch: Any = None
        self.installed = False
        self.started = False  # allocator hooks attached (or found impossible) in this process
        self.observer_attached = False
        self.history = 0  # entries of the history ring, when it runs
        self.backend = ""
        self.thread: Optional[threading.Thread] = None
        self.wake = threading.Event()
        self.stop = False
        self.prev_sys_hook: Optional[Callable[..., Any]] = None
        self.prev_thread_hook: Optional[Callable[..., Any]] = None
        self.last_obs: Dict[int, Tuple[float, Optional[str], int]] = {}  # thread -> (monotonic, sp, req)
        self.reported: List[int] = []  # ids of exceptions reported that refused an attribute
        self.meta = ""  # last memory metadata set
        self.status: Dict[str, Any] = {"observer": False, "sampler": False, "history": 0, "reason": ""}

    def forked(self) -> Alloc:
        """The state of a forked child: it cannot use its parent's CUDA context, so the
        allocator hooks start again; the module and the chained excepthooks stay."""
        new = Alloc()
        new.torch = self.torch
        new.installed = self.installed
        new.stop = self.stop
        new.prev_sys_hook = self.prev_sys_hook
        new.prev_thread_hook = self.prev_thread_hook
        return new


class HookState:
    """Everything the cold-start and allocator hooks keep, for one process: its main thread
    (the forking thread, in a forked child) and that thread's current span, which threads
    of ours read (the allocator's sampler tags with it); the cold-start and allocator state."""

    __slots__ = ("alloc", "coldstart", "main_ident", "main_span")

    def __init__(self, coldstart: Optional[ColdStart] = None, alloc: Optional[Alloc] = None,
                 main_ident: Optional[int] = None) -> None:
        self.main_ident = main_ident if main_ident is not None else threading.main_thread().ident
        self.main_span: Optional[str] = None  # kept by hooks.stage and _coldstart.set_current
        self.coldstart = coldstart if coldstart is not None else ColdStart()
        self.alloc = alloc if alloc is not None else Alloc()

    def forked(self, root_start_ns: int) -> HookState:
        return HookState(self.coldstart.forked(root_start_ns), self.alloc.forked(), threading.get_ident())


current = HookState()


def replace_after_fork(root_start_ns: int) -> HookState:
    """In a forked child (``_runtime``'s after-fork handler): a new instance for this process."""
    global current
    current = current.forked(root_start_ns)
    return current
