"""One exporter's waiting batches: a FIFO lane per producer uid, the lanes taken in turn.

A single FIFO put every batch behind whatever was queued before it: one uid's flood of events
toward a slow sink (an MQTT broker taking 7k messages/s) made another user's batches, its OOM
record among them, wait 10 s behind it. Each uid's batches keep their order in its own lane;
the worker takes one batch from each lane in turn. Batches the agent makes itself (no uid) have
a lane of their own. Order across uids is not kept, and no sink needs it: a producer's items
all come from one uid.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Entries of ``size`` items per lane (a producer uid, or None), taken round-robin by entry."""

    __slots__ = ("_entries", "_items", "_lanes", "_turns")

    def __init__(self) -> None:
        self._lanes: dict[int | None, deque[tuple[T, int]]] = {}
        self._items: dict[int | None, int] = {}  # items waiting per lane
        self._turns: deque[int | None] = deque()  # the lanes that hold entries, next first
        self._entries = 0

    def append(self, entry: T, size: int, uid: int | None = None) -> None:
        lane = self._lanes.get(uid)
        if lane is None:
            lane = self._lanes[uid] = deque()
            self._items[uid] = 0
            self._turns.append(uid)
        lane.append((entry, size))
        self._items[uid] += size
        self._entries += 1

    def head(self) -> T:
        """The entry :meth:`popleft` would take."""
        return self._lanes[self._turns[0]][0][0]

    def popleft(self) -> T:
        uid = self._turns.popleft()
        lane = self._lanes[uid]
        entry, size = lane.popleft()
        self._entries -= 1
        if lane:
            self._items[uid] -= size
            self._turns.append(uid)  # its next entry waits for the other lanes' turns
        else:
            del self._lanes[uid], self._items[uid]
        return entry

    def items_of(self, uid: int | None) -> int:
        """Items waiting in ``uid``'s lane."""
        return self._items.get(uid, 0)

    def lane_count(self) -> int:
        """Lanes that hold entries."""
        return len(self._turns)

    def __len__(self) -> int:
        return self._entries

    def __bool__(self) -> bool:
        return bool(self._turns)
