"""Per-producer sequence accounting (pure).

Producers number events 1, 2, 3, ... A missing number is a gap: counted as lost
until it arrives late (resend after a reconnect, spool replay), when it is recovered.
A number seen before is a duplicate: dropped and counted, so at-least-once delivery
from the hooks becomes exactly-once into the exporters.

A number further ahead than any producer can get is not a gap but a malformed event
(``implausible``: dropped, not processed, not counted as lost, and not acked): one producer
has at most ``MAX_MISSING`` numbers missing at a time, a jump that would pass it is refused.
A hook's numbers go missing only as events it dropped (a full buffer, a full spool: each
counted in its ``drops`` reports) or that are still on their way; 2**32 of them is over
eleven hours of dropping at 100 000 events a second, without a single one arriving. So a
peer's one frame (seq 10**18 after seq 1) cannot move the fleet's loss counters by more.

Its missing ranges are bounded too (``MAX_GAPS``), however they come: a jump ahead adds one, and
so does a late number inside a range (it splits it in two: seq 1, 2e9, then 3, 5, 7, ...). Past
the bound the oldest two ranges merge (``gaps_forgotten``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_GAPS = 256  # a uid may hold 1024 producers: 256 ranges each is about 34 MiB at most, 4096 was 530 MiB
MAX_KEPT_GAPS = 64  # gaps of one producer carried across an agent restart (more: not carried)
MAX_MISSING = 1 << 32  # numbers one producer may have missing at once: a jump past it is malformed


@dataclass(slots=True)
class SeqTracker:
    next_expected: int = 1
    lost: int = 0  # currently missing
    duplicates: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)  # [start, end) ranges, sorted
    gaps_forgotten: int = 0  # gap ranges merged away to stay within MAX_GAPS (new gaps and split ones)
    implausible: int = 0  # numbers refused: they would leave more than MAX_MISSING missing

    def resume_after(self, acked: int) -> None:
        """A producer new to this agent says everything up to ``acked`` was delivered."""
        if acked >= self.next_expected:
            self.next_expected = acked + 1

    def state(self) -> list[object] | None:
        """What this tracker has taken, to carry across an agent restart: ``[next_expected, gaps]``;
        None when it holds more than MAX_KEPT_GAPS gaps (too much to keep: that producer is back to
        at-least-once)."""
        if len(self.gaps) > MAX_KEPT_GAPS:
            return None
        return [self.next_expected, [list(g) for g in self.gaps]]

    def restore(self, state: object, acked: int) -> bool:
        """Take what a previous agent had taken (:meth:`state`), on a tracker new to this agent whose
        producer says ``acked`` was delivered: a resent number the previous agent already processed is a
        duplicate, one it was missing still fills its gap. False (nothing changed) for a malformed state."""
        if not (isinstance(state, list) and len(state) == 2 and type(state[0]) is int and isinstance(state[1], list)
                and len(state[1]) <= MAX_KEPT_GAPS):
            return False
        nxt = state[0]
        gaps: list[tuple[int, int]] = []
        for g in state[1]:
            if not (isinstance(g, list) and len(g) == 2 and all(type(x) is int for x in g)
                    and 1 <= g[0] < g[1] <= nxt):
                return False
            gaps.append((g[0], g[1]))
        if nxt < 1 or nxt - 1 > acked + MAX_MISSING or gaps != sorted(gaps):
            return False
        gaps = [(max(a, acked + 1), b) for a, b in gaps if b > acked + 1]  # delivered up to acked: no gap there
        self.next_expected = max(nxt, acked + 1, self.next_expected)
        self.gaps = gaps
        self.lost = sum(b - a for a, b in gaps)
        return True

    def observe(self, seq: int) -> bool:
        """Record ``seq``; True if it is new and should be processed."""
        if seq == self.next_expected:
            self.next_expected += 1
            return True
        if seq > self.next_expected:
            if self.lost + (seq - self.next_expected) > MAX_MISSING:
                self.implausible += 1  # no producer gets this far ahead: malformed, not lost
                return False
            self.gaps.append((self.next_expected, seq))
            self.lost += seq - self.next_expected
            self.next_expected = seq + 1
            self._bound_gaps()
            return True
        return self._fill(seq)

    def _bound_gaps(self, split_at: int | None = None) -> None:
        """Keep at most MAX_GAPS ranges (memory: one producer's numbers add a range each): merge the two
        oldest, counted in ``gaps_forgotten``. Numbers that arrived between them then look missing (see
        :meth:`_fill`). When the oldest range was just split at ``split_at`` by a late number, the next
        pair merges instead, so that number stays remembered and its resent copy is still a duplicate."""
        while len(self.gaps) > MAX_GAPS:
            i = 1 if split_at == 0 and len(self.gaps) > 2 else 0
            (a, _b), (_c, d) = self.gaps[i], self.gaps[i + 1]
            self.gaps[i : i + 2] = [(a, d)]
            self.gaps_forgotten += 1

    def _fill(self, seq: int) -> bool:
        lo, hi = 0, len(self.gaps)
        while lo < hi:  # binary search for the range holding seq
            mid = (lo + hi) // 2
            if self.gaps[mid][1] <= seq:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(self.gaps):
            start, end = self.gaps[lo]
            if start <= seq < end and self.lost > 0:
                # (In a merged range a number that did arrive looks missing too: its resent
                # copy would "recover" what was never counted. This producer's count stops at
                # zero, so it can never take from the others' in the fleet's total.)
                pieces = [(s, e) for s, e in ((start, seq), (seq + 1, end)) if s < e]
                self.gaps[lo : lo + 1] = pieces
                self.lost -= 1
                self._bound_gaps(split_at=lo)  # a number inside a range splits it: one range more
                return True
        self.duplicates += 1
        return False
