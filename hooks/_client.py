"""The producer side: a bounded buffer drained by a daemon thread to the agent's socket.

Guarantees to the host process: ``emit`` never blocks (a deque append under the GIL),
never raises, and costs well under a microsecond or two (past the spill mark, in a burst,
it also offers the GIL to the drain thread: see ``_yield``). All I/O happens on the drain
thread, which sends in batches: once ``batch_events`` are queued or the oldest queued
event is ``batch_delay_s`` old, whichever comes first (``flush``, fork and exit do not
wait), so a quiet process sends a few frames a second rather than one per event. When
the agent cannot keep up and the buffer fills past half, the drain thread spills batches
to the spool (the same file as for an absent agent) and replays them as the agent catches
up; events are dropped (and counted) only when the spool is full too.

Delivery is at-least-once: frames stay in ``_outbox`` until the agent acks them, and
are resent after a reconnect. While the agent is away, batches go to a
bounded spool file that is replayed (by this thread on reconnect, or by the agent if
this process has died). Every event gets a sequence number when it is emitted, so
anything dropped on a full buffer or spool shows up as a gap the agent counts, and the
drop counters reach the agent in a ``drops`` event once it is reachable.

Local users are not trusted: in a per-user fallback location (``/tmp/infersight-<uid>``),
the socket's directory must pass ``_paths.check_socket_dir`` and the peer must run as its
owner, root or us; the spool file is created
fresh (``O_EXCL|O_NOFOLLOW``, an unguessable name) in a directory opened without following
a symlink, and is truncated and unlinked only through our own descriptors.
"""

from __future__ import annotations

# The C socket type, not the ``socket`` module: same methods, without ~7 ms of imports
# (selectors, enum) on the host's start-up path. Everything the drain thread uses is
# imported here, on the main thread: a first import on a daemon thread can race the
# host's own imports or interpreter shutdown.
import _socket
import errno  # already loaded at start-up
import fcntl
import itertools
import os
import stat
import struct  # already loaded by _wire
import sys
import threading
import time
from _collections import deque  # the C type; the collections module costs ~2.5 ms

from . import _env, _paths, _wire

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

# ~516 B per buffered log event with attributes: 131072 events bound the buffer near 64 MiB.
MAX_BUFFER_EVENTS = 131072
MAX_BATCH_EVENTS = 512  # per frame: bounds a frame well under _wire.MAX_FRAME_BYTES
WRITE_FRAMES = 16  # frames per write or send, at most, while the buffer is long
WRITE_FRAMES_PRESSED = 64  # ... and past the spill mark (~3 MiB of log events a write)
BATCH_EVENTS: int = _env.VARS["INFERSIGHT_BATCH_EVENTS"].default  # send once this many are queued
BATCH_DELAY_S: float = _env.VARS["INFERSIGHT_BATCH_DELAY_MS"].default / 1e3  # ... or once the oldest is this old
MAX_OUTBOX_BYTES = 16 << 20
DEFAULT_SPOOL_MAX_BYTES: int = _env.VARS["INFERSIGHT_SPOOL_MAX_BYTES"].default
SEND_TIMEOUT_S = 2.0
URGENT_FRAME = _wire.encode_frame({"t": "urgent"})
IDLE_WAIT_S = 0.2
RECONNECT_MAX_S = 5.0
SPOOL_RETRY_S = 5.0  # after a spool error, batches are dropped (and counted) this long before a retry
EXIT_LOCK_WAIT_S = 1.0  # at exit, how long to wait for a drain thread stuck in I/O


def _say(msg: str) -> None:
    try:
        sys.stderr.write("infersight: %s\n" % msg)
        sys.stderr.flush()
    except Exception:
        pass


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until done; a short write that cannot finish raises OSError."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError("short write")
        view = view[n:]


def _yield() -> None:
    """Past the spill mark, each emit offers the GIL to the drain thread. A host thread in
    a tight loop otherwise holds it for whole switch intervals while the drain thread,
    which gives it up at every write, falls behind and the buffer overflows. This waits
    at most for the drain thread's turn (a switch interval), and only while the buffer is
    more than half full: a burst is absorbed, at the burst's own pace, instead of dropped."""
    time.sleep(0)


