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
