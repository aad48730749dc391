"""The bytes of large frames the agent holds while it reads them: a budget per uid and in all.

A frame may be 1 MiB (``_wire.MAX_FRAME_BYTES``), and the agent buffers a frame whole before it
decodes it. A peer that announces 1 MiB and sends it slowly (or all but its last byte) makes the
agent hold that megabyte until the frame timeout; on 256 connections (a uid's share) that was
256 MiB of agent memory per member of the socket group, renewed at every reconnect. Before it reads
a frame larger than ``SMALL_FRAME_BYTES`` (the stream's own buffering, which every connection has
anyway), a connection takes the frame's size from this budget: at most ``per_uid`` for one uid
(root aside) and ``total`` for all. A frame that does not fit waits, without reading, for frames
in flight to end (read whole, or cut off by their timeout), at most the frame timeout; then the
connection is closed as a slow peer. So one uid's large frames wait only for that uid's own,
unless several uids together fill the total.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from infersight.agent.daemon.health import Counters

SMALL_FRAME_BYTES = 64 << 10  # up to this, a frame is read as it comes (asyncio's stream limit)
TOTAL_BYTES = 64 << 20
PER_UID_BYTES = TOTAL_BYTES // 4  # a quarter, as every other per-uid share (16 frames of 1 MiB)


class FrameBudget:
    """Bytes of large frames being read, per peer uid and in all."""

    def __init__(self, counters: Counters, total: int = TOTAL_BYTES, per_uid: int = PER_UID_BYTES) -> None:
        self.counters = counters  # frames_waited_budget, over_frame_budget
        self.total = total
        self.per_uid = per_uid
        self.in_flight = 0
        self.by_uid: dict[int, int] = {}
        self._waiters: list[asyncio.Future[None]] = []

    def _fits(self, uid: int, n: int) -> bool:
        if self.in_flight + n > self.total:
            return False
        return uid == 0 or self.by_uid.get(uid, 0) + n <= self.per_uid

    def _take(self, uid: int, n: int) -> None:
        self.in_flight += n
        self.by_uid[uid] = self.by_uid.get(uid, 0) + n

    async def take(self, uid: int, n: int, timeout_s: float) -> bool:
        """Take ``n`` bytes for ``uid``, waiting at most ``timeout_s``; False: not given in time."""
        if self._fits(uid, n):
            self._take(uid, n)
            return True
        self.counters.frames_waited_budget += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._fits(uid, n):
            left = deadline - loop.time()
            if left <= 0:
                self.counters.over_frame_budget += 1
                return False
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                pass  # the loop's test says
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._take(uid, n)
        return True

    def give_back(self, uid: int, n: int) -> None:
        """The frame of ``n`` bytes ``uid`` took was read, or its connection ended."""
        self.in_flight -= n
        left = self.by_uid.get(uid, 0) - n
        if left > 0:
            self.by_uid[uid] = left
        else:
            self.by_uid.pop(uid, None)
        waiters, self._waiters = self._waiters, []
        for w in waiters:  # each tests again; those that still do not fit wait anew
            if not w.done():
                w.set_result(None)


class FrameShare:
    """One connection's use of the budget: its peer's uid, the frame timeout it waits at most, and what
    it says when the wait fails (the connection is then closed)."""

    __slots__ = ("budget", "on_refused", "timeout_s", "uid")

    def __init__(self, budget: FrameBudget, uid: int, timeout_s: Callable[[], float],
                 on_refused: Callable[[int], None]) -> None:
        self.budget = budget
        self.uid = uid
        self.timeout_s = timeout_s  # read at each wait: a reload may change it
        self.on_refused = on_refused

    @staticmethod
    def needs(n: int) -> bool:
        """Whether a frame of ``n`` bytes takes from the budget."""
        return n > SMALL_FRAME_BYTES

    async def take(self, n: int) -> bool:
        if await self.budget.take(self.uid, n, self.timeout_s()):
            return True
        self.on_refused(self.uid)
        return False

    def give_back(self, n: int) -> None:
        self.budget.give_back(self.uid, n)
