"""What every part of ``infersight launch`` shares: its options, the private directory, CMD.

:mod:`~infersight.agent.commands.launch` (the cheap half) spawns CMD, then imports one of
the agent sides (:mod:`~infersight.agent.commands.launch_session` for the embedded agent,
:mod:`~infersight.agent.commands.launch_join` for a joined one, or
:mod:`~infersight.agent.commands.launch_quick` when CMD is done at once). They all import
this module, never each other's entry point, so that no import goes both ways. Stdlib only:
it is imported before CMD starts.
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Iterator, Mapping, Sequence
    from typing import Any

    from infersight.agent.oom.stderr_relay import StderrRelay

EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_USAGE = 2
PRIVATE_PREFIX = "infersight-launch-"
MAX_DEAD_LOOKED = 1024  # launch directories looked at for a dead launch's leftovers, at most (the rest: later)
LOCK_NAME = "launch.lock"
COMMAND_NAME = "command"  # CMD's argv, NUL-joined: a later launch replays only what the same command left
TO_GROUP = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
FORCING = frozenset({signal.SIGINT, signal.SIGTERM})  # a second one of these: SIGKILL to the group


# What a joined launch subscribes to: the waterfall and the OOMs' lines (the console); with --otlp-file, its copy
ITEM_KINDS_CONSOLE = ["coldstart", "progress", "log"]
ITEM_KINDS_ALL = ["coldstart", "progress", "span", "log", "metric"]
RELAY_CLOSE_WAIT_S = 2.0  # at CMD's exit: what it wrote last on stderr is captured before launch's own lines
AGENT_HOLD_S = 20.0  # the embedded agent starts once CMD is ready, at the latest this long after (launch_hold)


def log_events_for(kinds: list[str]) -> list[str] | None:
    """The log records a joined launch asks for: the console shows only the OOMs' lines; a local copy has all."""
    return None if "span" in kinds else ["oom"]


class LaunchOptions:
    def __init__(
        self,
        cmd: Sequence[str],
        otlp_file: str | None = None,
        console: bool = True,
        flush_timeout_s: float = 10.0,
        ready_url: str | None = None,
        probe: str | None = None,
        ready_timeout_s: float = 3600.0,
        evict: Sequence[str] = (),
        agent: str = "auto",
        rules_dirs: Sequence[str] = (),
    ) -> None:
        self.cmd = list(cmd)
        self.otlp_file = otlp_file
        self.console = console
        self.flush_timeout_s = flush_timeout_s
        self.ready_url = ready_url
        self.probe = probe
        self.ready_timeout_s = ready_timeout_s
        self.evict = list(evict)
        self.agent = agent  # auto | embedded | PATH of an agent's socket
        self.rules_dirs = list(rules_dirs)
        self.import_abandoned = False  # launch's quick end left the agent side's import running
        self.hold_s: float | None = None  # None: AGENT_HOLD_S, unless the terminal shows the warming line
        self.agent_wait_s: float | None = None  # None: AGENT_WAIT_S when INFERSIGHT_SOCKET names the socket, else 0


class Joined:
    """A running agent that launch joined: its socket, the subscription's descriptor, the
    session token CMD's hooks carry, and what the agent said of itself (version, sinks)."""

    def __init__(self, path: str, fd: int, session: str, info: dict[str, Any]) -> None:
        self.path = path
        self.fd = fd
        self.session = session
        self.info = info


def printable_reply(v: Any, depth: int = 0) -> Any:
    """An agent's reply with every string one printable line (``log_text``): launch prints its version, sinks,
    problems and warnings on the user's terminal, where an escape sequence would act."""
    from infersight.sanitize import log_text

    if isinstance(v, str):
        return log_text(v)
    if depth >= 32:  # deeper than any reply the agent makes
        return None
    if isinstance(v, dict):
        return {log_text(k): printable_reply(x, depth + 1) for k, x in v.items()}
    if isinstance(v, list):
        return [printable_reply(x, depth + 1) for x in v]
    return v


def joined_spool(joined: Joined, paths: Any) -> str | None:
    """Where CMD's hooks spool when launch joined an agent: the agent's ``agent.spool_dir`` (what it replays after
    a restart; a spool the agent never reads keeps what it holds from every sink), unless the environment names
    one, or this user cannot write there (the hooks' own default then: the system spool or their private one).
    ``paths``: the hooks' ``_paths`` module (launch's stand-in before CMD starts: the hooks package costs ~20 ms)."""
    if os.environ.get("INFERSIGHT_SPOOL_DIR"):
        return None
    spool = joined.info.get("spool_dir")
    if not isinstance(spool, str) or not spool.startswith("/") \
            or fallback_distrust(joined.path, joined.fd, paths):
        return None
    # the hooks make it (0700) when it is not there yet and its parent lets them
    there = spool if os.path.isdir(spool) else os.path.dirname(spool.rstrip("/"))
    return spool if os.access(there, os.W_OK | os.X_OK) else None


