"""Per-producer sequence accounting (pure).

Producers number events 1, 2, 3, ... A missing number is a gap: counted as lost
until it arrives late (resend after a reconnect, spool replay), when it is recovered.
A number seen before is a duplicate: dropped and counted, so at-least-once delivery
from the hooks becomes exactly-once into the exporters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_GAPS = 4096


@dataclass(slots=True)
class SeqTracker:
    next_expected: int = 1
    lost: int = 0  # currently missing
    duplicates: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)  # [start, end) ranges, sorted
    gaps_forgotten: int = 0  # gap ranges merged away once MAX_GAPS was exceeded

    def resume_after(self, acked: int) -> None:
        """A producer new to this agent says everything up to ``acked`` was delivered."""
        if acked >= self.next_expected:
            self.next_expected = acked + 1

    def observe(self, seq: int) -> bool:
        """Record ``seq``; True if it is new and should be processed."""
        if seq == self.next_expected:
            self.next_expected += 1
            return True
        if seq > self.next_expected:
            self.gaps.append((self.next_expected, seq))
            self.lost += seq - self.next_expected
            self.next_expected = seq + 1
            if len(self.gaps) > MAX_GAPS:
                # Keep memory bounded: merge the two oldest ranges. Numbers between them
                # count as missing; a late one there is then taken as a duplicate.
                (a, _b), (_c, d) = self.gaps[0], self.gaps[1]
                self.gaps[0:2] = [(a, d)]
                self.gaps_forgotten += 1
            return True
        return self._fill(seq)

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
            if start <= seq < end:
                pieces = [(s, e) for s, e in ((start, seq), (seq + 1, end)) if s < e]
                self.gaps[lo : lo + 1] = pieces
                self.lost -= 1
                return True
        self.duplicates += 1
        return False
