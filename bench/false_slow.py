"""False "slow" verdicts on identical GPUs, and detection of a really slower one: the shipped
verdict (min_requests, the P99's lower confidence bound, hysteresis) against the one before it
(min_requests 20, the P99 itself, no hysteresis). Run: python bench/false_slow.py

Latencies: lognormal, sigma 0.3 (prompt-length variance), 100 ms median; 4 GPUs of one kind.
A. One evaluation of independent windows of n requests per GPU: how often is at least one of
   4 identical GPUs called slow; how often is a GPU 1.5x slower (every request) called slow.
B. A sliding 300 s window evaluated every 10 s for an hour (Poisson arrivals): the share of
   evaluations a GPU is slow and its slow<->ok transitions.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import replace

from infersight.agent.devices.heterogeneity import DeviceVerdict, evaluate
from infersight.agent.devices.settings import load_thresholds
from infersight.latency import SeriesKey, SeriesStats, series_stats
from infersight.rules.device_rules import DeviceThresholds

NEW = load_thresholds(None)
OLD = replace(NEW, min_requests=20)


def _stats(key: SeriesKey, values: list[float], old: bool) -> SeriesStats | None:
    s = series_stats(key, values)
    return replace(s, p99_low_s=None) if s is not None and old else s  # the old verdict judged the P99 itself


def one_shot(n: int, slow_factor: float, old: bool, rnd: random.Random, trials: int = 1000) -> float:
    th: DeviceThresholds = OLD if old else NEW
    hits = 0
    for _ in range(trials):
        st = [_stats(SeriesKey("GPU-%d" % d, "m", "c", "H100"),
                     [(slow_factor if d == 0 else 1.0) * 0.1 * rnd.lognormvariate(0, 0.3) for _ in range(n)], old)
              for d in range(4)]  # fmt: skip
        v = evaluate([s for s in st if s], {}, th)
        hits += (v[0].verdict == "slow") if slow_factor > 1 else any(x.verdict == "slow" for x in v)
    return hits / trials


def sliding(rate: float, old: bool, rnd: random.Random) -> tuple[list[float], list[int]]:
    th = OLD if old else NEW
    wins: list[deque[tuple[float, float]]] = [deque() for _ in range(4)]
    arr = [rnd.expovariate(rate) for _ in range(4)]
    t, ticks, slow, flips = 0.0, 0, [0] * 4, [0] * 4
    before: dict[SeriesKey, DeviceVerdict] = {}
    while t < 3600 + 300:
        t += 10
        for d in range(4):
            while arr[d] <= t:
                wins[d].append((arr[d], 0.1 * rnd.lognormvariate(0, 0.3)))
                arr[d] += rnd.expovariate(rate)
            while wins[d] and wins[d][0][0] < t - 300:
                wins[d].popleft()
        st = [_stats(SeriesKey("GPU-%d" % d, "m", "c", "H100"), [v for _, v in wins[d]], old) for d in range(4)]
        verdicts = evaluate([s for s in st if s], {}, th, None if old else before)
        now = {v.key: v for v in verdicts}
        if t > 300:
            ticks += 1
            for d in range(4):
                k = SeriesKey("GPU-%d" % d, "m", "c", "H100")
                was_slow = k in before and before[k].verdict == "slow"
                is_slow = k in now and now[k].verdict == "slow"
                slow[d] += is_slow
                flips[d] += was_slow != is_slow
        before = now
    return [s / ticks for s in slow], flips


def main() -> None:
    rnd = random.Random(1)
    print("A. one evaluation, 4 GPUs: P(an identical GPU called slow) | P(a 1.5x slower GPU called slow)")
    for n in (20, 50, 100, 200, 500, 1000):
        row = []
        for old in (True, False):
            row.append("%3.0f%% | %3.0f%%" % (100 * one_shot(n, 1.0, old, rnd), 100 * one_shot(n, 1.5, old, rnd)))
        print("  n=%4d  before: %s   now: %s" % (n, *row))
    print("B. sliding 300 s window, 10 s evaluations, 1 h, 4 identical GPUs: slow share per GPU, transitions")
    for rate in (0.15, 0.5, 1.0, 3.0):
        for old in (True, False):
            share, flips = sliding(rate, old, rnd)
            print("  %.2f req/s (%4d per window) %s: slow %s transitions %s" % (
                rate, rate * 300, "before" if old else "now   ", ["%.0f%%" % (100 * s) for s in share], flips))


if __name__ == "__main__":
    main()