def fallback_distrust(path: str, fd: int, paths: Any) -> str | None:
    """Why not to trust the agent connected on ``fd`` at ``path``, or None. Any agent at a socket of the system's
    or the operator's choosing is trusted; at a per-user fallback (``/tmp/infersight-<uid>``,
    ``$XDG_RUNTIME_DIR/infersight``), which another local user could have made first with an agent of its own in
    it, only one the hooks would connect to: its directory passes their rule and the kernel says the peer is this
    user, root or the directory's owner (the hooks' own rule, ``_connection``). Launch sends such an agent
    nothing (CMD's argv, its stderr) and takes nothing from it (what it prints, where CMD spools)."""
    owner = paths.fallback_owner(path)
    if owner is None:
        return None
    import socket
    import struct

    try:
        paths.check_socket_dir(os.path.dirname(os.path.abspath(path)), owner)
        with socket.socket(fileno=os.dup(fd)) as sock:  # SO_PEERCRED: pid, uid, gid
            peer_uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    except (OSError, ValueError) as exc:
        return "not trusting the process at %s: %s" % (path, exc)
    if peer_uid not in (0, os.geteuid(), owner):
        return "not trusting the process at %s: it runs as uid %d, not as this user or root" % (path, peer_uid)
    return None


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


SUN_PATH_MAX = 107  # bytes of an AF_UNIX socket's path (sun_path holds 108 with its NUL)


def temp_root(environ: Mapping[str, str] = os.environ) -> str:
    """Where launch makes its private directory (and looks for dead launches' ones): ``$TMPDIR``,
    or ``/tmp`` when its socket's path under ``$TMPDIR`` would be too long for AF_UNIX (a deep
    per-job or per-test temporary directory); the directory is 0700 and made exclusively either way."""
    root = environ.get("TMPDIR") or "/tmp"
    sock = os.path.join(root, PRIVATE_PREFIX + "0" * 12, "agent.sock")
    return root if len(os.fsencode(sock)) <= SUN_PATH_MAX else "/tmp"


def processes_using(sock: str) -> list[int]:
    """Live processes started under this launch (their environment names its socket)."""
    entry = b"\0INFERSIGHT_SOCKET=" + os.fsencode(sock) + b"\0"
    pids: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return pids
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as f:
                env = f.read()
        except OSError:
            continue
        if entry in b"\0" + env + b"\0":
            pids.append(int(name))
    return pids


