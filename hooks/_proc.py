"""Process identity from /proc (stdlib only)."""

from __future__ import annotations

import os
import time

from . import _env

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


def producer_id(pid: int = 0, exec_ns: int = 0) -> str:
    """boot id + pid + start ticks: unique per process across reboots and pid reuse. A program
    another hooked one exec'd (same pid, same start) adds the exec's time to the first part,
    which nothing parses: the agent keeps the two programs' events apart."""
    pid = pid or os.getpid()
    boot = boot_id() + ("x%x" % exec_ns if exec_ns else "")
    return "%s-%d-%s" % (boot, pid, stat_starttime_ticks(pid) or 0)


HELPER_ENTRY_POINTS = ("_inductor/compile_worker/",)  # script paths of known helper processes


def process_role(argv: List[str], launched: bool, env: Optional[Dict[str, str]] = None) -> str:
    """``"helper"`` for a process that serves another one's start-up, else ``""``.

    Helpers: ``python -c`` processes (multiprocessing's resource tracker and forkserver,
    capability probes) other than multiprocessing's spawned workers, and inductor's compile
    workers. The process ``launch`` started is never a helper. ``INFERSIGHT_PROCESS_ROLE``
    (set by a helper for its own children) wins.
    """
    forced: str = _env.get("INFERSIGHT_PROCESS_ROLE", env)
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


def _cmdline(proc_root: str = "/proc") -> List[str]:
    try:
        with open(proc_root + "/self/cmdline", "rb") as f:
            raw = f.read(65536)
    except OSError:
        return []
    args = [a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0")]
    return args[:-1] if args and args[-1] == "" else args


_OPTS_WITH_ARG = "WX"  # python -W arg, -X opt: the next argument (or the rest) is their value


def command_argv(orig: Optional[List[str]] = None) -> List[str]:
    """The command this interpreter runs, shaped like the final ``sys.argv``: ``[script, args...]``,
    ``["-m", module, args...]`` or ``["-c", args...]``; from ``sys.orig_argv`` (3.10+) or
    ``/proc/self/cmdline``, never ``sys.argv`` (a ``.pth`` bootstrap runs under
    ``runpy.run_path``, which sets ``sys.argv[0]`` to its own file while it runs)."""
    if orig is None:
        import sys

        orig = list(getattr(sys, "orig_argv", None) or _cmdline())
    i, n = 1, len(orig)
    while i < n:
        a = orig[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        if a.startswith("--"):
            i += 2 if a == "--check-hash-based-pycs" else 1
            continue
        for j in range(1, len(a)):
            ch, rest = a[j], a[j + 1:]
            if ch in "cm":
                value_at = i if rest else i + 1
                if ch == "c":
                    return ["-c", *orig[value_at + 1:]]
                module = rest or (orig[i + 1] if i + 1 < n else "")
                return ["-m", module, *orig[value_at + 1:]]
            if ch in _OPTS_WITH_ARG:
                i += 0 if rest else 1
                break
        i += 1
    return orig[i:]


def command_name(argv: List[str]) -> str:
    """What ``process.command`` says: the script's file name, the ``-m`` module, or ``-c``."""
    if not argv:
        return ""
    if argv[0] == "-m" and len(argv) > 1:
        return argv[1]
    return os.path.basename(argv[0])


def is_own_cli(argv: List[str]) -> bool:
    """infersight's own command line (the ``infersight`` script, ``python -m infersight``):
    it never becomes a producer, even with ``INFERSIGHT=1`` in its environment."""
    if not argv:
        return False
    if argv[0] == "-m":
        return len(argv) > 1 and (argv[1] == "infersight" or argv[1].startswith("infersight.agent"))
    if os.path.basename(argv[0]) != "infersight":
        return False
    try:
        with open(argv[0], "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b"infersight.agent" in head or b"from infersight" in head
