"""Every connection to the agent's socket, from its first frame to its close.

A connection is a peer the kernel names (``SO_PEERCRED``). A peer outside the allow list is
refused. Under the connection caps (a total, and a quarter of it per uid but root's) its
first frame says what it wants: ``status`` (the health probe, answered even over the cap,
briefly), ``subscribe`` (a joined launch: handed to ``subscribe``), ``urgent`` (the hooks'
doorbell: the read gate opens at once) or ``hello`` (a producer). A producer's connection
then carries batches, each acked once every exporter has it. A hostile or broken peer costs
one connection, never the agent: oversized frames, slow senders, garbage and refused uids
are each counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

from infersight.agent.daemon.assemble import Producer, ProducerTableFull
from infersight.agent.daemon.frame_budget import FrameBudget, FrameShare
from infersight.agent.daemon.framing import GATE_S, ReadDeadline, ReadGate, read_frame
from infersight.agent.daemon.identity import Peer, peer_credentials, peer_groups
from infersight.agent.daemon.liveness import Liveness
from infersight.agent.daemon.loop_share import LoopShare
from infersight.agent.daemon.receive import Receiver
from infersight.agent.daemon.sanitize import decode_frame
from infersight.hooks import _wire

log = logging.getLogger("infersight.ingest")

# Connections beyond the cap that may still ask for ``status`` (each holds a descriptor
# for at most PROBATION_S); past this, new connections are closed at once.
STATUS_RESERVE = 32
PROBATION_S = 1.0

# A joined launch's subscription (sessions.Sessions.serve): (message, peer uid, reader, writer).
Subscribe = Callable[[dict[str, Any], int, asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Connections:
    def __init__(self, receiver: Receiver, liveness: Liveness, health: Callable[[], dict[str, Any]],
                 max_connections: int, frame_timeout_s: float = 10.0, idle_timeout_s: float | None = 300.0,
                 gate_s: float = GATE_S) -> None:
        self.receiver = receiver
        self.counters = receiver.counters
        self.rlog = receiver.rlog
        self.liveness = liveness
        if liveness.counters is None:
            liveness.counters = self.counters  # it counts the producers it ends without a visible pid
        self.health = health
        self.max_connections = max_connections
        self.max_connections_per_uid = max(1, max_connections // 4)
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s or None
        self.gate = ReadGate(gate_s)
        self.frame_budget = FrameBudget(self.counters)
        self.loop_share = LoopShare(self.counters)
        self.subscribe: Subscribe | None = None
        self.open = 0  # connections open now
        self._per_uid: dict[int, int] = {}  # open connections per peer uid
        self._tasks: set[asyncio.Task[Any]] = set()

    def cancel(self) -> None:
        """Cancel every connection's task (at shutdown)."""
        for t in list(self._tasks):
            t.cancel()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One accepted connection, to its end."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self.open += 1
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
            self.open -= 1
            if task is not None:
                self._tasks.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        pid, uid, gid = peer_credentials(sock)
        if not self.receiver.allowed(uid, gid) and not (peer_groups(sock) & self.receiver.allowed_gids):
            self.counters.refused_peers += 1
            self.rlog.warn("uid", "refused peer pid %d uid %d gid %d (not in the allow list)", pid, uid, gid)
            writer.write(_wire.refuse_frame("uid %d is not allowed" % uid))
            await writer.drain()
            return
        n = self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        try:
            await self._serve_peer(reader, writer, pid, uid, n)
        finally:
            if self._per_uid[uid] <= 1:
                del self._per_uid[uid]
            else:
                self._per_uid[uid] -= 1

    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int, uid: int,
                          n_of_uid: int) -> None:
        # Over the cap, a connection may still ask for status (the health probe must work
        # under a flood), but only briefly, and only so many at once. One uid (root aside) may
        # hold a quarter of the connections: another user's flood leaves room for yours.
        over = self.open - self.max_connections
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
            self.rlog.warn("cap", "connection limit (%d) reached: closing new connections", self.max_connections)
            return
        try:
            payload = await read_frame(reader, PROBATION_S if over > 0 else self.frame_timeout_s,
                                       self.frame_timeout_s, self.counters, self.rlog, self._frame_share(uid))
        except TimeoutError:
            if over > 0:
                closed_over()
            else:
                self.counters.slow_peers += 1
            return
        if payload is None:
            return
        msg = await self._decode_first(uid, payload)
        if msg is None:
            self.counters.malformed_frames += 1
            self.rlog.warn("frame", "peer pid %d sent a frame that is not a JSON object", pid)
            return
        if msg.get("t") == "status":
            writer.write(_wire.health_frame(self.health()))
            await writer.drain()
            return
        if msg.get("t") == "subscribe" and self.subscribe is not None and over <= 0:
            await self.subscribe(msg, uid, reader, writer, pid)
            return
        if msg.get("t") == "urgent":  # a producer sent an urgent frame (an OOM): read everyone now
            self.counters.urgent_wakeups += 1
            self.gate.open()
            return
        if over > 0:  # no reply: the hook retries later (a refusal would make it stop trying)
            closed_over()
            self.rlog.warn("cap", "connection limit (%d) reached: closing new connections", self.max_connections)
            return
        try:
            producer = self.receiver.hello(msg, writer, Peer(uid, pid))
        except ProducerTableFull as exc:  # no reply, as at the connection cap: the hook retries later
            self.receiver.rlog.warn("producers", "turned a hello of uid %d away for now: %s", uid, exc)
            return
        if producer is None:
            await writer.drain()
            return
        started = self.liveness.joined(producer, pid)
        try:
            await self._serve_producer(producer, uid, reader, writer)
        finally:
            self.liveness.left(producer, pid, started)

    async def _decode_first(self, uid: int, payload: bytes) -> dict[str, Any] | None:
        """A connection's first frame, decoded. A large one waits for its uid's share of the loop and is
        charged to it, as any frame; a small one (a status probe, a hello, a doorbell) neither waits nor
        makes its uid compete for the loop."""
        if not FrameShare.needs(len(payload)):
            return decode_frame(payload)
        pace = self.loop_share
        if pace.over(uid):
            await pace.wait(uid)
        started = time.perf_counter()  # no await from here to the charge (see _producer_loop)
        estimate = pace.reserve(uid, len(payload))
        try:
            return decode_frame(payload)
        finally:
            pace.settle(uid, len(payload), estimate, time.perf_counter() - started)

    def _frame_share(self, uid: int) -> FrameShare:
        """A connection of ``uid``: its large frames wait for their share of the bytes being read."""
        return FrameShare(self.frame_budget, uid, lambda: self.frame_timeout_s, self._frame_refused)

    def _frame_refused(self, uid: int) -> None:
        b = self.frame_budget
        self.rlog.warn("frame_budget", "a frame of uid %d waited %.0f s for its share of the large frames being "
                       "read (%d MiB a uid, %d MiB in all); closing", uid, self.frame_timeout_s, b.per_uid >> 20,
                       b.total >> 20)

    async def _serve_producer(
        self, producer: Producer, uid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(_wire.welcome_frame())
        acks: deque[list[int]] = deque()  # [last seq, done]
        state = {"acked": 0}

        def send_acks() -> None:
            last = 0
            while acks and acks[0][1]:
                last = acks.popleft()[0]
            if last > state["acked"] and not writer.is_closing():
                state["acked"] = last
                writer.write(_wire.ack_frame(last))

        deadline = ReadDeadline(self, writer.transport, self.idle_timeout_s)
        transport = cast(asyncio.Transport, writer.transport)
        self.gate.join(transport)
        try:
            await self._producer_loop(producer, uid, reader, writer, deadline, acks, send_acks)
        except (asyncio.IncompleteReadError, ConnectionError):
            if not deadline.expired:
                raise
        finally:
            self.gate.leave(transport)
            deadline.cancel()

    def _process_frame(self, producer: Producer, payload: bytes, acks: deque[list[int]],
                       send_acks: Callable[[], None]) -> None:
        """Decode one batch frame and assemble its events (the loop time its uid is charged)."""
        msg = decode_frame(payload)
        if msg is None or msg.get("t") != "b":
            self.counters.malformed_frames += 1
            self.rlog.warn("frame", "producer %s sent a malformed frame", producer.id)
            return
        events = msg.get("e")
        if isinstance(events, list) and len(events) > _wire.MAX_BATCH_EVENTS_READ:
            self.counters.malformed_frames += 1
            self.rlog.warn("frame", "producer %s sent a batch of %d events (no hook sends more than %d); "
                           "refused whole", producer.id, len(events), _wire.MAX_BATCH_EVENTS)
            return
        self.receiver.process_batch(producer, events, acks, send_acks)

    async def _producer_loop(
        self, producer: Producer, uid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
        deadline: ReadDeadline, acks: deque[list[int]], send_acks: Callable[[], None],
    ) -> None:
        loop = deadline.loop
        share = self._frame_share(uid)
        pace, clock = self.loop_share, time.perf_counter
        broadcaster = self.receiver.broadcaster
        readexactly = reader.readexactly
        gate, transport = self.gate, cast(asyncio.Transport, writer.transport)
        while True:
            if broadcaster.must_wait(uid):  # an exporter is full, or this uid's share of it: reading waits
                deadline.phase = ReadDeadline.HELD
                if broadcaster.over_share(uid):
                    self.counters.frames_waited_queue_share += 1
                await broadcaster.wait_turn(uid)
            deadline.phase, deadline.since = ReadDeadline.IDLE, loop.time()
            n = _wire.frame_size(await readexactly(_wire.HEADER.size))
            if n > _wire.MAX_FRAME_BYTES:
                self.counters.oversized_frames += 1
                self.rlog.warn("oversized", "peer sent a %d-byte frame (max %d); closing", n, _wire.MAX_FRAME_BYTES)
                return
            if share.needs(n):  # the agent holds it while it waits, not the peer: no frame timeout yet
                deadline.phase = ReadDeadline.HELD
                if not await share.take(n):
                    return
                deadline.phase, deadline.since = ReadDeadline.FRAME, loop.time()
                try:
                    payload = await readexactly(n)
                finally:
                    share.give_back(n)
            else:
                deadline.phase, deadline.since = ReadDeadline.FRAME, loop.time()
                payload = await readexactly(n)
            gate.frame(transport, n, deadline.since)
            if pace.over(uid):  # its uid took more than its share of the loop: the agent holds the frame
                deadline.phase = ReadDeadline.HELD
                await pace.wait(uid)
            # No await from here to the charge: connections of one uid that wake together each see the
            # debt the one before them reserved.
            started = clock()
            estimate = pace.reserve(uid, n)
            try:
                self._process_frame(producer, payload, acks, send_acks)
            finally:
                pace.settle(uid, n, estimate, clock() - started)
            if writer.transport.get_write_buffer_size() > 1 << 20:
                deadline.phase = ReadDeadline.HELD  # as before: no limit on a peer reading its acks
                await writer.drain()
