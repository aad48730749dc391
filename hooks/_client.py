"""The producer side: a bounded buffer drained by a daemon thread to the agent's socket.

Guarantees to the host process: ``emit`` never blocks (a deque append under the GIL),
never raises, and costs well under a microsecond or two. All I/O happens on the drain
thread. Delivery is at-least-once: frames stay in ``_outbox`` until the agent acks
them, and are resent after a reconnect. While the agent is away, batches go to a
bounded spool file that is replayed (by this thread on reconnect, or by the agent if
this process has died). Every event gets a sequence number when it is emitted, so
anything dropped on a full buffer or spool shows up as a gap the agent counts.
"""

from __future__ import annotations

# The C socket type, not the ``socket`` module: same methods, without ~7 ms of imports
# (selectors, enum) on the host's start-up path. Everything the drain thread uses is
# imported here, on the main thread: a first import on a daemon thread can race the
# host's own imports or interpreter shutdown.
import _socket
import fcntl
import itertools
import os
import sys
import threading
import time
from _collections import deque  # the C type; the collections module costs ~2.5 ms

from . import _wire

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Deque, Dict, List, Optional, Tuple

# ~516 B per buffered log event with attributes: 131072 events bound the buffer near 64 MiB.
MAX_BUFFER_EVENTS = 131072
MAX_BATCH_EVENTS = 512
MAX_OUTBOX_BYTES = 16 << 20
DEFAULT_SPOOL_MAX_BYTES = 64 << 20
SEND_TIMEOUT_S = 2.0
IDLE_WAIT_S = 0.2
RECONNECT_MAX_S = 5.0


def _say(msg: str) -> None:
    try:
        sys.stderr.write("infersight: %s\n" % msg)
        sys.stderr.flush()
    except Exception:
        pass


