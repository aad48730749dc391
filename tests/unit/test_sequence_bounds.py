"""What one producer can do to the fleet's loss counters is bounded: a sequence number too far
ahead is malformed (not lost, not acked), and a ``drops`` report past what its producer can have
dropped is malformed (not counted); real gaps and real drops are still counted as they are."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from infersight.agent.daemon.assemble import Assembler
from infersight.agent.daemon.health import Counters, health_metrics
from infersight.agent.daemon.receive import MAX_DROPS, Receiver, plausible_drops
from infersight.agent.daemon.sequence import MAX_GAPS, MAX_MISSING, SeqTracker
from infersight.telemetry import Item, Resource


class StubBroadcaster:
    """Publishes at once: every batch is done as it is handed over."""

    congested = False

    def __init__(self) -> None:
        self.items: list[Item] = []

    def publish(self, items: list[Item], done: Callable[[], None] | None = None, uid: int | None = None) -> None:
        self.items += items
        if done is not None:
            done()


def receiver() -> tuple[Receiver, Assembler, Counters]:
    a = Assembler("h")
    counters = Counters()
    return Receiver(a, StubBroadcaster(), counters, {0}, set()), a, counters  # type: ignore[arg-type]


HELLO = {"t": "hello", "schema": 1, "producer": {"id": "hostile", "pid": 7, "start_ns": 1,
                                                 "trace_id": "a" * 32, "root_span_id": "b" * 16}}


def log(seq: int) -> list[Any]:
    return [seq, 5, "log", {"body": "x"}]


class Conn:
    """A producer's connection as ``connections.py`` runs it: batches in, acks out."""

    def __init__(self, rx: Receiver, p: Any) -> None:
        self.rx, self.p = rx, p
        self.acks: deque[list[int]] = deque()
        self.acked = 0

    def batch(self, events: list[Any]) -> list[int]:
        """Process one batch; the acks it makes the agent send."""
        sent: list[int] = []

        def send_acks() -> None:
            last = 0
            while self.acks and self.acks[0][1]:
                last = self.acks.popleft()[0]
            if last > self.acked:
                self.acked = last
                sent.append(last)

        self.rx.process_batch(self.p, events, self.acks, send_acks)
        return sent


def test_a_jump_past_the_bound_is_malformed_not_lost() -> None:
    t = SeqTracker()
    assert t.observe(1)
    assert not t.observe(10**18)
    assert (t.lost, t.implausible, t.next_expected, t.gaps) == (0, 1, 2, [])
    assert t.observe(2) and t.lost == 0, "the producer's own next number is taken as before"