# kind -> build(*args): the dict of an event queued flat, ``(seq, t_ns, kind, *args)``
# (``hooks.stage``, ``hooks.request``): the caller's thread allocates one tuple of its
# atomic values, which the garbage collector stops tracking at its first pass, and this
# thread builds the dict.
builders: Dict[str, Callable[..., Dict[str, Any]]] = {}

# The last value of a flat event whose attributes dict waits in ``Client.held`` under the
# event's sequence number: one dict store instead of flattening the dict on the caller's
# thread. A bare ``object()``: unique, and (no GC type) it lets the tuple be untracked too.
HELD = object()


def _built(event: Tuple[Any, ...], held: Dict[int, Dict[str, Any]]) -> Optional[_wire.Event]:
    """The event with its data built: a queued event is ``(seq, t_ns, kind, data)`` with
    ``data`` a dict, or ``(seq, t_ns, kind, *args)`` (more than four items) for
    ``builders[kind]``, its last value ``HELD`` when its attributes wait in ``held``; None
    if building it failed."""
    if len(event) == 4:
        return event  # type: ignore[return-value]
    try:
        args = event[3:]
        if args[-1] is HELD:
            attrs = held.pop(event[0])  # a KeyError drops and counts it, as any failure to build
            args = (*args[:-1], *attrs, *attrs.values())  # as if queued flat
        return (event[0], event[1], event[2], builders[event[2]](*args))
    except Exception:
        return None


def _user_events(events: List[_wire.Event]) -> int:
    """Events that count as lost when this batch is: our own ``drops`` reports do not."""
    return sum(1 for e in events if e[2] != "drops")


