"""The producer side: one client per process, a thin coordinator of three parts.

- :class:`~._buffer.Buffer`: the bounded buffer the host's threads append to (the hot path);
- :class:`~._connection.Connection`: the agent's socket, with an outbox of unacked frames;
- :class:`~._spoolfile.SpoolFile`: the file batches wait in while the agent cannot take them.

Guarantees to the host process: ``emit`` never blocks, never raises, and costs well under a
microsecond or two. All I/O happens on the drain thread (``_run``), which sends in batches:
once ``batch_events`` are queued or the oldest queued event is ``batch_delay_s`` old,
whichever comes first (``flush``, fork and exit do not wait), so a quiet process sends a few
frames a second rather than one per event.

Where a batch goes (``_pump``): to the agent when connected and nothing older waits in the
spool; to the spool when the agent is away, or when the buffer is past its spill mark (the
agent falls behind a burst; a later pump replays the spool, in order, as the agent catches
up). Events are dropped, and counted, only when the spool cannot take them either (full,
or a failing disk: then for ``SPOOL_RETRY_S``). Every event is numbered when it is emitted,
so a drop shows up as a gap the agent counts, and the drop counters reach the agent in a
``drops`` event once it is reachable. At exit (``close``) whatever was not acked goes to
the spool, for the agent to replay.

An OOM report is urgent (``urgent``): sent at once, then the agent's doorbell is rung.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from . import _env, _fds, _lazy, _spoolfile, _wire
from ._buffer import BATCH_EVENTS, HELD, MAX_BUFFER_EVENTS, Buffer, builders, user_events
from ._connection import Connection
from ._spoolfile import SpoolFile

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

    from ._connection import Frame

__all__ = ["BATCH_DELAY_S", "BATCH_EVENTS", "HELD", "MAX_BUFFER_EVENTS", "Client", "builders"]

MAX_BATCH_EVENTS = _wire.MAX_BATCH_EVENTS  # per frame
WRITE_FRAMES = 16  # frames per write or send, at most, while the buffer is long
WRITE_FRAMES_PRESSED = 64  # ... and past the spill mark (~3 MiB of log events a write)
BATCH_DELAY_S: float = _env.VARS["INFERSIGHT_BATCH_DELAY_MS"].default / 1e3  # ... or once the oldest is this old
DEFAULT_SPOOL_MAX_BYTES: int = _env.VARS["INFERSIGHT_SPOOL_MAX_BYTES"].default
SPOOL_RETRY_S = _spoolfile.RETRY_S
IDLE_WAIT_S = 0.2
ACK_WAIT_S = 1.0  # ... when only acks are owed, connected (``_idle_wait``)
IDLE_LONG_S = 5.0  # ... when nothing is owed
READ_ACKS_BYTES = 256 << 10  # unacked bytes past which every pump reads acks (``_pump``)
EXIT_LOCK_WAIT_S = 1.0  # at exit, how long to wait for a drain thread stuck in I/O, at most
EXIT_GRACE_S = 0.3  # at exit, past the flush budget: for the drain thread to leave an abandoned wait

_say = _env.say  # the hooks' one stderr line (``_runtime`` says its own through this name)


# Memory-error texts the logging hook did not send, over its budget (``_enginelog.dropped``, the same list):
# reported with the events' drops.
TEXT_DROPS = [0]


class Client:
    """One per process (re-created in a forked child)."""

    # The hot path's names, bound to the buffer's once (``hooks.stage`` and the request
    # hooks append to ``_buf`` themselves while its length is calm: see ``Buffer.calm``).
    emit: Callable[[str, Any], None]
    queue: Callable[[Tuple[Any, ...]], bool]

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
        self.spool_dir = spool_dir
        self.producer = producer
        self.max_buffer = max_buffer
        self.spool_max_bytes = spool_max_bytes
        self.batch_delay_s = max(0.0, batch_delay_s)
        self._wake = threading.Event()
        self.buffer = buf = Buffer(self._wake, max_buffer, batch_events)
        self.conn = Connection(socket_path, producer)
        self.spool = SpoolFile(spool_dir, producer, spool_max_bytes)
        self.batch_events, self.spill_at = buf.batch_events, buf.spill_at
        self.calm, self.calm_from, self.calm_to = buf.calm, buf.calm_from, buf.calm_to
        self._buf: Deque[Tuple[Any, ...]] = buf.events
        self._seq: Iterator[int] = buf.seq
        self.held: Dict[int, Dict[str, Any]] = buf.held
        self.emit = buf.emit
        self.queue = buf.queue
        self.enabled = True
        self.spilled_events = 0  # sent to the spool while connected (a burst), replayed later
        self.dropped_spool = 0  # events neither sent nor spooled
        self._reported = (0, 0, 0, 0, 0)  # (buffer, spool, vanished, texts, fds) drops the agent was told of
        self._warned_loss = False
        self.unencodable = 0  # events no frame could hold (counted in dropped_buffer too: ``_encode``)
        self._warned_bad: set = set()  # type: ignore[type-arg]  # the reasons said on stderr
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._adopted = False  # leftover private spool files looked for (once, after the first connect)
        self._hurry = False  # flush, fork or exit: send now, do not wait for a full batch
        self._urgent = False  # an urgent event (an OOM) is queued: ring the agent once it is sent
        self._engine = False  # a serving engine's package was imported: ring a held launch (ENGINE_FRAME)
        self._flushing = 0  # callers in flush(): read acks at every pump
        self._lock = threading.Lock()  # guards connection + spool state for close()
        self.wakeups = 0  # the drain thread's rounds (tests: none while nothing is owed)
        self._thread = threading.Thread(target=self._run, name="infersight-drain", daemon=True)
        self._thread.start()

    # -- counters (tests, the exit line) -------------------------------------------------

    @property
    def dropped_buffer(self) -> int:
        return self.buffer.dropped

    @property
    def spool_vanished(self) -> int:
        return self.spool.vanished_count

    @property
    def sent_events(self) -> int:
        return self.conn.sent_events

    @property
    def sent_frames(self) -> int:
        return self.conn.sent_frames

    @property
    def acked(self) -> int:
        return self.conn.acked

    @property
    def urgent_rings(self) -> int:
        return self.conn.urgent_rings

    # -- the host's side -----------------------------------------------------------------

    def hurry(self) -> None:
        """Send what is queued now, without waiting for a full batch (never blocks)."""
        self._hurry = True
        self._wake.set()

    def urgent(self) -> None:
        """``hurry``, and once what is queued is sent, ring the agent's doorbell
        (``_wire.URGENT_FRAME`` on a fresh connection), which makes the agent read every
        producer at once: an OOM report is never held by its read gate. Never blocks."""
        self._urgent = True
        self.hurry()

    def engine_imported(self) -> None:
        """``hurry``, and ring a held launch's doorbell with ``_wire.ENGINE_FRAME``: its agent starts
        while the engine starts, niced, and loads the OOM rules. Never blocks."""
        self._engine = True
        self.hurry()

    def flush(self, timeout_s: float, wake_launch: bool = True) -> bool:
        """Wait until everything emitted so far was sent and acked, or spooled (or counted).
        Under a launch that holds its agent back (``Connection.held``), ``wake_launch`` rings
        it and waits for the agent to take the spool (``hooks.flush``: the caller wants it
        delivered); at exit (``close``) the spool is enough."""
        deadline = time.monotonic() + timeout_s
        held_now = wake_launch and self.conn.held()
        held = held_now or (wake_launch and self.conn.held_back)
        if held_now:
            self.urgent()  # launch starts its agent; once connected, the spool is replayed
        self._flushing += 1  # the pumps read acks now, whatever the outbox holds
        try:
            while time.monotonic() < deadline:
                if not self._buf and self._idle.is_set():
                    conn = self.conn
                    if held and (not conn.up or self.spool.pending()):
                        if conn.refused:
                            return False  # (launch's agent is on its way: wait for it)
                    elif not conn.outbox:
                        return True
                    elif not conn.up and (conn.refused or conn.retry_in() > 0):
                        # Sent, unacked, and the agent went away (a send failed: it is not read
                        # for nothing any more, so that is how a dead agent shows): no ack can
                        # come before a reconnect; at exit they go to the spool (``close``).
                        return False
                self.hurry()
                time.sleep(0.005)
            return False
        finally:
            self._flushing -= 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush within the time limit, then spool whatever is left (at exit)."""
        deadline = time.monotonic() + timeout_s
        try:
            self.flush(timeout_s, wake_launch=False)
        finally:
            self._stop = True
            self.conn.abandoned = True  # a wait on an agent that does not answer ends now
            self._wake.set()
            # Within the budget, and a short grace past it for the drain thread to leave the wait it was in
            # (an agent that accepts and never answers held the exit two seconds past a budget of 0.2).
            end = max(deadline, time.monotonic()) + EXIT_GRACE_S

            def left() -> float:
                return min(EXIT_LOCK_WAIT_S, max(0.0, end - time.monotonic()))

            self._thread.join(timeout=left())
            # A drain thread stuck in I/O holds the lock: do not wait on it past a bound.
            connected, unreported = self.conn.up, self._unreported()
            if self._lock.acquire(timeout=left()):
                try:
                    self.spool.retry_at = 0.0  # one last try, whatever failed before
                    if unreported:
                        self._report_drops()  # the spool carries the count to the agent
                    self._spool_leftovers()
                finally:
                    self._lock.release()
            else:
                self.buffer.dropped += self._left_behind()
            lost = self.dropped_buffer + self.dropped_spool
            if lost and (not connected or unreported or self._unreported()):
                bad = " or that could not be encoded (%d)" % self.unencodable if self.unencodable else ""
                _say("%d event(s) lost in this process (%d on a full buffer%s, %d that could not be "
                     "spooled)" % (lost, self.dropped_buffer, bad, self.dropped_spool))

    def _left_behind(self) -> int:
        """Events still buffered or unacked, counted while the drain thread may still take from
        both (a copy of a deque another thread changes can fail: then an estimate)."""
        for _ in range(3):
            try:
                return user_events(list(self._buf)) + sum(n for _l, n, _f in list(self.conn.outbox))
            except RuntimeError:
                continue
        return len(self._buf) + len(self.conn.outbox)

    def close_inherited(self) -> None:
        """In a forked child: stop using this client, closing only the child's copies of its
        descriptors (the parent's connection, spool file and lock stay the parent's)."""
        self.enabled = False
        self.conn.close_inherited()
        self.spool.close_inherited()

    # -- drops ---------------------------------------------------------------------------

    def _drops(self) -> Tuple[int, int, int, int, int]:
        return self.dropped_buffer, self.dropped_spool, self.spool_vanished, TEXT_DROPS[0], _fds.lost

    def _unreported(self) -> bool:
        return self._drops() != self._reported

    def _report_drops(self) -> None:
        """Queue a ``drops`` event with the counts so far."""
        self._reported = b, s, v, t, f = self._drops()
        d: Dict[str, int] = {"buffer": b, "spool": s}
        if v:
            d["vanished"] = v
        if t:
            d["texts"] = t
        if f:  # the hooks' descriptors the host closed or took (``_fds``): nothing lost, but the host said so
            d["fds"] = f
        self.buffer.append_report("drops", d)

    def _lose(self, n_events: int, why: str) -> None:
        """Count events that could be neither sent nor spooled; say so once."""
        self.dropped_spool += n_events
        if n_events and not self._warned_loss:
            self._warned_loss = True
            agent = "falls behind a burst" if self.conn.up else "is not reachable"
            _say("cannot spool events (%s) and the agent at %s %s: events are dropped and "
                 "counted; the count goes to the agent" % (why, self.socket_path, agent))

    def _spool_write(self, data: bytes, n_events: int) -> bool:
        why = self.spool.write(data, self.conn.acked)
        if why:
            self._lose(n_events, why)
        return not why

    # -- the drain thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                if not self._buf:
                    self._wake.wait(self._idle_wait())
                self.wakeups += 1
                self._wake.clear()
                self._gather()
                self._hurry = False
                urgent, self._urgent = self._urgent, False  # queued before the flag was set
                engine, self._engine = self._engine, False
                with self._lock:
                    if self._stop:
                        break  # close() holds the buffer now: it spools what is left
                    self._idle.clear()
                    self._pump()
                    if urgent and (self.conn.up or self.conn.held()):
                        self.conn.ring()  # (held: the ring starts launch's agent)
                    elif engine and self.conn.held():
                        self.conn.ring(_wire.ENGINE_FRAME)
                    if not self._buf:
                        self._idle.set()
                if not self._adopted and self.conn.up:
                    self._adopted = True
                    self._adopt_leftovers()
        except Exception as exc:  # fail open: never take the host down
            self.enabled = False
            if not sys.is_finalizing():  # at interpreter shutdown, stay quiet
                _say("hook drain thread disabled: %r" % (exc,))
            self._idle.set()

    def _adopt_leftovers(self) -> None:
        """Once, after the first connect, outside the lock: spool files this user's earlier processes
        left in its private spool (not yet in the socket's group then) go where the agent replays them."""
        from . import _paths  # imported at start already

        if self.producer.get("launched") or _env.get("INFERSIGHT_LAUNCH_EMBEDDED"):
            # launch's own agent (CMD or any of its descendants, a gunicorn worker too): its spool is its private
            # directory and its output is CMD's cold start, not an unrelated earlier process's
            return
        private = _paths.private_spool_dir()
        if os.path.abspath(private) == os.path.abspath(self.spool_dir) or not os.path.isdir(private):
            return
        # Only now, with leftovers possible: an import in a worker's short cold start shows in its waterfall
        # (a forked gunicorn worker's first connect falls inside it).
        if not _lazy.fresh("_spool_adopt", "moving earlier processes' spool files to the agent's"):
            return
        from . import _spool_adopt

        n = _spool_adopt.adopt(private, self.spool_dir)
        if n:
            _say("moved %d spool file(s) that earlier processes of this user left in %s (the agent does not "
                 "read it) to %s, where the agent replays them" % (n, private, self.spool_dir))

    def _idle_wait(self) -> float:
        """How long the drain thread sleeps with nothing queued: IDLE_WAIT_S while something
        is owed (a spool to replay, drops to report: a read or a reconnect is due; the agent
        away, or gone after it welcomed this producer: until its next try), ACK_WAIT_S when
        only the acks of frames sent are (connected: reading them only frees the outbox, which
        a flush and READ_ACKS_BYTES read anyway; the cold-start checkpoints come every
        0.1-0.3 s, so a shorter wait woke the thread for one receive between each two), else
        IDLE_LONG_S. An event wakes it at once either way; every wake-up costs the host's busy
        main thread a GIL switch or more."""
        conn = self.conn
        if conn.refused:
            return IDLE_LONG_S
        replay = self.spool.pending() or self._unreported()
        if conn.up:
            return IDLE_WAIT_S if replay else ACK_WAIT_S if conn.outbox else IDLE_LONG_S
        if not (replay or conn.outbox or conn.welcomed):
            return IDLE_LONG_S  # an agent that never knew this process counts nothing: no hurry
        # The agent away: its next try. Owed nothing, a producer the agent knew is back within its grace for a
        # pid it cannot see (agent/daemon/liveness.py), not at the first IDLE_LONG_S wake-up past its backoff.
        return min(IDLE_LONG_S, max(IDLE_WAIT_S, conn.retry_in()))

    def _gather(self) -> None:
        """Wait until a batch is full, or its oldest event is ``batch_delay_s`` old."""
        buf, delay = self.buffer, self.batch_delay_s
        while not self._hurry and not self._stop and 0 < len(buf) < self.batch_events:
            oldest_ns = buf.oldest_ns()
            if oldest_ns is None:
                return
            left = min(delay, delay - (time.time_ns() - oldest_ns) / 1e9)  # bounded if the clock jumps
            if left <= 0:
                return
            self._wake.wait(left)
            self._wake.clear()

    def _pump(self) -> None:
        """Connect if we can, replay the spool, then send or spool the buffer."""
        conn, spool, buf = self.conn, self.spool, self.buffer
        if conn.connect():
            # Acks are read when they matter: a pump with nothing to send (the idle wake-up
            # after frames went out), a flush, an outbox past READ_ACKS_BYTES; not before each
            # send of a busy cold start (one receive per checkpoint, for nothing that counts).
            if not self._buf or self._flushing or conn.outbox_bytes >= READ_ACKS_BYTES:
                conn.read_acks()
            if spool.pending():
                self._replay_spool()
            # Drops are reported only where they cannot be dropped again (a report that is
            # itself dropped would be one more drop to report: a spin).
            if conn.up and not spool.pending() and self._unreported():
                self._report_drops()
        while self._buf:
            if self._stop:
                return  # close() takes over the buffer (it spools what is left): free the lock
            pressed = buf.pressed()
            if conn.up and conn.congested() and not pressed:
                if not conn.wait_room() and not buf.pressed():
                    return  # congested: leave events buffered until the spill mark
                pressed = buf.pressed()
            # Several frames per write while the buffer is long: each write or send gives
            # the GIL to a busy host thread, and getting it back takes a switch interval.
            group: List[Frame] = []
            users: List[int] = []
            while self._buf and len(group) < (WRITE_FRAMES_PRESSED if pressed else WRITE_FRAMES):
                for events, frame in self._encode(buf.take(MAX_BATCH_EVENTS)):
                    group.append((events[-1][0], len(events), frame))
                    users.append(user_events(events))
            if not group:
                continue
            if conn.up and not spool.pending() and (not pressed or not spool.usable()):
                conn.send_group(group)
            else:
                self._spool_group(group, users)
        # No read of acks right after sending (the agent has not read it yet: a receive for
        # nothing); the next pump reads them first, and ``_idle_wait`` makes sure it comes.

    def _encode(self, events: List[_wire.Event]) -> List[Tuple[List[_wire.Event], bytes]]:
        """Batch frames of ``events`` taken off the buffer, each within ``_wire.MAX_FRAME_BYTES``
        (a frame the agent refuses would close the connection, be resent at every reconnect, and
        hold every later event back). An event no frame can hold (too large, or a value JSON
        cannot encode: only the drain thread's own builds and ``hooks.stage`` attributes can
        hold one, ``hooks.log`` and the like make theirs safe) is dropped and counted with the
        buffer's drops, which reach the agent; one stderr line per reason."""
        if not events:
            return []
        frames, bad = _wire.encode_batches(events)
        if bad:
            self._unencodable(bad)
        return frames

    def _unencodable(self, bad: List[Tuple[_wire.Event, str, str]]) -> None:
        n = user_events([ev for ev, _why, _detail in bad])
        self.buffer.dropped += n
        self.unencodable += n
        for ev, why, detail in bad:
            if why not in self._warned_bad:
                self._warned_bad.add(why)
                try:
                    kind = str(ev[2])[:32]
                except Exception:
                    kind = "?"
                _say("a %s event could not be sent (%s): dropped and counted, the hooks go on (said once "
                     "for this reason)" % (kind, detail))

    def _spool_group(self, group: List[Frame], users: List[int]) -> None:
        """Spool frames in one write if they fit, else one by one (what fits is kept)."""
        data = b"".join(entry[2] for entry in group)
        if len(group) > 1 and not self.spool.fits(len(data)):
            for i, entry in enumerate(group):  # (zip(strict=) is 3.10+)
                if self._spool_write(entry[2], users[i]) and self.conn.up:
                    self.spilled_events += entry[1]
            return
        if self._spool_write(data, sum(users)) and self.conn.up:
            self.spilled_events += sum(entry[1] for entry in group)  # a later pump replays it, in order

    def _replay_spool(self) -> None:
        """Send the spool in order, within the outbox bound; resumed by later pumps."""
        conn, spool = self.conn, self.spool
        while spool.fd is not None and conn.up and spool.pending():
            if self.buffer.pressed() or self._stop:
                return  # spill the buffer first (the agent is slower than the producer), or close() takes over
            if not conn.wait_room():
                return  # the agent has not acked yet: go on at the next pump
            frames = spool.next_frames()
            if frames is None:
                return  # unreadable here: abandoned, the agent replays it later
            for payload in frames:
                head = _wire.batch_header(payload) or {}
                spool.consumed(payload)
                conn.send(int(head.get("l") or 0), int(head.get("n") or 0), _wire.HEADER.pack(len(payload)) + payload)
                if not conn.up:
                    return
        if spool.fd is not None and not spool.pending():
            spool.discard()

    def _spool_leftovers(self) -> None:
        """At exit: unacked frames and buffered events go to the spool for the agent.

        Order on disk stays: unacked frames, then the unread spool, then the buffer. Acks the
        agent sent since the last pump are read first: the frames they cover were exported
        already, and a replay would export their spans again.
        """
        spool = self.spool
        self.conn.read_acks()  # connected: without waiting; else the disconnect drained them
        if spool.vanished():
            spool.rescue(self.conn.acked)
        partly_sent = spool.pending() and spool.read > spool.head
        if not self.conn.outbox and not self._buf and not partly_sent:
            self._close_spool_and_socket()
            return
        pending: List[Tuple[bytes, int]] = [(frame, n) for _last, n, frame in self.conn.take_outbox()]
        old: Optional[_spoolfile.Handles] = None
        if spool.pending() and (pending or spool.read > spool.head):
            # Copy the unread rest behind the unacked frames into a new file; the old one
            # goes only once the copy is complete (else the agent replays it: nothing lost).
            rest = spool.unread()
            old = spool.detach()
            if rest:
                pending.append((rest, 0))
            else:
                _spoolfile.close_fds(old)  # keep it whole for the agent
                old = None
        copied = [self._spool_write(data, n) for data, n in pending]
        if old is not None:
            fd, dfd, name = old
            if copied[-1] and fd is not None:  # the rest is safe in the new file
                _spoolfile.unlink_own(fd, dfd, name)
            _spoolfile.close_fds(old)
        while self._buf:
            for events, frame in self._encode(self.buffer.take(MAX_BATCH_EVENTS)):
                self._spool_write(frame, user_events(events))
        self._close_spool_and_socket()

    def _close_spool_and_socket(self) -> None:
        self.spool.close()  # releases the lock: the agent may replay it now
        self.conn.close()
