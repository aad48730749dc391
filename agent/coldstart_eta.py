"""Cold-start progress and ETA from a service's past cold starts (pure: no files, no clocks).

The model: a cold start is a sequence of named stages. A finished run is remembered as its
ordered stage durations, its total, and the cache state that makes the same service fast or
slow (page cache of the weights, compile cache). While a new cold start runs we know which
stages have finished and how long it has been going. Then

    remaining = max(typical(current) - spent in current, floor) + sum(typical(s) for s to come)

scaled up by the service's typical share of time that no stage covers. "Typical" is the
median over the matching runs: robust to the one run where the disk was busy. Runs with
the same cache state are preferred; with none, every run of the key is used and the
estimate says so. Without any history there is no ETA, only elapsed time.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Never predict that the current stage ends sooner than this: a stage that runs past its
# typical time is still running, and a zero would make the ETA jump to "done".
FLOOR_S = 0.25
# A stage joins the expected sequence when it appears in at least this share of runs.
PRESENCE = 0.5
UNATTRIBUTED = "unattributed"


@dataclass(frozen=True, slots=True)
class Run:
    """One finished cold start of a service, as history keeps it."""

    stages: tuple[tuple[str, float], ...]  # (stage, seconds), in start order; repeats summed
    total_s: float
    cache: str = "unknown"  # e.g. "weights=warm,compile=hit"
    ended_at: float = 0.0  # wall-clock seconds, for ordering only

    def duration(self, stage: str) -> float:
        return sum(d for s, d in self.stages if s == stage)

    def covered_s(self) -> float:
        return sum(d for s, d in self.stages if s != UNATTRIBUTED)


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a gateway needs while an instance warms."""

    stage: str | None  # the stage believed to be running
    elapsed_s: float
    eta_s: float | None  # predicted seconds left; None without history
    progress: float | None  # elapsed / (elapsed + eta); None without history
    runs: int  # runs the estimate rests on
    spread_s: float | None  # interquartile range of the matching runs' totals
    same_cache: bool  # False when no run had this cache state and all runs were used


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _iqr(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    if len(values) < 4:
        return max(values) - min(values)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def expected_order(runs: Sequence[Run]) -> list[str]:
    """The stages a typical run goes through, in the order the most recent runs used.

    A stage present in fewer than half of the runs is left out; unattributed gaps are not
    stages one waits for, they are folded in as a share (see ``gap_share``).
    """
    if not runs:
        return []
    counts: dict[str, int] = {}
    position: dict[str, list[int]] = {}
    for run in runs:
        seen: list[str] = []
        for stage, _ in run.stages:
            if stage != UNATTRIBUTED and stage not in seen:
                seen.append(stage)
        for i, stage in enumerate(seen):
            counts[stage] = counts.get(stage, 0) + 1
            position.setdefault(stage, []).append(i)
    keep = [s for s, c in counts.items() if c >= PRESENCE * len(runs)]
    return sorted(keep, key=lambda s: (_median(position[s]), s))


def gap_share(runs: Sequence[Run]) -> float:
    """Median share of a cold start covered by no named stage, capped so it cannot explode."""
    shares = [max(0.0, 1.0 - r.covered_s() / r.total_s) for r in runs if r.total_s > 0]
    return min(_median(shares), 0.8)


def matching(history: Sequence[Run], cache: str | None) -> tuple[list[Run], bool]:
    """Runs with the same cache state when there are any, else all (flagged)."""
    if cache:
        same = [r for r in history if r.cache == cache]
        if same:
            return same, True
    return list(history), cache is None


def predict(
    history: Sequence[Run],
    done: Mapping[str, float],
    elapsed_s: float,
    *,
    current: str | None = None,
    current_spent_s: float | None = None,
    cache: str | None = None,
) -> Estimate:
    """Progress and ETA of a cold start that has run ``elapsed_s`` and finished ``done``.

    ``done`` maps finished stages to their seconds so far. ``current`` is the stage that is
    known to be running (from a stage-open event), else the next expected one that has not
    finished. ``current_spent_s`` defaults to the time since the finished stages' sum.
    """
    runs, same_cache = matching(history, cache)
    order = expected_order(runs)
    if current is None:
        current = next((s for s in order if s not in done), None)
    if not runs:
        return Estimate(current, elapsed_s, None, None, 0, None, same_cache)
    typical = {s: _median([r.duration(s) for r in runs]) for s in order}
    if current_spent_s is None:
        current_spent_s = max(0.0, elapsed_s - sum(v for k, v in done.items() if k != UNATTRIBUTED))
    if current is not None:
        left_now = max(typical.get(current, 0.0) - current_spent_s, FLOOR_S)
    else:
        # Every expected stage has finished: what is left is the tail after the last stage.
        left_now = max(_median([r.total_s for r in runs]) - elapsed_s, 0.0)
    to_come = [s for s in order if s not in done and s != current]
    named_left = left_now + sum(typical[s] for s in to_come)
    eta = named_left / (1.0 - gap_share(runs)) if current is not None else named_left
    progress = elapsed_s / (elapsed_s + eta) if elapsed_s + eta > 0 else 1.0
    totals = [r.total_s for r in runs]
    return Estimate(current, elapsed_s, eta, min(max(progress, 0.0), 1.0), len(runs), _iqr(totals), same_cache)
