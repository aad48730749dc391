"""The hooks' per-process state, one ``HookState`` (stdlib only).

One section per part of the hooks: the producer and its trace (``Runtime``: ``_runtime``,
``_activate``), cold-start detection (``ColdStart``: ``_recorder``, ``_readiness``,
``_coldstart``, ``_stagerules``), and the instrumenters it loads on demand (``Imports``, ``Build``, ``Torch``,
``Weights``), requests (``Requests``) and the allocator (``Alloc``).

``current`` is the one instance of this process. A forked child does not reset fields of
its parent's state: ``_activate``'s after-fork handler replaces ``current`` with
``current.forked(...)``, a fresh instance that carries over, by name, only what must
survive the fork (the client until the child's own replaces it, wrappers still installed,
caches, the role). ``_coldstart`` and ``_alloc`` then restart their threads on the new
instance. Tests install a fresh one in its place (``monkeypatch.setattr(_state, "current",
HookState())``): every module reads ``_state.current`` when it runs, never a copy of it.

The behaviour lives in the modules named above; this module holds data only.
"""

from __future__ import annotations

import os
import sys
import threading

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
# Servers whose hooks tell when a worker forked from a ready master is itself ready (gunicorn's
# serving-loop rules and request hooks, uvicorn's Server.startup): with neither imported at the
# fork, fork readiness is final (``ColdStart.forked``).
FORK_CONFIRMING_MODULES = ("gunicorn.workers.base", "uvicorn.server")
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Set, Tuple

    from ._client import Client


class Runtime:
    """The producer (``_runtime``, ``_activate``): its client, its trace and the cold-start root."""

    __slots__ = (
        "client", "exit_flush", "failed", "mp_registered", "publish_env", "root_attrs", "root_ended", "root_parent",
        "root_span_id", "root_start_ns", "trace_id",
    )

    def __init__(self) -> None:
        self.client: Optional[Client] = None  # while the hooks are active
        self.trace_id = ""
        self.root_span_id = ""
        self.root_parent: Optional[str] = None
        self.root_start_ns = 0
        self.root_ended = False
        self.root_attrs: Dict[str, Any] = {}
        self.failed = False  # an internal error disabled the hooks
        self.publish_env: Optional[Callable[[], None]] = None  # _spawn.publish once active
        self.exit_flush: Optional[Callable[[], None]] = None  # _activate.at_exit once active (once per process)
        self.mp_registered = False  # multiprocessing's after-fork registry knows our finalizer

    def forked(self) -> Runtime:
        """The same values: the after-fork handler then gives the child a client and root of its own."""
        new = Runtime()
        for name in Runtime.__slots__:
            setattr(new, name, getattr(self, name))
        return new


class ImportThread:
    """One thread's import timing (``_imports``): the packages being executed (one entry per
    package change), the time up to which their time is counted, the piece in progress, how
    many stages are open on the thread, the imports put aside by the stages opened inside them,
    whether a run of it is open."""

    __slots__ = ("busy", "finding", "paused", "piece_parent", "piece_start", "pkgs", "run_open", "saved",
                 "stack", "t_last")

    def __init__(self) -> None:
        self.stack: List[str] = []
        self.paused = 0
        # (stages open, stack, when) per stage opened inside an import: that import's stack, set
        # aside while the stage runs (its own imports start a stack of their own), and the time
        self.saved: List[Tuple[int, List[str], int]] = []
        self.t_last = 0
        self.piece_start = 0
        self.piece_parent: Optional[str] = None
        self.pkgs: Dict[str, int] = {}
        self.run_open = False  # the next stage on this thread emits it
        # True whenever ``stack``, ``run_open`` or ``saved`` is (and maybe a while after: the
        # next stage settles it): a stage's start or end on the thread has something to do
        self.busy = False
        self.finding = False  # the finder is looking for a spec on this thread


