"""Serving engines' memory errors that reach ``logging`` or an uncaught exception (stdlib only).

vLLM, SGLang, TGI's server, lmdeploy and the other Python engines report their own memory
errors ("No available memory for the cache blocks", "Not enough memory. Please try to
increase --mem-fraction-static", a wrapped PyTorch OOM...) through ``logging`` or as an
exception; the agent classifies them with ``rules/serving.toml`` like a PyTorch OOM.

The cost stays off the hot path: ``logging.Logger.callHandlers`` is wrapped once; for a record
below INFO the wrapper is one integer compare, for an INFO record two and a logger-name check
(an engine's sizing lines are kept: ``keep_context``). A WARNING+ record is checked against a
few lower-case needles, fixed strings that every anchor of the serving rules holds (``NEEDLES``;
a test keeps them in step with ``infersight.rules.serving.NEEDLES``): its message and arguments
first, and it is formatted (``getMessage``) only when one may hold a needle (``_may_hold``); an
array argument is never made a string (a CUDA tensor's would synchronise the device). Only a
text that holds one is sent, at most once per distinct text; the agent decides whether it is a
memory error. Warnings and errors
have a budget each (``MAX_REPORTS`` per process): a loop of warnings whose counters change
(vLLM's preemption notice) is one text with its digits masked, and cannot use up the errors'
budget. A text over budget is counted and the count goes to the agent with the hooks' other
drops. Never raises, never blocks.
"""

from __future__ import annotations

import sys
import threading

from . import _client, _proc, _runtime

TYPE_CHECKING = False  # the typing module costs milliseconds at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional

NEEDLES = (  # = rules.serving.NEEDLES
    "memory", "alloc", "kv cache", "kvcache", "cache blocks", "resource_exhausted", "resource exhausted",
    "are available (after", "mem_buffer", "kv slot", "failed to create context",
    "swap space", "no space left for only one request", "not enough vram", "insufficient workspace",
    "failed to decode the batch", "cache entries", "cudnn convolution algorithm", "no enough blocks",
    "buffer maximum", "capacity of block_manager", "context size has been exceeded",
)
MAX_TEXT = 16384
MAX_REPORTS = 64  # distinct texts sent per process and kind (warnings, errors): a log loop cannot flood the agent
MAX_ARGS = 128  # command-line arguments sent with a report (knob_args)
MAX_SCANNED_ARGS = 16  # a record's arguments checked for needles
ERROR_LEVEL = 40  # logging.ERROR
_seen: Dict[int, bool] = {}
_refused: Dict[int, bool] = {}  # texts over budget already counted (bounded: past it, each repeat counts)
MAX_REFUSED = 4096
_sent = {"warning": 0, "error": 0}  # texts sent, per budget
dropped = _client.TEXT_DROPS  # texts with a needle not sent: over their budget (the client reports it with its drops)
_lock = threading.Lock()
# An engine's sizing lines come at INFO (vLLM's memory profiling, "# GPU blocks", SGLang's "Load weight end ...
# avail mem="): the numbers its later error leaves out and the serving rules read as context. The latest few
# from an engine's loggers (the package's own name or a child of it) are kept, formatted (they are rare:
# start-up, a profile run, a graph capture's start and end) and sent with a report as ``ctx``: the agent reads
# them for numbers, never as an error of their own.
CONTEXT_LOGGERS = ("vllm", "sglang", "lmdeploy", "text_generation_server", "tensorrt_llm", "aphrodite")
_CONTEXT_CHILDREN = tuple(n + "." for n in CONTEXT_LOGGERS)
CONTEXT_NEEDLES = (  # words of the sizing messages, not of the periodic stats ("GPU KV cache usage: 3.1%")
    "gpu_memory_utilization", "weights take", "weights took", "loading took", "reserved for kv cache",
    "gpu blocks", "available kv cache memory", "gpu kv cache size", "memory profiling", "maximum concurrency",
    "avail mem=", "kv cache is allocated", "mem_fraction", "graph capturing finished", "capture cuda graph",
    "capturing cudagraphs", "capturing cuda graph")
MAX_CONTEXT_LINES = 12
MAX_CONTEXT_LINE = 1024
MAX_CONTEXT_CHARS = 8192
_context: Any = None  # a deque of lines (collections is imported with logging; made at install)
INFO_LEVEL = 20  # logging.INFO
_digit_runs: List[Any] = []  # the compiled pattern, at the first warning worth sending (re is not loaded before)


def interesting(text: str) -> bool:
    """The prefilter: ``text`` holds one of the needles (case-insensitive)."""
    low = text[:MAX_TEXT].lower()
    for n in NEEDLES:  # noqa: SIM110 - a plain loop: 2/3 the cost of any() over a generator, per WARNING+ record
        if n in low:
            return True
    return False


