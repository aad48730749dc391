"""Agent-side handlers for the hooks' ``oom`` and ``mem`` events (hooks/_alloc.py).

``oom``: the evidence for one OOM is merged in this order, first known value wins:

1. the exception text, parsed with ``find_ooms`` (PyTorch printed it at the OOM, with its
   own NVML view of U and of the other processes);
2. the observer's numbers: R = req, T = total, F = free, L = allowed, A and P from
   memory_stats (allocated / reserved bytes);
3. NVML, sampled here, for the device (matched by UUID, else by index): U = this process's
   used bytes, O = the sum of the other processes' used bytes, T = the device total.
   N = U - P follows in the rule engine.

The verdict (rules from the builtin file and ``rules.dirs``) is exported as an ERROR log
record (event_name ``oom``), a span event ``infersight.oom`` on the linked span, and the
running counter ``infersight.oom.count`` per ``infersight.oom.class``.

The same OOM seen by the observer and then as an exception (excepthook or
``report_oom``) counts once: an exception whose device and requested size match an
observer OOM of the same producer within ``DEDUP_WINDOW_NS`` is folded into it; an
exception whose text repeats one already counted in the window is dropped too.

``mem``: ``infersight.memory.*`` metrics (gauges in bytes, sums for counts) and span
events for segment changes, retries and large allocations on the span current in the
served process's main thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from infersight.agent.daemon.assemble import HEX16, Malformed, Producer
from infersight.agent.daemon.offloop import TooManyCallsError, in_daemon_thread, within
from infersight.agent.daemon.sessions import STAND_IN_PREFIX
from infersight.agent.errors import AgentError
from infersight.agent.oom.nvml_views import DeviceView, NvmlGuard, NvmlLike
from infersight.bytesize import torch_bytes
from infersight.metricspec import declared
from infersight.telemetry import Attributes, Item, LogItem, NumberPoint, Origin, SpanEvent

# The rule engines (rules.engine, rules.serving: ~40 ms of imports, ~70 ms to load and check
# the serving rules) are imported when the rules are first needed: a start without site
# rule files, and an agent that never sees an OOM, pay neither.
if TYPE_CHECKING:
    from infersight.rules.engine import RuleSet, Verdict
    from infersight.rules.oom_parse import OomMessage
    from infersight.rules.serving import Finding, ServingRules
    from infersight.rules.serving_context import LiveContext
    from infersight.settings import Config

log = logging.getLogger("infersight.agent.oom")
_T = TypeVar("_T")

DEDUP_WINDOW_NS = 30_000_000_000
SIBLINGS_NS = 1_000_000_000  # one failure's copies from a parent's children (its tensor-parallel ranks) come this close
_STREAMS = ("log", "stderr")  # text the hooks or launch copied from a log or from stderr
MAX_RECENT = 64
MAX_TEXTS_PER_UID = 64  # of the 4 * MAX_RECENT messages remembered for deduplication, one uid's share
MAX_LINEAGE = 16  # ancestors looked up for a copy's process family
# Distinct memory errors from logs and stderr that one producer may report in DEDUP_WINDOW_NS: a log that
# floods the agent with messages it cannot tell apart costs that producer the rest, counted (``over_budget``).
MAX_NEW_PER_PRODUCER = 16
# The event loop's time one uid's texts may take to analyse (the serving rules cost 0.5-5 ms a text, whatever
# it turns out to be) in ANALYSIS_WINDOW_NS, on the agent's clock: a member of the socket group who sent 30,000
# distinct texts held the loop 14 s, and another user's OOM report waited up to 2 s. Past it a text of that uid
# is not read (``over_uid_budget``). A process's hooks send at most 64 warnings and 64 errors (tens of ms).
ANALYSIS_NS_PER_UID = 250_000_000
# An engine's live context read early (``read_early``: a capture of its stderr opened under launch, or its error was
# held) stands in for the one read at classification when the engine has gone by then (it printed its error and
# exited: NVML no longer lists it), for this long; a pid's latest early read is kept (an empty one too: an older one
# is no evidence), at most MAX_EARLY of them.
EARLY_CONTEXT_NS = 15_000_000_000
MAX_EARLY = 64
EARLY_WAIT_S = 0.5  # a classification waits this long for an early read still in flight
NVML_READ_WAIT_S = 5.0  # an OOM waits this long for its NVML read (a hung driver): then it goes out without
# Under launch, an engine's error that the hooks report (its exception, its log record) and that the message alone
# leaves ``unknown`` waits this long for launch's copy of CMD's stderr: the same error with the lines the engine
# printed around it (JAX logs its pool's limit 10 s before it raises; the exception holds none of it). The stderr
# copy, when it comes, goes out instead; else the held one does. At most MAX_HELD wait at once.
HOLD_FOR_STDERR_S = 0.5
# A joined launch spawns CMD before its event loop forwards the relay's captures (under load, seconds: measured
# 1.7 s with two busy cores): until launch says its relay forwards (a ``relaying`` frame), a held copy waits for
# that, at most this long; then HOLD_FOR_STDERR_S more, for the captures launch kept meanwhile.
RELAY_START_WAIT_S = 5.0
MAX_HELD = 64
# An observer's event after a text copy of its OOM: the text came at most this long before (launch's stderr copy
# comes within a few hundred ms of the error); an older text of the same size is another OOM.
TEXT_BEFORE_OBSERVER_S = 2.0
ANALYSIS_WINDOW_NS = 30_000_000_000
MAX_UIDS_ANALYSED = 256  # uids whose recent analyses are remembered (the least recent go first)
MAX_TEXT = 16384
MAX_CONTEXT = 8192  # an oom event's ``ctx``: the engine's sizing lines the hooks kept
MAX_MEM_SPAN_EVENTS = 1024  # memory span events waiting for their span, per producer
SEVERITY_ERROR = 17

OOM_COUNT = declared("infersight.oom.count", "sum", "{oom}", "OOMs classified, per class", monotonic=True)
# The hooks' allocator statistics (``mem`` events): (key, the metric it is).
GAUGES = tuple((key, declared(name, "gauge", "By", "PyTorch caching allocator: %s bytes (memory_stats)"
                                        % key.replace("_", " "))) for key, name in (
    ("reserved", "infersight.memory.reserved"),
    ("reserved_peak", "infersight.memory.reserved.peak"),
    ("allocated", "infersight.memory.allocated"),
    ("allocated_peak", "infersight.memory.allocated.peak"),
    ("active", "infersight.memory.active"),
    ("active_peak", "infersight.memory.active.peak"),
    ("inactive_split", "infersight.memory.inactive_split"),
))
SUMS = tuple((key, declared(name, "sum", "{count}", "PyTorch caching allocator: %s (memory_stats)"
                                        % key.replace("_", " "), monotonic=True)) for key, name in (
    ("retries", "infersight.memory.alloc_retries"),
    ("device_alloc", "infersight.memory.device_allocs"),
    ("device_free", "infersight.memory.device_frees"),
    ("ooms", "infersight.memory.ooms"),
))
MEM_EVENTS = ("segment_alloc", "segment_free", "alloc_retry", "large_alloc")



def same_message(a: str, b: str) -> bool:
    """Two copies of one message (keys ``rule|text|k=v,...``, ``Finding.key``): the same rule and text, and
    the numbers of one are among the other's. A copy may carry fewer: launch's stderr relay cuts a capture
    at a pause of the writer, and Ray prints the killed task's size 28 lines after its first line, so the
    stderr copy of a Ray kill had the node's numbers and the exception's copy the task's too (two OOMs)."""
    if a == b:
        return True
    if a.count("|") < 2 or b.count("|") < 2:  # not a serving rule's key (a PyTorch message's): exact only
        return False
    ha, _, va = a.rpartition("|")
    hb, _, vb = b.rpartition("|")
    if ha != hb:
        return False
    sa, sb = set(filter(None, va.split(","))), set(filter(None, vb.split(",")))
    return sa <= sb or sb <= sa

