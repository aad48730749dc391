"""The event loop's time that producers' frames take: a share per uid while several uids send.

Decoding and assembling a frame runs on the agent's event loop, and a frame may hold 2,048 events
(``_wire.MAX_BATCH_EVENTS_READ``) in 1 MiB. One uid's producers on eight connections, each streaming
the costliest batches the wire allows, kept the loop busy for 0.6-0.8 s at a time: another user's
acks and ``status`` waited that long (``bench/loop_share.py``). The frame budget bounds the bytes
being read, not the time their processing takes.

So the time each frame takes (decode and assembly, on the loop) is charged to its peer's uid. While
more than one uid has sent frames within ``ACTIVE_S``, a uid (root aside) may take at most its share
of the loop, ``(1 - HEADROOM) / n`` for ``n`` such uids but never less than ``(1 - HEADROOM) /
MAX_PARTS``, with a burst of ``BURST_S``; a uid past it waits, unread, before its next frame, until
its use has decayed (the agent holds the connection; no frame or idle timeout runs against the peer).
What waits waits in the socket: nothing is dropped here; the hooks' own queues decide what a paced
producer keeps. A lone uid is never paced: no one waits for it. A frame's cost is known only once it
was processed, so each frame first reserves an estimate (its size times its uid's recent cost per
byte), in the same step as the test, and settles the difference after: several connections of one
uid that wake together do not all pass on one reading of the debt.

What a frame costs the agent does not end on the loop: reading its bytes, the exporters' encoding (in
threads, under the GIL) and the rest come after. Timing them per uid would reach into every exporter,
so the agent's whole CPU time is laid on the frames instead: every ``RESCALE_S`` the process's CPU
seconds over the loop time charged to frames meanwhile give a factor (1 to ``MAX_SCALE``) that the
frames of the uid that took the most loop time in that window are multiplied by. One uid's frames of
wide events, whose file encoding costs twice their decoding, were paced as half what they cost
without it. Only the heaviest uid bears it: the CPU no frame is charged for (another user's status
probes, the agent's own work) must not make a light victim look expensive and get it paced.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from infersight.agent.daemon.health import Counters

ACTIVE_S = 2.0  # a uid that sent a frame this recently competes for the loop
HEADROOM = 0.2  # of the loop, kept for exporters, timers and status probes when uids compete
MAX_PARTS = 2  # a uid's share is at least (1 - HEADROOM) / MAX_PARTS, however many uids send
BURST_S = 0.05  # loop time a uid may run ahead of its share before it waits
_COST_WEIGHT = 0.25  # weight of the newest frame in a uid's cost per byte
_PRUNE_EVERY = 256  # uids kept at most between sweeps of idle ones
RESCALE_S = 0.5  # how often the agent's CPU time is laid on the frames' loop time
MAX_SCALE = 4.0
_BUSY = 0.1  # frames took at least this share of a rescale's wall time: a factor worth reading


def process_cpu() -> float:
    """This process's CPU seconds, every thread (user and system)."""
    t = os.times()
    return t.user + t.system


class _Use:
    __slots__ = ("debt", "per_byte", "seen", "stamp")

    def __init__(self, now: float) -> None:
        self.debt = 0.0  # loop seconds taken beyond the share, decaying at the share's rate
        self.stamp = now  # when debt was last decayed
        self.seen = now  # when this uid last sent a frame
        self.per_byte = 0.0  # loop seconds per frame byte, recently