def _masked(text: str) -> str:
    """``text`` with each run of digits as one 0: a warning's identity whatever its counters and ids."""
    if not _digit_runs:
        import re

        _digit_runs.append(re.compile(r"\d+"))
    return str(_digit_runs[0].sub("0", text))


def report_text(text: str, source: str, span: Optional[str] = None, warning: bool = False) -> bool:
    """Send ``text`` (a log record or an exception) for the agent to classify; True when sent.
    ``warning``: a record below ERROR, from the warnings' budget, its digits masked for its identity."""
    try:
        if not text or not _runtime.active() or not interesting(text):
            return False
        head = text[:MAX_TEXT]
        budget = "warning" if warning else "error"
        key = hash((budget, _masked(head) if warning else head))
        lock = _lock
        if not lock.acquire(blocking=False):  # never wait in the user's thread
            return False
        try:
            if key in _seen:
                return False
            if _sent[budget] >= MAX_REPORTS:
                if key not in _refused:  # each text over budget counted once, however often it repeats
                    if len(_refused) < MAX_REFUSED:
                        _refused[key] = True
                    dropped[0] += 1
                return False
            _seen[key] = True
            _sent[budget] += 1
        finally:
            lock.release()
        data: Dict[str, Any] = {
            "source": source, "text": text[:MAX_TEXT], "sp": span or _runtime.current_span.get() or
            _runtime.state().root_span_id or None, "args": knob_args(_proc.command_argv()),
        }
        ctx = _context
        if ctx:  # the engine's sizing lines, in the order it logged them (the newest kept)
            data["ctx"] = "\n".join(list(ctx))[-MAX_CONTEXT_CHARS:]
        _runtime.emit_urgent("oom", data)
        return True
    except Exception:
        return False


def _numeric(v: str) -> bool:
    return 0 < len(v) <= 24 and v.replace(".", "", 1).replace("e-", "", 1).isdigit()


def knob_args(argv: List[str]) -> List[str]:
    """The command line's flags and numbers, for the agent to read the engine's knobs from should
    this process be gone when it looks (``/proc/<pid>/cmdline`` first). Every other value (a
    path, a model name, a token) is sent as ``""``: its position kept, its text not."""
    out: List[str] = []
    for a in argv[:MAX_ARGS]:
        if not isinstance(a, str) or len(a) > 64:
            out.append("")
        elif a.startswith("-"):
            name, eq, value = a.partition("=")
            out.append(name + "=" + value if eq and _numeric(value) else name + "=" if eq else name)
        else:
            out.append(a if _numeric(a) else "")
    return out


_ARRAY_MODULES = ("torch", "numpy", "jax", "jaxlib", "cupy", "tensorflow", "paddle", "mlx")
_PLAIN = (int, float, bool, type(None))
_BYTES_NEEDLES = tuple(n.encode() for n in NEEDLES)


def _may_hold(v: Any, depth: int = 0) -> bool:
    """Whether ``v``, formatted, may hold a needle, without formatting it: a string or bytes is checked, an
    exception may (its text is cheap), a number cannot, an array (torch, numpy...: its text would copy, for a
    CUDA tensor synchronise, the device) is taken not to; a list, tuple or mapping is looked into once; any other
    object may."""
    if isinstance(v, str):
        return interesting(v)
    if isinstance(v, BaseException):
        return True
    if isinstance(v, _PLAIN):
        return False
    if isinstance(v, (bytes, bytearray)):
        low = bytes(v[:MAX_TEXT]).lower()
        return any(n in low for n in _BYTES_NEEDLES)
    if isinstance(v, (list, tuple, dict)):
        if depth:
            return True
        return _any_of_first(v.values() if isinstance(v, dict) else v, 1)
    return not (type(v).__module__ or "").startswith(_ARRAY_MODULES)


def worth_formatting(record: Any) -> bool:
    """Whether a record may hold a needle, without formatting it (``_may_hold``): its message (a format
    string, or an object: structlog hands over a dict), its arguments, or its exception."""
    exc = getattr(record, "exc_info", None)
    if exc and len(exc) > 1 and exc[1] is not None:
        return True
    if _may_hold(getattr(record, "msg", None)):
        return True
    args = getattr(record, "args", None)
    if not args:
        return False
    values = args.values() if isinstance(args, dict) else args if isinstance(args, tuple) else (args,)
    return _any_of_first(values, 0)


def _any_of_first(items: Any, depth: int) -> bool:
    """``_may_hold`` of the first MAX_SCANNED_ARGS items only: a list of a million token ids costs as
    much as one of sixteen (the rest is not even stepped through)."""
    for i, x in enumerate(items):
        if i >= MAX_SCANNED_ARGS:
            return False
        if _may_hold(x, depth):
            return True
    return False