class Client:
    """One per process (re-created in a forked child)."""

    def __init__(
        self,
        socket_path: str,
        spool_dir: str,
        producer: Dict[str, Any],
        max_buffer: int = MAX_BUFFER_EVENTS,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
    ) -> None:
        self.socket_path = socket_path
        self.spool_dir = spool_dir
        self.producer = producer
        self.max_buffer = max_buffer
        self.spool_max_bytes = spool_max_bytes
        self.enabled = True
        self._buf: Deque[_wire.Event] = deque()
        self._seq = itertools.count(1)
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._lock = threading.Lock()  # guards connection + spool state for flush()
        # Counters reported to the agent in "drops" events and at exit.
        self.dropped_buffer = 0
        self.dropped_spool = 0
        self._reported_buffer = 0
        self._reported_spool = 0
        self.sent_events = 0
        # Connection state (drain thread only).
        self._sock: Optional[Any] = None  # a _socket.socket
        self._rx = b""
        self._refused = False
        self._next_attempt = 0.0
        self._backoff = 0.05
        self._outbox: Deque[Tuple[int, int, bytes]] = deque()  # (last seq, events, frame)
        self._outbox_bytes = 0
        self.acked = 0
        # Spool state.
        self._spool_fd: Optional[int] = None
        self._spool_path = os.path.join(spool_dir, "%s.spool" % producer["id"])
        self._spool_size = 0
        self._spool_read = 0
        self._thread = threading.Thread(target=self._run, name="infersight-drain", daemon=True)
        self._thread.start()

    # -- hot path -------------------------------------------------------------------

    def emit(self, kind: str, data: Dict[str, Any]) -> None:
        seq = next(self._seq)
        if len(self._buf) >= self.max_buffer:
            self.dropped_buffer += 1
            return
        self._buf.append((seq, time.time_ns(), kind, data))
        if not self._wake.is_set():
            self._wake.set()

    # -- control --------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything emitted so far was sent and acked, or spooled."""
        deadline = time.monotonic() + timeout_s
        self._report_drops()
        while time.monotonic() < deadline:
            if not self._buf and not self._outbox and self._idle.is_set():
                return True
            self._wake.set()
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
            with self._lock:
                self._spool_leftovers()

    def _report_drops(self) -> None:
        b, s = self.dropped_buffer, self.dropped_spool
        if b != self._reported_buffer or s != self._reported_spool:
            self._reported_buffer, self._reported_spool = b, s
            self.emit("drops", {"buffer": b, "spool": s})

    # -- drain thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                with self._lock:
                    self._idle.clear()
                    self._pump()
                    if not self._buf:
                        self._idle.set()
        except Exception as exc:  # fail open: never take the host down
            self.enabled = False
            if not sys.is_finalizing():  # at interpreter shutdown, stay quiet
                _say("hook drain thread disabled: %r" % (exc,))
            self._idle.set()

    def _pump(self) -> None:
        if self._sock is None and not self._refused:
            self._try_connect()
        if self._sock is not None:
            self._read_acks()
            if self._spool_pending():
                self._replay_spool()
        while self._buf:
            if self._sock is not None and self._outbox_bytes >= MAX_OUTBOX_BYTES:
                self._read_acks(block=True)
                if self._outbox_bytes >= MAX_OUTBOX_BYTES:
                    return  # congested: leave events buffered (emit drops when full)
            events: List[_wire.Event] = []
            pop = self._buf.popleft
            while self._buf and len(events) < MAX_BATCH_EVENTS:
                events.append(pop())
            frame = _wire.encode_batch(events)
            last = events[-1][0]
            if self._sock is not None and not self._spool_pending():
                self._send(last, len(events), frame)
            else:
                self._spool_write(frame, len(events))
            if (
                self.dropped_buffer != self._reported_buffer
                or self.dropped_spool != self._reported_spool
            ):
                self._report_drops()
        if self._sock is not None:
            self._read_acks()

    def _send(self, last_seq: int, n_events: int, frame: bytes) -> None:
        self._outbox.append((last_seq, n_events, frame))
        self._outbox_bytes += len(frame)
        assert self._sock is not None
        try:
            self._sock.sendall(frame)
            self.sent_events += n_events
        except OSError:
            self._disconnect()

    def _try_connect(self) -> None:
        now = time.monotonic()
        if now < self._next_attempt:
            return
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(SEND_TIMEOUT_S)
        try:
            sock.connect(self.socket_path)
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

    def _spool_open(self) -> bool:
        if self._spool_fd is not None:
            return True
        try:
            os.makedirs(self.spool_dir, mode=0o700, exist_ok=True)
            fd = os.open(self._spool_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while we live
        except OSError as exc:
            _say("cannot open spool %s: %s; events are dropped and counted" % (self._spool_path, exc))
            self.spool_max_bytes = 0
            return False
        self._spool_fd = fd
        hello = _wire.encode_frame(
            {"t": "hello", "schema": _wire.SCHEMA_VERSION, "producer": dict(self.producer)}
        )
        os.write(fd, hello)
        self._spool_size = self._spool_read = len(hello)
        return True

    def _spool_write(self, frame: bytes, n_events: int) -> None:
        if self._spool_size + len(frame) > self.spool_max_bytes or not self._spool_open():
            self.dropped_spool += n_events
            return
        try:
            assert self._spool_fd is not None
            os.write(self._spool_fd, frame)
            self._spool_size += len(frame)
        except OSError:
            self.dropped_spool += n_events

    def _replay_spool(self) -> None:
        """Send the spool in order, within the outbox bound; resumed by later pumps."""
        fd = self._spool_fd
        while fd is not None and self._sock is not None and self._spool_pending():
            if self._outbox_bytes >= MAX_OUTBOX_BYTES:
                self._read_acks(block=True)
                if self._outbox_bytes >= MAX_OUTBOX_BYTES:
                    return  # the agent has not acked yet: go on at the next pump
            data = os.pread(fd, min(1 << 20, self._spool_size - self._spool_read), self._spool_read)
            frames, _rest, _bad = _wire.split_frames(data)
            if not frames:
                # A frame larger than one read: read exactly that frame.
                (n,) = _wire.HEADER.unpack_from(data, 0)
                frames = [os.pread(fd, n, self._spool_read + _wire.HEADER.size)]
            for payload in frames:
                head = _wire.batch_header(payload) or {}
                self._spool_read += _wire.HEADER.size + len(payload)
                self._send(int(head.get("l") or 0), int(head.get("n") or 0), _wire.HEADER.pack(len(payload)) + payload)
                if self._sock is None:
                    return
        if fd is not None and not self._spool_pending():
            os.ftruncate(fd, 0)
            self._spool_size = self._spool_read = 0
            os.close(fd)
            self._spool_fd = None
            try:
                os.unlink(self._spool_path)
            except OSError:
                pass

    def _spool_leftovers(self) -> None:
        """At exit: unacked frames and buffered events go to the spool for the agent.

        Order on disk stays: unacked frames, then the unread spool, then the buffer.
        """
        if not self._outbox and not self._buf:
            self._close_spool_and_socket()
            return
        pending: List[Tuple[bytes, int]] = [(frame, n) for _last, n, frame in self._outbox]
        self._outbox.clear()
        self._outbox_bytes = 0
        if pending and self._spool_pending():
            assert self._spool_fd is not None
            rest = os.pread(self._spool_fd, self._spool_size - self._spool_read, self._spool_read)
            os.ftruncate(self._spool_fd, 0)
            os.close(self._spool_fd)
            self._spool_fd = None
            self._spool_size = self._spool_read = 0
            pending.append((rest, 0))
        while self._buf:
            chunk = [self._buf.popleft() for _ in range(min(MAX_BATCH_EVENTS, len(self._buf)))]
            pending.append((_wire.encode_batch(chunk), len(chunk)))
        for data, n in pending:
            self._spool_write(data, n)
        self._close_spool_and_socket()

    def _close_spool_and_socket(self) -> None:
        if self._spool_fd is not None:
            os.close(self._spool_fd)  # releases the lock: the agent may replay it now
            self._spool_fd = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