class LoopShare:
    """Loop time taken by producers' frames, per peer uid."""

    def __init__(self, counters: Counters, clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = process_cpu) -> None:
        self.counters = counters  # frames_paced
        self.clock = clock
        self.cpu = cpu
        self.uses: dict[int, _Use] = {}
        self._active = 0
        self._active_at = -1e9
        self.scale = 1.0  # the agent's CPU time per second of frames' loop time, recently
        self.heaviest: int | None = None  # the uid that took the most loop time last window: it bears the scale
        self._charged = 0.0  # frames' loop time since the last rescale
        self._by_uid: dict[int, float] = {}  # and each uid's part of it
        self._rescaled_at = clock()
        self._cpu_at = cpu()

    def _competing(self, now: float) -> int:
        """Uids that sent a frame within ACTIVE_S (recounted at most every 0.1 s)."""
        if now - self._active_at > 0.1:
            self._active_at = now
            self._active = sum(1 for u in self.uses.values() if now - u.seen <= ACTIVE_S)
            if len(self.uses) > _PRUNE_EVERY:  # a uid quiet for ACTIVE_S competes with no one: it starts afresh
                self.uses = {k: u for k, u in self.uses.items() if now - u.seen <= ACTIVE_S}
        return self._active

    def rate(self, now: float) -> float:
        """The share of the loop one uid may take now: its part of the loop's (1 - HEADROOM), never less
        than half of it (many quiet uids must not shrink a busy honest one to a sliver)."""
        return (1.0 - HEADROOM) / min(MAX_PARTS, max(1, self._competing(now)))

    def _decayed(self, uid: int, now: float) -> _Use:
        use = self.uses.get(uid)
        if use is None:
            use = self.uses[uid] = _Use(now)
            self._active_at = -1e9  # a newcomer competes at once
            return use
        if use.debt > 0:
            use.debt = max(0.0, use.debt - (now - use.stamp) * self.rate(now))
        use.stamp = now
        return use

    def over(self, uid: int) -> bool:
        """Whether ``uid`` must wait before its next frame (cheap: the per-frame test)."""
        if uid == 0:
            return False
        use = self.uses.get(uid)
        if use is None or use.debt <= BURST_S:
            return False
        now = self.clock()
        return self._competing(now) > 1 and self._decayed(uid, now).debt > BURST_S

    async def wait(self, uid: int) -> None:
        """Wait until ``uid`` is back within its share (or competes with no one)."""
        self.counters.frames_paced += 1
        while self.over(uid):
            now = self.clock()
            await asyncio.sleep(max(0.001, (self.uses[uid].debt - BURST_S) / self.rate(now)))

    def reserve(self, uid: int, n: int) -> float:
        """Charge a frame of ``n`` bytes its estimated cost ahead; returns the estimate."""
        now = self.clock()
        use = self._decayed(uid, now)
        use.seen = now
        estimate = n * use.per_byte * self._factor(uid)
        use.debt += estimate
        return estimate

    def _factor(self, uid: int) -> float:
        return self.scale if uid == self.heaviest else 1.0

    def settle(self, uid: int, n: int, estimate: float, cost: float) -> None:
        """The frame reserved with ``estimate`` took ``cost`` seconds of the loop."""
        now = self.clock()
        use = self.uses.get(uid)
        if use is None:  # swept meanwhile
            use = self.uses[uid] = _Use(now)
        use.debt = max(0.0, use.debt + cost * self._factor(uid) - estimate)
        if n > 0:
            use.per_byte += _COST_WEIGHT * (cost / n - use.per_byte)
        self._charged += cost
        self._by_uid[uid] = self._by_uid.get(uid, 0.0) + cost
        if now - self._rescaled_at >= RESCALE_S:
            self._rescale(now)

    def _rescale(self, now: float) -> None:
        cpu = self.cpu()
        wall, spent, charged = now - self._rescaled_at, cpu - self._cpu_at, self._charged
        by_uid, self._by_uid = self._by_uid, {}
        self._rescaled_at, self._cpu_at, self._charged = now, cpu, 0.0
        self.heaviest = max(by_uid, key=by_uid.__getitem__) if by_uid else None
        if charged >= _BUSY * wall:  # mostly frames: the rest of the agent's time is theirs
            self.scale = min(MAX_SCALE, max(1.0, (self.scale + spent / charged) / 2))
