"""At the agent's shutdown, a producer without a visible pid (another pid namespace: a pod's model container
beside a sidecar agent) that hung up before it is taken as ended: its 30 s grace would outlast the agent, and its
cold start with it. A native sidecar is stopped right after the main containers exit, so a model server killed
mid-load left no root at the collector (a review of the pod). One that the shutdown itself disconnects lives on
and reconnects to the next agent: it is not ended."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from infersight.agent.daemon.liveness import Liveness


def _liveness(ended: list[str]) -> Liveness:
    live = Liveness(lambda p: ended.append(p.id), lambda _p: True)
    live.grace_s = 3600.0
    return live


async def test_a_pidless_producer_waiting_out_its_grace_is_lost_at_shutdown() -> None:
    ended: list[str] = []
    live = _liveness(ended)
    gone: Any = SimpleNamespace(id="model-server", gone=False, uid=1000)
    here: Any = SimpleNamespace(id="still-connected", gone=False, uid=1000)
    live.joined(gone, 0)
    live.joined(here, 0)
    live.left(gone, 0, None)  # killed mid cold start
    assert ended == []
    live.cancel()  # SIGTERM, within the grace
    live.left(here, 0, None)  # the shutdown closes the live one's connection
    live.release()
    await asyncio.sleep(0)
    assert ended == ["model-server"], ended


async def test_a_pidless_producer_the_shutdown_disconnects_is_not_ended() -> None:
    ended: list[str] = []
    live = _liveness(ended)
    here: Any = SimpleNamespace(id="loading", gone=False, uid=1000)
    live.joined(here, 0)
    live.cancel()
    live.left(here, 0, None)
    live.release()
    await asyncio.sleep(0)
    assert ended == []
