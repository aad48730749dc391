"""The agent's listening socket: where it is made, and the loop that accepts connections.

The socket's directory is checked before the agent listens in it (a per-user fallback
location another user made first would hand them every producer's events). Connections
are accepted by our own loop rather than asyncio's: out of descriptors (EMFILE), asyncio
logs a traceback per attempt and keeps trying; ours counts, logs one line (rate-limited)
and pauses accepting with a growing backoff. Each accepted connection goes to ``handle``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from infersight.agent.daemon.frame_budget import SMALL_FRAME_BYTES
from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.receive import RateLimitedLog
from infersight.agent.errors import AgentError
from infersight.hooks import _paths
from infersight.settings import ConfigError

log = logging.getLogger("infersight.agent")

ACCEPT_BACKOFF_MIN_S = 0.05
ACCEPT_BACKOFF_MAX_S = 2.0
ERRNO_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# A StreamReader's buffer: a connection reads ahead at most twice this while the agent is not reading it
# (asyncio pauses the socket there). It was 2 MiB: 4 MiB of agent memory per connection, whatever it sent.
# A frame larger than this is read whole only with its share of frame_budget's bytes.
STREAM_LIMIT = SMALL_FRAME_BYTES
# The listen backlog: producers that connect during an agent restart or a burst wait here instead of being
# refused (systemd/infersight.socket's Backlog=512 says the same); the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = max(512, socket.SOMAXCONN)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class UnsafeSocketDirError(ConfigError, AgentError):
    """The socket's directory could be another user's: the agent will not listen there."""


def ensure_socket_dir(path: str) -> None:
    """Make the socket's directory (0750), and where it is a per-user fallback location check
    the one that is there: a squatted one (e.g. ``/tmp/infersight-<uid>`` made 0777 by another
    user) would hand every producer's events to whoever listens in it."""
    directory = os.path.dirname(os.path.abspath(path))
    owner = _paths.fallback_owner(path)
    try:
        os.makedirs(directory, mode=0o750, exist_ok=True)
        if owner is not None:
            _paths.check_socket_dir(directory, owner)
        else:
            warn_replaceable_socket_dir(directory)
    except OSError as exc:
        raise UnsafeSocketDirError("cannot make the socket directory %s: %s" % (directory, exc)) from exc
    except ValueError as exc:
        raise UnsafeSocketDirError(
            "unsafe socket directory: %s. Remove it (or make it a directory of uid %d with mode "
            "0750 or stricter), or set agent.socket / INFERSIGHT_SOCKET to a path in a directory "
            "only the agent's user can write" % (exc, owner if owner is not None else os.geteuid())) from exc


def _describe_dir(path: str) -> str:
    """``the directory /run/x belongs to uid 1000, mode 2700``, or what is known of it."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.lstat(directory)
    except OSError as exc:
        return "the directory %s: %s" % (directory, exc.strerror or exc)
    return "the directory %s belongs to uid %d, mode %04o" % (directory, st.st_uid, stat.S_IMODE(st.st_mode))


def socket_dir_problem(st: os.stat_result, uid: int) -> str | None:
    """Why another user could remove or replace a socket in a directory of this ``lstat``, or None."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (uid, 0):
        return "it belongs to uid %d" % st.st_uid
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return "it is %04o: writable by %s without the sticky bit" % (mode, "others" if mode & 0o002 else "its group")
    return None


def _group_as_directory(path: str) -> int | None:
    """An agent run as root outside its service (in the foreground, after ``systemd-tmpfiles --create``)
    binds its socket as group root: the hooks of the directory's group (``/run/infersight``, group
    infersight) could not connect, and their hint would have been to join group root. Its socket takes
    the directory's group instead, as ``infersight.socket`` gives it (``SocketGroup=``). A directory of
    group root changes nothing; another user's agent cannot give its socket a group it is not in.
    Returns the group given, None when none was."""
    if os.geteuid() != 0:
        return None
    try:
        directory = os.path.dirname(os.path.abspath(path))
        st = os.stat(directory)
        if st.st_gid in (0, os.getegid()) or st.st_mode & stat.S_IWOTH:  # (anyone's directory: its group says nothing)
            return None
        os.chown(path, -1, st.st_gid, follow_symlinks=False)
        log.info("the socket %s takes its directory's group, gid %d (as infersight.socket's SocketGroup= would): "
                 "its members may connect, and send unless agent.allowed_gids says otherwise", path, st.st_gid)
        return st.st_gid
    except OSError as exc:
        log.warning("cannot give the socket %s its directory's group: %s", path, exc)
        return None


def warn_replaceable_socket_dir(directory: str) -> None:
    """An operator's socket directory is used as configured, but one where another user could
    remove or replace the socket (a Kubernetes emptyDir is 2777) is said at start."""
    try:
        problem = socket_dir_problem(os.lstat(directory), os.geteuid())
    except OSError:
        return
    if problem is not None:
        log.warning("the socket's directory %s: %s, so another user could remove or replace the agent's socket "
                    "(and answer the hooks and probes in its place): put the socket in a directory only the "
                    "agent can write, e.g. a subdirectory the agent makes (agent.socket = %s)", directory, problem,
                    os.path.join(directory, "agent", "agent.sock"))


def fd_limit() -> int:
    """The soft limit on this process's descriptors (a large number when unlimited)."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1 << 20
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def answers(path: str) -> bool:
    """Whether something listens on the Unix socket at ``path``. Only a refused connect (nobody
    listens: a stale file) or a vanished path says no; a full backlog (EAGAIN, or a connect that
    times out), no permission or anything else is taken as a live agent, whose socket is not ours
    to remove."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()
    return True


