"""The per-instance request windows (routing's P50/P99) within a per-uid budget, and not sorted again
while unchanged: 256 instances of one uid x 4096 requests each once took +138 MiB outside every budget,
and every device tick, routing refresh and ``status`` sorted all of them again (an idle agent at 18% CPU)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from infersight.agent.requests import kind as rk
from infersight.latency import UID_SHARE, UidShare
from infersight.telemetry import Resource

TOTAL = 4096  # the instances' requests in all, in these tests (the agent's: MAX_INSTANCE_SAMPLES)
PER_UID = TOTAL // UID_SHARE  # one uid's share


def _stats() -> rk.RequestStats:
    """Request statistics whose instance windows hold TOTAL requests in all (fewer to send than the agent's)."""
    stats = rk.RequestStats()
    stats.instance_samples = UidShare(TOTAL)
    return stats


def _resource(uid: int, pid: int) -> Resource:
    return Resource.of({"service.name": "llm", "process.pid": pid, "process.user.id": uid})


def _event(dur: float, t_ns: int, klass: str = "default") -> rk.ReqEvent:
    return rk.ReqEvent("cuda:0", "m", None, klass, t_ns, dur, None, None, None, None, None, None)


def test_the_agents_budget_is_a_quarter_per_uid_of_a_bounded_total() -> None:
    share = rk.RequestStats().instance_samples
    assert share.total == rk.MAX_INSTANCE_SAMPLES and share.per_uid == rk.MAX_INSTANCE_SAMPLES // UID_SHARE
    assert rk.MAX_INSTANCE_SAMPLES < rk.MAX_INSTANCES_PER_UID * 4096, "below what a uid's instances could hold"


def test_one_uid_filling_many_instances_takes_only_its_share() -> None:
    stats = _stats()
    now = time.time_ns()
    crowd = [_resource(2000, 100_000 + n) for n in range(rk.MAX_INSTANCES_PER_UID)]
    per_instance = PER_UID // len(crowd) + 8  # past the share in all, far below an instance's own cap
    for _ in range(per_instance):
        for n, res in enumerate(crowd):
            stats.record("crowd-%d" % n, res, _event(0.02, now), now)
    for _ in range(100):
        stats.record("mine", _resource(1000, 7), _event(0.05, now), now)
    by_producer = {lat.producer: lat for lat in stats.instance_latency()}
    crowd_held = sum(lat.count for p, lat in by_producer.items() if p != "mine")
    assert crowd_held == PER_UID, "no more than a quarter of the instances' requests"
    assert by_producer["mine"].count == 100 and by_producer["mine"].p50_s == 0.05, "another uid still gets its own"
    refused = stats.stats()["refused"]
    assert refused["instance_samples"] == {"2000": per_instance * len(crowd) - PER_UID}, "refusals counted per uid"
    assert set(refused) >= {"window_series", "window_samples", "histogram_series"}


def test_expired_requests_give_their_budget_back() -> None:
    stats = _stats()
    now = time.time_ns()
    for i in range(PER_UID + 10):
        stats.record("p%d" % (i % 64), _resource(2000, i % 64), _event(0.02, now), now)
    assert stats.instance_samples.held == PER_UID
    assert stats.instance_latency(now / 1e9 + stats.window_s + 1) == []  # the window passed: all gone
    assert stats.instance_samples.held == 0
    later = now + int((stats.window_s + 2) * 1e9)
    stats.record("p0", _resource(2000, 0), _event(0.03, later), later)
    (lat,) = stats.instance_latency(later / 1e9)
    assert lat.count == 1 and lat.p50_s == 0.03


def test_an_unchanged_window_is_not_sorted_again(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = rk.RequestStats()
    now = time.time_ns()
    for n in range(8):
        for i in range(50):
            stats.record("p%d" % n, _resource(2000, n), _event(0.001 * (i + 1), now), now)
    stats.stats()  # every instance's figures, once
    sorted_of: list[int] = []
    real = rk.percentile

    def counting(values: Any, p: float) -> float:
        sorted_of.append(len(values))
        return real(values, p)

    monkeypatch.setattr(rk, "percentile", counting)
    stats.stats()
    stats.instance_latency()
    assert sorted_of == [], "nothing changed: no instance's requests sorted again"
    stats.record("p3", _resource(2000, 3), _event(0.5, now), now)
    by_producer = {lat.producer: lat for lat in stats.instance_latency()}
    assert sorted_of and set(sorted_of) <= {51, rk.RECENT_REQUESTS}, "only the changed instance"
    assert by_producer["p3"].count == 51 and by_producer["p3"].p99_s == 0.5
    assert by_producer["p2"].count == 50 and by_producer["p2"].p99_s == 0.05


def test_figures_follow_expiry_and_the_switch_to_http() -> None:
    stats = _stats()
    t0 = time.time()
    res = _resource(1000, 7)
    for i in range(100):  # 1 .. 100 ms, one a second
        t_ns = int((t0 + i) * 1e9)
        stats.record("p", res, _event(0.001 * (i + 1), t_ns), t_ns)
    (lat,) = stats.instance_latency(t0 + 100)
    assert (lat.count, lat.p50_s) == (100, 0.05)
    (lat,) = stats.instance_latency(t0 + stats.window_s + 49.5)  # the first 50 left the window
    assert (lat.count, lat.p50_s) == (50, 0.075)
    assert stats.instance_samples.held == 50
    t_ns = int((t0 + stats.window_s + 50) * 1e9)
    stats.record("p", res, _event(0.2, t_ns, rk.HTTP_CLASS), t_ns)  # only HTTP requests count from now on
    (lat,) = stats.instance_latency(t0 + stats.window_s + 50)
    assert (lat.count, lat.p50_s) == (1, 0.2) and stats.instance_samples.held == 1
