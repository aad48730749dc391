"""Supervisors and their workers (stdlib only).

A supervisor (uvicorn ``--workers``, gunicorn's arbiter) starts its workers and then only
waits while they do the real cold start. Every hooked process tells its hooked children,
through ``INFERSIGHT_CHILDREN_DIR``, a private directory (made when the parent's hooks
start, removed when its cold start ends) where each child writes one
small file when its own cold start ends: its root's start, end and how it ended, and an
empty one when it is ready (``report_ready``: a pre-fork master's readiness waits for it). A
process that has had no request of its own ends its cold start when a child served the
first request (``ended_by=workers``); the children's roots, which nest under it through
``TRACEPARENT``, count as covered time.

The directory is created 0700 by whoever comes first, must be owned by this uid and not a
symlink; files are created with ``O_EXCL|O_NOFOLLOW``. Any trouble: no report, no harm.
A process killed before its cold start ended cannot remove its directory: the next hooked
process of this uid removes those whose producer no longer runs.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Tuple

ENV = "INFERSIGHT_CHILDREN_DIR"
CHILDREN_PREFIX = "children-"  # in the spool directory: not a spool file
MAX_LOOKED = 4096  # names of the spool directory looked at for this uid's own children directory, at most


def children_dir(spool_dir: str, producer_id: str) -> str:
    return os.path.join(children_base(spool_dir), producer_id)


def children_base(spool_dir: str) -> str:
    """``<spool>/children-<uid>``, where this uid's processes keep their children's directories;
    one that another user made first (the spool directory is shared with the socket group, and
    the name is easy to guess: a member who took it turned off every worker report of this uid for
    good) gives way to a private one of a name nobody can guess, made now (0700)."""
    base = os.path.join(spool_dir, "%s%d" % (CHILDREN_PREFIX, os.getuid()))
    try:
        st = os.lstat(base)
    except OSError:
        return base  # made by prepare(), as ever
    if not os.path.islink(base) and os.path.isdir(base) and st.st_uid == os.getuid():
        return base
    try:  # one made by an earlier process of this uid: reused, so that no process leaves one more behind. At
        # most MAX_LOOKED names are looked at: a member who planted 400k names beside the squat made every start
        # of this uid's processes list them all (0.09 -> 0.3 s); past that, a new one is made.
        prefix = os.path.basename(base) + "-"
        with os.scandir(spool_dir) as it:
            for looked, entry in enumerate(it):
                if looked >= MAX_LOOKED:
                    break
                if entry.name.startswith(prefix):
                    ast = entry.stat(follow_symlinks=False)
                    if (ast.st_uid == os.getuid() and ast.st_mode & 0o170777 == 0o040700):  # a real 0700 directory
                        return entry.path
    except OSError:
        pass
    for _ in range(3):
        alt = "%s-%s" % (base, os.urandom(8).hex())
        try:
            os.mkdir(alt, 0o700)
            return alt
        except FileExistsError:
            continue
        except OSError:
            break
    return base


def _safe_dir(path: str, create: bool) -> bool:
    """``path`` and its parent are real directories of ours (created 0700 when asked)."""
    if create:
        try:
            os.makedirs(os.path.dirname(os.path.dirname(path)), mode=0o700, exist_ok=True)  # the spool dir
        except OSError:
            return False
    for d in (os.path.dirname(path), path):
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            if not create:
                return False
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
            except OSError:
                return False
            try:
                st = os.lstat(d)
            except OSError:
                return False
        except OSError:
            return False
        if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.getuid():
            return False
    return True


SERVED = ("first_request", "workers")  # a child's cold start that ended by serving


def prepare(own_dir: str) -> bool:
    """Let children report: make this process's directory (and sweep those of processes
    that died before their cold start ended: a killed process cannot remove its own)."""
    ok = _safe_dir(own_dir, create=True)
    if ok:
        sweep(os.path.dirname(own_dir), os.path.basename(own_dir))
    return ok


def sweep(parent: str, own: str) -> int:
    """Remove the directories under ``parent`` whose producer (``<boot>-<pid>-<ticks>``,
    ``_proc.producer_id``) is no longer running. Returns how many went."""
    from . import _proc

    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    boot = _proc.boot_id()
    gone = 0
    for name in names:
        if name == own:
            continue
        parts = name.rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        if parts[0] == boot and str(_proc.stat_starttime_ticks(int(parts[1])) or 0) == parts[2]:
            continue  # it still runs
        cleanup(os.path.join(parent, name))
        gone += 1
    return gone


READY = "ready"  # ``ready.<pid>``: that child is ready


def report_ready(parent_dir: str) -> bool:
    """This child is ready (it serves, or waits for its first request): tell the parent, if it listens."""
    if not _safe_dir(parent_dir, create=False):
        return False
    try:
        fd = os.open(os.path.join(parent_dir, "%s.%d" % (READY, os.getpid())),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return False
    os.close(fd)
    return True


def report(parent_dir: str, start_ns: int, end_ns: int, ended_by: str) -> bool:
    """This child's cold start ended: tell the parent, if it listens."""
    if not _safe_dir(parent_dir, create=False):
        return False
    path = os.path.join(parent_dir, "%d" % os.getpid())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return False
    try:
        os.write(fd, ("%d %d %s\n" % (start_ns, end_ns, ended_by.replace(" ", "_")[:32])).encode("ascii", "replace"))
    finally:
        os.close(fd)
    return True


