"""Sequence-gap accounting (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from infersight.agent.daemon.sequence import SeqTracker


def test_in_order_has_no_loss() -> None:
    t = SeqTracker()
    assert all(t.observe(i) for i in range(1, 101))
    assert (t.lost, t.duplicates, t.next_expected) == (0, 0, 101)


def test_gap_counts_lost_and_late_arrival_recovers() -> None:
    t = SeqTracker()
    for i in (1, 2, 6, 7):
        assert t.observe(i)
    assert t.lost == 3 and t.gaps == [(3, 6)]
    assert t.observe(4)
    assert t.lost == 2 and t.gaps == [(3, 4), (5, 6)]
    assert not t.observe(4), "a second copy is a duplicate"
    assert t.duplicates == 1 and t.lost == 2


def test_duplicate_below_watermark_is_dropped() -> None:
    t = SeqTracker()
    for i in (1, 2, 3):
        t.observe(i)
    assert not t.observe(2)
    assert t.duplicates == 1 and t.lost == 0


def test_resume_after_ack_counts_only_unacked_gaps() -> None:
    t = SeqTracker()
    t.resume_after(500)  # a restarted agent: the producer says 1..500 were acked
    assert t.observe(501) and t.lost == 0
    assert t.observe(505) and t.lost == 3


@given(st.lists(st.integers(min_value=1, max_value=300), max_size=400))
def test_lost_equals_missing_numbers(seqs: list[int]) -> None:
    t = SeqTracker()
    for s in seqs:
        t.observe(s)
    seen = set(seqs)
    top = max(seen) if seen else 0
    assert t.lost == len(set(range(1, top + 1)) - seen)
    assert t.duplicates == len(seqs) - len(seen)
