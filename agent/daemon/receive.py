"""What every source of producer frames shares: a connection and a replayed spool file.

:class:`Receiver` checks a hello against the kernel (:mod:`identity`) and the schema, takes a
batch of events through the assembler to the exporters (with a completion per batch, which
becomes the producer's ack), closes a dead producer's cold start, and holds the allow list
and the counters. A hostile or broken peer is counted and logged (rate-limited), never
raised to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from infersight.agent.daemon.assemble import Assembler, Malformed, Producer
from infersight.agent.daemon.broadcast import Broadcaster
from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.identity import Peer, refusal
from infersight.hooks import _wire

log = logging.getLogger("infersight.ingest")


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


class Receiver:
    def __init__(self, assembler: Assembler, broadcaster: Broadcaster, counters: Counters,
                 allowed_uids: set[int], allowed_gids: set[int]) -> None:
        self.assembler = assembler
        self.broadcaster = broadcaster
        self.counters = counters
        self.allowed_uids = allowed_uids  # a reload replaces these
        self.allowed_gids = allowed_gids
        self.rlog = RateLimitedLog()
        self.pending_completions = 0  # batches handed to the exporters, not yet complete

    def allowed(self, uid: int, gid: int) -> bool:
        """The allow list: a peer (or a spool file's owner) of these uids or gids may produce."""
        return uid in self.allowed_uids or gid in self.allowed_gids

    def hello(self, msg: dict[str, Any], writer: asyncio.StreamWriter | None, peer: Peer | None = None
              ) -> Producer | None:
        """The producer of a hello from ``peer`` (None: in-process, trusted); None when refused
        (with a ``refuse`` frame to ``writer``, if any)."""
        def refuse(error: str) -> None:
            if writer is not None:
                writer.write(_wire.refuse_frame(error))

        if msg.get("t") != "hello":
            self.counters.malformed_frames += 1
            refuse("expected a hello frame first")
            return None
        schema = msg.get("schema")
        if schema != _wire.SCHEMA_VERSION:
            self.counters.refused_schema += 1
            err = "this agent speaks event schema %d, the producer speaks %r: upgrade the older side" % (
                _wire.SCHEMA_VERSION, schema)
            self.rlog.warn("schema", "%s", err)
            refuse(err)
            return None
        raw = msg.get("producer")
        if peer is not None and isinstance(raw, dict) and isinstance(raw.get("id"), str) \
                and type(raw.get("pid")) is int:
            why = refusal(raw["id"], raw["pid"], peer)
            if why is not None:
                self.counters.refused_identity += 1
                self.rlog.warn("identity", "refused a hello from uid %d: %s", peer.uid, why)
                refuse("identity refused: %s" % why)
                return None
        try:
            return self.assembler.hello(raw, None if peer is None else peer.uid)
        except Malformed as exc:
            self.counters.malformed_frames += 1
            self.rlog.warn("hello", "malformed hello: %s", exc)
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
        """Assemble one batch and publish it. Once every exporter has it, its entry in
        ``acks`` (``[last seq, done]``) is marked done and ``send_acks``, then ``on_done``, run."""
        before_bad, before_dup, before_n = producer.malformed, producer.seq.duplicates, producer.events
        before_vanished = producer.spool_vanished
        items = self.assembler.events(producer, events)
        if producer.spool_vanished > before_vanished:
            self.counters.spool_files_vanished += producer.spool_vanished - before_vanished
            self.rlog.warn("vanished", "producer %s: someone removed its spool file (%d so far; the hook "
                           "rescued what it held)", producer.id, producer.spool_vanished)
        self.counters.malformed_events += producer.malformed - before_bad
        self.counters.duplicates += producer.seq.duplicates - before_dup
        self.counters.events_in += producer.events - before_n
        if producer.malformed > before_bad:
            self.rlog.warn("event", "producer %s sent malformed events (counted, dropped)", producer.id)
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

    def close_lost(self, producer: Producer) -> None:
        """Its process has ended: close its open cold start (the assembler's ``producer_lost``)."""
        items = self.assembler.producer_lost(producer)
        if items:
            self.counters.items_out += len(items)
            self.broadcaster.publish(items)
