"""Serving engines' memory errors that reach ``logging`` or an uncaught exception (stdlib only).

vLLM, SGLang, TGI's server, lmdeploy and the other Python engines report their own memory
errors ("No available memory for the cache blocks", "Not enough memory. Please try to
increase --mem-fraction-static", a wrapped PyTorch OOM...) through ``logging`` or as an
exception; the agent classifies them with ``rules/serving.toml`` like a PyTorch OOM.

The cost stays off the hot path: ``logging.Logger.callHandlers`` is wrapped once, and for a
record below WARNING the wrapper is one integer compare. A WARNING+ record is formatted
(``getMessage``, as its handlers will do anyway) and checked against a few lower-case
needles, fixed strings that every anchor of the serving rules holds (``NEEDLES``; a test
keeps them in step with ``infersight.rules.serving.NEEDLES``). Only a record that holds one
is sent, at most once per distinct text and at most ``MAX_REPORTS`` per process; the agent
decides whether it is a memory error. Never raises, never blocks.
"""

from __future__ import annotations

import sys
import threading

from . import _proc, _runtime

TYPE_CHECKING = False  # the typing module costs milliseconds at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional

NEEDLES = (  # = rules.serving.NEEDLES
    "memory", "alloc", "kv cache", "kvcache", "cache blocks", "resource_exhausted", "resource exhausted",
    "are available (after", "mem_buffer", "kv slot", "failed to create context",
    "swap space", "no space left for only one request", "not enough vram", "insufficient workspace",
    "failed to decode the batch", "cache entries", "cudnn convolution algorithm", "no enough blocks",
    "buffer maximum", "capacity of block_manager",
)
MAX_TEXT = 16384
MAX_REPORTS = 64  # distinct texts sent per process: a log loop cannot flood the agent
MAX_ARGS = 128  # command-line arguments sent with a report (knob_args)
_seen: Dict[int, bool] = {}
_lock = threading.Lock()


def interesting(text: str) -> bool:
    """The prefilter: ``text`` holds one of the needles (case-insensitive)."""
    low = text[:MAX_TEXT].lower()
    for n in NEEDLES:  # noqa: SIM110 - a plain loop: 2/3 the cost of any() over a generator, per WARNING+ record
        if n in low:
            return True
    return False


def report_text(text: str, source: str, span: Optional[str] = None) -> bool:
    """Send ``text`` (a log record or an exception) for the agent to classify; True when sent."""
    try:
        if not text or not _runtime.active() or not interesting(text):
            return False
        key = hash(text[:MAX_TEXT])
        lock = _lock
        if not lock.acquire(blocking=False):  # never wait in the user's thread
            return False
        try:
            if key in _seen or len(_seen) >= MAX_REPORTS:
                return False
            _seen[key] = True
        finally:
            lock.release()
        data: Dict[str, Any] = {
            "source": source, "text": text[:MAX_TEXT], "sp": span or _runtime.current_span.get() or
            _runtime.state().root_span_id or None, "args": knob_args(_proc.command_argv()),
        }
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

    def callHandlers(self: Any, record: Any) -> None:  # noqa: N802 - the stdlib's name
        # Formatted only while something can still be sent (report_text checks the needles).
        if record.levelno >= warning and len(_seen) < MAX_REPORTS and _runtime.active():
            try:
                report_text(_record_text(record), "log")
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


def report_uncaught(value: Any) -> bool:
    """An uncaught exception whose text is an engine's memory error; True when sent."""
    try:
        if value is None or getattr(value, "_infersight_reported", False):
            return False
        return report_text("%s: %s" % (type(value).__name__, value), "exception")
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
