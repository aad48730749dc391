"""More producers without a visible pid waiting out their grace than are watched: the longest waiting
ends at once (as at the end of its grace) instead of being forgotten, which held its cold start open
and its place in the producer table for good."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from infersight.agent.daemon.liveness import MAX_WATCHED, Liveness


async def test_the_longest_waiting_pidless_producer_ends_when_the_watch_is_full() -> None:
    ended: list[str] = []
    live = Liveness(lambda p: ended.append(p.id), lambda _p: True)
    live.grace_s = 3600.0
    producers: list[Any] = [SimpleNamespace(id="p%d" % i, gone=False) for i in range(MAX_WATCHED + 2)]
    for p in producers:
        live.joined(p, 0)
        live.left(p, 0, None)
    assert ended == ["p0", "p1"], ended
    assert len(live._pidless) == MAX_WATCHED
    live.release()
    await asyncio.sleep(0)
