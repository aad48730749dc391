"""The agent's Unix socket: peer checks, framing, validation, acks, spool replay.

I/O shell around the pure :mod:`assemble` core. A hostile or broken peer costs one
connection, never the agent: oversized frames, slow senders, garbage and refused uids
are each counted. Who a producer is comes from the kernel (:mod:`identity`): SO_PEERCRED
for a connection, the owner for a spool file; a hello the kernel contradicts is refused.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import resource
import select
import socket
import stat
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

from infersight.agent.daemon.assemble import Assembler, Malformed, Producer
from infersight.agent.daemon.broadcast import Broadcaster
from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.identity import Peer, process_start, refusal
from infersight.agent.daemon.sanitize import decode_frame
from infersight.agent.errors import AgentError
from infersight.hooks import _paths, _wire
from infersight.settings import ConfigError

log = logging.getLogger("infersight.ingest")
UCRED = struct.Struct("3i")


class RateLimitedLog:
    """At most one line per ``every_s`` per key; says how many were suppressed."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.every_s:
            n = self._suppressed.pop(key, 0)
            suffix = " (%d similar suppressed)" % n if n else ""
            log.warning(msg + suffix, *args)
            self._last[key] = now
        else:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux; Python has no constant for it
MAX_GROUPS = 256


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer via SO_PEERCRED."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    pid, uid, gid = UCRED.unpack(raw)
    return pid, uid, gid