class MainImportThread(ImportThread):
    """The main thread's ``ImportThread``: its ``paused`` and ``busy`` live on the process's
    ``ColdStart`` (``main_paused``, ``main_busy``), where ``hooks.stage`` already holds the
    object: no load of this one per stage."""

    __slots__ = ("cold",)

    def __init__(self, cold: ColdStart) -> None:
        self.cold = cold
        super().__init__()

    @property  # type: ignore[override]
    def paused(self) -> int:
        return self.cold.main_paused

    @paused.setter
    def paused(self, value: int) -> None:
        self.cold.main_paused = value

    @property  # type: ignore[override]
    def busy(self) -> bool:
        return self.cold.main_busy

    @busy.setter
    def busy(self, value: bool) -> None:
        self.cold.main_busy = value


class Imports:
    """Import timing (``_imports``): the runs still open, one per thread, and each thread's
    ``ImportThread``: the main thread's in a plain slot (its stage count on ``cold``), the
    others' thread-local."""

    __slots__ = ("lock", "main", "main_ident", "runs", "tls")

    def __init__(self, cold: ColdStart, main_ident: Optional[int] = None) -> None:
        self.lock = threading.Lock()
        self.runs: Dict[int, Any] = {}  # thread ident -> the _imports._Run still open on that thread
        self.main_ident = main_ident if main_ident is not None else threading.main_thread().ident
        self.main: ImportThread = MainImportThread(cold)
        self.tls = threading.local()  # other threads: ``.thread`` holds their ImportThread

    def thread(self) -> ImportThread:
        """The calling thread's."""
        if threading.get_ident() == self.main_ident:
            return self.main
        tls = self.tls
        try:
            t: ImportThread = tls.thread
        except AttributeError:
            t = tls.thread = ImportThread()
        return t


class Build:
    """``model_build`` and ``tokenizer_load`` (``_build``)."""

    __slots__ = ("hf_done", "init_runs", "lock", "tls", "torch_done")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tls = threading.local()  # per thread: the model being built, inside an nn.init call
        self.init_runs: Dict[int, List[Any]] = {}  # ident -> [parent, start, end, calls, seq, span]
        self.hf_done = False  # transformers' entry points hooked
        self.torch_done = False  # torch.nn.init wrapped

    def forked(self) -> Build:
        new = Build()
        new.hf_done = self.hf_done
        new.torch_done = self.torch_done
        return new


class Torch:
    """PyTorch instrumentation (``_torch``)."""

    __slots__ = ("backend", "cuda_seen", "module", "tls")

    def __init__(self) -> None:
        self.module: Any = None  # the torch module, once imported
        self.tls = threading.local()  # per thread: forward depth, dynamo and capture stacks, guards
        self.cuda_seen = False
        self.backend = "inductor"  # the backend of the latest torch.compile() call (its default)

    def forked(self) -> Torch:
        new = Torch()
        new.module = self.module
        new.tls = self.tls  # the forking thread's depth and guards go on in the child
        new.cuda_seen = self.cuda_seen
        new.backend = self.backend
        return new


class Weights:
    """Weights loads (``_weights``): the files whose tensors still map them."""

    __slots__ = ("lock", "mapped", "module", "scanned", "tls")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: Any = None  # the torch module, once imported
        self.tls = threading.local()  # per thread: a load in progress (``busy``)
        self.mapped: List[Any] = []  # _weights._Mapped: files still mapped (cleared at the root's end)
        self.scanned: Dict[int, bool] = {}  # id(module) -> looked at by a first forward already

    def forked(self) -> Weights:
        """The child maps what its parent mapped (a fresh lock: the parent's may be held)."""
        new = Weights()
        new.module = self.module
        new.tls = self.tls
        new.mapped = self.mapped
        new.scanned = self.scanned
        return new


class Requests:
    """``hooks.request`` (``_request``): what it found out about each device once."""

    __slots__ = ("hw_cache",)

    def __init__(self) -> None:
        self.hw_cache: Dict[int, Optional[Tuple[str, Optional[str]]]] = {}  # device index -> (hw.id, hw.name) or None

    def forked(self) -> Requests:
        new = Requests()
        new.hw_cache = self.hw_cache
        return new


