"""Percentiles, coefficients and slow-device verdicts on recorded latency series; rule examples."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infersight.agent.devices.heterogeneity import WindowState, evaluate, run_example, summarize_samples
from infersight.agent.devices.nvml import DeviceSample
from infersight.latency import LatencyWindow, SeriesKey, SeriesStats, percentile, series_stats
from infersight.rules.device_rules import (
    CAUSES,
    WINDOW_KEYS,
    DeviceRulesError,
    DeviceThresholds,
    load_device_rules,
    parse_device_rules,
)

TH = DeviceThresholds()
RULES = load_device_rules()


# ---- percentiles (nearest-rank) ----


def test_percentile_nearest_rank() -> None:
    v = [float(i) for i in range(1, 101)]
    assert percentile(v, 50) == 50.0
    assert percentile(v, 99) == 99.0
    assert percentile(v, 100) == 100.0
    ten = [float(i) for i in range(1, 11)]
    assert percentile(ten, 50) == 5.0
    assert percentile(ten, 99) == 10.0
    assert percentile([3.0], 50) == percentile([3.0], 99) == 3.0
    assert percentile([float(i) for i in range(1, 301)], 99) == 297.0  # no float drift at 0.99*300
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 0)


@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=300), st.floats(0.01, 100))
def test_percentile_is_an_observed_value_and_monotonic(xs: list[float], p: float) -> None:
    v = sorted(xs)
    assert percentile(v, p) in v
    assert percentile(v, p) <= percentile(v, min(100.0, p + 1))


# ---- recorded series: coefficient and verdicts ----


def _recorded(seed: int, n: int = 1000, base: float = 0.010, tail: float = 0.0) -> list[float]:
    """A latency series: ~10 ms with 3% jitter; ``tail`` share of requests take 3x as long."""
    rng = random.Random(seed)
    out = [base * rng.uniform(0.97, 1.03) for _ in range(n)]
    for i in rng.sample(range(n), int(n * tail)):
        out[i] = base * 3 * rng.uniform(0.97, 1.03)
    return out


def _key(dev: str, model: str = "llama", cls: str = "short", kind: str = "H100") -> SeriesKey:
    return SeriesKey(dev, model, cls, kind)


def test_device_slow_only_at_the_tail() -> None:
    series = [
        series_stats(_key("gpu0"), _recorded(0)),
        series_stats(_key("gpu1"), _recorded(1)),
        series_stats(_key("gpu2"), _recorded(2)),
        series_stats(_key("gpu3"), _recorded(3, tail=0.03)),  # 3% of requests 3x slower
    ]
    stats = [s for s in series if s is not None]
    by = {v.key.device: v for v in evaluate(stats, {}, TH)}
    tail = by["gpu3"]
    # the median request is just as fast as the peers'; only P99 shows it
    assert tail.p50_s == pytest.approx(by["gpu0"].p50_s, rel=0.03)
    assert tail.coefficient is not None
    assert tail.coefficient > 2.5
    assert tail.verdict == "slow"
    assert tail.cause == "unknown"
    assert tail.peers == 3
    for d in ("gpu0", "gpu1", "gpu2"):
        assert by[d].verdict == "ok"
        assert by[d].coefficient == pytest.approx(1.0, abs=0.05)


def test_coefficient_uses_median_of_peers_excluding_itself() -> None:
    s = [SeriesStats(_key(f"g{i}"), 100, p, p) for i, p in enumerate([0.10, 0.12, 0.20, 0.30])]
    by = {v.key.device: v for v in evaluate(s, {}, TH)}
    # g3: peers 0.10, 0.12, 0.20 -> median 0.12; g0: peers 0.12, 0.20, 0.30 -> 0.20
    assert by["g3"].peer_median_p99_s == pytest.approx(0.12)
    assert by["g3"].coefficient == pytest.approx(0.30 / 0.12)
    assert by["g0"].coefficient == pytest.approx(0.10 / 0.20)
    two = evaluate([s[0], s[1], s[2]], {}, TH)  # g2's peers: 0.10, 0.12 -> even count, mean
    assert two[2].peer_median_p99_s == pytest.approx(0.11)


def test_peers_need_same_model_class_and_kind() -> None:
    s = [
        SeriesStats(_key("a", model="llama"), 100, 0.1, 0.1),
        SeriesStats(_key("b", model="mistral"), 100, 0.3, 0.3),
        SeriesStats(_key("c", cls="long"), 100, 0.3, 0.3),
        SeriesStats(_key("d", kind="A100"), 100, 0.3, 0.3),
    ]
    assert [v.verdict for v in evaluate(s, {}, TH)] == ["no_peers"] * 4
    assert all(v.coefficient is None for v in evaluate(s, {}, TH))


def test_peers_with_too_few_requests_do_not_count() -> None:
    s = [SeriesStats(_key("a"), 100, 0.1, 0.1), SeriesStats(_key("b"), 5, 0.3, 0.3)]
    a, b = evaluate(s, {}, TH)
    assert a.verdict == "no_peers"
    assert b.verdict == "insufficient_data"
    assert b.coefficient is None


def test_slow_verdict_takes_its_cause_from_the_window() -> None:
    s = [SeriesStats(_key(d), 100, 0.1, p) for d, p in (("a", 0.1), ("b", 0.1), ("c", 0.2))]
    w = {"c": WindowState(samples=10, busy_samples=10, power_samples=5, pcie_below_max_samples=10)}
    c = evaluate(s, w, TH)[2]
    assert c.verdict == "slow"
    assert c.cause == "power_throttling"
    assert c.causes == ("power_throttling", "pcie_link_degraded")
    assert "power throttling in 5/10 busy samples" in c.detail  # a share of busy samples


def test_latency_window_slides_by_age_and_count() -> None:
    w = LatencyWindow(window_s=10.0, max_per_series=5)
    k = _key("a")
    for t in range(8):
        w.add(k, float(t), at_s=float(t))
    (s,) = w.stats(now_s=8.0)
    assert s.count == 5
    assert s.p99_s == 7.0
    (s,) = w.stats(now_s=15.5)  # 0..5 older than 10 s
    assert s.count == 2
    assert s.p50_s == 6.0
    assert w.stats(now_s=100.0) == []


# ---- NVML window summaries ----


def _sample(**kw: object) -> DeviceSample:
    base: dict[str, object] = {
        "time_ns": 0,
        "index": 0,
        "uuid": "GPU-a",
        "name": "x",
        "utilization_gpu_pct": 90,
        "clock_sm_mhz": 1980,
        "clock_sm_max_mhz": 1980,
        "throttle_mask": 0,
        "pcie_link_gen": 5,
        "pcie_link_gen_max": 5,
        "pcie_link_width": 16,
        "pcie_link_width_max": 16,
    }
    base.update(kw)
    return DeviceSample(**base)  # type: ignore[arg-type]


def test_summarize_counts_each_condition() -> None:
    samples = [
        _sample(throttle_mask=0x40, throttle_reasons=("hw_thermal_slowdown",), clock_sm_mhz=1200),
        _sample(throttle_mask=0x4, throttle_reasons=("sw_power_cap",), ecc_corrected_volatile=1),
        _sample(pcie_link_gen=3, pcie_link_width=8, ecc_corrected_volatile=4),
        _sample(clock_sm_mhz=1500),  # below 90% of max, no reason: unexplained
        _sample(utilization_gpu_pct=0, pcie_link_gen=1, clock_sm_mhz=300),  # idle: ignored
        _sample(lost=True, state="failed"),
    ]
    w = summarize_samples(samples, TH)
    assert w == WindowState(
        samples=5,
        busy_samples=4,
        thermal_samples=1,
        power_samples=1,
        pcie_below_max_samples=1,
        clocks_below_max_samples=1,
        ecc_errors=3,
        lost=True,
        pcie_detail="Gen3 x8 of Gen5 x16",
    )


def test_idle_link_downtraining_is_not_a_cause() -> None:
    idle = [_sample(utilization_gpu_pct=0, pcie_link_gen=1) for _ in range(10)]
    w = summarize_samples(idle, TH)
    assert w.pcie_below_max_samples == 0
    assert w.busy_samples == 0
    s = [SeriesStats(_key(d), 100, 0.1, p) for d, p in (("a", 0.1), ("b", 0.1), ("c", 0.2))]
    assert evaluate(s, {"c": w}, TH)[2].cause == "unknown"


# ---- rule file: examples and validation ----


@pytest.mark.parametrize("ex", RULES.examples, ids=lambda e: e.name)
def test_rule_examples(ex: object) -> None:
    v = run_example(ex, RULES.thresholds)  # type: ignore[arg-type]
    assert (v.verdict, v.cause) == (ex.expect_verdict, ex.expect_cause), f"line {ex.line}"  # type: ignore[attr-defined]


def test_examples_cover_every_cause_and_negative_cases() -> None:
    assert {e.expect_cause for e in RULES.examples if e.expect_verdict == "slow"} == set(CAUSES)
    assert {e.expect_verdict for e in RULES.examples} >= {"ok", "no_peers", "slow"}
    assert RULES.thresholds.slow_coefficient == 1.2
    assert RULES.engine == 1


def test_window_keys_match_window_state() -> None:
    fields = {f.name for f in dataclasses.fields(WindowState)} - {"pcie_detail", "other_detail", "lost_detail"}
    assert set(WINDOW_KEYS) == fields


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [
        ("engine = 1\n[thresholds]\nslow_coefficient = 1.2\nbogus = 3\n", 4, "unknown threshold"),
        ("engine = 1\n[thresholds]\n\nslow_coefficient = 0.9\n", 4, "above 1.0"),
        ("engine = 1\n[thresholds]\nthrottle_share = 2\n", 3, "[0, 1]"),
        ('engine = 1\n[thresholds]\nthermal_reasons = ["hot"]\n', 3, "unknown reason"),
        ("engine = 7\n", 1, "needs engine 7"),
        ("\n[thresholds]\n", 1, "engine"),
        ("engine = 1\n[thresholds\n", 2, "invalid TOML"),
        (
            'engine = 1\n[[examples]]\nname = "a"\ndevice_p99_s = 1\npeer_p99_s = [1]\n'
            'expect_verdict = "ok"\n[[examples]]\nname = "b"\ndevice_p99_s = 2\n'
            'peer_p99_s = [1]\nexpect_verdict = "slow"\n',
            7,
            "needs expect_cause",
        ),
        (
            'engine = 1\n[[examples]]\nname = "a"\ndevice_p99_s = 1\npeer_p99_s = [1]\n'
            'expect_verdict = "ok"\nwindow = { hot = 1 }\n',
            7,
            "unknown window key",
        ),
        (
            'engine = 1\n[[examples]]\nname = "a"\ndevice_p99_s = "x"\npeer_p99_s = [1]\nexpect_verdict = "ok"\n',
            4,
            "must be a number",
        ),
    ],
)
def test_rule_errors_name_file_and_line(tmp_path: Path, text: str, line: int, needle: str) -> None:
    p = tmp_path / "devices.toml"
    p.write_text(text)
    with pytest.raises(DeviceRulesError) as err:
        load_device_rules(p)
    assert str(err.value).startswith(f"{p}:{line}: "), str(err.value)
    assert needle in str(err.value)


def test_parse_from_string_and_defaults() -> None:
    r = parse_device_rules("engine = 1\n")
    assert r.thresholds == DeviceThresholds()
    assert r.examples == ()
