"""More departed producers (cold start open, process alive) than watch descriptors: the oldest watch
of the uid holding the most was let go and never checked again, so when its process ended it was
never taken as lost. Its pending state stayed held (1.15 GB after a review's flood had exited), the
producer stayed protected from eviction and its progress topic warming. Now a watch pushed out is
checked at once (ended: lost now) and otherwise polled, without a descriptor, until its process ends."""

from __future__ import annotations

import asyncio
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from infersight.agent.daemon import liveness
from infersight.agent.daemon.liveness import Liveness


def spawn(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(["sleep", "60"]) for _ in range(n)]


def depart(live: Liveness, procs: list[subprocess.Popen[bytes]], uid: int, tag: str) -> list[Any]:
    out: list[Any] = []
    for i, proc in enumerate(procs):
        p = SimpleNamespace(id="%s%d" % (tag, i), gone=False, uid=uid)
        start = live.joined(p, proc.pid)  # type: ignore[arg-type]
        live.left(p, proc.pid, start)  # type: ignore[arg-type]
        out.append(p)
    return out


def end(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


async def test_a_watch_pushed_out_is_still_taken_as_lost_when_its_process_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "MAX_WATCHED", 3)
    ended: list[str] = []
    live = Liveness(lambda p: ended.append(p.id), lambda p: not p.gone)
    procs = spawn(8)
    try:
        depart(live, procs, 1003, "a")
        assert ended == []  # all alive: none taken as ended
        end(procs)
        live.sweep()
        assert sorted(ended) == sorted("a%d" % i for i in range(8)), ended  # was: only the 3 watched
        assert live.watches_polled == 5 and live.watches_dropped == 0
    finally:
        end(procs)
        live.release()
        live.cancel()
        await asyncio.sleep(0)


async def test_a_watch_pushed_out_after_its_process_ended_is_lost_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "MAX_WATCHED", 2)
    ended: list[str] = []
    live = Liveness(lambda p: ended.append(p.id), lambda p: not p.gone)
    first, rest = spawn(1), spawn(2)
    try:
        depart(live, first, 1003, "a")
        depart(live, rest[:1], 1003, "b")
        end(first)  # ended, not yet noticed (the loop has not run its reader)
        victim = depart(live, rest[1:], 1002, "v")[0]
        assert ended == ["a0"]  # pushed out by the third watch: checked then, not forgotten
        assert "v0" in live._pidfds and victim.id not in ended
    finally:
        end(first + rest)
        live.release()
        live.cancel()
        await asyncio.sleep(0)
