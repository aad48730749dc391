"""The agent's shutdown cancels the cold-start extension's ceiling gauge at once (agent/coldstart/extension.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest


async def test_the_agents_shutdown_is_not_held_by_the_ceiling_gauge() -> None:
    """At CMD's exit launch's agent cancels its jobs; the storage measurement's end (which the
    cancellation also brings) wakes the ceiling gauge. A cancellation that came just as that wake-up
    was swallowed (``asyncio.wait_for`` before Python 3.12): the gauge ran on, and launch's exit waited
    out the shutdown's 10 s (one launch in five here). In process: the same order, exactly."""
    from infersight.agent.coldstart import extension

    ext = extension.ColdStartExtension({})  # type: ignore[arg-type]
    reads: list[int] = []
    agent = SimpleNamespace(resource=None, broadcaster=SimpleNamespace(publish=lambda items: None))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(extension.storage_ceiling, "known_ceilings", lambda: reads.append(1) or {})
        gauge = asyncio.ensure_future(ext._export_ceilings(agent))  # type: ignore[arg-type]
        try:
            while not reads:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # past its read of the cache (a thread): waiting for a measurement
            ext._measured.set()  # a measurement ends: the gauge's wait is done...
            await asyncio.sleep(0)  # ...and its waker is due
            gauge.cancel()  # the agent's shutdown
            await asyncio.wait((gauge,), timeout=2)
            assert gauge.cancelled(), "the ceiling gauge ran on after the agent's shutdown cancelled it"
        finally:
            gauge.cancel()
            await asyncio.wait((gauge,), timeout=2)
