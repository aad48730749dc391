"""Verdicts that hold still: no P99 verdict from too few requests, a confidence bound on the
P99, hysteresis over evaluations; throttling judged on busy samples."""

from __future__ import annotations

import random

from infersight.agent.devices.heterogeneity import causes, evaluate, summarize_samples
from infersight.agent.devices.nvml import DeviceSample
from infersight.agent.devices.settings import load_thresholds
from infersight.latency import SeriesKey, SeriesStats, series_stats

TH = load_thresholds(None)  # the shipped rules/devices.toml


def _key(d: int) -> SeriesKey:
    return SeriesKey("GPU-%d" % d, "m", "c", "H100")


def _identical(n: int, rnd: random.Random) -> list[SeriesStats]:
    out = [series_stats(_key(d), [0.1 * rnd.lognormvariate(0, 0.3) for _ in range(n)]) for d in range(4)]
    return [s for s in out if s is not None]


def test_identical_gpus_are_not_called_slow_at_realistic_rates() -> None:
    rnd = random.Random(7)
    for n in (100, 200, 400):  # at and above min_requests (below it: no verdict, the next test)
        slow = sum(v.verdict == "slow" for _ in range(100) for v in evaluate(_identical(n, rnd), {}, TH))
        assert slow <= 4, (n, slow)  # of 400 verdicts (the old rules: 20 to 70 at 20-50 requests)


def test_no_p99_verdict_below_min_requests() -> None:
    assert TH.min_requests >= 100  # below 100 requests the nearest-rank P99 is the maximum
    s = [SeriesStats(_key(0), 50, 0.1, 0.5), SeriesStats(_key(1), 50, 0.1, 0.1), SeriesStats(_key(2), 50, 0.1, 0.1)]
    assert [v.verdict for v in evaluate(s, {}, TH)] == ["insufficient_data"] * 3


def test_two_outliers_in_a_hundred_are_not_a_slow_device() -> None:
    base = [0.1] * 98
    dev = series_stats(_key(0), base + [0.5, 0.5])  # P99 = the 2nd largest: an outlier
    peers = [series_stats(_key(d), [0.1] * 100) for d in (1, 2, 3)]
    v = evaluate([s for s in [dev, *peers] if s], {}, TH)[0]
    assert v.coefficient is not None and v.coefficient > 1.2  # the point estimate says 5x ...
    assert v.verdict == "ok"  # ... its 95% lower bound does not


def test_hysteresis_enters_after_evaluations_in_a_row_and_leaves_below_recover() -> None:
    def stats(p99: float) -> list[SeriesStats]:
        return [SeriesStats(_key(0), 500, 0.1, p99, p99)] + [SeriesStats(_key(d), 500, 0.1, 0.1, 0.1) for d in (1, 2)]

    before: dict[SeriesKey, object] = {}
    seen = []
    for p99 in (0.15, 0.15, 0.15, 0.115, 0.115, 0.105, 0.15, 0.10):
        verdicts = evaluate(stats(p99), {}, TH, before)  # type: ignore[arg-type]
        before = {v.key: v for v in verdicts}
        seen.append(verdicts[0].verdict)
    assert TH.slow_evaluations == 3
    assert TH.recover_coefficient == 1.1
    # slow on the 3rd evaluation over 1.2; 1.15 keeps it slow (above 1.1); 1.05 ends it; one
    # evaluation over 1.2 alone is not slow again.
    assert seen == ["ok", "ok", "slow", "slow", "slow", "ok", "ok", "ok"]
    assert "over it 1 of 3 evaluations" in evaluate(stats(0.15), {}, TH, {})[0].detail  # pending, said


def test_throttling_is_a_share_of_busy_samples() -> None:
    samples = []
    for i in range(300):
        busy = i % 20 < 3  # busy 15% of the window, thermally throttled whenever busy
        samples.append(DeviceSample(
            i * 10**9, 0, "GPU-a", "H100", utilization_gpu_pct=95 if busy else 0,
            clock_sm_mhz=1188 if busy else 345, clock_sm_max_mhz=1980,
            throttle_mask=0x40 if busy else 0x1,
            throttle_reasons=("hw_thermal_slowdown",) if busy else ("gpu_idle",),
        ))  # fmt: skip
    w = summarize_samples(samples, TH)
    assert (w.busy_samples, w.thermal_samples) == (45, 45)
    assert causes(w, TH)[0] == ("thermal_throttling", "thermal throttling in 45/45 busy samples")
    # throttled only while idle: no busy sample throttled, not the cause
    idle_hot = [DeviceSample(i, 0, "GPU-a", "H100", utilization_gpu_pct=0, throttle_mask=0x40,
                             throttle_reasons=("hw_thermal_slowdown",)) for i in range(60)]
    assert causes(summarize_samples(idle_hot, TH), TH)[0][0] == "unknown"