class Client:
    """One per process (re-created in a forked child)."""

    def __init__(
        self,
        socket_path: str,
        spool_dir: str,
        producer: Dict[str, Any],
        max_buffer: int = MAX_BUFFER_EVENTS,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        batch_events: int = BATCH_EVENTS,
        batch_delay_s: float = BATCH_DELAY_S,
    ) -> None:
        self.socket_path = socket_path
        self._socket_owner = _paths.fallback_owner(socket_path)  # None: a path used as given
        self.spool_dir = spool_dir
        self.producer = producer
        self.max_buffer = max_buffer
        self.spool_max_bytes = spool_max_bytes
        self.batch_events = max(1, batch_events)
        self.batch_delay_s = max(0.0, batch_delay_s)
        # Past this fill the drain thread spills to the spool rather than wait on the agent.
        self.spill_at = max(1, max_buffer // 2)
        # Lengths at which an append needs no wake-up, spill or drop, so the callers of
        # ``queue`` append to ``_buf`` directly, without a call: ``0 < n < calm`` (a batch
        # filling) and ``calm_from <= n < calm_to`` (past a full batch, which already woke
        # the drain thread, and below the spill mark: a burst the drain thread is pumping).
        self.calm = min(self.batch_events, self.spill_at) - 1
        self.calm_from = self.batch_events
        self.calm_to = self.spill_at - 1
        self.spilled_events = 0
        self.enabled = True
        self._buf: Deque[Tuple[Any, ...]] = deque()  # _wire.Event, or flat for builders
        self.held: Dict[int, Dict[str, Any]] = {}  # seq -> attributes of a queued ``HELD`` event
        self._seq = itertools.count(1)
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._hurry = False  # flush, fork or exit: send now, do not wait for a full batch
        self._urgent = False  # an urgent event (an OOM) is queued: ring the agent once it is sent
        self.urgent_rings = 0
        self._lock = threading.Lock()  # guards connection + spool state for flush()
        # Counters reported to the agent in "drops" events and at exit.
        self.dropped_buffer = 0
        self.dropped_spool = 0
        self.spool_vanished = 0  # our spool file was removed by someone else (its frames were rescued)
        self._reported_vanished = 0
        self._reported_buffer = 0
        self._reported_spool = 0
        self._warned_loss = False
        self._warned_socket = ""
        self.sent_events = 0
        self.sent_frames = 0
        # Connection state (drain thread only).
        self._sock: Optional[Any] = None  # a _socket.socket
        self._rx = b""
        self._refused = False
        self._next_attempt = 0.0
        self._backoff = 0.05
        self._outbox: Deque[Tuple[int, int, bytes]] = deque()  # (last seq, events, frame)
        self._outbox_bytes = 0
        self.acked = 0
        # Spool state: our file and the directory it is in, both held open while in use.
        self._spool_fd: Optional[int] = None
        self._spool_dir_fd: Optional[int] = None
        self._spool_name = ""
        self._spool_size = 0
        self._spool_read = 0
        self._spool_head = 0  # the hello: what the agent must read before our frames
        self._spool_retry_at = 0.0  # monotonic: no spool writes before this, after an error
        self._spool_error = ""
        self._thread = threading.Thread(target=self._run, name="infersight-drain", daemon=True)
        self._thread.start()

    @property
    def spool_path(self) -> str:
        return os.path.join(self.spool_dir, self._spool_name) if self._spool_name else ""

    # -- hot path -------------------------------------------------------------------

    def emit(self, kind: str, data: Any) -> None:
        """Queue one event; ``data`` is a dict, or ``(build, args)`` for the drain thread to
        call: ``build(*args)`` returns the dict (work moved off the caller's thread)."""
        seq = next(self._seq)
        buf = self._buf
        n = len(buf)
        if n >= self.max_buffer:
            self.dropped_buffer += 1
            return
        buf.append((seq, time.time_ns(), kind, data))
        # Wake the drain thread at the first event of a batch (it starts the delay), when
        # the batch is full, and at the spill mark: a few times per batch, not per event.
        if n == 0 or n + 1 == self.batch_events or n + 1 == self.spill_at:
            self._wake.set()
        elif n >= self.spill_at:
            _yield()  # a burst: let the drain thread spill rather than drop (see _yield)

    def queue(self, event: Tuple[Any, ...]) -> None:
        """Queue an event built by the caller, sequence number included: ``(seq, t_ns, kind,
        *args)`` for ``builders[kind]``. The caller appends to ``_buf`` itself while its
        length is in a calm range (see ``calm``: nothing to wake, spill or drop) and calls
        this otherwise."""
        buf = self._buf
        n = len(buf)
        if n >= self.max_buffer:
            self.dropped_buffer += 1
            return
        buf.append(event)
        if n == 0 or n + 1 == self.batch_events or n + 1 == self.spill_at:
            self._wake.set()
        elif n >= self.spill_at:
            _yield()

    def hurry(self) -> None:
        """Send what is queued now, without waiting for a full batch (never blocks)."""
        self._hurry = True
        self._wake.set()

    def urgent(self) -> None:
        """``hurry``, and once what is queued is sent, ring the agent's doorbell: a one-frame
        connection (``{"t": "urgent"}``) that makes the agent read every producer at once,
        so an OOM report is never held by its read gate (which pauses quiet producers'
        connections to coalesce wake-ups). Never blocks."""
        self._urgent = True
        self.hurry()

    def _ring(self) -> None:
        """The doorbell: a non-blocking connect and send on a fresh connection; any failure
        is ignored (the report itself is on its way regardless)."""
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.connect(self.socket_path)
            sock.send(URGENT_FRAME)
            self.urgent_rings += 1
        except OSError:
            pass
        finally:
            sock.close()

    # -- control --------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything emitted so far was sent and acked, or spooled (or counted)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._buf and not self._outbox and self._idle.is_set():
                return True
            self.hurry()
            time.sleep(0.005)
        return False

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush within the time limit, then spool whatever is left (at exit)."""
        try:
            self.flush(timeout_s)
        finally:
            self._stop = True
            self._wake.set()
            self._thread.join(timeout=1.0)
            # A drain thread stuck in I/O holds the lock: do not wait on it past a bound.
            connected, unreported = self._sock is not None, self._unreported()
            if self._lock.acquire(timeout=EXIT_LOCK_WAIT_S):
                try:
                    self._spool_retry_at = 0.0  # one last try, whatever failed before
                    if unreported:
                        self._report_drops()  # the spool carries the count to the agent
                    self._spool_leftovers()
                finally:
                    self._lock.release()
            else:
                self.dropped_buffer += _user_events(list(self._buf)) + sum(n for _l, n, _f in list(self._outbox))
            lost = self.dropped_buffer + self.dropped_spool
            if lost and (not connected or unreported or self._unreported()):
                _say("%d event(s) lost in this process (%d on a full buffer, %d that could not be "
                     "spooled)" % (lost, self.dropped_buffer, self.dropped_spool))

    def _unreported(self) -> bool:
        return (self.dropped_buffer != self._reported_buffer or self.dropped_spool != self._reported_spool
                or self.spool_vanished != self._reported_vanished)

    def _report_drops(self) -> None:
        """Queue a ``drops`` event with the counts so far (outside the buffer bound: it is
        one per pump at most, and only queued when something can carry it)."""
        b, s, v = self.dropped_buffer, self.dropped_spool, self.spool_vanished
        self._reported_buffer, self._reported_spool, self._reported_vanished = b, s, v
        data = {"buffer": b, "spool": s, "vanished": v} if v else {"buffer": b, "spool": s}
        self._buf.append((next(self._seq), time.time_ns(), "drops", data))

    def _lose(self, n_events: int, why: str) -> None:
        """Count events that could be neither sent nor spooled; say so once."""
        self.dropped_spool += n_events
        if n_events and not self._warned_loss:
            self._warned_loss = True
            agent = ("falls behind a burst" if self._sock is not None else "is not reachable")
            _say("cannot spool events (%s) and the agent at %s %s: events are dropped and "
                 "counted; the count goes to the agent" % (why, self.socket_path, agent))

    # -- drain thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                if not self._buf:
                    self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                self._gather()
                self._hurry = False
                urgent, self._urgent = self._urgent, False  # queued before the flag was set
                with self._lock:
                    if self._stop:
                        break  # close() holds the buffer now: it spools what is left
                    self._idle.clear()
                    self._pump()
                    if urgent and self._sock is not None:
                        self._ring()
                    if not self._buf:
                        self._idle.set()
        except Exception as exc:  # fail open: never take the host down
            self.enabled = False
            if not sys.is_finalizing():  # at interpreter shutdown, stay quiet
                _say("hook drain thread disabled: %r" % (exc,))
            self._idle.set()

    def _gather(self) -> None:
        """Wait until a batch is full, or its oldest event is ``batch_delay_s`` old."""
        buf, delay = self._buf, self.batch_delay_s
        while not self._hurry and not self._stop and 0 < len(buf) < self.batch_events:
            try:
                oldest_ns = buf[0][1]
            except IndexError:
                return
            left = min(delay, delay - (time.time_ns() - oldest_ns) / 1e9)  # bounded if the clock jumps
            if left <= 0:
                return
            self._wake.wait(left)
            self._wake.clear()

    def _pressed(self) -> bool:
        """The buffer is past the spill mark: move it to disk rather than wait on the agent."""
        return len(self._buf) >= self.spill_at

    def _pump(self) -> None:
        if self._sock is None and not self._refused:
            self._try_connect()
        if self._sock is not None:
            self._read_acks()
            if self._spool_pending():
                self._replay_spool()
            # Drops are reported only where they cannot be dropped again (a report that is
            # itself dropped would be one more drop to report: a spin).
            if self._sock is not None and not self._spool_pending() and self._unreported():
                self._report_drops()
        while self._buf:
            if self._stop:
                return  # close() takes over the buffer (it spools what is left): free the lock
            pressed = self._pressed()
            if self._sock is not None and self._outbox_bytes >= MAX_OUTBOX_BYTES and not pressed:
                self._read_acks(block=True)
                if self._outbox_bytes >= MAX_OUTBOX_BYTES and not self._pressed():
                    return  # congested: leave events buffered until the spill mark
                pressed = self._pressed()
            # Several frames per write while the buffer is long: each write or send gives
            # the GIL to a busy host thread, and getting it back takes a switch interval.
            group: List[Tuple[int, int, bytes]] = []
            users: List[int] = []
            while self._buf and len(group) < (WRITE_FRAMES_PRESSED if pressed else WRITE_FRAMES):
                events = self._take(MAX_BATCH_EVENTS)
                if events:
                    group.append((events[-1][0], len(events), _wire.encode_batch(events)))
                    users.append(_user_events(events))
            if not group:
                continue
            if self._sock is not None and not self._spool_pending() and (not pressed or not self._spool_usable()):
                self._send_group(group)
            else:
                self._spool_group(group, users)
        if self._sock is not None:
            self._read_acks()

    def _take(self, limit: int) -> List[_wire.Event]:
        """Up to ``limit`` events off the buffer, built (one that fails to build is dropped
        and counted: its sequence number shows the gap)."""
        buf = self._buf
        pop = buf.popleft
        events = [pop() for _ in range(min(limit, len(buf)))]  # only this thread pops
        held = self.held
        for i, ev in enumerate(events):
            if len(ev) != 4:
                events[i] = _built(ev, held)  # type: ignore[assignment]
        if None in events:
            self.dropped_buffer += events.count(None)  # type: ignore[arg-type]
            events = [ev for ev in events if ev is not None]
        return events

    def _spool_group(self, group: List[Tuple[int, int, bytes]], users: List[int]) -> None:
        """Spool frames in one write if they fit, else one by one (what fits is kept)."""
        data = b"".join(entry[2] for entry in group)
        if len(group) > 1 and self._spool_size + len(data) > self.spool_max_bytes:
            for i, entry in enumerate(group):  # (zip(strict=) is 3.10+)
                if self._spool_write(entry[2], users[i]) and self._sock is not None:
                    self.spilled_events += entry[1]
            return
        if self._spool_write(data, sum(users)) and self._sock is not None:
            self.spilled_events += sum(entry[1] for entry in group)  # a later pump replays it, in order

    def _send_group(self, group: List[Tuple[int, int, bytes]]) -> None:
        """Send frames in one write; each stays in the outbox until acked."""
        if len(group) == 1:
            self._send(*group[0])
            return
        for entry in group:
            self._outbox.append(entry)
            self._outbox_bytes += len(entry[2])
        assert self._sock is not None
        try:
            self._sock.sendall(b"".join(entry[2] for entry in group))
            self.sent_events += sum(entry[1] for entry in group)
            self.sent_frames += len(group)
        except OSError:
            self._disconnect()

    def _send(self, last_seq: int, n_events: int, frame: bytes) -> None:
        self._outbox.append((last_seq, n_events, frame))
        self._outbox_bytes += len(frame)
        assert self._sock is not None
        try:
            self._sock.sendall(frame)
            self.sent_events += n_events
            self.sent_frames += 1
        except OSError:
            self._disconnect()

    def _agent_uids(self) -> Optional[Tuple[int, ...]]:
        """The uids the agent may run as (empty: not checked, a path the operator chose), or
        None when the socket is to be taken as absent: missing, or in an unsafe directory."""
        owner = self._socket_owner
        if owner is None:
            return ()
        uid = os.geteuid()
        try:
            _paths.check_socket_dir(os.path.dirname(os.path.abspath(self.socket_path)), owner)
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            return None  # no agent (yet): quietly spool
        except (OSError, ValueError) as exc:
            self._warn_socket(str(exc))
            return None
        uids = (uid, 0, owner)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in uids:
            self._warn_socket("%s is not a socket of uid %s" % (self.socket_path, " or ".join(
                str(u) for u in sorted(set(uids)))))
            return None
        return uids

    def _warn_socket(self, why: str) -> None:
        if why != self._warned_socket:
            self._warned_socket = why
            _say("not connecting to the agent: %s; spooling instead" % why)

    def _try_connect(self) -> None:
        now = time.monotonic()
        if now < self._next_attempt:
            return
        uids = self._agent_uids()
        if uids is None:
            self._schedule_retry(now)
            return
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(SEND_TIMEOUT_S)
        try:
            sock.connect(self.socket_path)
            peer = self._peer_uid(sock)
            if uids and peer is not None and peer not in uids:
                # The path was swapped after our checks: not the agent, tell it nothing.
                self._warn_socket("the peer at %s runs as uid %d" % (self.socket_path, peer))
                raise OSError("untrusted peer")
            hello = dict(self.producer)
            hello["acked"] = self.acked
            sock.sendall(
                _wire.encode_frame({"t": "hello", "schema": _wire.SCHEMA_VERSION, "producer": hello})
            )
            reply = self._recv_frame(sock)
        except OSError:
            sock.close()
            self._schedule_retry(now)
            return
        if reply is None or reply.get("t") != "welcome":
            sock.close()
            err = (reply or {}).get("error", "no welcome from agent")
            if reply is not None and reply.get("t") == "refuse":
                self._refused = True
                _say("agent refused this producer: %s; spooling instead" % err)
            self._schedule_retry(now)
            return
        self._sock = sock
        self._backoff = 0.05
        self._rx = b""
        # Resend what the last connection did not get acked, then the spool, in order.
        for _last, _n, frame in list(self._outbox):
            try:
                sock.sendall(frame)
            except OSError:
                self._disconnect()
                return
        self._replay_spool()

    @staticmethod
    def _peer_uid(sock: Any) -> Optional[int]:
        """The connected peer's uid (SO_PEERCRED: pid, uid, gid as native ints), if known."""
        opt = getattr(_socket, "SO_PEERCRED", None)
        if opt is None:
            return None
        raw = sock.getsockopt(_socket.SOL_SOCKET, opt, 12)
        return int.from_bytes(raw[4:8], sys.byteorder)

    def _schedule_retry(self, now: float) -> None:
        jitter = int.from_bytes(os.urandom(2), "big") / 65536.0
        self._next_attempt = now + self._backoff * (0.5 + jitter)
        self._backoff = min(self._backoff * 2, RECONNECT_MAX_S)

    def _recv_frame(self, sock: Any) -> Optional[Dict[str, Any]]:
        buf = b""
        while True:
            frames, rest, bad = _wire.split_frames(buf)
            if bad:
                return None
            if frames:
                self._rx = rest
                return _wire.decode_reply(frames[0])
            chunk = sock.recv(65536)
            if not chunk:
                return None
            buf += chunk

    def _read_acks(self, block: bool = False) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            sock.settimeout(0.5 if block else 0.0)
            while True:
                try:
                    chunk = sock.recv(65536)
                except (BlockingIOError, _socket.timeout):  # _socket.timeout: not TimeoutError on 3.9
                    break
                if not chunk:
                    self._disconnect()
                    return
                self._rx += chunk
                frames, self._rx, bad = _wire.split_frames(self._rx)
                for payload in frames:
                    msg = _wire.decode_reply(payload)
                    if msg and msg.get("t") == "ack" and isinstance(msg.get("seq"), int):
                        self._on_ack(msg["seq"])
                if bad:
                    self._disconnect()
                    return
                if not block:
                    continue
                break
        except OSError:
            self._disconnect()
            return
        finally:
            if self._sock is not None:
                self._sock.settimeout(SEND_TIMEOUT_S)

    def _on_ack(self, seq: int) -> None:
        self.acked = max(self.acked, seq)
        while self._outbox and self._outbox[0][0] <= seq:
            _last, _n, frame = self._outbox.popleft()
            self._outbox_bytes -= len(frame)

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._schedule_retry(time.monotonic())

    # -- spool ------------------------------------------------------------------------

    def _spool_pending(self) -> bool:
        return self._spool_read < self._spool_size

    def _spool_usable(self) -> bool:
        return time.monotonic() >= self._spool_retry_at

    def _spool_failed(self, why: str) -> None:
        """Drop (and count) spooled batches for a while, rather than retry on every batch."""
        self._spool_error = why
        self._spool_retry_at = time.monotonic() + SPOOL_RETRY_S

    def _spool_open(self) -> bool:
        """Create a fresh spool file: never an existing file, never through a symlink."""
        if time.monotonic() < self._spool_retry_at:
            return False
        if self._spool_fd is not None:
            return True
        # Unguessable, so nobody can plant anything at the name first; ".spool" is what
        # the agent's replay looks for.
        name = "%s-%s.spool" % (self.producer["id"], os.urandom(8).hex())
        dfd = fd = None
        try:
            os.makedirs(self.spool_dir, mode=0o700, exist_ok=True)
            dfd = os.open(self.spool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            mode = os.fstat(dfd).st_mode
            if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                raise OSError("the directory is writable by everyone (mode %04o)" % stat.S_IMODE(mode))
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND,
                         0o600, dir_fd=dfd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while we live
            # "acked": what an agent already has, so that the agent that replays this file
            # after our death (another launch, say) does not count those events as lost.
            producer = dict(self.producer)
            producer["acked"] = self.acked
            hello = _wire.encode_frame({"t": "hello", "schema": _wire.SCHEMA_VERSION, "producer": producer})
            _write_all(fd, hello)
        except OSError as exc:
            if fd is not None:
                self._unlink_own(fd, dfd, name)
                os.close(fd)
            if dfd is not None:
                os.close(dfd)
            link = exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(self.spool_dir)
            why = "a symbolic link, not followed" if link else exc.strerror or str(exc)
            self._spool_failed("%s: %s" % (self.spool_dir, why))
            return False
        self._spool_fd, self._spool_dir_fd, self._spool_name = fd, dfd, name
        self._spool_size = self._spool_read = self._spool_head = len(hello)
        return True

    def _spool_vanished(self) -> bool:
        """Our spool file has no name any more: someone removed it (the directory's owner,
        root, or a group member where the directory lacks its sticky bit)."""
        fd = self._spool_fd
        if fd is None:
            return False
        try:
            return os.fstat(fd).st_nlink == 0
        except OSError:
            return False

    def _spool_rescue(self) -> None:
        """Its unsent frames are still readable through our descriptor: copy them into a
        fresh spool file (with its own hello) and count the removal, which the next
        ``drops`` report tells the agent."""
        fd = self._spool_fd
        assert fd is not None
        try:
            rest = os.pread(fd, self._spool_size - self._spool_read, self._spool_read)
        except OSError:
            rest = b""
        self._close_fds(self._spool_detach())
        self.spool_vanished += 1
        _say("the spool file was removed by someone else; %d byte(s) of events rescued into a new one" % len(rest))
        if rest and self._spool_open():
            fd = self._spool_fd
            assert fd is not None
            try:
                _write_all(fd, rest)
                self._spool_size += len(rest)
            except OSError:
                self._spool_abandon()

    def _spool_write(self, frame: bytes, n_events: int) -> bool:
        if self._spool_vanished():
            self._spool_rescue()
        if self._spool_size + len(frame) > self.spool_max_bytes or not self._spool_open():
            self._lose(n_events, self._spool_error if not self._spool_usable() else
                       "the spool is full (%d bytes)" % self.spool_max_bytes)
            return False
        fd = self._spool_fd
        assert fd is not None
        if self._spool_size + len(frame) > self.spool_max_bytes:  # the hello took the room
            self._lose(n_events, "the spool is full (%d bytes)" % self.spool_max_bytes)
            return False
        try:
            _write_all(fd, frame)
        except OSError as exc:
            self._spool_failed("%s: %s" % (self.spool_path, exc.strerror or exc))
            try:  # a partial frame would garble every frame after it: cut it off
                os.ftruncate(fd, self._spool_size)
            except OSError:
                self._spool_abandon()
            self._lose(n_events, self._spool_error)
            return False
        self._spool_size += len(frame)
        return True

    def _replay_spool(self) -> None:
        """Send the spool in order, within the outbox bound; resumed by later pumps."""
        fd = self._spool_fd
        while fd is not None and self._sock is not None and self._spool_pending():
            if self._pressed() or self._stop:
                return  # spill the buffer first (the agent is slower than the producer), or close() takes over
            if self._outbox_bytes >= MAX_OUTBOX_BYTES:
                self._read_acks(block=True)
                if self._outbox_bytes >= MAX_OUTBOX_BYTES:
                    return  # the agent has not acked yet: go on at the next pump
            try:
                data = os.pread(fd, min(1 << 20, self._spool_size - self._spool_read), self._spool_read)
                frames, _rest, _bad = _wire.split_frames(data)
                if not frames:
                    # A frame larger than one read: read exactly that frame.
                    (n,) = _wire.HEADER.unpack_from(data, 0)
                    frames = [os.pread(fd, n, self._spool_read + _wire.HEADER.size)]
            except (OSError, struct.error):
                self._spool_abandon()  # unreadable here: the agent replays it later
                return
            for payload in frames:
                head = _wire.batch_header(payload) or {}
                self._spool_read += _wire.HEADER.size + len(payload)
                self._send(int(head.get("l") or 0), int(head.get("n") or 0), _wire.HEADER.pack(len(payload)) + payload)
                if self._sock is None:
                    return
        if fd is not None and not self._spool_pending():
            self._spool_discard()

    def _spool_detach(self) -> Tuple[Optional[int], Optional[int], str]:
        fd, dfd, name = self._spool_fd, self._spool_dir_fd, self._spool_name
        self._spool_fd = self._spool_dir_fd = None
        self._spool_name = ""
        self._spool_size = self._spool_read = 0
        return fd, dfd, name

    def _spool_discard(self) -> None:
        """Our spool file is fully delivered: truncate and unlink it, through our descriptors."""
        fd, dfd, name = self._spool_detach()
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
            self._unlink_own(fd, dfd, name)
        except OSError:
            pass
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)

    def _spool_abandon(self) -> None:
        """Stop using the spool file but keep it: closing it frees its lock, so the agent
        replays what it holds. A later batch starts a new file."""
        fd, dfd, _name = self._spool_detach()
        for d in (fd, dfd):
            if d is not None:
                try:
                    os.close(d)
                except OSError:
                    pass

    @staticmethod
    def _unlink_own(fd: int, dfd: Optional[int], name: str) -> None:
        """Unlink ``name`` in the directory we opened, only if it is still our file: whoever
        else can write there may have swapped a symlink or another file in since."""
        if dfd is None:
            return
        try:
            mine, now = os.fstat(fd), os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(name, dir_fd=dfd)
        except OSError:
            pass

    def _spool_leftovers(self) -> None:
        """At exit: unacked frames and buffered events go to the spool for the agent.

        Order on disk stays: unacked frames, then the unread spool, then the buffer.
        """
        if self._spool_vanished():
            self._spool_rescue()
        partly_sent = self._spool_pending() and self._spool_read > self._spool_head
        if not self._outbox and not self._buf and not partly_sent:
            self._close_spool_and_socket()
            return
        pending: List[Tuple[bytes, int]] = [(frame, n) for _last, n, frame in self._outbox]
        self._outbox.clear()
        self._outbox_bytes = 0
        old: Optional[Tuple[Optional[int], Optional[int], str]] = None
        if self._spool_pending() and (pending or self._spool_read > self._spool_head):
            # Copy the unread rest behind the unacked frames into a new file; the old one
            # goes only once the copy is complete (else the agent replays it: nothing lost).
            assert self._spool_fd is not None
            try:
                rest = os.pread(self._spool_fd, self._spool_size - self._spool_read, self._spool_read)
            except OSError:
                rest = b""
            old = self._spool_detach()
            if rest:
                pending.append((rest, 0))
            else:
                self._close_fds(old)  # keep it whole for the agent
                old = None
        copied = [self._spool_write(data, n) for data, n in pending]
        if old is not None:
            fd, dfd, name = old
            if copied[-1] and fd is not None:  # the rest is safe in the new file
                self._unlink_own(fd, dfd, name)
            self._close_fds(old)
        while self._buf:
            chunk = self._take(MAX_BATCH_EVENTS)
            if chunk:
                self._spool_write(_wire.encode_batch(chunk), _user_events(chunk))
        self._close_spool_and_socket()

    @staticmethod
    def _close_fds(spool: Tuple[Optional[int], Optional[int], str]) -> None:
        for d in spool[:2]:
            if d is not None:
                try:
                    os.close(d)
                except OSError:
                    pass

    def _close_spool_and_socket(self) -> None:
        if self._spool_fd is not None:
            self._close_fds(self._spool_detach())  # releases the lock: the agent may replay it now
        if self._sock is not None:
            self._sock.close()
            self._sock = None