def test_the_bound_is_per_producer_not_only_per_gap() -> None:
    t = SeqTracker()
    assert t.observe(1 + MAX_MISSING // 2)  # a gap of MAX_MISSING/2 (1 .. MAX_MISSING/2): possible
    assert t.lost == MAX_MISSING // 2
    nxt = t.next_expected
    assert not t.observe(nxt + MAX_MISSING // 2 + 1), "a second such gap would pass MAX_MISSING missing"
    assert t.lost == MAX_MISSING // 2 and t.implausible == 1
    assert t.observe(nxt + MAX_MISSING // 2), "up to the bound it is still a gap"
    assert t.lost == MAX_MISSING


def test_real_gaps_are_still_counted_and_recovered() -> None:
    t = SeqTracker()
    for s in (1, 2, 100_000, 100_001):
        assert t.observe(s)
    assert t.lost == 100_000 - 3 and t.implausible == 0
    assert t.observe(50) and t.lost == 100_000 - 4


def test_merged_gaps_never_make_a_producers_loss_negative() -> None:
    """Past MAX_GAPS the oldest ranges merge; resending the numbers that did arrive between
    them must not drive this producer's count below zero (it would hide other producers' losses)."""
    t = SeqTracker()
    seqs = list(range(1, 4 * (MAX_GAPS + 50), 4))  # 1, 5, 9, ...: gaps of three
    for s in seqs:
        t.observe(s)
    for s in range(1, seqs[-1]):
        t.observe(s)  # everything, again: the missing ones fill, the others are duplicates
    assert t.lost >= 0


def test_the_receiver_counts_a_far_jump_as_malformed_and_does_not_ack_it() -> None:
    rx, a, counters = receiver()
    p = rx.hello(HELLO, None)
    assert p is not None
    conn = Conn(rx, p)
    assert conn.batch([log(1)]) == [1]
    assert conn.batch([log(10**18)]) == [], "no ack for a number the sequence refused"
    assert conn.batch([log(10**18), log(2)]) == [2], "nor with honest numbers in the same batch"
    assert a.lost_total() == 0
    assert counters.seq_implausible == 2 and counters.malformed_events == 2
    assert conn.batch([log(3), log(6)]) == [6], "honest numbers after it are taken and acked"
    assert a.lost_total() == 2 and counters.seq_implausible == 2
    metrics = health_metrics(Resource.of({}), 0, counters, a.lost_total(), 0, [], 0.0, 0)
    (lost,) = [m for m in metrics if m.name == "infersight.events.lost"]
    assert lost.points[0].value == 2


def dropped(a: Assembler) -> int:
    return sum(p.dropped_buffer + p.dropped_spool + p.dropped_texts for p in a.producers.values())


def test_the_receiver_refuses_a_drops_report_past_what_its_producer_can_have_dropped() -> None:
    rx, a, counters = receiver()
    p = rx.hello(HELLO, None)
    assert p is not None
    conn = Conn(rx, p)
    conn.batch([log(1), [2, 5, "drops", {"buffer": 10**15, "spool": 10**15}]])
    assert dropped(a) == 0
    assert counters.drops_implausible == 1 and counters.malformed_events == 1
    assert p.seq.lost == 0 and p.seq.next_expected == 3, "its number was no gap"
    # One report per field: buffer past the report's own number, texts past MAX_DROPS.
    conn.batch([[3, 5, "drops", {"buffer": 4, "spool": 0}], [4, 5, "drops", {"texts": MAX_DROPS + 1}]])
    assert dropped(a) == 0 and counters.drops_implausible == 3
    # Honest reports count as before (the hooks send totals: the largest is kept).
    conn.batch([log(5), log(10), [11, 5, "drops", {"buffer": 4, "spool": 1, "texts": 2}]])
    assert dropped(a) == 7 and p.seq.lost == 4 and counters.drops_implausible == 3


def test_plausible_drops() -> None:
    assert plausible_drops(10, {"buffer": 5, "spool": 5})
    assert plausible_drops(10, {"buffer": 10, "spool": 10, "texts": 10**6, "vanished": 3})
    assert not plausible_drops(10, {"buffer": 11})
    assert not plausible_drops(10, {"spool": 11})
    assert not plausible_drops(10**18, {"buffer": MAX_DROPS + 1})
    assert not plausible_drops(1, {"vanished": MAX_DROPS + 1})
    assert plausible_drops(1, {"fds": 40}) and not plausible_drops(1, {"fds": MAX_DROPS + 1})
    assert plausible_drops(1, {"buffer": "x"}), "a wrong type is the assembler's to refuse"


class HeldBroadcaster(StubBroadcaster):
    """Holds each batch's completion until the test releases it: an exporter still retrying a collector (a batch
    with no items completes at once, as the agent's broadcaster's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Callable[[], None]] = []

    def publish(self, items: list[Item], done: Callable[[], None] | None = None, uid: int | None = None) -> None:
        self.items += items
        if done is not None:
            (self.held.append if items else lambda f: f())(done)


def test_a_batch_of_duplicates_completes_only_once_its_originals_have() -> None:
    """A producer's exit spool (or a resent batch) holds only copies of a batch an exporter still has in memory: it
    completed at once, so the agent acked it and unlinked the spool file, and a SIGKILL then lost the events that
    only the exporter held (a review: 0 of 10 OOMs reached the collector). It completes with the originals."""
    hb = HeldBroadcaster()
    a = Assembler("h")
    rx = Receiver(a, hb, Counters(), {0}, set())  # type: ignore[arg-type]
    p = rx.hello(HELLO, None)
    assert p is not None
    first, copy = Conn(rx, p), Conn(rx, p)  # the connection, then the spool file's replay of the same events
    assert first.batch([log(1), log(2)]) == []
    done: list[str] = []
    rx.process_batch(p, [log(1), log(2)], copy.acks, lambda: done.append("copy"))
    assert done == [] and len(hb.held) == 1, "the copy waits for the original still in flight"
    hb.held.pop()()
    assert done == ["copy"]
    rx.process_batch(p, [log(1)], None, lambda: done.append("late copy"))  # nothing in flight: at once
    assert done == ["copy", "late copy"]


def test_a_copy_waits_only_for_the_batches_in_flight_when_it_came() -> None:
    """A producer that keeps a batch in flight at every moment (a slow collector, never idle) held a copy's
    completion, and every ack queued behind it, for good (a re-review: 198 batches later, still held)."""
    hb = HeldBroadcaster()
    rx = Receiver(Assembler("h"), hb, Counters(), {0}, set())  # type: ignore[arg-type]
    p = rx.hello(HELLO, None)
    assert p is not None
    first, copy = Conn(rx, p), Conn(rx, p)
    first.batch([log(1)])
    done: list[str] = []
    rx.process_batch(p, [log(1)], copy.acks, lambda: done.append("copy"))
    first.batch([log(2)])  # a newer batch in flight before the original completes
    hb.held.pop(0)()  # the original completes: the copy is complete, whatever came after it
    assert done == ["copy"]