class RuleReloadError(AgentError, ValueError):
    """A rule file failed to load; ``str()`` names file:line for every error."""


def rule_paths(dirs: Iterable[str | Path]) -> list[Any]:
    """The builtin rule file, then ``*.toml`` in each directory (sorted; each dir once)."""
    from infersight.rules.engine import builtin_rules_path

    return [builtin_rules_path(), *site_rule_files(dirs)]


def site_rule_files(dirs: Iterable[str | Path]) -> list[Path]:
    """``*.toml`` in each directory (sorted; each dir once): the site's rule files."""
    paths: list[Path] = []
    seen: set[str] = set()
    for d in dirs:
        p = Path(d)
        key = str(p.resolve()) if p.exists() else str(p)
        if key in seen or not p.is_dir():
            continue
        seen.add(key)
        paths.extend(sorted(p.glob("*.toml")))
    return paths


class OomClassifier:
    """Holds the rule set; ``reload`` swaps it only when every file loads.

    Site rule files (``*.toml`` in ``dirs``) are loaded and checked when it is built, so that
    an invalid one is reported (file:line) at start; without any, the builtin rules load at
    first use. The serving-engine rules load at first use, or at :meth:`warm` (the daemon's
    start; launch's stderr relay when a capture opens, before the capture ends)."""

    def __init__(self, dirs: Sequence[str | Path] = (), rules: RuleSet | None = None) -> None:
        self.dirs = [str(d) for d in dirs]
        self._lock = threading.Lock()  # warm() may run on another thread than the first OOM
        self._rules = rules
        if rules is None and site_rule_files(self.dirs):
            self._rules = self.load(self.dirs)
        self._serving: ServingRules | None = None

    @property
    def rules(self) -> RuleSet:
        rules = self._rules
        if rules is None:
            with self._lock:
                if self._rules is None:
                    from infersight.rules.engine import builtin_rule_set

                    self._rules = builtin_rule_set()
                rules = self._rules
        return rules

    @rules.setter
    def rules(self, rules: RuleSet) -> None:
        self._rules = rules

    @staticmethod
    def load(dirs: Iterable[str | Path]) -> RuleSet:
        from infersight.rules.engine import RuleFileError, load_rules

        try:
            return load_rules(rule_paths(dirs))
        except RuleFileError as exc:
            raise RuleReloadError("invalid rule file(s):\n" + str(exc)) from exc

    def reload(self, config: Config | None = None, dirs: Sequence[str | Path] | None = None) -> None:
        """Load the rules of ``config["rules.dirs"]``; raise RuleReloadError and keep the old ones."""
        new_dirs = [str(d) for d in (dirs if dirs is not None else (config["rules.dirs"] if config else self.dirs))]
        rules = self.load(new_dirs)
        self.rules, self.dirs = rules, new_dirs
        log.info("OOM rules reloaded: %d rule(s) from %s", len(rules.rules), ", ".join(rules.sources))

    def prepare(self, config: Config) -> Callable[[], None]:
        """Load the rules of ``config["rules.dirs"]`` (RuleReloadError when invalid) and
        return the swap, for the agent to apply once every part of a reload is valid."""
        new_dirs = [str(d) for d in config["rules.dirs"]]
        rules = self.load(new_dirs)

        def commit() -> None:
            self.rules, self.dirs = rules, new_dirs
            log.info("OOM rules reloaded: %d rule(s) from %s", len(rules.rules), ", ".join(rules.sources))

        return commit

    def classify(self, numbers: dict[str, int | None], backend: str = "native") -> Verdict:
        return self.rules.classify(numbers, backend=backend)

    def warm(self) -> None:
        """Load the rules now, so that the next OOM does not wait for them (any thread)."""
        _ = self.serving

    @property
    def serving(self) -> ServingRules:
        """The builtin serving-engine rules over the current rubric rules."""
        rubric = self.rules
        with self._lock:
            if self._serving is None or self._serving.rubric is not rubric:
                from infersight.rules.serving import builtin as builtin_serving

                # every part of the builtin rules (their [[not_memory]] lines too), over this rubric
                self._serving = replace(builtin_serving(), rubric=rubric)
            return self._serving


# -- validation helpers ---------------------------------------------------------------------


def _opt_int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise Malformed("%s must be a non-negative integer" % key)
    return v


def _opt_str(d: dict[str, Any], key: str, limit: int = 512) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise Malformed("%s must be a string" % key)
    return v[:limit]


def _span_id(d: dict[str, Any]) -> str | None:
    sp = d.get("sp")
    return sp if isinstance(sp, str) and HEX16.match(sp) else None


def _int_map(v: Any, name: str) -> dict[str, int]:
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > 64:
        raise Malformed("%s must be an object" % name)
    return {str(k): x for k, x in v.items() if isinstance(x, int) and not isinstance(x, bool)}


@dataclass(frozen=True, slots=True)
class Seen:
    """One process family's copy of a memory error's text: when, from which source, and who sent it."""

    t_ns: int
    source: str
    pid: int | None
    lineage: tuple[int, ...]  # pid, then its ancestors as far as known (below pid 1)
    trace: str
    here: bool  # the pid is of this pid namespace (its start time checked): its ancestors are /proc's
    producer: str = ""  # who sent it (the producer table's key and the kernel's uid): one process, pid or none
    session: str = ""  # the launch it is of (a random token its processes' hellos say), if any

    def related(self, other: Seen) -> bool:
        """One process is the other or one of its ancestors, or both are children of one parent in one trace
        that report it within SIBLINGS_NS of each other (the tensor-parallel workers of one engine, which log
        the same error at once; a supervisor's restarted worker, seconds later, has its own). Pids of another
        pid namespace (a container's pid 1, say) only count within one trace: two containers' pids may be equal."""
        if self.producer and self.producer == other.producer:
            return True  # the same producer (a joined launch's stand-in for a CMD it cannot give a pid)
        if self.pid is None or other.pid is None:
            return False
        if not (self.here and other.here) and self.trace != other.trace:
            return False
        if self.pid in other.lineage or other.pid in self.lineage:
            return True
        return (bool(self.trace) and self.trace == other.trace and len(self.lineage) > 1 and len(other.lineage) > 1
                and self.lineage[1] == other.lineage[1] and abs(self.t_ns - other.t_ns) <= SIBLINGS_NS)