# own_dir -> ((dev, inode, uid, mode, ctime), reports, ready): ``reports`` reads the directory again
# only when it changed. A report is a new name in it (O_EXCL), which moves its ctime (so do
# a chown, a chmod); a directory changed more recently than its ctime's resolution is read
# every time: a second name made in the same tick of that clock moves nothing. The kernel
# stamps a ctime from its coarse clock (one scheduler tick: 10 ms at most), which a file
# system may round further (to the second on some): FINE_RECENT_NS for a ctime with digits
# below the millisecond, else RECENT_NS. (A report created but not yet written is never
# cached: ``whole``.) The directory is made at the process's start, so with RECENT_NS for
# all, every tick of the first 2 s of a cold start read it again: a dozen system calls each.
_seen: Dict[str, Tuple[Tuple[int, ...], List[Tuple[int, int, str]], int]] = {}
RECENT_NS = 2_000_000_000
FINE_RECENT_NS = 100_000_000
reads = 0  # full reads of a directory (tests)


def recent_ns(ctime_ns: int) -> int:
    """How long after a change to ``ctime_ns`` the directory must still be read every time."""
    return FINE_RECENT_NS if ctime_ns % 1_000_000 else RECENT_NS


def reports(own_dir: str) -> List[Tuple[int, int, str]]:
    """(start_ns, end_ns, ended_by) of the children's cold starts reported so far. Polled by
    the sampler thread every tick: one ``lstat`` while the directory has not changed (each
    system call there costs the busy main thread a switch to hand the GIL back)."""
    return _scan(own_dir)[0]


def ready_children(own_dir: str) -> int:
    """How many children said they were ready (``report_ready``), read as ``reports``."""
    return _scan(own_dir)[1]