class Listener:
    """``open_connections()`` tells the EMFILE log line how many connections are open."""

    def __init__(self, handle: Handler, counters: Counters, rlog: RateLimitedLog,
                 open_connections: Callable[[], int]) -> None:
        self.handle = handle
        self.counters = counters
        self.rlog = rlog
        self.open_connections = open_connections
        self.server: asyncio.Server | None = None
        self._listeners: list[socket.socket] = []  # our duplicates of the server's sockets
        self._backoff = ACCEPT_BACKOFF_MIN_S
        self.paused = False
        self._accepting: set[asyncio.Task[None]] = set()
        self.bound: tuple[int, int] | None = None  # (device, inode) of the socket file this listener made
        self.socket_group: int | None = None  # the directory's group, given to the socket by a root agent

    async def start(self, path: str, mode: int, sock: socket.socket | None = None) -> None:
        """Listen at ``path`` with ``mode``, or on ``sock`` (socket activation: systemd owns
        the path and its mode)."""
        if sock is None:
            ensure_socket_dir(path)
            old = os.umask(0o777 & ~mode & 0o777)
            try:
                if os.path.lexists(path):  # noqa: ASYNC240 - startup, once
                    if answers(path):
                        raise OSError(errno.EADDRINUSE, "another agent is listening on %s: stop it first, or give "
                                      "this one another agent.socket" % path)
                    os.unlink(path)  # a stale socket from a previous run
                self.server = await asyncio.start_unix_server(self.handle, path=path, limit=STREAM_LIMIT,
                                                              backlog=LISTEN_BACKLOG)
            except PermissionError as exc:  # a directory another uid made (or moved) where ours was
                raise UnsafeSocketDirError("cannot listen at %s: %s (%s): remove it, or set agent.socket / "
                                           "INFERSIGHT_SOCKET to a path in a directory only the agent's user can "
                                           "write" % (path, exc.strerror or exc, _describe_dir(path))) from exc
            finally:
                os.umask(old)
            os.chmod(path, mode)
            self.socket_group = _group_as_directory(path)
            st = os.lstat(path)
            self.bound = (st.st_dev, st.st_ino)
        else:
            # asyncio listens again on the inherited socket: with its default backlog (100) that would
            # shrink the socket unit's Backlog= for the socket's whole life
            self.server = await asyncio.start_unix_server(self.handle, sock=sock, limit=STREAM_LIMIT,
                                                          backlog=LISTEN_BACKLOG)
        self._own_accept_loop()

    def unlink_own(self, path: str) -> None:
        """Remove the socket at ``path`` if it is still the one this listener bound: a newer agent may
        have bound its own there since (never remove another agent's socket)."""
        if self.bound is None:
            return
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == self.bound:
                os.unlink(path)
        except OSError:
            pass

    def _own_accept_loop(self) -> None:
        assert self.server is not None
        loop = asyncio.get_running_loop()
        for tsock in self.server.sockets:
            loop.remove_reader(tsock.fileno())
            lsock = socket.socket(fileno=os.dup(tsock.fileno()))
            lsock.setblocking(False)
            self._listeners.append(lsock)
            loop.add_reader(lsock.fileno(), self._accept, lsock)

    def _accept(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(64):
            try:
                conn, _addr = lsock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                self.counters.accept_errors += 1
                if exc.errno not in ERRNO_OUT_OF_RESOURCES:
                    self.rlog.warn("accept", "accept failed: %s (%d accept errors so far)",
                                   exc, self.counters.accept_errors)
                    return
                self.rlog.warn("emfile", "cannot accept connections: %s (%d accept errors so far, %d open "
                               "connections); pausing accepts for %.2f s", exc, self.counters.accept_errors,
                               self.open_connections(), self._backoff)
                self._pause(loop, lsock)
                return
            self._backoff = ACCEPT_BACKOFF_MIN_S
            conn.setblocking(False)
            task = loop.create_task(self._accepted(conn))
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)

    def _pause(self, loop: asyncio.AbstractEventLoop, lsock: socket.socket) -> None:
        loop.remove_reader(lsock.fileno())
        self.paused = True

        def resume() -> None:
            self.paused = False
            if lsock.fileno() >= 0 and lsock in self._listeners:
                loop.add_reader(lsock.fileno(), self._accept, lsock)

        loop.call_later(self._backoff, resume)
        self._backoff = min(self._backoff * 2, ACCEPT_BACKOFF_MAX_S)

    def adopt(self, conns: Sequence[Any]) -> None:
        """Serve connections accepted before the agent started (``launch`` holds its agent
        back while CMD starts and accepts the hooks' connections meanwhile: ``_socket``
        objects, made ``socket.socket`` here)."""
        loop = asyncio.get_running_loop()
        for raw in conns:
            conn = raw if isinstance(raw, socket.socket) else socket.socket(fileno=raw.detach())
            conn.setblocking(False)
            task = loop.create_task(self._accepted(conn))
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)

    async def _accepted(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=STREAM_LIMIT)
        except OSError:
            conn.close()
            return
        await self.handle(reader, writer)

    def stop(self) -> None:
        """Stop accepting (connections already open go on)."""
        loop = asyncio.get_running_loop()
        for lsock in self._listeners:
            try:
                loop.remove_reader(lsock.fileno())
            except (ValueError, OSError):
                pass
            lsock.close()
        self._listeners = []
        if self.server is not None:
            self.server.close()
