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
from infersight.agent.daemon.sequence import MAX_MISSING
from infersight.hooks import _wire
from infersight.sanitize import log_text

log = logging.getLogger("infersight.ingest")

# A ``drops`` report carries its producer's totals so far (the agent keeps the largest). What
# one report may claim is bounded by what its producer can have dropped: every event dropped
# by the buffer (``buffer``) or lost for want of spool (``spool``) had a sequence number below
# the report's own, so each is at most the report's number; every count (``texts``, ``vanished``
# and ``fds`` too) is at most MAX_MISSING, the most numbers a producer may have missing. Since
# the agent keeps the largest, that bounds the producer's totals as well. A report past these
# bounds is malformed: counted (``drops_implausible``, and as a malformed event), not taken.
MAX_DROPS = MAX_MISSING


class RateLimitedLog:
    """At most one line per ``every_s`` per key; says how many were suppressed. Every argument
    but a number is another user's word, as often as not (a producer id, a spool file's name, an
    error quoting a hello): each is made one bounded line here (:func:`log_text`), so that no
    producer can write a line of its own into the agent's log."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.every_s:
            n = self._suppressed.pop(key, 0)
            suffix = " (%d similar suppressed)" % n if n else ""
            log.warning(msg + suffix, *(a if isinstance(a, (int, float)) else log_text(a) for a in args))
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
        # shown each producer that said hello on a connection of its own (a live process), after its checks
        self.hello_taps: list[Callable[[Producer], None]] = []
        # Per producer, its batches not yet complete (batch number -> the waiters [batches left, done] of the
        # batches without items that came while it was in flight: see ``process_batch``)
        self._inflight_batches: dict[str, dict[int, list[list[Any]]]] = {}
        self._batch_no = 0

    def allowed(self, uid: int, gid: int) -> bool:
        """The allow list: a peer (or a spool file's owner) of these uids or gids may produce."""
        return uid in self.allowed_uids or gid in self.allowed_gids

    def hello(self, msg: dict[str, Any], writer: asyncio.StreamWriter | None, peer: Peer | None = None
              ) -> Producer | None:
        """The producer of a hello from ``peer`` (None: in-process, trusted); None when refused
        (with a ``refuse`` frame to ``writer``, if any). Raises :class:`ProducerTableFull` when
        the uid holds its share of the producer table: a "not now", not a refusal."""
        def refuse(error: str) -> None:
            if writer is not None:  # the reply quotes the hello (its id, its schema): one bounded line
                writer.write(_wire.refuse_frame(log_text(error)))

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
            producer = self.assembler.hello(raw, None if peer is None else peer.uid)
        except Malformed as exc:
            self.counters.malformed_frames += 1
            self.rlog.warn("hello", "malformed hello: %s", exc)
            refuse("malformed hello: %s" % exc)
            return None
        if peer is not None and peer.pid is not None:  # a connection (a spool file's hello names none)
            producer.peer_pid = peer.pid
            for tap in self.hello_taps:
                try:
                    tap(producer)
                except Exception as exc:  # a feature's tap never costs a producer its hello
                    self.rlog.warn("hello-tap", "a hello tap failed: %s", exc)
        return producer

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
        before_vanished, before_implausible = producer.spool_vanished, producer.seq.implausible
        before_fds = producer.fds_lost
        last = 0
        if isinstance(events, list):
            bad_drops = False
            for ev in events:
                if isinstance(ev, list) and ev and isinstance(ev[0], int) and not isinstance(ev[0], bool):
                    last = max(last, ev[0])
                    if len(ev) == 4 and ev[2] == "drops" and not plausible_drops(ev[0], ev[3]):
                        bad_drops = True
            if bad_drops:
                events = self._refuse_drops(producer, events)
        items = self.assembler.events(producer, events)
        implausible = producer.seq.implausible - before_implausible
        if implausible:
            self.counters.seq_implausible += implausible
            self.counters.malformed_events += implausible
            self.rlog.warn("seq", "producer %s sent sequence numbers too far ahead to be gaps (%d so far: "
                           "malformed, not counted as lost)", producer.id, producer.seq.implausible)
        if producer.spool_vanished > before_vanished:
            self.counters.spool_files_vanished += producer.spool_vanished - before_vanished
            self.rlog.warn("vanished", "producer %s: someone removed its spool file (%d so far; the hook "
                           "rescued what it held)", producer.id, producer.spool_vanished)
        if producer.fds_lost > before_fds:
            self.counters.producer_fds_lost += producer.fds_lost - before_fds
            self.rlog.warn("fds", "producer %s: its host closed or took over the hooks' descriptors (%d so far: "
                           "a daemonizing os.closerange?); the hooks left them to the host and reopened theirs",
                           producer.id, producer.fds_lost)
        self.counters.malformed_events += producer.malformed - before_bad
        self.counters.duplicates += producer.seq.duplicates - before_dup
        self.counters.events_in += producer.events - before_n
        if producer.malformed > before_bad:
            self.rlog.warn("event", "producer %s sent malformed events (counted, dropped)", producer.id)
        self.counters.items_out += len(items)
        # Acked: up to the highest number the batch held that the producer's sequence took (not
        # one refused as too far ahead: the ack would tell the hook to forget what never counted).
        entry = [min(last, producer.seq.next_expected - 1), 0]
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

        pid = producer.id
        if not items:
            inflight = self._inflight_batches.get(pid)
            if inflight:
                # A batch that made no items (a resent or replayed copy of batches still in flight) completes once
                # the batches in flight now have, else its ack (or its spool file's unlink) comes while the
                # originals are only in an exporter's memory. Not later ones: a producer never idle would hold
                # this ack, and every one behind it, for good.
                waiting = [len(inflight), done]
                for waiters in inflight.values():
                    waiters.append(waiting)
                return
            self.broadcaster.publish(items, done, producer.uid)
            return
        batches = self._inflight_batches.setdefault(pid, {})
        self._batch_no += 1
        token = self._batch_no
        batches[token] = []

        def done_inflight() -> None:
            waiters = batches.pop(token, [])
            if not batches and self._inflight_batches.get(pid) is batches:
                del self._inflight_batches[pid]
            done()
            for waiting in waiters:
                waiting[0] -= 1
                if waiting[0] == 0:
                    waiting[1]()

        self.broadcaster.publish(items, done_inflight, producer.uid)

    def _refuse_drops(self, producer: Producer, events: list[Any]) -> list[Any]:
        """``events`` with each implausible ``drops`` report replaced by one the assembler
        refuses as malformed (its sequence number still taken: it was no gap)."""
        out: list[Any] = []
        for ev in events:
            if isinstance(ev, list) and len(ev) == 4 and ev[2] == "drops" and type(ev[0]) is int \
                    and not plausible_drops(ev[0], ev[3]):
                self.counters.drops_implausible += 1
                self.rlog.warn("drops", "producer %s reported more drops than it can have made (report seq %d): "
                               "malformed, not counted", producer.id, ev[0])
                out.append([ev[0], ev[1], "drops", None])  # "data must be an object": counted, dropped
            else:
                out.append(ev)
        return out

    def close_lost(self, producer: Producer) -> None:
        """Its process has ended: close its open cold start (the assembler's ``producer_lost``)."""
        items = self.assembler.producer_lost(producer)
        if items:
            self.counters.items_out += len(items)
            self.broadcaster.publish(items)


def plausible_drops(seq: int, data: Any) -> bool:
    """Whether a ``drops`` report numbered ``seq`` claims no more than its producer can have
    dropped (see MAX_DROPS). Values of the wrong type are the assembler's to refuse."""
    if type(data) is not dict:
        return True
    for key in ("buffer", "spool", "texts", "vanished", "fds"):
        v = data.get(key, 0)
        if type(v) is not int:
            continue
        if v > MAX_DROPS or (key in ("buffer", "spool") and v > seq):
            return False
    return True
