"""Reading a producer's connection: frame deadlines, and the read gate across producers.

A frame is a 4-byte length and a JSON payload (:mod:`infersight.hooks._wire`). A peer may be
silent between frames up to the idle timeout, and must send a frame it has begun within the
frame timeout: :class:`ReadDeadline` enforces both with one timer per connection.
:class:`ReadGate` coalesces the agent's wake-ups across quiet producers. Neither is ever
the reason a frame is lost: what is not read waits in the socket.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from infersight.agent.daemon.frame_budget import FrameShare
from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.receive import RateLimitedLog
from infersight.hooks import _wire

# After a quiet producer's frame, quiet producers are not read for this long: a host of
# many wakes the agent once per window instead of once per frame, and at two of the hooks'
# batch delays (50 ms) each quiet producer's frames come in pairs: one read, one ack.
# The price: a quiet producer's events reach the exporters up to this much later (80 ms:
# quiet fleet ratio ~1.5x, where 50 ms gave 1.7-2.0x and 100 ms 1.3-1.5x on the 2-core VM).
# An urgent event is never held: the hook sends an OOM report at once (``emit_urgent``) and
# then rings the agent on a fresh connection (``{"t": "urgent"}``), which opens the gate.
GATE_S = 0.08
QUIET_FRAME_BYTES = 16 << 10  # a producer that sends this much within a window is busy: never held


class DeadlineOwner(Protocol):
    """What a :class:`ReadDeadline` reads of the connections it times."""

    frame_timeout_s: float  # a reload may change it
    gate: ReadGate
    counters: Counters
    rlog: RateLimitedLog


async def read_frame(reader: asyncio.StreamReader, header_s: float, frame_s: float, counters: Counters,
                     rlog: RateLimitedLog, share: FrameShare | None = None) -> bytes | None:
    """One payload (a connection's first frame); None after counting an oversized or slow
    frame, or a large one that did not get its ``share`` of the bytes being read. The header may
    take up to ``header_s``, the payload ``frame_s``; TimeoutError past the header's."""
    n = _wire.frame_size(await asyncio.wait_for(reader.readexactly(_wire.HEADER.size), header_s))
    if n > _wire.MAX_FRAME_BYTES:
        counters.oversized_frames += 1
        rlog.warn("oversized", "peer sent a %d-byte frame (max %d); closing", n, _wire.MAX_FRAME_BYTES)
        return None
    if share is not None and share.needs(n):
        if not await share.take(n):
            return None
        try:
            return await _read_payload(reader, n, frame_s, counters, rlog)
        finally:
            share.give_back(n)
    return await _read_payload(reader, n, frame_s, counters, rlog)


async def _read_payload(reader: asyncio.StreamReader, n: int, frame_s: float, counters: Counters,
                        rlog: RateLimitedLog) -> bytes | None:
    try:
        return await asyncio.wait_for(reader.readexactly(n), frame_s)
    except TimeoutError:
        counters.slow_peers += 1
        rlog.warn("slow", "peer too slow to send a frame; closing")
        return None


class ReadDeadline:
    """One read deadline per connection, instead of a ``wait_for`` per frame.

    The read loop only notes where it is (waiting for a frame's header, inside a frame, or
    held back by the exporters) and since when: two attribute writes per frame. One timer
    per connection wakes at most every ``min(idle_s, frame_s)`` seconds; past the idle
    limit (between frames) or the frame limit (inside one) it counts the peer and aborts
    the transport, which ends the pending read."""

    __slots__ = ("expired", "frame_s", "handle", "idle_s", "loop", "owner", "phase", "since", "transport")

    IDLE, FRAME, HELD = 0, 1, 2

    def __init__(self, owner: DeadlineOwner, transport: asyncio.WriteTransport, idle_s: float | None) -> None:
        self.owner = owner
        self.loop = asyncio.get_running_loop()
        self.transport = transport
        self.idle_s = idle_s
        self.frame_s = owner.frame_timeout_s
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
        self.frame_s = self.owner.frame_timeout_s  # a reload may change it
        limit = self.idle_s if self.phase == self.IDLE else self.frame_s if self.phase == self.FRAME else None
        if self.owner.gate.holds(self.transport):
            limit = None  # the agent holds it (its read gate), not the peer
        now = self.loop.time()
        if limit is None or now - self.since < limit:
            left = self._period() if limit is None else limit - (now - self.since)
            return self._arm(min(left, self._period()))
        self.expired = True
        if self.phase == self.IDLE:  # silent beyond the idle timeout: the hook reconnects when it has news
            self.owner.counters.idle_closed += 1
        else:
            self.owner.counters.slow_peers += 1
            self.owner.rlog.warn("slow", "peer too slow to send a frame; closing")
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
    ``window_s`` (one that joins or turns quiet meanwhile is held at its first frame); then
    their sockets are read together, in one wake-up. A producer that
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
        if self._handle is not None:
            # Closed, and this quiet producer was not held (it joined, or turned quiet, after
            # the gate closed): it waits for the opening like the others.
            if transport not in self._held and transport.is_reading():
                transport.pause_reading()
                self._held.add(transport)
        elif self.window_s > 0 and len(self.members) - len(self.busy) > 1:
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
