"""Sequence state carried across an agent restart (pure part, and the file at the edge)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from infersight.agent.daemon import seqstate
from infersight.agent.daemon.sequence import MAX_KEPT_GAPS, SeqTracker


def test_what_the_previous_agent_took_is_a_duplicate_and_its_gaps_still_fill() -> None:
    old = SeqTracker()
    for n in (1, 2, 3, 5, 6):  # 4 never came
        assert old.observe(n)
    new = SeqTracker()
    new.resume_after(2)  # the producer had 1 and 2 acked
    assert new.restore(old.state(), acked=2)
    assert [new.observe(n) for n in (3, 4, 5, 6, 7)] == [False, True, False, False, True]
    assert new.duplicates == 3 and new.lost == 0


def test_acked_numbers_are_no_gap_and_a_bad_state_changes_nothing() -> None:
    old = SeqTracker()
    old.observe(1)
    old.observe(4)  # 2 and 3 missing
    new = SeqTracker()
    assert new.restore(old.state(), acked=3)  # the producer says 1..3 were delivered
    assert new.lost == 0 and new.next_expected == 5
    for bad in ([5, [[3, 2]]], [5, [[1, 9]]], "x", [5], [0, []], [5, [[2, 3]] * (MAX_KEPT_GAPS + 1)]):
        t = SeqTracker()
        assert not t.restore(bad, acked=0)
        assert t.next_expected == 1 and t.gaps == []


def test_too_many_gaps_are_not_carried() -> None:
    t = SeqTracker()
    for n in range(1, 4 * MAX_KEPT_GAPS, 2):
        t.observe(n)
    assert t.state() is None


def test_the_file_is_read_once_and_a_foreign_one_is_ignored(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    seqstate.save(str(state), {"p1": [4, [[2, 3]]]})
    f = state / seqstate.FILE
    assert (f.stat().st_mode & 0o777) == 0o600
    assert seqstate.load(str(state)) == {"p1": [4, [[2, 3]]]}
    assert not f.exists() and seqstate.load(str(state)) == {}
    f.write_text(json.dumps([1, 2]))
    assert seqstate.load(str(state)) == {} and not f.exists()
    os.symlink("/etc/passwd", f)  # a link is not followed
    assert seqstate.load(str(state)) == {}


def test_a_state_goes_only_to_the_same_id_from_the_same_uid() -> None:
    """Keyed by the table key, the state went to whoever said hello first with the bare id: another user
    who said hello with a victim's id (and acked near 2**32) in the old agent had every event of the
    victim dropped as a duplicate by the next one (a review reproduced it: 0 of 199 kept)."""
    from infersight.agent.daemon.assemble import Assembler

    def hello(a: Assembler, uid: int, acked: int):  # type: ignore[no-untyped-def]
        return a.hello({"id": "boot-4242-987654", "pid": 4242, "start_ns": 1, "trace_id": "a" * 32,
                        "root_span_id": "b" * 16, "acked": acked}, uid)

    old = Assembler("h")
    hello(old, 2000, 4_000_000_000)  # the attacker, first, with the victim's id
    victim = hello(old, 1000, 0)
    for n in range(1, 6):
        victim.seq.observe(n)
    new = Assembler("h")
    new.resume_hints = json.loads(json.dumps(old.sequences()))  # as the file carries it
    again = hello(new, 1000, 0)  # the victim first this time: the bare id is its own here
    assert again.seq.next_expected == 6  # its own state: 1..5 are duplicates, 6 goes on
    assert [again.seq.observe(n) for n in (5, 6)] == [False, True]
    other = hello(new, 2000, 0)
    assert other.seq.next_expected == 4_000_000_001  # the attacker's state went to the attacker only