def _engine_logger(name: str) -> bool:
    """An engine's own logger: its package's name, or a child of it (not 'vllm_bench_client')."""
    return name.startswith(_CONTEXT_CHILDREN) or name in CONTEXT_LOGGERS


def keep_context(record: Any) -> None:
    """(An INFO record of an engine's logger) keep it when its format string names the engine's sizing."""
    msg = record.msg
    if not isinstance(msg, str):
        return
    low = msg.lower()
    for n in CONTEXT_NEEDLES:  # a plain loop, as in interesting()
        if n in low:
            break
    else:
        return
    try:
        text = record.getMessage()
    except Exception:
        return
    ctx = _context
    if ctx is not None:
        ctx.append(text[:MAX_CONTEXT_LINE])


def _record_text(record: Any) -> str:
    try:
        text = record.getMessage()
    except Exception:
        text = str(getattr(record, "msg", ""))
    exc = getattr(record, "exc_info", None)
    if exc and len(exc) > 1 and exc[1] is not None:
        try:
            text = "%s\n%s: %s" % (text, type(exc[1]).__name__, exc[1])
        except Exception:
            pass
    return str(text)


def install_logging(logging: Any) -> None:
    """Wrap ``logging.Logger.callHandlers`` once (idempotent). It stays for the process's life:
    memory errors while serving matter as much as those of the cold start."""
    cls = logging.Logger
    orig = cls.callHandlers
    if getattr(orig, "_infersight", False):
        return
    warning = int(logging.WARNING)
    global _context
    if _context is None:
        import collections

        _context = collections.deque(maxlen=MAX_CONTEXT_LINES)

    def callHandlers(self: Any, record: Any) -> None:  # noqa: N802 - the stdlib's name
        level = record.levelno
        if level >= warning:
            if _runtime.active():
                try:
                    if worth_formatting(record):  # report_text checks the needles in the formatted text
                        report_text(_record_text(record), "log", warning=level < ERROR_LEVEL)
                except Exception:
                    pass
        elif level >= INFO_LEVEL and _engine_logger(record.name) and _runtime.active():
            try:
                keep_context(record)
            except Exception:
                pass
        orig(self, record)

    import os

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=after_fork_child)
    callHandlers._infersight = True  # type: ignore[attr-defined]
    cls.callHandlers = callHandlers


# -- uncaught exceptions ------------------------------------------------------------------------
# Installed at activation (torch or not), chained to the hooks that were there. When torch is
# imported later, _alloc's hooks chain on top and report a PyTorch OOM first (marking it), so
# this one skips what _alloc reported.

_prev_sys: Any = None
_prev_thread: Any = None


MAX_CHAIN = 8  # links of an exception's cause/context chain read (as find_oom in _alloc)


def report_uncaught(value: Any) -> bool:
    """An uncaught exception whose text, or a cause's, is an engine's memory error; True when sent.
    Engines wrap it (vLLM: ``RuntimeError: Engine core initialization failed`` raised from the
    ``ValueError: No available memory for the cache blocks``): the chain's lines go in the order
    Python prints them, causes first; a link already reported (a PyTorch OOM) is left out."""
    try:
        lines: List[str] = []
        seen = 0
        while value is not None and seen < MAX_CHAIN:
            if not getattr(value, "_infersight_reported", False):
                lines.append("%s: %s" % (type(value).__name__, value))
            value = value.__cause__ or (None if value.__suppress_context__ else value.__context__)
            seen += 1
        return bool(lines) and report_text("\n".join(reversed(lines)), "exception")
    except Exception:
        return False


def _sys_hook(tp: Any, value: Any, tb: Any) -> None:
    report_uncaught(value)
    (_prev_sys or sys.__excepthook__)(tp, value, tb)


def _thread_hook(args: Any) -> None:
    report_uncaught(getattr(args, "exc_value", None))
    (_prev_thread or threading.__excepthook__)(args)


def install_excepthooks() -> None:
    global _prev_sys, _prev_thread
    if sys.excepthook is not _sys_hook:
        _prev_sys = sys.excepthook
        sys.excepthook = _sys_hook
    if threading.excepthook is not _thread_hook:
        _prev_thread = threading.excepthook
        threading.excepthook = _thread_hook


def after_fork_child() -> None:
    """A new lock (the parent's may have been held by a thread that is not in the child)."""
    global _lock
    _lock = threading.Lock()
    _seen.clear()
    _refused.clear()
    if _context is not None:
        _context.clear()
    _sent["warning"] = _sent["error"] = 0
    dropped[0] = 0
