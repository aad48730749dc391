"""The agent's own metrics go out every ``agent.health_interval_s`` (README: default 15 s), not on each
of the heartbeat's wake-ups (at least every SPOOL_SCAN_S, 5 s, for systemd's STATUS= line and a reloaded
interval): before, any interval above 5 s had no effect. A FAKE clock: the loop's sleeps advance it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from infersight.agent.daemon import lifecycle
from infersight.agent.daemon.lifecycle import Agent


class _Stop(Exception):
    pass


def _run(monkeypatch: pytest.MonkeyPatch, interval: float, until_s: float,
         reload_at: tuple[float, float] | None = None) -> tuple[list[float], int]:
    clock = {"t": 1000.0}
    published: list[float] = []
    status = [0]
    agent: Any = SimpleNamespace(config={"agent.health_interval_s": interval}, _heartbeat_jobs=[],
                                 publish_health=lambda: published.append(clock["t"] - 1000.0),
                                 notify_status=lambda: status.__setitem__(0, status[0] + 1))

    async def sleep(s: float) -> None:
        assert 0 <= s <= lifecycle.SPOOL_SCAN_S
        clock["t"] += s
        if reload_at is not None and clock["t"] - 1000.0 >= reload_at[0]:
            agent.config["agent.health_interval_s"] = reload_at[1]
        if clock["t"] - 1000.0 > until_s:
            raise _Stop

    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(lifecycle.asyncio, "sleep", sleep)
    with pytest.raises(_Stop):
        asyncio.run(Agent._heartbeat(agent))
    return published, status[0]


def test_the_agents_metrics_follow_the_configured_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    published, wakes = _run(monkeypatch, 15.0, 60.0)
    assert published == [15.0, 30.0, 45.0, 60.0]  # not every 5 s
    assert wakes >= 12  # STATUS= kept current at least every SPOOL_SCAN_S
    published, _ = _run(monkeypatch, 0.5, 2.0)
    assert published == [0.5, 1.0, 1.5, 2.0]


def test_a_reloaded_interval_applies_within_a_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    published, _ = _run(monkeypatch, 3600.0, 40.0, reload_at=(10.0, 10.0))
    assert published and published[0] <= 10.0 + lifecycle.SPOOL_SCAN_S
    assert all(b - a == pytest.approx(10.0) for a, b in zip(published, published[1:], strict=False))