# -- the handlers ---------------------------------------------------------------------------


def _emit(p: Producer, origin: Origin, t_ns: int, sp: str | None, cls: str, body: str, attrs: Attributes,
          out: list[Item]) -> None:
    """One classified OOM on every sink: the log record, the event on its span, and the
    producer's ``infersight.oom.count`` per class."""
    out.append(LogItem(p.resource, t_ns, SEVERITY_ERROR, "ERROR", body, attrs,
                       p.info["trace_id"] if sp else None, sp, "oom", origin))
    p.attach_event(sp, SpanEvent("infersight.oom", t_ns, dict(attrs)))
    counts: dict[str, int] = p.state.setdefault("oom_counts", {})
    counts[cls] = counts.get(cls, 0) + 1
    out.append(OOM_COUNT.item(p.resource, t_ns, int(p.info.get("start_ns") or t_ns),
                              [NumberPoint(n, {"infersight.oom.class": c}) for c, n in sorted(counts.items())]))


def _stands_in(seen: Seen) -> bool:
    """The copy came from a producer that stands for a joined launch's CMD (agent/daemon/sessions.py)."""
    return seen.producer.startswith(STAND_IN_PREFIX)


def _one_launch(a: Seen, b: Seen) -> bool:
    """Two copies of one joined launch, one of them its stderr's stand-in: launch re-subscribed to a restarted
    agent and sent CMD's stderr before CMD's hooks said hello again (no pid to relate them by), then the hooks
    sent their spooled copy: one OOM, counted two or three times before (a review of the pod)."""
    return bool(a.session) and a.session == b.session and (_stands_in(a) or _stands_in(b))


def _pid(p: Producer) -> int | None:
    pid = p.info.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 1 else None


@dataclass(slots=True)
class _Held:
    """An engine error the hooks reported, waiting for launch's stderr copy of it."""

    timer: asyncio.TimerHandle
    p: Producer
    origin: Origin
    t_ns: int
    d: dict[str, Any]
    f: Finding
    held_at: float  # monotonic s


