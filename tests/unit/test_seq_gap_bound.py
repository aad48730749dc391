"""A producer's gap list stays within MAX_GAPS however the gaps come: a late number inside a
range splits it in two, so seq 1, 2e9, then 3, 5, 7, ... once added one range per event without
bound (4M events: +520 MiB in the agent). Past the bound the oldest ranges merge, counted."""

from __future__ import annotations

from infersight.agent.daemon.sequence import MAX_GAPS, MAX_KEPT_GAPS, SeqTracker

FAR = 2_000_000_000  # within MAX_MISSING: a real gap, not a malformed jump
EXTRA = 500  # ranges past the bound (one is there before the splits: 2 .. FAR-1)


def _ranges_are_sorted_and_disjoint(gaps: list[tuple[int, int]]) -> bool:
    return all(a < b for a, b in gaps) and all(b1 <= a2 for (_a1, b1), (a2, _b2) in zip(gaps, gaps[1:]))


def _split_ascending(t: SeqTracker, n: int) -> list[int]:
    """seq 1, FAR, then n odd numbers 3, 5, 7, ...: each splits the open range; the numbers sent."""
    assert t.observe(1) and t.observe(FAR)
    odds = list(range(3, 3 + 2 * n, 2))
    for s in odds:
        assert t.observe(s), "a number missing until now is new"
    return odds


def test_splitting_a_gap_cannot_grow_the_list_past_its_bound() -> None:
    t = SeqTracker()
    odds = _split_ascending(t, MAX_GAPS - 1 + EXTRA)
    assert len(t.gaps) <= MAX_GAPS
    assert t.gaps_forgotten == EXTRA, "each split past the bound forgets one range, counted"
    assert _ranges_are_sorted_and_disjoint(t.gaps)
    assert t.lost == (FAR - 2) - len(odds), "each fill recovered one number, as before"
    assert not t.observe(odds[-1]) and t.duplicates == 1, "the latest fill is remembered: its copy is a duplicate"


def test_splitting_the_oldest_gap_keeps_the_number_just_filled() -> None:
    """Late numbers filling the oldest range from its end (a list insert at the front each time):
    bounded too, and the merge spares the two pieces the last number split, so its copy is dropped."""
    t = SeqTracker()
    assert t.observe(1) and t.observe(FAR)
    for _ in range(MAX_GAPS - 1 + EXTRA):
        assert t.observe(t.gaps[0][1] - 2)
    assert len(t.gaps) <= MAX_GAPS and t.gaps_forgotten == EXTRA
    assert _ranges_are_sorted_and_disjoint(t.gaps)
    last = t.gaps[0][1]  # the number that split the oldest range last
    assert not t.observe(last) and t.duplicates == 1


def test_honest_producers_below_the_bound_forget_nothing() -> None:
    t = SeqTracker()
    for s in (1, 2, 10, 20, 30):  # gaps 3..9, 11..19, 21..29
        assert t.observe(s)
    assert t.observe(5) and t.observe(15) and t.lost == 7 + 9 + 9 - 2
    assert not t.observe(5) and not t.observe(15) and not t.observe(20) and t.duplicates == 3
    assert t.gaps == [(3, 5), (6, 10), (11, 15), (16, 20), (21, 30)] and t.gaps_forgotten == 0


def test_a_split_gap_list_is_not_carried_across_a_restart() -> None:
    """What the state file gets stays bounded: a producer with more than MAX_KEPT_GAPS ranges is left out."""
    t = SeqTracker()
    _split_ascending(t, MAX_KEPT_GAPS + 1)
    assert len(t.gaps) > MAX_KEPT_GAPS and t.state() is None