class ColdStart:
    """Cold-start detection (``_recorder``, ``_readiness``, ``_coldstart``, ``_stagerules``):
    stages, readiness, wrappers."""

    __slots__ = (
        "boot_ns", "callbacks", "ceilings", "checkpoint", "children_dir", "children_ready", "claims_pending",
        "collecting",
        "covered", "covered_seen", "early_listen_codes", "ended_early", "exit_waited_s", "exiting", "explicit",
        "finder", "finished", "finishing", "first", "first_done", "held_ready",
        "imports", "inherited_sockets", "init_gave_up", "init_pending", "init_span",
        "installed", "last_end_ns", "listen_owned", "listen_poll", "listen_polled_ns", "listen_watch", "lock",
        "main_busy", "main_end_ns", "main_paused", "main_pid",
        "orig_listen", "parent_dir", "post_import", "ready_file", "ready_file_inherited", "ready_ns",
        "ready_rules_open", "ready_source",
        "reporting", "role", "rule_absorb_owed", "rule_fork_ready_sent", "rule_stages_open", "rule_waits",
        "rule_waits_done", "run_sources", "sampler", "serving_attrs", "serving_ns",
        "side_sockets",
        "stage_mark", "supervising", "tls", "undo", "warm", "watch_listen", "watched",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tls = threading.local()  # per thread: "compile" depth (jit.trace, torch.compile)
        self.installed = False
        self.collecting = False  # True from install until the root ends: wrappers check this first
        self.boot_ns = 0
        self.ready_ns: Optional[int] = None
        self.ready_source = ""
        self.last_end_ns = 0  # end of the latest stage that finished (start of ready_wait): _recorder.last_end
        self.covered_seen = 0  # entries of ``covered`` (2 per interval) that last_end_ns includes
        # _recorder's stages that ended while a stage opened inside them was still open: their
        # span id -> the span that was current when they began (``_recorder.still_open``)
        self.ended_early: Dict[str, Optional[str]] = {}
        # Changes at every stage start while collecting (splits import, init and warmup runs):
        # the span id of hooks.stage's latest, a fresh object for others. Compared, never ordered.
        self.stage_mark: object = None
        self.main_paused = 0  # stages open on the main thread (its ImportThread's ``paused``)
        self.main_busy = False  # its ``busy``: hooks.stage checks these two per stage
        self.explicit = False  # the user called mark_ready(): first_request ends at first_response()
        self.main_pid = os.getpid()
        self.main_end_ns = 0  # when the main script ended (threading's shutdown, before atexit)
        # runtime_init not emitted yet: [when the hooks' set-up ended] until the main program's
        # first line or the root's end (one list.pop claims it, no lock: _recorder.end_runtime_init)
        self.init_pending: List[int] = []
        self.init_gave_up: List[int] = []  # [when _mainstart's watch gave up] (the program's start unseen)
        self.init_span = ""  # runtime_init's span id, fixed at set-up: a checkpoint sends it while pending
        self.ready_file: Optional[str] = None
        # Passed on by launch's own child (this process is one it started: a spawned worker): the URL's
        # answer is this process's readiness only once it serves itself (``serving_ns``), never before.
        self.ready_file_inherited = False
        self.serving_ns = 0  # when a server hook said this process serves (``_readiness.server_started``)
        self.serving_attrs: Dict[str, Any] = {}  # ... and on what (``server.port``, the hook)
        self.undo: List[Callable[[], None]] = []
        self.post_import: Dict[str, List[Callable[[Any], None]]] = {}
        self.watched: Set[str] = set()  # names with post-import callbacks: the Finder wraps their loader
        self.callbacks: Dict[str, Callable[[int], None]] = {}
        self.finder: Any = None  # the _imports.Finder on sys.meta_path
        self.imports: Any = None  # the _imports module, once installed
        self.sampler: Any = None  # the _sampler.Sampler while the cold start is collected
        self.checkpoint: Any = None  # the sampler's _checkpoint.Checkpoint
        # (flush(end_ns, final), open_runs()) of each instrumenter that holds runs not yet
        # emitted (_imports, _build): flushed at readiness and at the end, sent by checkpoints
        self.run_sources: List[Tuple[Callable[[int, bool], None], Callable[[], List[Any]]]] = []
        # This process's stage intervals, flat (start, end, start, end, ...; one atomic extend
        # per interval). hooks.stage's are read from the queue while they wait there, and
        # noted here by the drain thread before they leave it (``_recorder.covered_pairs``).
        self.covered: List[int] = []
        self.role = ""  # "helper" for resource trackers, compile workers, ``python -c`` probes
        self.ceilings: Optional[Dict[str, Any]] = None  # storage ceilings, read once from the cache
        self.warm: Any = None  # the _readiness._Warm run in progress
        self.first: Any = None  # the _readiness._First request in progress
        self.first_done = False
        # The root's end is claimed once (``finishing``, under ``lock``); ``finished`` is set when it is done, for
        # a thread that came second to wait on (the sampler's tick and the exit handler may both end it).
        self.finishing = False
        self.finished = threading.Event()
        self.exiting = False  # the exit handler runs: threads started now are never joined
        self.exit_waited_s = 0.0  # what the exit handler waited for a report in flight (of INFERSIGHT_EXIT_FLUSH_S)
        self.parent_dir: Optional[str] = None  # where this process reports its cold start's end
        self.reporting: Optional[threading.Thread] = None  # that report, sent off the caller's thread
        self.children_dir: Optional[str] = None  # where this process's children report theirs
        self.children_ready = False  # that directory exists
        # A pre-fork master (gunicorn's arbiter, Hypercorn's main process with workers): this process
        # starts workers that serve for it; never carried into a fork (a worker is none)
        self.supervising = False
        # Its ``ready_wait`` (start, end, attributes), held back until one of its workers says it is ready
        # (``_readiness.mark_ready``): sent then, or at the end of its cold start if its readiness stands
        self.held_ready: Optional[Tuple[int, int, Dict[str, Any]]] = None
        self.orig_listen: Any = None  # socket.socket.listen before our wrapper
        self.listen_owned = False  # ... and whether socket.socket defined it itself
        self.watch_listen = False  # poll the kernel's listening sockets (INFERSIGHT_READY_ON_LISTEN)
        self.listen_watch: Any = None  # the _listening.ListenWatch, made on the first poll
        self.listen_polled_ns = 0  # when it was last polled
        self.listen_poll = threading.Lock()  # one poll at a time (acquired without waiting)
        self.inherited_sockets: Set[int] = set()  # sockets held at start: their listening is no readiness
        # Code whose listen() calls come before its server has loaded its app (Hypercorn's trio_worker listens
        # on its supervisor's sockets first): no readiness; such a socket counts once the server serves on it
        self.early_listen_codes: Set[Any] = set()
        # Sockets of servers the process starts beside the one it serves (a metrics exporter's, ``_sideservers``):
        # never readiness, never the served port, their requests never the first request
        self.side_sockets: Set[int] = set()
        self.rule_stages_open = 0  # outermost stage-rule spans running (a listen inside one is no readiness)
        self.claims_pending: Set[int] = set()  # sockets a server said it serves on, for the next poll
        self.ready_rules_open = 0  # of those, ``ready = true`` ones: readiness comes at their return
        # The outermost rule call returned and the sockets it made listen are not yet taken as
        # foreign: whoever holds the watch next (the call's thread, or a poll) absorbs first.
        self.rule_absorb_owed = False
        # ``_stagerules``' wait rules: rule id -> (stage, target, parent span, start) while open;
        # the rules whose wait has run (only a process's first counts: a forked child has its own)
        # a wait rule's open wait: stage, target, parent span, start, its span id, the span current at its start,
        # whether it is its task's current span (a coroutine target)
        self.rule_waits: Dict[str, Tuple[str, str, str, int, str, Optional[str], bool]] = {}
        self.rule_waits_done: Set[str] = set()
        self.rule_fork_ready_sent = False  # a ``ready = "entry"`` rule sent this fork's readiness

    def forked(self, root_start_ns: int) -> ColdStart:
        """The state of a child forked from this process: a cold start of its own, whose
        root starts at ``root_start_ns``. Carries over what the fork kept in memory (the
        wrappers and their undo list, the import finder, post-import callbacks) and what
        stays true (the role, the readiness file, cached ceilings)."""
        new = ColdStart()
        new.installed = self.installed
        new.collecting = self.collecting  # the parent's (its wrappers are in place); the child's is decided on start
        new.boot_ns = self.boot_ns
        new.stage_mark = self.stage_mark
        # the same notes: the child's current span may still lead through them, and the stages the
        # parent opened end in the child on this (the parent's) state
        new.ended_early = self.ended_early
        new.role = self.role
        new.ceilings = self.ceilings
        new.ready_file = self.ready_file
        new.ready_file_inherited = self.ready_file_inherited
        if self.ready_ns is not None:
            # It inherited a server that was already ready: no readiness signal of its own.
            # Provisional: it is ready when its own work after the fork (a gunicorn worker's app
            # load, its warmup) is done, which its request hooks, a serving loop's entry,
            # uvicorn's startup or a listen() tell (``_readiness.fork_ready``, ``request_begin``).
            # Where the parent's cold start had ended, those wrappers are gone, and where no server
            # whose hooks confirm it was imported (a fork pool's worker, ForkingMixIn, a queue-fed
            # worker: nothing would ever say so), it is final at the fork: its first forward is
            # then its first request, as before, and its hooks leave with it.
            new.ready_ns = root_start_ns
            new.ready_source = "fork"
            confirmable = any(m in sys.modules for m in FORK_CONFIRMING_MODULES)
            new.rule_fork_ready_sent = not (self.collecting and confirmable)
        new.last_end_ns = root_start_ns
        new.parent_dir = self.children_dir  # the parent's children dir is this child's parent dir
        new.undo = self.undo
        new.post_import = self.post_import
        new.watched = self.watched
        new.callbacks = self.callbacks
        new.finder = self.finder
        new.imports = self.imports
        new.run_sources = self.run_sources
        new.orig_listen = self.orig_listen
        new.listen_owned = self.listen_owned
        new.watch_listen = self.watch_listen  # a new watch: the parent's foreign set is not this one's
        new.inherited_sockets = self.inherited_sockets
        new.early_listen_codes = self.early_listen_codes
        new.side_sockets = self.side_sockets  # the child holds them too (its parent serves them)
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
    """Everything the hooks keep, for one process: its main thread (the forking thread, in a
    forked child) and that thread's current span, which threads of ours read (the
    allocator's sampler tags with it); then one section per part of the hooks."""

    __slots__ = ("alloc", "build", "coldstart", "imports", "main_ident", "main_span", "requests", "runtime",
                 "torch", "weights")

    def __init__(self, coldstart: Optional[ColdStart] = None, alloc: Optional[Alloc] = None,
                 main_ident: Optional[int] = None, runtime: Optional[Runtime] = None) -> None:
        self.main_ident = main_ident if main_ident is not None else threading.main_thread().ident
        self.main_span: Optional[str] = None  # kept by hooks.stage and _recorder.set_current
        self.runtime = runtime if runtime is not None else Runtime()
        self.coldstart = coldstart if coldstart is not None else ColdStart()
        self.alloc = alloc if alloc is not None else Alloc()
        self.imports = Imports(self.coldstart, self.main_ident)
        self.build = Build()
        self.torch = Torch()
        self.weights = Weights()
        self.requests = Requests()

    def forked(self, root_start_ns: int) -> HookState:
        new = HookState(self.coldstart.forked(root_start_ns), self.alloc.forked(), threading.get_ident(),
                        self.runtime.forked())
        new.build = self.build.forked()  # import runs start afresh (new Imports)
        new.torch = self.torch.forked()
        new.weights = self.weights.forked()
        new.requests = self.requests.forked()
        return new


current = HookState()


def replace_after_fork(root_start_ns: int) -> HookState:
    """In a forked child (``_activate``'s after-fork handler): a new instance for this process.

    The parent's state stops collecting here (in the child's copy only): a ``hooks.stage``
    the parent opened before the fork ends in the child on that state, with no bookkeeping,
    and is not emitted (the parent's client is closed in the child): the parent emits it."""
    global current
    old = current
    current = old.forked(root_start_ns)
    old.coldstart.collecting = False
    return current