class OomHandlers:
    """The ``oom`` and ``mem`` kind handlers, sharing a classifier and an NVML view."""

    def __init__(
        self,
        classifier: OomClassifier,
        nvml: NvmlLike | None = None,
        publish: Callable[[list[Item]], None] | None = None,
        nvml_guard: NvmlGuard | None = None,
    ) -> None:
        self.classifier = classifier
        self.nvml = nvml
        # With ``publish`` (the agent's broadcaster), an OOM that needs NVML is finished off the
        # event loop: NVML is read in a thread, through ``nvml_guard`` (the device job's lock,
        # which keeps reads and nvmlShutdown apart), then the items are published.
        self.publish = publish
        self.nvml_guard = nvml_guard
        self.ooms = 0
        self.duplicates = 0
        self.not_memory = 0  # logged or uncaught texts the hooks sent that were no memory error
        # (uid, message key) -> the copies seen in the last DEDUP_WINDOW_NS, one per process family
        self._texts: dict[tuple[int | None, str], list[Seen]] = {}
        # per producer (uid, id): when its recent new messages came
        self._new_by_producer: dict[tuple[int | None, str], list[int]] = {}
        self.over_budget = 0  # memory errors from logs and stderr not reported: over their producer's budget
        self.nvml_late = 0  # OOMs that went out without their NVML read: it did not come within NVML_READ_WAIT_S
        self.reads_refused = 0  # OOMs that went out without it: too many reads were out (offloop.MAX_CALLS_OUT)
        self.over_uid_budget = 0  # texts not analysed: their uid's took ANALYSIS_NS_PER_UID of the loop in the window
        self._analysis_by_uid: dict[int, deque[tuple[int, int]]] = {}  # uid -> (when, cost) on the agent's clock
        self._uuid_index: dict[str, int] = {}
        self._later: set[asyncio.Task[None]] = set()
        self.context_decided = 0  # engine OOMs whose class the live context decided
        self.proc_root = "/proc"
        # pid -> (monotonic ns, context) read early; and the reads in flight
        self._early: dict[int, tuple[int, LiveContext]] = {}
        self._early_running: dict[int, threading.Event] = {}
        self._early_lock = threading.Lock()
        self.early_used = 0  # engine OOMs classified with the context read early
        # launch: whether a producer's stderr goes through launch's relay (its copies come as "stderr")
        self.relayed: Callable[[Producer], bool] | None = None
        # ... and when launch's relay started forwarding them (monotonic s; None: not yet; 0.0: no relay now)
        self.relay_started: Callable[[Producer], float | None] | None = None
        self._held: dict[tuple[int | None, str, str], _Held] = {}  # (uid, producer, message) -> a copy waiting
        self.stderr_preferred = 0  # held copies that launch's stderr copy replaced
        self._launch_recent: dict[int, list[dict[str, Any]]] = {}  # pid -> launch's producers' recent OOMs

    # -- oom ------------------------------------------------------------------------------

    def oom(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], out: list[Item]) -> None:
        source = _opt_str(d, "source", 32) or "exception"
        dev = _opt_int(d, "dev")
        req = _opt_int(d, "req")
        text = _opt_str(d, "text", MAX_TEXT)
        stats = _int_map(d.get("stats"), "stats")
        snap = d.get("snap") if isinstance(d.get("snap"), dict) else None
        if text:
            if source in _STREAMS and self._at_budget(p, time.monotonic_ns()):
                self.over_budget += 1  # nothing a stream's text can give would go out: not analysed
                return
            if not self._may_analyse(p.uid):
                self.over_uid_budget += 1
                return
            from infersight.rules.serving import analyse

            began = time.monotonic_ns()
            # The engine's sizing lines (logged at INFO before the error): read for their numbers, as the lines
            # before an error in a log are, never as an error of their own (only what reaches into ``text``).
            ctx = _opt_str(d, "ctx", MAX_CONTEXT)
            if ctx:
                skip = ctx.count("\n") + 1
                found = [f for f in analyse(ctx + "\n" + text, self.classifier.serving) if f.last_line >= skip]
            else:
                found = analyse(text, self.classifier.serving)
            self._charge(p.uid, began)
            if not found:
                if source != "observer":
                    self.not_memory += 1
                    return
            else:
                # A log record or a stderr capture may hold several distinct messages (a shard's PyTorch OOM and
                # the router's own error, two ranks' OOMs on two devices): each goes out. An exception's text is
                # one error: its first finding.
                for f in found if source in _STREAMS else found[:1]:
                    if f.message is None:
                        self._engine_text(p, origin, t_ns, d, f, source, out)
                    else:
                        self._pytorch_text(p, origin, t_ns, dict(d), f, source, dev, req, stats, snap, out)
                return
        self._pytorch_oom(p, origin, t_ns, d, source, dev, req, stats, snap, None, "pytorch", out)

    def _engine_text(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], f: Finding, source: str,
                     out: list[Item]) -> None:
        """An engine's memory error found in a text: once per producer family, held for launch's stderr copy when
        the hooks' copy leaves it undecided."""
        if self._seen_text(p, f.key, t_ns, remember=False) is not None:
            self.duplicates += 1
            held = self._unhold(p, f.key) if source == "stderr" else None
            if held is not None:  # the same error with what surrounds it, as its process's
                self.stderr_preferred += 1
                self._engine(held.p, held.origin, held.t_ns, {**held.d, "source": "stderr"}, f, out)
            return
        if source in _STREAMS and not self._admit(p, time.monotonic_ns()):
            self.over_budget += 1  # not remembered: a copy from another source still counts
            return
        self._seen_text(p, f.key, t_ns)
        if source != "stderr" and f.cls == "unknown" and self._hold(p, origin, t_ns, d, f):
            return
        self._engine(p, origin, t_ns, d, f, out)

    def _pytorch_text(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], f: Finding, source: str,
                      dev: int | None, req: int | None, stats: dict[str, int], snap: dict[str, Any] | None,
                      out: list[Item]) -> None:
        """A PyTorch OOM message found in a text (an exception's, a log record's, a stderr capture's)."""
        # The same PyTorch text as an exception, a log record and a stderr copy: once.
        before = self._seen_text(p, f.key, t_ns, source, remember=False)
        if before is not None and (source in _STREAMS or before in _STREAMS):
            self.duplicates += 1
            return
        if before is None:
            if source in _STREAMS and not self._admit(p, time.monotonic_ns()):
                self.over_budget += 1
                return
            self._seen_text(p, f.key, t_ns, source)
        self._pytorch_oom(p, origin, t_ns, d, source, dev, req, stats, snap, f.message, f.engine, out)

    def _pytorch_oom(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], source: str, dev: int | None,
                     req: int | None, stats: dict[str, int], snap: dict[str, Any] | None, msg: OomMessage | None,
                     engine: str, out: list[Item]) -> None:
        """A PyTorch OOM (its message, or an observer's numbers alone): classified with the rubric, NVML's view
        added where the numbers need it."""
        d["_engine"] = engine
        if msg is not None:
            dev = dev if dev is not None else msg.device_index
            req = req if req is not None else msg.R
        if self._duplicate(p, t_ns, source, dev, req, msg):
            self.duplicates += 1
            return
        from infersight.rules.engine import BASE_QUANTITIES

        numbers: dict[str, int | None] = dict.fromkeys(BASE_QUANTITIES)
        if msg is not None:
            numbers.update({k: v for k, v in msg.numbers().items() if v is not None})
        observed = {
            "R": req, "T": _opt_int(d, "total"), "F": _opt_int(d, "free"), "L": _opt_int(d, "allowed"),
            "A": stats.get("allocated"), "P": stats.get("reserved"),
        }
        for k, v in observed.items():
            if numbers.get(k) is None and v is not None:
                numbers[k] = v
        uuid = _opt_str(d, "uuid", 64)
        if self.publish is not None and self._needs_nvml(numbers):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                task = loop.create_task(self._oom_later(p, origin, t_ns, d, dev, req, uuid, numbers, snap, msg))
                self._later.add(task)
                task.add_done_callback(self._later.discard)
                return
        nvml_used = self._nvml(p, dev, uuid, numbers)
        self._finish(p, origin, t_ns, d, dev, uuid, numbers, snap, msg, nvml_used, out)

    async def _oom_later(
        self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], dev: int | None, req: int | None,
        uuid: str | None, numbers: dict[str, int | None], snap: dict[str, Any] | None, msg: OomMessage | None,
    ) -> None:
        read_into = dict(numbers)  # a read that comes back late must not change what went out

        def read() -> bool:
            return self._nvml(p, dev, uuid, read_into)

        guard = self.nvml_guard
        done, used = await self._read_off_loop(read if guard is None else lambda: guard(read), "NVML sample")
        if done:  # (T is read even where this process is not placed among NVML's processes)
            numbers.update(read_into)
        nvml_used = bool(used)
        items: list[Item] = []
        self._finish(p, origin, t_ns, d, dev, uuid, numbers, snap, msg, nvml_used, items)
        if self.publish is not None:
            self.publish(items)

    def _hold(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], f: Finding) -> bool:
        """Hold an undecided engine error that the hooks reported, for launch's stderr copy of it (see
        HOLD_FOR_STDERR_S); False when it goes out now (no relay for ``p``, no event loop, too many held)."""
        if self.relayed is None or self.publish is None or len(self._held) >= MAX_HELD:
            return False
        try:
            if not self.relayed(p):
                return False
            loop = asyncio.get_running_loop()
        except Exception:
            return False
        key = (p.uid, str(p.info.get("id")), f.key)
        if key in self._held:
            return False  # the same message of the same producer is held already: this one goes now
        timer = loop.call_later(HOLD_FOR_STDERR_S, self._expire, key)
        self._held[key] = _Held(timer, p, origin, t_ns, dict(d), f, time.monotonic())
        self.read_early(p)  # while it waits, the process may exit: its context is read now
        return True

    def _unhold(self, p: Producer, key: str) -> _Held | None:
        """A held copy of the message ``key`` (of ``p``'s uid; launch's stand-in has none; a root launch's stand-in:
        of any uid in its launch) is taken back: the stderr copy goes out instead, as the held one's producer's."""
        session = p.info.get("session")
        for k in list(self._held):
            of_launch = (p.uid == 0 and session is not None and p.id.startswith(STAND_IN_PREFIX)
                         and self._held[k].p.info.get("session") == session)
            if (p.uid is None or k[0] == p.uid or of_launch) and same_message(k[2], key):
                h = self._held.pop(k)
                h.timer.cancel()
                return h
        return None

    def _left_to_hold(self, h: _Held) -> float:
        """How much longer ``h`` waits for launch's copy: HOLD_FOR_STDERR_S from when launch's relay started
        forwarding (the captures it kept until then come right after), and while it has not, until
        RELAY_START_WAIT_S after ``h`` came."""
        started = self.relay_started(h.p) if self.relay_started is not None else 0.0
        now = time.monotonic()
        if started is None:
            return min(HOLD_FOR_STDERR_S, RELAY_START_WAIT_S - (now - h.held_at))
        return max(started, h.held_at) + HOLD_FOR_STDERR_S - now

    def _expire(self, key: tuple[int | None, str, str]) -> None:
        """A held copy's timer: it goes out, unless launch's copy may still come (then it waits on)."""
        h = self._held.get(key)
        if h is None:
            return
        left = self._left_to_hold(h)
        if left > 0.001:
            try:
                h.timer = asyncio.get_running_loop().call_later(left, self._expire, key)
                return
            except RuntimeError:  # no loop running (shutting down): it goes out now
                pass
        self._release(key)

    def _release(self, key: tuple[int | None, str, str]) -> None:
        h = self._held.pop(key, None)
        if h is None:
            return
        items: list[Item] = []
        self._engine(h.p, h.origin, h.t_ns, h.d, h.f, items)
        if items and self.publish is not None:
            self.publish(items)

    async def session_ended(self, session: str, uid: int, timeout_s: float = 1.0) -> None:
        """A joined launch's session ends: its producers' held copies (of the launch's ``uid``; root's: any) go out
        now (no stderr copy is coming), and OOMs still reading NVML are given ``timeout_s`` to publish."""
        for key in [k for k, h in self._held.items()
                    if h.p.info.get("session") == session and uid in (0, h.p.uid)]:
            self._held[key].timer.cancel()
            self._release(key)
        if self._later:
            await asyncio.wait(list(self._later), timeout=timeout_s)

    async def wait_later(self, timeout_s: float = 2.0) -> None:
        """At shutdown: held copies go out now; let OOMs still reading NVML finish and publish."""
        for key in list(self._held):
            self._held[key].timer.cancel()
            self._release(key)
        if self._later:
            await asyncio.wait(list(self._later), timeout=timeout_s)

    def _needs_nvml(self, numbers: dict[str, int | None]) -> bool:
        return self.nvml is not None and (numbers["U"] is None or numbers["O"] is None)

    def _finish(
        self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], dev: int | None, uuid: str | None,
        numbers: dict[str, int | None], snap: dict[str, Any] | None, msg: OomMessage | None, nvml_used: bool,
        out: list[Item],
    ) -> None:
        source = _opt_str(d, "source", 32) or "exception"
        backend = _opt_str(d, "backend", 32) or (msg.backend if msg is not None else "native")
        if backend not in ("native", "cudaMallocAsync"):
            backend = "native"
        verdict = self.classifier.classify(numbers, backend)
        self.ooms += 1
        sp = _span_id(d) or p.info.get("root_span_id")
        attrs = self._attributes(verdict, source, dev, uuid, backend, d, snap, nvml_used, msg)
        _emit(p, origin, t_ns, sp, verdict.cls, one_line(verdict, dev), attrs, out)

    def _seen_text(self, p: Producer, key: str, t_ns: int, source: str = "", remember: bool = True) -> str | None:
        """The source that first saw the same message in the last DEDUP_WINDOW_NS in ``p``'s process
        family (a vLLM worker logs it, its parent re-raises it, launch sees it on stderr: one of them is
        the other or its ancestor); None when it is new (then noted). Another process of the same uid
        that is not of the family (a second service, a restart) has its own OOM, and so does another
        uid. An in-process producer (no uid: launch's stderr relay for a CMD without hooks) is of
        every family: launch's own agent serves CMD's processes only."""
        for k in list(self._texts):
            kept = [c for c in self._texts[k] if t_ns - c.t_ns <= DEDUP_WINDOW_NS]
            if kept:
                self._texts[k] = kept
            else:
                del self._texts[k]
        uid = p.uid
        me = self._family(p, t_ns, source)
        if uid is None:
            hit = next((c for (_u, k), cs in self._texts.items() if same_message(k, key) for c in cs), None)
        else:
            hit = next((c for (u, k), cs in self._texts.items() if u is None and same_message(k, key) for c in cs),
                       None) or next((c for (u, k), cs in self._texts.items() if u == uid and same_message(k, key)
                                      for c in cs if c.related(me) or _one_launch(c, me)), None)
            if hit is None and me.session:
                # a root launch whose CMD runs the engine as another user (sudo -u, runuser): its stderr copy (a
                # producer of uid 0 standing for CMD) and the engine's own copy are one launch's, one OOM; two
                # hooked engines of the launch, one root's, are two
                hit = next((c for (u, k), cs in self._texts.items() if (u == 0) != (uid == 0)
                            and same_message(k, key) for c in cs if c.session == me.session
                            and _stands_in(c if u == 0 else me)), None)
        if hit is not None:
            return hit.source
        if not remember:
            return None
        own = [k for k in self._texts if k[0] == uid]
        if sum(len(self._texts[k]) for k in own) >= MAX_TEXTS_PER_UID:
            # a uid's flood forgets its own oldest, never another uid's
            oldest = min(own, key=lambda k: self._texts[k][0].t_ns)
            del self._texts[oldest][0]
            if not self._texts[oldest]:
                del self._texts[oldest]
        elif sum(len(cs) for cs in self._texts.values()) >= 4 * MAX_RECENT:
            first = next(iter(self._texts))
            del self._texts[first][0]
            if not self._texts[first]:
                del self._texts[first]
        self._texts.setdefault((uid, key), []).append(me)
        return None

    def _family(self, p: Producer, t_ns: int, source: str) -> Seen:
        """Who sent this copy: its pid, the pids above it (``/proc`` while it runs in this pid namespace,
        else its hello's parent) and its trace. Looked up once per event (the check before the budget and
        the note after it ask alike)."""
        cached = p.state.get("oom_family")
        if isinstance(cached, Seen) and cached.t_ns == t_ns:
            return replace(cached, source=source)
        seen = self._lookup_family(p, t_ns, source)
        p.state["oom_family"] = seen
        return seen

    def _lookup_family(self, p: Producer, t_ns: int, source: str) -> Seen:
        from infersight.agent.daemon.identity import parent_pid
        from infersight.agent.oom.engine_context import same_process

        pid = p.info.get("pid")
        trace = str(p.info.get("trace_id") or "")
        who = "%s@%s" % (p.id, p.uid)
        session = str(p.info.get("session") or "")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return Seen(t_ns, source, None, (), trace, False, who, session)
        here = same_process(p, pid, self.proc_root)
        chain = [pid]
        ppid = p.info.get("ppid")
        for _ in range(MAX_LINEAGE):
            parent = parent_pid(chain[-1], self.proc_root) if here else (
                ppid if len(chain) == 1 and isinstance(ppid, int) else None)
            if parent is None or parent <= 1 or parent in chain:
                break
            chain.append(parent)
        return Seen(t_ns, source, pid, tuple(chain), trace, here, who, session)

    def _at_budget(self, p: Producer, t_ns: int) -> bool:
        """Whether producer ``p`` has reported MAX_NEW_PER_PRODUCER new memory errors from logs or stderr in
        the window (``_admit`` would refuse the next): a duplicate or a non-memory text would not go out either."""
        times = self._new_by_producer.get((p.uid, str(p.info.get("id"))), [])
        return sum(1 for t in times if t_ns - t <= DEDUP_WINDOW_NS) >= MAX_NEW_PER_PRODUCER

    def _may_analyse(self, uid: int | None) -> bool:
        """Whether ``uid``'s texts took less than ANALYSIS_NS_PER_UID of the loop in the last window; the agent's
        own in-process producers (no uid) always may."""
        if uid is None:
            return True
        costs = self._analysis_by_uid.get(uid)
        if not costs:
            return True
        horizon = time.monotonic_ns() - ANALYSIS_WINDOW_NS
        while costs and costs[0][0] < horizon:
            costs.popleft()
        return sum(c for _, c in costs) < ANALYSIS_NS_PER_UID

    def _charge(self, uid: int | None, began: int) -> None:
        """Note what one analysis of ``uid``'s text cost (begun at ``began``, the agent's clock)."""
        if uid is None:
            return
        now = time.monotonic_ns()
        costs = self._analysis_by_uid.pop(uid, None) or deque()
        costs.append((now, now - began))
        self._analysis_by_uid[uid] = costs  # the most recent last
        if len(costs) > 4096:  # cheap texts: the oldest are not what decides
            costs.popleft()
        if len(self._analysis_by_uid) > MAX_UIDS_ANALYSED:
            del self._analysis_by_uid[next(iter(self._analysis_by_uid))]

    def _admit(self, p: Producer, t_ns: int) -> bool:
        """Whether producer ``p`` may report one more new memory error from a log or stderr now (at most
        MAX_NEW_PER_PRODUCER in DEDUP_WINDOW_NS); noted when it may. Per producer: eight engines of one user
        failing at once each keep their own. ``t_ns`` is the agent's clock (monotonic), never the event's: a
        producer writes its events' timestamps, and spacing them an hour apart would reopen its window."""
        who = (p.uid, str(p.info.get("id")))
        times = [t for t in self._new_by_producer.get(who, []) if t_ns - t <= DEDUP_WINDOW_NS]
        if len(times) >= MAX_NEW_PER_PRODUCER:
            self._new_by_producer[who] = times
            return False
        times.append(t_ns)
        self._new_by_producer[who] = times
        if len(self._new_by_producer) > 4 * MAX_RECENT:  # producers gone quiet
            for k in [k for k, ts in self._new_by_producer.items() if not ts or t_ns - ts[-1] > DEDUP_WINDOW_NS]:
                del self._new_by_producer[k]
        return True

    def _engine(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], f: Finding,
                out: list[Item]) -> None:
        """An engine's own memory error, new in the window: its live context (the producer's
        command line; NVML's view of the devices its process tree uses) is read once, off the
        event loop when the agent runs one, then the verdict goes out."""
        if self.publish is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                task = loop.create_task(self._engine_later(p, origin, t_ns, dict(d), f))
                self._later.add(task)
                task.add_done_callback(self._later.discard)
                return
        self._finish_engine(p, origin, t_ns, d, f, out, self._context(p, d))

    def _context(self, p: Producer, d: dict[str, Any]) -> LiveContext | None:
        from infersight.agent.oom.engine_context import gather, sent_args

        try:
            ctx = gather(p, self.nvml, self.nvml_guard, self.proc_root, sent_args(d.get("args")))
        except Exception as exc:  # never fatal: the message's own verdict goes out
            log.debug("live context of an engine OOM failed: %s", exc)
            ctx = None
        if ctx is None or not ctx.devices:
            early = self._early_context(p)
            log.debug("live context at classification: pid %s, NVML %s, no device; read early: %s",
                      ctx.pid if ctx else None, ctx.nvml if ctx else None, "used" if early else "none")
            if early is not None:
                self.early_used += 1
                return early
        return ctx

    def read_early(self, p: Producer) -> threading.Event | None:
        """Read ``p``'s live context now, on a thread of its own, for a memory error that is being printed
        (launch: a capture of CMD's stderr opened; its text comes at least 50 ms later): an engine that prints
        its error and exits is gone from NVML's process list by the time the text is classified. Any thread.
        The read stands for every producer of that pid. Returns the read's end (None: one for that pid is already
        in flight, or ``p`` has no pid)."""
        key = _pid(p)
        if key is None:
            return None
        with self._early_lock:
            if key in self._early_running:
                return None
            done = self._early_running[key] = threading.Event()

        def run() -> None:
            began = time.monotonic_ns()
            try:
                ctx = self._context_now(p)
                log.debug("live context of pid %d read early in %.1f ms: pid %s, NVML %s, %d device(s)", key,
                          (time.monotonic_ns() - began) / 1e6, ctx.pid if ctx else None, ctx.nvml if ctx else None,
                          len(ctx.devices) if ctx else 0)
                if ctx is not None:  # the latest read, empty or not: an older one is no evidence now
                    with self._early_lock:
                        self._early.pop(key, None)
                        self._early[key] = (began, replace(ctx, early=True))
                        while len(self._early) > MAX_EARLY:
                            del self._early[next(iter(self._early))]
            finally:
                with self._early_lock:
                    self._early_running.pop(key, None)
                done.set()

        threading.Thread(target=run, name="infersight-oom-context", daemon=True).start()
        return done

    def _context_now(self, p: Producer) -> LiveContext | None:
        from infersight.agent.oom.engine_context import gather

        try:
            return gather(p, self.nvml, self.nvml_guard, self.proc_root)
        except Exception as exc:
            log.debug("early live context of an engine failed: %s", exc)
            return None

    def _early_context(self, p: Producer) -> LiveContext | None:
        """The context :meth:`read_early` read for ``p``'s pid (waiting a little for one in flight), if recent."""
        key = _pid(p)
        if key is None:
            return None
        with self._early_lock:
            running = self._early_running.get(key)
        if running is not None:
            running.wait(EARLY_WAIT_S)
        with self._early_lock:
            got = self._early.get(key)
        if got is None or not got[1].devices or time.monotonic_ns() - got[0] > EARLY_CONTEXT_NS:
            return None
        return got[1]

    async def _engine_later(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], f: Finding) -> None:
        _, ctx = await self._read_off_loop(lambda: self._context(p, d), "live context")
        items: list[Item] = []
        self._finish_engine(p, origin, t_ns, d, f, items, ctx)
        if self.publish is not None:
            self.publish(items)

    async def _read_off_loop(self, read: Callable[[], _T], what: str) -> tuple[bool, _T | None]:
        """``read()`` (NVML, /proc) on a daemon thread, waited for at most NVML_READ_WAIT_S: (came back, its
        result). A read that fails, or does not come (a driver that stopped answering), lets the OOM go out
        without it; a late one is counted (``nvml_late``), one refused for the reads out already too
        (``reads_refused``)."""
        try:
            done, got = await within(in_daemon_thread(read, "infersight-oom-read", capped=True), NVML_READ_WAIT_S)
        except TooManyCallsError:
            self.reads_refused += 1  # MAX_CALLS_OUT reads are out and have not returned: this OOM goes without
            return False, None
        except Exception as exc:
            log.debug("%s for an OOM failed: %s", what, exc)
            return False, None
        if not done:
            self.nvml_late += 1
            log.warning("the %s of an OOM did not come within %g s (NVML not answering?): the OOM goes out "
                        "without it", what, NVML_READ_WAIT_S)
        return done, got

    def _finish_engine(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], f: Finding,
                       out: list[Item], ctx: LiveContext | None = None) -> None:
        """An engine's own memory error: the finding's verdict on every sink, like a PyTorch OOM;
        with its live context, refined where the context decides (rules/serving_context.py)."""
        self.ooms += 1
        source = _opt_str(d, "source", 32) or "exception"
        sp = _span_id(d) or p.info.get("root_span_id")
        cls, rule, remedy, note, reason = f.cls, f.rule, f.remedy, f.note, f.reason
        extra: dict[str, Any] = {}
        if ctx is not None:
            from infersight.rules.serving_context import refine

            r = refine(f, ctx, self.classifier.serving.engine_remedies.get(f.engine, {}))
            cls, rule, remedy, note, reason = r.cls, r.rule, r.remedy, r.note, r.reason
            extra = dict(r.attributes)
            extra["infersight.oom.context_decided"] = r.decided
            if r.decided:
                self.context_decided += 1
        a: Attributes = {
            "infersight.oom.class": cls,
            "infersight.oom.rule": rule,
            "infersight.oom.rule_version": f.rule_version,
            "infersight.oom.remedy": remedy,
            "infersight.oom.source": source,
            "infersight.oom.engine": f.engine,
            "infersight.oom.message": f.text[:2048],
        }
        if note:
            a["infersight.oom.note"] = note
        if reason:
            a["infersight.oom.reason"] = reason
        if f.knob:
            a["infersight.oom.knob"] = f.knob
        for k, v in f.numbers.items():
            if v is not None:
                a["infersight.oom.%s_bytes" % k] = v
        for k, x in f.extra.items():
            a["infersight.oom.engine.%s" % k] = int(x) if float(x).is_integer() else float(x)
        a.update(extra)
        body = " ".join(("OOM [%s]: %s by rule %s: %s%s" % (f.engine, cls, rule, _sentence(reason), remedy)).split())
        _emit(p, origin, t_ns, sp, cls, body, a, out)

    def _duplicate(
        self, p: Producer, t_ns: int, source: str, dev: int | None, req: int | None, msg: OomMessage | None
    ) -> bool:
        recent: list[dict[str, Any]] = p.state.setdefault("oom_recent", [])
        recent[:] = [r for r in recent if t_ns - r["t"] <= DEDUP_WINDOW_NS][-MAX_RECENT:]
        pool = recent
        # launch: its copy of CMD's stderr may come as its stand-in for CMD (in-process, no uid: the hooked
        # process's hello was not read yet) while the hooks' copies come as CMD's own producer: one OOM of one pid
        # (launch's own agent only: the daemon has no in-process producer, and a hello's ``launched`` is the
        # producer's word)
        pid = _pid(p)
        inproc = p.uid is None
        shared = None
        now = time.monotonic()
        if self.relayed is not None and pid is not None and (inproc or p.info.get("launched")):
            shared = self._launch_recent.setdefault(pid, [])
            shared[:] = [r for r in shared if now - r["at"] <= DEDUP_WINDOW_NS / 1e9][-MAX_RECENT:]
            pool = recent + [r for r in shared if r["inproc"] != inproc]
        key = msg.key if msg is not None else None
        if source != "observer":
            if key is not None and any(r["key"] == key for r in pool):
                return True  # the same text again (report_oom, then the excepthook)
            for r in pool:
                if r["source"] == "observer" and not r["matched"] and _same(r["dev"], dev) and _close(r["req"], req):
                    r["matched"] = True
                    r["key"] = key
                    return True
        elif req is not None:
            # the text came first (launch's stderr copy, or the exception's, reached the agent before the hooks
            # sent the observer's event with its snapshot: seen on an H200 under launch): the same OOM
            for r in pool:
                if (r["source"] != "observer" and not r["matched"] and r["req"] is not None and _same(r["dev"], dev)
                        and _close(r["req"], req) and now - r["at"] <= TEXT_BEFORE_OBSERVER_S):
                    r["matched"] = True
                    return True
        entry = {"t": t_ns, "at": now, "source": source, "dev": dev, "req": req, "key": key, "matched": False,
                 "inproc": inproc}
        recent.append(entry)
        if shared is not None:
            shared.append(entry)
            if len(self._launch_recent) > 4 * MAX_RECENT:  # processes gone quiet
                for k in [k for k, rs in self._launch_recent.items()
                          if not rs or now - rs[-1]["at"] > DEDUP_WINDOW_NS / 1e9]:
                    del self._launch_recent[k]
        return False

    def _nvml(self, p: Producer, dev: int | None, uuid: str | None, numbers: dict[str, int | None]) -> bool:
        """Fill U, O (and T) from NVML's per-process view of the device. True when used."""
        if self.nvml is None or (numbers["U"] is not None and numbers["O"] is not None):
            return False
        try:
            sample = self._device(dev, uuid)
        except Exception as exc:
            log.debug("NVML sample for an OOM failed: %s", exc)
            return False
        if sample is None:
            return False
        if numbers["T"] is None and sample.memory_total_bytes is not None:
            numbers["T"] = sample.memory_total_bytes
        procs = sample.processes
        pid = p.info.get("pid")
        if not procs:
            return False
        mine = [g for g in procs if pid is not None and pid in (g.pid, g.host_pid)]
        if not mine:
            return False  # we cannot tell this process from the others
        if numbers["U"] is None:
            numbers["U"] = sum(g.used_bytes or 0 for g in mine)
        if numbers["O"] is None:
            numbers["O"] = sum(g.used_bytes or 0 for g in procs if g not in mine)
        return True

    def _device(self, dev: int | None, uuid: str | None) -> DeviceView | None:
        """NVML's sample of the device with this UUID (the CUDA index may be remapped by
        CUDA_VISIBLE_DEVICES): try the cached index, then the CUDA index, then scan once."""
        assert self.nvml is not None
        if not uuid:
            return self.nvml.sample(dev) if dev is not None else None
        tried: set[int] = set()
        for i in (self._uuid_index.get(uuid), dev):
            if i is not None and i not in tried:
                tried.add(i)
                s = self.nvml.sample(i)
                if s is not None and s.uuid == uuid:
                    self._uuid_index[uuid] = i
                    return s
        for i in range(self.nvml.device_count()):
            if i not in tried:
                s = self.nvml.sample(i)
                if s is not None and s.uuid == uuid:
                    self._uuid_index[uuid] = i
                    return s
        return None

    @staticmethod
    def _attributes(
        v: Verdict, source: str, dev: int | None, uuid: str | None, backend: str, d: dict[str, Any],
        snap: dict[str, Any] | None, nvml_used: bool, msg: OomMessage | None,
    ) -> Attributes:
        a: Attributes = {
            "infersight.oom.class": v.cls,
            "infersight.oom.rule": v.rule,
            "infersight.oom.rule_version": v.rule_version,
            "infersight.oom.remedy": v.remedy,
            "infersight.oom.source": source,
            "infersight.oom.backend": backend,
        }
        if v.note:
            a["infersight.oom.note"] = v.note
        if v.missing:
            a["infersight.oom.missing"] = list(v.missing)
        if v.cls == "unknown":
            from infersight.rules.serving import rubric_reason

            a["infersight.oom.reason"] = rubric_reason(v, msg)
        for k, n in v.used.items():
            a["infersight.oom.%s_bytes" % k] = n
        if v.requested_bytes is not None:
            a["infersight.oom.R_bytes"] = v.requested_bytes
        if dev is not None:
            a["infersight.oom.device"] = "cuda:%d" % dev
        if uuid:
            a["hw.id"] = uuid
        if nvml_used:
            a["infersight.oom.nvml"] = True
        conf = d.get("alloc_conf")
        if isinstance(conf, str) and conf:
            a["infersight.oom.alloc_conf"] = conf[:512]
        frac = d.get("fraction")
        if isinstance(frac, (int, float)) and not isinstance(frac, bool):
            a["infersight.oom.memory_fraction"] = float(frac)
        if snap is not None:
            a.update(_snap_attrs(snap))
        hist = d.get("hist")
        if isinstance(hist, list) and hist:
            a["infersight.oom.history"] = [
                "%s %d%s" % (h.get("action"), int(h.get("size") or 0), (" " + str(h["meta"])) if h.get("meta") else "")
                for h in hist[-32:] if isinstance(h, dict)
            ] or ["none"]
        if msg is not None:
            a["infersight.oom.message"] = msg.text[:2048]
        engine = d.get("_engine")
        a["infersight.oom.engine"] = engine if isinstance(engine, str) else "pytorch"
        return a

    # -- mem ------------------------------------------------------------------------------

    def mem(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], out: list[Item]) -> None:
        dev = _opt_int(d, "dev")
        if dev is None:
            raise Malformed("mem needs dev")
        st = _int_map(d.get("s"), "s")
        uuid = _opt_str(d, "uuid", 64)
        dattrs: Attributes = {"infersight.device": "cuda:%d" % dev}
        if uuid:
            dattrs["hw.id"] = uuid
        start = int(p.info.get("start_ns") or t_ns)
        # A reset of PyTorch's accumulated stats restarts the sums.
        starts: dict[tuple[int, str], tuple[int, int]] = p.state.setdefault("mem_sum_start", {})
        for key, spec in GAUGES:
            if key in st:
                out.append(spec.item(p.resource, t_ns, start, [NumberPoint(st[key], dict(dattrs))]))
        for key, spec in SUMS:
            if key not in st:
                continue
            s0, last = starts.get((dev, key), (start, 0))
            if st[key] < last:
                s0 = t_ns
            starts[(dev, key)] = (s0, st[key])
            out.append(spec.item(p.resource, t_ns, s0, [NumberPoint(st[key], dict(dattrs))]))
        ev = d.get("ev")
        if ev is None:
            return
        if not isinstance(ev, list) or len(ev) > 16:
            raise Malformed("mem ev must be a list of at most 16 objects")
        sp = _span_id(d)
        pending: list[str] = p.state.setdefault("mem_attached", [])
        for e in ev:
            if not isinstance(e, dict) or e.get("n") not in MEM_EVENTS:
                raise Malformed("mem event must be {n, count, bytes} with a known n")
            a: Attributes = dict(dattrs)
            a["infersight.memory.count"] = _opt_int(e, "count") or 0
            a["infersight.memory.bytes"] = _opt_int(e, "bytes") or 0
            if e["n"] == "large_alloc":
                a["infersight.memory.approx"] = True  # growth between two samples
            if sp is None:
                continue
            p.attach_event(sp, SpanEvent("infersight.memory." + str(e["n"]), t_ns, a))
            pending.append(sp)
        # Bound what waits for spans that may already have ended.
        while len(pending) > MAX_MEM_SPAN_EVENTS:
            old = pending.pop(0)
            evs = p.span_events.get(old)
            if evs:
                i = next((j for j, x in enumerate(evs) if x.name.startswith("infersight.memory.")), None)
                if i is not None:
                    del evs[i]
                if not evs:
                    del p.span_events[old]