def _scan(own_dir: str) -> Tuple[List[Tuple[int, int, str]], int]:
    global reads
    if not own_dir:
        return [], 0
    try:
        st = os.lstat(own_dir)
    except OSError:
        return [], 0
    key = (st.st_dev, st.st_ino, st.st_uid, st.st_mode, st.st_ctime_ns)
    seen = _seen.get(own_dir)
    if seen is not None and seen[0] == key and time.time_ns() - st.st_ctime_ns > recent_ns(st.st_ctime_ns):
        return list(seen[1]), seen[2]
    _seen.pop(own_dir, None)
    if not _safe_dir(own_dir, create=False):
        return [], 0
    reads += 1
    out: List[Tuple[int, int, str]] = []
    ready = 0
    whole = True
    try:
        names = os.listdir(own_dir)
    except OSError:
        return [], 0
    for name in names:
        if not name.isdigit():
            kind, _, pid = name.partition(".")
            if kind == READY and pid.isdigit():
                ready += 1
            continue
        try:
            fd = os.open(os.path.join(own_dir, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            whole = False
            continue
        try:
            parts = os.read(fd, 128).split()
        finally:
            os.close(fd)
        if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
            out.append((int(parts[0]), int(parts[1]), parts[2].decode("ascii", "replace")))
        else:
            whole = False  # being written: read again
    if whole and len(_seen) < 16:
        _seen[own_dir] = (key, out, ready)
    return list(out), ready


CURRENT = "current"  # the parent's span that a child started through a non-hooked process nests under


def publish_current(own_dir: str, span: str) -> None:
    """Say which span this process is in now (a stage rule's call opened or ended), for the
    children a non-hooked process starts for it meanwhile: Ray's raylet starts the workers a
    driver asks for, with the environment the driver had when it started the raylet, so
    their ``TRACEPARENT`` names a span long closed. Written whole (rename): never half read."""
    tmp = os.path.join(own_dir, "%s.%d" % (CURRENT, os.getpid()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.write(fd, span.encode("ascii", "replace")[:16])
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(own_dir, CURRENT))
    except OSError:
        pass


def parent_current(parent_dir: str, ppid: int) -> Optional[str]:
    """The span the hooked parent that owns ``parent_dir`` is in now, when this process was
    started by someone else on its behalf (its parent process is not the hooked one), else
    None (a direct child's ``TRACEPARENT`` is exact)."""
    parts = os.path.basename(parent_dir).rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) == ppid:
        return None
    if not _safe_dir(parent_dir, create=False):
        return None
    try:
        fd = os.open(os.path.join(parent_dir, CURRENT), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        span = os.read(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return span if len(span) == 16 and all(c in "0123456789abcdef" for c in span) else None


def cleanup(own_dir: Optional[str]) -> None:
    """Remove the directory once this process's cold start is over (children may still
    report later: their write fails harmlessly)."""
    if not own_dir or not _safe_dir(own_dir, create=False):
        return
    try:
        for name in os.listdir(own_dir):
            if name.isdigit() or name.partition(".")[0] in (CURRENT, READY):
                os.unlink(os.path.join(own_dir, name))
        os.rmdir(own_dir)
        parent = os.path.dirname(own_dir)
        if "-" in os.path.basename(parent)[len(CHILDREN_PREFIX):]:  # a private base (children_base): empty now?
            os.rmdir(parent)
    except OSError:
        pass


class DeferredSignals:
    """``with DeferredSignals():`` holds back the Python handlers of SIGINT, SIGTERM and SIGQUIT
    on the main thread, then runs them for the signals that came meanwhile. A gunicorn worker
    stopped right after its first response (its handler raises SystemExit wherever the main
    thread is) would otherwise be stopped inside the hooks' own ending of its cold start, and
    lose its first request. Elsewhere (another thread, a handler set from C) it does nothing."""

    __slots__ = ("came", "saved")

    def __init__(self) -> None:
        self.saved: List[Tuple[int, object]] = []
        self.came: List[int] = []

    def __enter__(self) -> DeferredSignals:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for name in ("SIGINT", "SIGTERM", "SIGQUIT"):
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                old = signal.getsignal(sig)
                if callable(old):  # a Python handler: SIG_DFL, SIG_IGN and C handlers stay
                    signal.signal(sig, self._hold)
                    self.saved.append((sig, old))
            except (OSError, ValueError):
                pass
        return self

    def _hold(self, sig: int, _frame: object) -> None:
        self.came.append(sig)

    def __exit__(self, *exc: object) -> None:
        import signal

        for sig, old in self.saved:
            try:
                signal.signal(sig, old)  # type: ignore[arg-type]
            except (OSError, ValueError):
                pass
        for sig in self.came:  # their handlers run now, once the hooks' work is done
            signal.raise_signal(sig)
