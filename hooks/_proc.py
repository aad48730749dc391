"""Process identity from /proc (stdlib only)."""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Dict, List, Optional


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def stat_starttime_ticks(pid: int = 0, proc_root: str = "/proc") -> Optional[int]:
    """Field 22 of /proc/<pid>/stat: start time in clock ticks since boot."""
    text = _read("%s/%s/stat" % (proc_root, pid or "self"))
    if not text:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = text[text.rfind(")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def process_start_ns(pid: int = 0, proc_root: str = "/proc") -> Optional[int]:
    """Wall-clock Unix ns of the process start (its fork), at clock-tick resolution."""
    ticks = stat_starttime_ticks(pid, proc_root)
    if ticks is None:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    since_boot_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    wall_ns = time.time_ns()
    return wall_ns - (since_boot_ns - ticks * (1_000_000_000 // hz))


def boot_id(proc_root: str = "/proc") -> str:
    text = _read(proc_root + "/sys/kernel/random/boot_id")
    return (text or "noboot").strip().replace("-", "")[:12]


def producer_id(pid: int = 0) -> str:
    """boot id + pid + start ticks: unique per process across reboots and pid reuse."""
    pid = pid or os.getpid()
    return "%s-%d-%s" % (boot_id(), pid, stat_starttime_ticks(pid) or 0)


HELPER_ENTRY_POINTS = ("_inductor/compile_worker/",)  # script paths of known helper processes


def process_role(argv: List[str], launched: bool, env: Optional[Dict[str, str]] = None) -> str:
    """``"helper"`` for a process that serves another one's start-up, else ``""``.

    Helpers: ``python -c`` processes (multiprocessing's resource tracker and forkserver,
    capability probes) other than multiprocessing's spawned workers, and inductor's compile
    workers. The process ``launch`` started is never a helper. ``INFERSIGHT_PROCESS_ROLE``
    (set by a helper for its own children) wins.
    """
    e = os.environ if env is None else env
    forced = e.get("INFERSIGHT_PROCESS_ROLE", "").strip()
    if forced:
        return forced
    if launched or not argv:
        return ""
    first = argv[0] or ""
    if first == "-c" and "--multiprocessing-fork" not in argv:
        return "helper"
    if any(p in first for p in HELPER_ENTRY_POINTS):
        return "helper"
    return ""