def _sentence(text: str | None) -> str:
    """``text`` ended as a sentence, and a space, before what follows it on one line ("" for none)."""
    text = (text or "").rstrip()
    if not text:
        return ""
    return text + ("" if text.endswith((".", ":", ";", "!", "?")) else ".") + " "


def _same(a: int | None, b: int | None) -> bool:
    return a is None or b is None or a == b


def _close(a: int | None, b: int | None) -> bool:
    """Equal within 1% (the text prints two decimals of a unit)."""
    if a is None or b is None:
        return True
    return abs(a - b) <= max(1, max(a, b) // 100)


def _snap_attrs(snap: dict[str, Any]) -> Attributes:
    a: Attributes = {}
    for key in ("segments", "inactive_split", "private_pools"):
        v = snap.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            a["infersight.oom.snapshot.%s%s" % (key, "" if key == "segments" else "_bytes")] = v
    pools = snap.get("pools")
    if isinstance(pools, dict):
        for name, pool in list(pools.items())[:4]:
            if isinstance(pool, dict):
                for k in ("largest_free", "free", "reserved"):
                    v = pool.get(k)
                    if isinstance(v, int) and not isinstance(v, bool):
                        a["infersight.oom.snapshot.%s.%s_bytes" % (str(name)[:16], k)] = v
    if snap.get("truncated") is True:  # the hook stopped at its segment/block bound
        a["infersight.oom.snapshot.truncated"] = True
    top = snap.get("top")
    if isinstance(top, list) and top and all(isinstance(x, int) and not isinstance(x, bool) for x in top):
        a["infersight.oom.snapshot.top_live_bytes"] = [int(x) for x in top[:16]]
    return a


def one_line(v: Verdict, dev: int | None = None) -> str:
    """``OOM on cuda:0: fragmentation (rule frag-1): tried 2.00 GiB; ...`` for a log body."""
    where = " on cuda:%d" % dev if dev is not None else ""
    req = " requested %s;" % torch_bytes(v.requested_bytes) if v.requested_bytes is not None else ""
    note = " (%s)" % v.note if v.note else ""
    return " ".join(("OOM%s: %s by rule %s:%s %s%s" % (where, v.cls, v.rule, req, v.remedy, note)).split())
