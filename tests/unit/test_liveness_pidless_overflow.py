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
    producers: list[Any] = [SimpleNamespace(id="p%d" % i, gone=False, uid=None)
                         for i in range(MAX_WATCHED + 2)]
    for p in producers:
        live.joined(p, 0)
        live.left(p, 0, None)
    assert ended == ["p0", "p1"], ended
    assert len(live._pidless) == MAX_WATCHED
    live.release()
    await asyncio.sleep(0)


async def test_another_users_departed_producers_push_out_their_own_never_the_victims() -> None:
    """The watch tables had no per-user share: 256 departed producers of one member pushed out the watch
    on a victim's departed producer (the oldest went), so the victim's cold start was taken as ended while
    it lived (no visible pid) or never closed when it died (pidfd, /proc). The uid holding the most lets go."""
    ended: list[str] = []
    live = Liveness(lambda p: ended.append(p.id), lambda _p: True)
    live.grace_s = 3600.0
    victim = SimpleNamespace(id="victim", gone=False, uid=1002)
    live.joined(victim, 0)
    live.left(victim, 0, None)  # the victim waits first: the oldest entry
    flood: list[Any] = [SimpleNamespace(id="a%d" % i, gone=False, uid=1003) for i in range(MAX_WATCHED + 5)]
    for p in flood:
        live.joined(p, 0)
        live.left(p, 0, None)
    assert "victim" not in ended and "victim" in live._pidless
    assert ended == ["a%d" % i for i in range(6)], ended
    live.release()
    await asyncio.sleep(0)


async def test_the_proc_watch_lets_go_of_the_uid_holding_the_most() -> None:
    import os

    from infersight.agent.daemon.identity import process_start

    live = Liveness(lambda p: None, lambda _p: True)
    start = process_start(os.getpid())
    assert start is not None
    victim = SimpleNamespace(id="victim", gone=False, uid=1002)
    live._watch_by_proc(victim, os.getpid(), start)
    for i in range(MAX_WATCHED + 3):
        live._watch_by_proc(SimpleNamespace(id="a%d" % i, gone=False, uid=1003), os.getpid(), start)
    assert "victim" in live._watch and len(live._watch) == MAX_WATCHED
    live.cancel()
    await asyncio.sleep(0)
