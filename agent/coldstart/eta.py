"""Cold-start progress and ETA from a service's past cold starts (pure: no files, no clocks).

A finished run is remembered as its stages in start order, each with its duration and the
offset from the process start at which it ended, plus the total and the cache state that
makes the same service fast or slow (page cache of the weights, compile cache).

While a new cold start runs we know which stages have ended, and when. Each ended stage is
a *milestone* (``weights_load#0``: the first ``weights_load``). The furthest milestone that
history knows gives the prediction:

    eta = pace * median(total - end(milestone)) - (time since the milestone ended)

where ``pace`` is how much slower or faster this run reached the milestone than history did
(clipped to 0.67-1.5, and 1 until the milestone lies 20% into a typical run: a 0.1 s stage
that took 0.2 s says nothing about the next 20 s). Time that no stage covers is part
of the offsets, so gaps need no model of their own. The result never drops below a small
floor while the cold start is still running. Before any milestone, the ETA is the median
total minus the elapsed time. "Typical" is the median over matching runs: robust to the one
run where the disk was busy. Runs with the same cache state are preferred; with none, every
run is used and the estimate says so. Without history there is no ETA, only elapsed time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Never predict less than this while the cold start runs: a run past its typical time is
# still running, and a zero would tell a gateway to retry at once.
FLOOR_S = 0.25
# A stage joins the expected sequence when it appears in at least this share of runs.
PRESENCE = 0.5
UNATTRIBUTED = "unattributed"
PACE_MIN, PACE_MAX = 0.67, 1.5
PACE_AFTER = 0.2  # the pace is trusted once the milestone lies this far into a typical run
# A run is remembered (and a live one tracked) by its first MAX_STAGES top-level stages: a
# process that opens a stage per request before it is ready would otherwise make every run,
# and every estimate made from them, grow without bound. Milestones past them are not used.
MAX_STAGES = 256


@dataclass(frozen=True, slots=True)
class Run:
    """One finished cold start of a service, as history keeps it."""

    stages: tuple[tuple[str, float, float], ...]  # (stage, seconds, end offset from start), start order
    total_s: float
    cache: str = "unknown"  # e.g. "weights=warm,compile=hit"
    ended_at: float = 0.0  # wall-clock seconds, for ordering only

    def milestones(self) -> dict[str, float]:
        return milestones([(s, e) for s, _, e in self.stages])


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a gateway needs while an instance warms."""

    stage: str | None  # the stage expected to be running
    elapsed_s: float
    eta_s: float | None  # predicted seconds left; None without history
    progress: float | None  # elapsed / (elapsed + eta); None without history
    runs: int  # runs the estimate rests on
    spread_s: float | None  # interquartile range of the matching runs' totals
    same_cache: bool  # False when no run had this cache state and all runs were used


def milestones(ended: Sequence[tuple[str, float]]) -> dict[str, float]:
    """``{"stage#k": end offset}`` for ``(stage, end offset)`` pairs in start order."""
    seen: dict[str, int] = {}
    out: dict[str, float] = {}
    for stage, end in ended:
        if stage == UNATTRIBUTED:
            continue
        k = seen.get(stage, 0)
        seen[stage] = k + 1
        out["%s#%d" % (stage, k)] = end
    return out


def _median(values: Sequence[float]) -> float:
    import statistics  # at a prediction (a command with a history), not at every agent's start

    return float(statistics.median(values)) if values else 0.0


def _iqr(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    if len(values) < 4:
        return max(values) - min(values)
    import statistics

    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def typical_ends(runs: Sequence[Run]) -> dict[str, float]:
    """The median end offset of each milestone present in half the runs."""
    offsets: dict[str, list[float]] = {}
    for run in runs:
        for m, end in run.milestones().items():
            offsets.setdefault(m, []).append(end)
    return {m: _median(ends) for m, ends in offsets.items() if len(ends) >= PRESENCE * len(runs)}


def expected_order(runs: Sequence[Run]) -> list[str]:
    """The milestones a typical run passes, by median end offset (present in half the runs)."""
    ends = typical_ends(runs)
    return sorted(ends, key=lambda m: (ends[m], m))


def _next(order: list[str], ends: dict[str, float], now: dict[str, float]) -> str | None:
    """The milestone expected next: the first of ``order`` not passed, unless this run passed a later one after
    that one is typically over (it skipped it: a 2 ms import run that most runs had and this one did not,
    which held the expected stage at framework_import while the run loaded weights)."""
    for i, m in enumerate(order):
        if m in now:
            continue
        if any(now.get(later, -1.0) > ends[m] for later in order[i + 1:]):
            continue
        return m
    return None


def matching(history: Sequence[Run], cache: str | None) -> tuple[list[Run], bool]:
    """Runs whose cache state has every part of ``cache`` when there are any, else all (flagged).

    ``cache`` may be partial ("weights=cold" before the compile cache is known).
    """
    if cache:
        parts = set(cache.split(","))
        same = [r for r in history if parts <= set(r.cache.split(","))]
        if same:
            return same, True
    return list(history), cache is None


def predict(
    history: Sequence[Run],
    ended: Sequence[tuple[str, float]],
    elapsed_s: float,
    *,
    cache: str | None = None,
) -> Estimate:
    """Progress and ETA of a cold start ``elapsed_s`` in, whose stages ``ended`` so far.

    ``ended`` holds ``(stage, end offset from the process start)`` in start order.
    """
    runs, same_cache = matching(history, cache)
    ends = typical_ends(runs)
    order = sorted(ends, key=lambda m: (ends[m], m))
    now = milestones(ended)
    nxt = _next(order, ends, now)
    stage = nxt.split("#", 1)[0] if nxt else None
    if not runs:
        return Estimate(stage, elapsed_s, None, None, 0, None, same_cache)
    totals = [r.total_s for r in runs]
    known = [m for m in order if m in now]
    if known:
        mark = known[-1]
        past = [(r.milestones().get(mark), r.total_s) for r in runs]
        past_ok = [(end, total) for end, total in past if end is not None]
        typical_end = _median([end for end, _ in past_ok])
        pace = 1.0
        if typical_end >= PACE_AFTER * _median(totals):  # an early, tiny milestone says little
            pace = min(max(now[mark] / typical_end, PACE_MIN), PACE_MAX)
        left = pace * _median([total - end for end, total in past_ok]) - (elapsed_s - now[mark])
    else:
        left = _median(totals) - elapsed_s
    eta = max(left, FLOOR_S)
    progress = elapsed_s / (elapsed_s + eta) if elapsed_s + eta > 0 else 1.0
    return Estimate(stage, elapsed_s, eta, min(max(progress, 0.0), 1.0), len(runs), _iqr(totals), same_cache)