def peer_groups(sock: socket.socket) -> set[int]:
    """The peer's supplementary groups (SO_PEERGROUPS): producers reach the socket through
    membership of the agent's group, which SO_PEERCRED's primary gid does not show."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_GROUPS)
    except OSError:
        return set()
    n = len(raw) // 4
    return set(struct.unpack("%dI" % n, raw[: 4 * n]))


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
    except OSError as exc:
        raise UnsafeSocketDirError("cannot make the socket directory %s: %s" % (directory, exc)) from exc
    except ValueError as exc:
        raise UnsafeSocketDirError(
            "unsafe socket directory: %s. Remove it (or make it a directory of uid %d with mode "
            "0750 or stricter), or set agent.socket / INFERSIGHT_SOCKET to a path in a directory "
            "only the agent's user can write" % (exc, owner if owner is not None else os.geteuid())) from exc


# Connections beyond the cap that may still ask for ``status`` (each holds a descriptor
# for at most PROBATION_S); past this, new connections are closed at once.
STATUS_RESERVE = 32
PROBATION_S = 1.0
FD_HEADROOM = 64  # descriptors kept free for the spool, exporters and status probes
ACCEPT_BACKOFF_MIN_S = 0.05
ACCEPT_BACKOFF_MAX_S = 2.0
LOST_CHECK_S = (0.05, 0.2, 0.5, 1.0)  # a producer that hung up: is its process gone?
ERRNO_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
HAVE_PROC = os.path.isdir("/proc/self")
MAX_WATCHED = 256  # departed producers whose process is watched (one descriptor each)
# After a quiet producer's frame, quiet producers are not read for this long: a host of
# many wakes the agent once per window instead of once per frame, and at two of the hooks'
# batch delays (50 ms) each quiet producer's frames come in pairs: one read, one ack.
# The price: a quiet producer's events reach the exporters up to this much later (80 ms:
# quiet fleet ratio ~1.5x, where 50 ms gave 1.7-2.0x and 100 ms 1.3-1.5x on the 2-core VM).
# An urgent event is never held: the hook sends an OOM report at once (``emit_urgent``) and
# then rings the agent on a fresh connection (``{"t": "urgent"}``), which opens the gate.
GATE_S = 0.08
QUIET_FRAME_BYTES = 16 << 10  # a producer that sends this much within a window is busy: never held


def ack_frame(seq: int) -> bytes:
    """``encode_frame({"t": "ack", "seq": seq})``, formatted directly: one per frame read."""
    payload = b'{"t":"ack","seq":%d}' % seq
    return _wire.HEADER.pack(len(payload)) + payload


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def fd_limit() -> int:
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1 << 20
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class ReadDeadline:
    """One read deadline per connection, instead of a ``wait_for`` per frame.

    The read loop only notes where it is (waiting for a frame's header, inside a frame, or
    held back by the exporters) and since when: two attribute writes per frame. One timer
    per connection wakes at most every ``min(idle_s, frame_s)`` seconds; past the idle
    limit (between frames) or the frame limit (inside one) it counts the peer and aborts
    the transport, which ends the pending read."""

    __slots__ = ("expired", "frame_s", "handle", "idle_s", "ingest", "loop", "phase", "since", "transport")

    IDLE, FRAME, HELD = 0, 1, 2

    def __init__(self, ingest: Ingest, transport: asyncio.WriteTransport, idle_s: float | None) -> None:
        self.ingest = ingest
        self.loop = asyncio.get_running_loop()
        self.transport = transport
        self.idle_s = idle_s
        self.frame_s = ingest.frame_timeout_s
        self.phase = self.IDLE
        self.since = self.loop.time()
        self.expired = False
        self.handle: asyncio.TimerHandle | None = None
        self._arm(self._period())

    def _period(self) -> float:
        return self.frame_s if self.idle_s is None else min(self.idle_s, self.frame_s)

    def _arm(self, delay: float) -> None:
        self.handle = self.loop.call_later(max(delay, 0.001), self._check)

    def _check(self) -> None:
        self.handle = None
        if self.transport.is_closing():
            return None
        self.frame_s = self.ingest.frame_timeout_s  # a reload may change it
        limit = self.idle_s if self.phase == self.IDLE else self.frame_s if self.phase == self.FRAME else None
        if self.ingest.gate.holds(self.transport):
            limit = None  # the agent holds it (its read gate), not the peer
        now = self.loop.time()
        if limit is None or now - self.since < limit:
            left = self._period() if limit is None else limit - (now - self.since)
            return self._arm(min(left, self._period()))
        self.expired = True
        if self.phase == self.IDLE:  # silent beyond the idle timeout: the hook reconnects when it has news
            self.ingest.counters.idle_closed += 1
        else:
            self.ingest.counters.slow_peers += 1
            self.ingest._rlog.warn("slow", "peer too slow to send a frame; closing")
        self.transport.abort()
        return None

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class ReadGate:
    """Wake-up coalescing across quiet producers (interrupt moderation).

    On a loaded host a wake-up of the agent costs more than a small frame's work, and a
    fleet of quiet producers, each sending a few events per frame at its own time, wakes
    the agent once per frame. After a quiet producer's frame, while two or more quiet
    producers are connected, the gate stops reading from every quiet producer for
    ``window_s``; then their sockets are read together, in one wake-up. A producer that
    sent ``QUIET_FRAME_BYTES`` or more within a window (a busy one, or a backlog) is not
    held, a lone producer is not held (there is nothing to coalesce), and the gate costs
    nothing while nothing arrives: it closes only after a frame. What waits meanwhile waits
    in the socket: nothing is dropped, and the hold (milliseconds) is far inside the frame
    and idle timeouts."""

    __slots__ = ("_handle", "_held", "busy", "members", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # Each producer's transport -> [start, bytes] of its current window.
        self.members: dict[asyncio.ReadTransport, list[float]] = {}
        self.busy: set[asyncio.ReadTransport] = set()
        self._held: set[asyncio.ReadTransport] = set()
        self._handle: asyncio.TimerHandle | None = None

    @property
    def closed(self) -> bool:
        return self._handle is not None

    def holds(self, transport: asyncio.BaseTransport) -> bool:
        return transport in self._held

    def join(self, transport: asyncio.ReadTransport) -> None:
        self.members[transport] = [-1e9, 0.0]

    def leave(self, transport: asyncio.ReadTransport) -> None:
        self.members.pop(transport, None)
        self.busy.discard(transport)

    def frame(self, transport: asyncio.ReadTransport, size: int, now: float) -> None:
        """A frame of ``size`` bytes was read from ``transport`` at loop time ``now``."""
        recent = self.members.get(transport)
        if recent is None:
            return
        if now - recent[0] > self.window_s:
            recent[0], recent[1] = now, 0.0
        recent[1] += size
        if recent[1] >= QUIET_FRAME_BYTES:
            self.busy.add(transport)
            return
        self.busy.discard(transport)
        if self._handle is None and self.window_s > 0 and len(self.members) - len(self.busy) > 1:
            self._close()

    def _close(self) -> None:
        # Only transports that are reading: one its StreamReader paused (a full buffer)
        # stays the StreamReader's to resume.
        held = self._held
        for t in self.members:
            if t not in self.busy and t.is_reading():
                t.pause_reading()
                held.add(t)
        self._handle = asyncio.get_running_loop().call_later(self.window_s, self.open)

    def open(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        held, self._held = self._held, set()
        for t in held:
            if t in self.members and not t.is_closing() and not t.is_reading():
                t.resume_reading()


class Ingest:
    def __init__(
        self,
        assembler: Assembler,
        broadcaster: Broadcaster,
        counters: Counters,
        allowed_uids: set[int],
        allowed_gids: set[int],
        health: Callable[[], dict[str, Any]],
        frame_timeout_s: float = 10.0,
        max_connections: int = 1024,
        idle_timeout_s: float | None = 300.0,
        gate_s: float = GATE_S,
    ) -> None:
        self.assembler = assembler
        self.broadcaster = broadcaster
        self.counters = counters
        self.allowed_uids = allowed_uids
        self.allowed_gids = allowed_gids
        self.health = health
        self.frame_timeout_s = frame_timeout_s
        # Never more producers than the descriptor limit leaves room for.
        self.max_connections = max(1, min(max_connections, fd_limit() - FD_HEADROOM - STATUS_RESERVE))
        self.idle_timeout_s = idle_timeout_s or None
        self.gate = ReadGate(gate_s)
        self.server: asyncio.Server | None = None
        self.open_connections = 0
        self._uid_connections: dict[int, int] = {}  # open connections per peer uid
        self.max_connections_per_uid = max(1, self.max_connections // 4)
        self.pending_completions = 0
        self._conn_tasks: set[asyncio.Task[Any]] = set()
        self._rlog = RateLimitedLog()
        self._replaying: set[str] = set()  # spool files published but not yet exported
        self._listeners: list[socket.socket] = []  # our duplicates of the server's sockets
        self._accept_backoff = ACCEPT_BACKOFF_MIN_S
        self._accept_paused = False
        self._accepting: set[asyncio.Task[None]] = set()
        self._live: dict[str, int] = {}  # producer id -> open connections
        # Producers that hung up with a cold start still open: (producer, pid, start time).
        self._watch: dict[str, tuple[Producer, int, str]] = {}
        self._pidfds: dict[str, tuple[Producer, int]] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self.spool_dir: str | None = None  # the hooks' spool directory (agent.spool_dir)
        # A joined launch's subscription (sessions.Sessions.serve): (message, peer uid, reader, writer).
        self.subscribe: Callable[[dict[str, Any], int, asyncio.StreamReader, asyncio.StreamWriter],
                                 Awaitable[None]] | None = None

    # -- server ---------------------------------------------------------------------

    async def start(self, path: str, mode: int, sock: socket.socket | None = None) -> None:
        if sock is None:
            ensure_socket_dir(path)
            if os.path.lexists(path):  # noqa: ASYNC240 - startup, once
                os.unlink(path)  # a stale socket from a previous run
            old = os.umask(0o777 & ~mode & 0o777)
            try:
                self.server = await asyncio.start_unix_server(self._handle, path=path, limit=1 << 21)
            finally:
                os.umask(old)
            os.chmod(path, mode)
        else:  # socket activation: systemd owns the path and its mode
            self.server = await asyncio.start_unix_server(self._handle, sock=sock, limit=1 << 21)
        self._own_accept_loop()

    # -- accepting ------------------------------------------------------------------

    def _own_accept_loop(self) -> None:
        """Accept through our own loop instead of asyncio's: at EMFILE asyncio logs a traceback
        per attempt and keeps trying; ours counts, logs one line (rate-limited) and pauses
        accepting with a growing backoff."""
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
                    self._rlog.warn("accept", "accept failed: %s (%d accept errors so far)",
                                    exc, self.counters.accept_errors)
                    return
                self._rlog.warn("emfile", "cannot accept connections: %s (%d accept errors so far, %d open "
                                "connections); pausing accepts for %.2f s", exc, self.counters.accept_errors,
                                self.open_connections, self._accept_backoff)
                self._pause_accepting(loop, lsock)
                return
            self._accept_backoff = ACCEPT_BACKOFF_MIN_S
            conn.setblocking(False)
            task = loop.create_task(self._accepted(conn))
            self._accepting.add(task)
            task.add_done_callback(self._accepting.discard)

    def _pause_accepting(self, loop: asyncio.AbstractEventLoop, lsock: socket.socket) -> None:
        loop.remove_reader(lsock.fileno())
        self._accept_paused = True

        def resume() -> None:
            self._accept_paused = False
            if lsock.fileno() >= 0 and lsock in self._listeners:
                loop.add_reader(lsock.fileno(), self._accept, lsock)

        loop.call_later(self._accept_backoff, resume)
        self._accept_backoff = min(self._accept_backoff * 2, ACCEPT_BACKOFF_MAX_S)

    async def _accepted(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=1 << 21)
        except OSError:
            conn.close()
            return
        await self._handle(reader, writer)

    async def stop_accepting(self) -> None:
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

    async def wait_connections_closed(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.open_connections and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        self.sweep_lost()  # close the cold starts of producers that died just before
        self.release()
        return self.open_connections == 0

    def close_connections(self) -> None:
        for t in list(self._conn_tasks):
            t.cancel()
        if self._watch_task is not None:
            self._watch_task.cancel()

    def release(self) -> None:
        """Close the descriptors that watch departed producers (at shutdown)."""
        for producer_id in list(self._pidfds):
            self._unwatch(producer_id)

    # -- producers that went away -----------------------------------------------------

    def _producer_left(self, producer: Producer, pid: int, start: str | None) -> None:
        """A producer's connection closed. If its cold start is still open, find out whether
        its process has ended (a pidfd, which works even where /proc hides other users'
        processes; else /proc polling) and then close that cold start for it."""
        n = self._live.get(producer.id, 1) - 1
        if n > 0:
            self._live[producer.id] = n
            return None
        self._live.pop(producer.id, None)
        if pid <= 0 or producer.gone:
            return None  # cannot tell whether it lives: keep its state (bounded) for a reconnect
        if not self.assembler.awaits_end(producer):
            return None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return self._publish_lost(producer)
        except (OSError, AttributeError):  # no pidfds here: poll /proc
            return self._watch_by_proc(producer, pid, start)
        if _readable(fd):  # it has exited (a zombie)
            os.close(fd)
            return self._publish_lost(producer)
        self._unwatch(producer.id)
        if len(self._pidfds) >= MAX_WATCHED:
            self._unwatch(next(iter(self._pidfds)))
        self._pidfds[producer.id] = (producer, fd)
        asyncio.get_running_loop().add_reader(fd, self._process_ended, producer.id)
        return None

    def _process_ended(self, producer_id: str) -> None:
        entry = self._pidfds.get(producer_id)
        self._unwatch(producer_id)
        if entry is not None and producer_id not in self._live:
            self._publish_lost(entry[0])

    def _unwatch(self, producer_id: str) -> None:
        self._watch.pop(producer_id, None)
        entry = self._pidfds.pop(producer_id, None)
        if entry is not None:
            try:
                asyncio.get_running_loop().remove_reader(entry[1])
            except RuntimeError:  # no loop any more
                pass
            os.close(entry[1])

    def _watch_by_proc(self, producer: Producer, pid: int, start: str | None) -> None:
        if not HAVE_PROC or start is None:
            return
        if len(self._watch) >= MAX_WATCHED:
            self._watch.pop(next(iter(self._watch)))
        self._watch[producer.id] = (producer, pid, start)
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_lost(), name="ingest-lost")

    async def _watch_lost(self) -> None:
        """A process's socket closes while it exits: look again shortly after, then every second."""
        for delay in (*LOST_CHECK_S, *([1.0] * 1000000)):
            await asyncio.sleep(delay)
            self.sweep_lost()
            if not self._watch:
                return

    def sweep_lost(self) -> int:
        """Producers found dead: close their open cold start and free their state."""
        done = 0
        for producer_id, (_producer, fd) in list(self._pidfds.items()):
            if _readable(fd):
                self._process_ended(producer_id)
                done += 1
        for producer_id, (producer, pid, start) in list(self._watch.items()):
            if producer.id in self._live:  # it reconnected
                del self._watch[producer_id]
                continue
            if process_start(pid) == start:
                continue
            del self._watch[producer_id]
            self._publish_lost(producer)
            done += 1
        return done

    def _publish_lost(self, producer: Producer, replay: bool = True) -> None:
        """Its process has ended. What it spooled (its root, often: written at exit when the
        agent was busy) is read first, so that the agent closes its root only if it really
        never came."""
        if replay and self.spool_dir and not producer.gone:
            self.replay_spools(self.spool_dir, producer.id + "-")
        items = self.assembler.producer_lost(producer)
        if items:
            self.counters.items_out += len(items)
            self.broadcaster.publish(items)

    def connected(self, producer_id: str) -> bool:
        """The producer has a connection open now."""
        return self._live.get(producer_id, 0) > 0

    def allowed(self, uid: int, gid: int) -> bool:
        return uid in self.allowed_uids or gid in self.allowed_gids

    # -- one connection -------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conn_tasks.add(task)
        self.open_connections += 1
        self.counters.connections += 1
        try:
            await self._serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the producer went away; its unacked events come back on reconnect
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("connection handler failed")
        finally:
            self.open_connections -= 1
            if task is not None:
                self._conn_tasks.discard(task)
            writer.close()

    async def _read_frame(
        self, reader: asyncio.StreamReader, idle_ok: bool, timeout_s: float | None = None
    ) -> bytes | None:
        """One payload; None after counting an oversized or slow frame. The header may take
        up to the idle timeout (``idle_ok``) or ``timeout_s``; TimeoutError past that."""
        wait = self.idle_timeout_s if idle_ok else (timeout_s or self.frame_timeout_s)
        if wait is None:
            hdr = await reader.readexactly(_wire.HEADER.size)
        else:
            hdr = await asyncio.wait_for(reader.readexactly(_wire.HEADER.size), wait)
        (n,) = _wire.HEADER.unpack(hdr)
        if n > _wire.MAX_FRAME_BYTES:
            self.counters.oversized_frames += 1
            self._rlog.warn("oversized", "peer sent a %d-byte frame (max %d); closing", n, _wire.MAX_FRAME_BYTES)
            return None
        try:
            return await asyncio.wait_for(reader.readexactly(n), self.frame_timeout_s)
        except TimeoutError:
            self.counters.slow_peers += 1
            self._rlog.warn("slow", "peer too slow to send a frame; closing")
            return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        pid, uid, gid = peer_credentials(sock)
        if not self.allowed(uid, gid) and not (peer_groups(sock) & self.allowed_gids):
            self.counters.refused_peers += 1
            self._rlog.warn("uid", "refused peer pid %d uid %d gid %d (not in the allow list)", pid, uid, gid)
            writer.write(_wire.encode_frame({"t": "refuse", "schema": _wire.SCHEMA_VERSION,
                                             "error": "uid %d is not allowed" % uid}))
            await writer.drain()
            return
        n = self._uid_connections[uid] = self._uid_connections.get(uid, 0) + 1
        try:
            await self._serve_peer(reader, writer, pid, uid, n)
        finally:
            if self._uid_connections[uid] <= 1:
                del self._uid_connections[uid]
            else:
                self._uid_connections[uid] -= 1

    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int, uid: int,
                          n_of_uid: int) -> None:
        # Over the cap, a connection may still ask for status (the health probe must work
        # under a flood), but only briefly, and only so many at once. One uid (root aside) may
        # hold a quarter of the connections: another user's flood leaves room for yours.
        over = self.open_connections - self.max_connections
        by_uid = False  # over this uid's share, not the total
        if uid != 0 and n_of_uid > self.max_connections_per_uid:
            by_uid = over <= 0
            over = max(over, n_of_uid - self.max_connections_per_uid)

        def closed_over() -> None:
            self.counters.over_capacity += 1
            if by_uid:
                self.counters.over_uid_budget += 1
        if over > STATUS_RESERVE:
            closed_over()
            self._rlog.warn("cap", "connection limit (%d) reached: closing new connections", self.max_connections)
            return
        try:
            payload = await self._read_frame(reader, idle_ok=False,
                                             timeout_s=PROBATION_S if over > 0 else self.frame_timeout_s)
        except TimeoutError:
            if over > 0:
                closed_over()
            else:
                self.counters.slow_peers += 1
            return
        if payload is None:
            return
        msg = decode_frame(payload)
        if msg is None:
            self.counters.malformed_frames += 1
            self._rlog.warn("frame", "peer pid %d sent a frame that is not a JSON object", pid)
            return
        if msg.get("t") == "status":
            writer.write(_wire.encode_frame({"t": "health", **self.health()}))
            await writer.drain()
            return
        if msg.get("t") == "subscribe" and self.subscribe is not None and over <= 0:
            await self.subscribe(msg, uid, reader, writer)
            return
        if msg.get("t") == "urgent":  # a producer sent an urgent frame (an OOM): read everyone now
            self.counters.urgent_wakeups += 1
            self.gate.open()
            return
        if over > 0:  # no reply: the hook retries later (a refusal would make it stop trying)
            closed_over()
            self._rlog.warn("cap", "connection limit (%d) reached: closing new connections", self.max_connections)
            return
        producer = self._hello(msg, writer, Peer(uid, pid))
        if producer is None:
            await writer.drain()
            return
        self._live[producer.id] = self._live.get(producer.id, 0) + 1
        self._unwatch(producer.id)  # it is back: alive
        started = process_start(pid) if pid > 0 and HAVE_PROC else None  # tells a reused pid later
        try:
            await self._serve_producer(producer, reader, writer)
        finally:
            self._producer_left(producer, pid, started)

    async def _serve_producer(
        self, producer: Producer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(_wire.encode_frame({"t": "welcome", "schema": _wire.SCHEMA_VERSION}))
        acks: deque[list[int]] = deque()  # [last seq, done]
        state = {"acked": 0}

        def send_acks() -> None:
            last = 0
            while acks and acks[0][1]:
                last = acks.popleft()[0]
            if last > state["acked"] and not writer.is_closing():
                state["acked"] = last
                writer.write(ack_frame(last))

        deadline = ReadDeadline(self, writer.transport, self.idle_timeout_s)
        transport = cast(asyncio.Transport, writer.transport)
        self.gate.join(transport)
        try:
            await self._producer_loop(producer, reader, writer, deadline, acks, send_acks)
        except (asyncio.IncompleteReadError, ConnectionError):
            if not deadline.expired:
                raise
        finally:
            self.gate.leave(transport)
            deadline.cancel()

    async def _producer_loop(
        self, producer: Producer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
        deadline: ReadDeadline, acks: deque[list[int]], send_acks: Callable[[], None],
    ) -> None:
        loop = deadline.loop
        broadcaster = self.broadcaster
        readexactly = reader.readexactly
        gate, transport = self.gate, cast(asyncio.Transport, writer.transport)
        while True:
            if broadcaster.congested:  # an exporter is full: its acks are held, and so is our reading
                deadline.phase = ReadDeadline.HELD
                await broadcaster.wait_ready()
            deadline.phase, deadline.since = ReadDeadline.IDLE, loop.time()
            hdr = await readexactly(_wire.HEADER.size)
            (n,) = _wire.HEADER.unpack(hdr)
            if n > _wire.MAX_FRAME_BYTES:
                self.counters.oversized_frames += 1
                self._rlog.warn("oversized", "peer sent a %d-byte frame (max %d); closing", n, _wire.MAX_FRAME_BYTES)
                return
            deadline.phase, deadline.since = ReadDeadline.FRAME, loop.time()
            payload = await readexactly(n)
            gate.frame(transport, n, deadline.since)
            msg = decode_frame(payload)
            if msg is None or msg.get("t") != "b":
                self.counters.malformed_frames += 1
                self._rlog.warn("frame", "producer %s sent a malformed frame", producer.id)
                continue
            self.process_batch(producer, msg.get("e"), acks, send_acks)
            if writer.transport.get_write_buffer_size() > 1 << 20:
                deadline.phase = ReadDeadline.HELD  # as before: no limit on a peer reading its acks
                await writer.drain()

    def _hello(
        self, msg: dict[str, Any], writer: asyncio.StreamWriter | None, peer: Peer | None = None
    ) -> Producer | None:
        """The producer of a hello from ``peer`` (None: in-process, trusted); None when refused."""
        def refuse(error: str) -> None:
            if writer is not None:
                writer.write(_wire.encode_frame({"t": "refuse", "schema": _wire.SCHEMA_VERSION, "error": error}))

        if msg.get("t") != "hello":
            self.counters.malformed_frames += 1
            refuse("expected a hello frame first")
            return None
        schema = msg.get("schema")
        if schema != _wire.SCHEMA_VERSION:
            self.counters.refused_schema += 1
            err = "this agent speaks event schema %d, the producer speaks %r: upgrade the older side" % (
                _wire.SCHEMA_VERSION, schema)
            self._rlog.warn("schema", "%s", err)
            refuse(err)
            return None
        raw = msg.get("producer")
        if peer is not None and isinstance(raw, dict) and isinstance(raw.get("id"), str) \
                and type(raw.get("pid")) is int:
            why = refusal(raw["id"], raw["pid"], peer)
            if why is not None:
                self.counters.refused_identity += 1
                self._rlog.warn("identity", "refused a hello from uid %d: %s", peer.uid, why)
                refuse("identity refused: %s" % why)
                return None
        try:
            return self.assembler.hello(raw, None if peer is None else peer.uid)
        except Malformed as exc:
            self.counters.malformed_frames += 1
            self._rlog.warn("hello", "malformed hello: %s", exc)
            refuse("malformed hello: %s" % exc)
            return None

    def process_batch(
        self,
        producer: Producer,
        events: Any,
        acks: deque[list[int]] | None = None,
        send_acks: Callable[[], None] | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        before_bad, before_dup, before_n = producer.malformed, producer.seq.duplicates, producer.events
        before_vanished = producer.spool_vanished
        items = self.assembler.events(producer, events)
        if producer.spool_vanished > before_vanished:
            self.counters.spool_files_vanished += producer.spool_vanished - before_vanished
            self._rlog.warn("vanished", "producer %s: someone removed its spool file (%d so far; the hook "
                            "rescued what it held)", producer.id, producer.spool_vanished)
        self.counters.malformed_events += producer.malformed - before_bad
        self.counters.duplicates += producer.seq.duplicates - before_dup
        self.counters.events_in += producer.events - before_n
        if producer.malformed > before_bad:
            self._rlog.warn("event", "producer %s sent malformed events (counted, dropped)", producer.id)
        self.counters.items_out += len(items)
        last = 0
        if isinstance(events, list):
            for ev in events:
                if isinstance(ev, list) and ev and isinstance(ev[0], int) and not isinstance(ev[0], bool):
                    last = max(last, ev[0])
        entry = [last, 0]
        if acks is not None:
            acks.append(entry)
        self.pending_completions += 1

        def done() -> None:
            self.pending_completions -= 1
            entry[1] = 1
            if send_acks is not None:
                send_acks()
            if on_done is not None:
                on_done()

        self.broadcaster.publish(items, done)

    # -- spool replay -----------------------------------------------------------------

    def replay_spools(self, directory: str, prefix: str = "") -> int:
        """Replay spool files whose producer has died (its lock is free); returns files done.

        Whoever may write the directory (its group, by design) is not trusted with our
        reads and unlinks: names are opened relative to the directory without following a
        symlink or blocking on a FIFO, only a regular file with one link is read, and it is
        unlinked only if the name still holds that same file."""
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return 0
        try:
            names = sorted(n for n in os.listdir(dfd) if n.endswith(".spool") and n.startswith(prefix))
            return sum(1 for name in names if self._replay_one(directory, dfd, name))
        except OSError:
            return 0
        finally:
            os.close(dfd)

    def _replay_one(self, directory: str, dfd: int, name: str) -> bool:
        path = os.path.join(directory, name)
        if path in self._replaying:
            return False
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except OSError:
            return False  # gone, or a symlink (ELOOP)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                self.counters.spool_files_refused += 1
                self._rlog.warn("spool", "not replaying %s: not a regular file with one link", path)
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # its producer is alive and replays it itself
            if not self.allowed(st.st_uid, st.st_gid):
                self.counters.spool_files_refused += 1
                self._rlog.warn("spool", "not replaying %s: owner uid %d is not allowed", path, st.st_uid)
                return False
            data = b""
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                data += chunk
            frames, _rest, bad = _wire.split_frames(data)
            if bad:
                self.counters.oversized_frames += 1
            producer: Producer | None = None
            self._replaying.add(path)
            outstanding = [1]  # batches not yet complete, +1 until all are published
            identity = (st.st_dev, st.st_ino)

            def one_done() -> None:
                outstanding[0] -= 1
                if outstanding[0] == 0:  # every exporter has it: now the file may go
                    self._replaying.discard(path)
                    unlink_if_same(directory, name, identity)

            for payload in frames:
                msg = decode_frame(payload)
                if msg is None:
                    self.counters.malformed_frames += 1
                    continue
                if producer is None:
                    producer = self._hello(msg, None, Peer(st.st_uid, None))
                    if producer is None:
                        break
                    continue
                if msg.get("t") == "b":
                    outstanding[0] += 1
                    self.process_batch(producer, msg.get("e"), on_done=one_done)
                else:
                    self.counters.malformed_frames += 1
            self.counters.spool_files_replayed += 1
            if producer is not None and producer.id not in self._live:
                self._publish_lost(producer, replay=False)  # its lock was free: the process has ended
            one_done()
            return True
        finally:
            os.close(fd)


def unlink_if_same(directory: str, name: str, identity: tuple[int, int]) -> None:
    """Unlink ``directory/name`` only if it is still the file we read (device, inode)."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(name, dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