class Private:
    """launch's private directory (0700, created exclusively), locked while launch lives."""

    def __init__(self, root: str | None = None, command: list[str] | None = None) -> None:
        import fcntl

        root = root or temp_root()
        while True:
            path = os.path.join(root, PRIVATE_PREFIX + os.urandom(6).hex())
            try:
                os.mkdir(path, 0o700)
                break
            except FileExistsError:
                continue
        self.path = path
        self.sock = os.path.join(path, "agent.sock")
        self.spool = os.path.join(path, "spool")
        self.lock_fd = os.open(os.path.join(path, LOCK_NAME),
                               os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        os.write(self.lock_fd, b"%d\n" % os.getpid())
        if command is not None:
            fd = os.open(os.path.join(path, COMMAND_NAME),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"\0".join(os.fsencode(a) for a in command))
            finally:
                os.close(fd)

    def listen(self) -> int:
        """Listen on the private socket now, so a hook can connect before the agent runs; the fd."""
        import _socket

        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        s.bind(self.sock)
        os.chmod(self.sock, 0o600)
        s.listen(128)
        return int(s.detach())

    def release(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def config_flags(opts: LaunchOptions, path: str, private: Private) -> dict[str, Any]:
    """What launch sets over the environment's configuration."""
    return {
        "agent.socket": private.sock,
        "agent.socket_mode": 0o600,
        "agent.spool_dir": private.spool,
        "agent.allowed_uids": [os.getuid()],
        "agent.allowed_gids": [os.getgid()],
        "exporters.file.path": path,
        "exporters.console.enabled": opts.console,
    }


class Child:
    """CMD: its own process group, reaped by :meth:`poll` (waitpid with WUNTRACED)."""

    def __init__(self, popen: subprocess.Popen[bytes], tty: int | None) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.tty = tty
        self.returncode: int | None = None
        self.exit_ns = 0  # when launch saw CMD exit (before reaping it, possibly)
        self.forwarded: list[int] = []
        self.relay: StderrRelay | None = None  # the relay copying CMD's stderr, when there is one

    def forward(self, sig: int) -> None:
        """A signal launch got: to CMD's group (INT, TERM, HUP, QUIT) or CMD (USR1, USR2);
        the second INT/TERM forces (SIGKILL to the group). After CMD exited, its group may
        live on (workers that outlived it): it still gets the signal."""
        forced = sig in FORCING and any(s in FORCING for s in self.forwarded)
        self.forwarded.append(sig)
        try:
            if forced:
                os.killpg(self.pid, signal.SIGKILL)
            elif sig in TO_GROUP:
                os.killpg(self.pid, sig)
            elif self.returncode is None:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def poll(self) -> int | None:
        """Reap CMD if it exited (its returncode, negative for a signal); follow it into a stop."""
        while self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                self.returncode = 255  # reaped elsewhere: nothing better is known
                break
            if pid == 0:
                return None
            if os.WIFSTOPPED(status):
                if self.tty is not None:  # job control: mirror the stop to the shell
                    self._stopped()
                continue
            self.returncode = os.waitstatus_to_exitcode(status)
            self.popen.returncode = self.returncode
            self.exit_ns = self.exit_ns or time.time_ns()
        return self.returncode

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to CMD's group, then SIGKILL after timeout_s; reaped."""
        self.forward(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.forward(signal.SIGTERM)  # the second one forces
                deadline = float("inf")
            time.sleep(0.02)
        self.restore_tty()

    def _stopped(self) -> None:
        """CMD stopped (Ctrl-Z, or a background read of the terminal): stop launch too, so that
        the shell sees its job stopped. The shell's fg/bg sends launch SIGCONT: :meth:`resume`."""
        self.restore_tty()
        os.kill(os.getpid(), signal.SIGTSTP)  # returns at SIGCONT; at once in an orphaned group
        self.resume()

    def resume(self) -> None:
        """launch was continued: give CMD the terminal if launch has it (fg), and continue CMD."""
        if self.tty is not None:
            try:
                if os.tcgetpgrp(self.tty) == os.getpgrp():
                    os.tcsetpgrp(self.tty, self.pid)
            except OSError:
                pass
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def restore_tty(self) -> None:
        """Give the terminal back to launch's group, if CMD has it (SIGTTOU is ignored by then)."""
        if self.tty is None:
            return
        try:
            if os.tcgetpgrp(self.tty) == self.pid:
                os.tcsetpgrp(self.tty, os.getpgrp())
        except OSError:
            pass


# -- what a dead launch left ---------------------------------------------------------------


def dead_launch_dirs(root: str, own: str, exclusive: bool) -> Iterator[tuple[str, int]]:
    """Private directories under ``root`` of this uid's launches that died (their lock is
    free), ``own`` aside: (path, the lock's descriptor, held shared, or ``exclusive`` to
    replay it). The caller closes the descriptor. A live launch's directory (locked), a
    directory of another uid or one others may write is never yielded."""
    names: list[str] = []
    try:  # at most MAX_DEAD_LOOKED of them: 300k planted names made another user's launch take 3.5 s to end
        with os.scandir(root) as it:
            for entry in it:
                if entry.name.startswith(PRIVATE_PREFIX):
                    names.append(entry.name)
                    if len(names) >= MAX_DEAD_LOOKED:
                        break
    except OSError:
        return
    names.sort()
    for name in names:
        path = os.path.join(root, name)
        if path == own:
            continue
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                continue  # not a directory of ours: never read or delete it
            fd = os.open(os.path.join(path, LOCK_NAME), (os.O_RDWR if exclusive else os.O_RDONLY)
                         | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError:  # its launch is alive (or another launch is replaying it)
            os.close(fd)
            continue
        yield path, fd


def leftover_command(path: str) -> list[str] | None:
    """The command an earlier launch ran (its private directory's ``command`` file); None when
    unknown (an older launch wrote none)."""
    try:
        fd = os.open(os.path.join(path, COMMAND_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    return [os.fsdecode(a) for a in raw.split(b"\0")]


def same_command(a: list[str] | None, b: list[str]) -> bool:
    """The same command, as the ETA history sees one (values such as ports do not count)."""
    from infersight.agent.coldstart.history import command_shape  # not on launch's way to CMD

    return a is not None and command_shape(a) == command_shape(b)


def spool_files(spool: str) -> list[str]:
    """What is left in a hook spool directory (any name: producers choose their own), but
    the hooks' children report directories (``children-<uid>``): they hold no events."""
    try:
        names = os.listdir(spool)
    except OSError:
        return []
    return sorted(n for n in names if not n.startswith(".") and not is_children_dir(spool, n))


def is_children_dir(spool: str, name: str) -> bool:
    from infersight.hooks._workers import CHILDREN_PREFIX

    return name.startswith(CHILDREN_PREFIX) and stat.S_ISDIR(_lstat_mode(os.path.join(spool, name)))


def _lstat_mode(path: str) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0
