"""Which items already went out while their batch failed: a retry sends only the rest.

One OTLP export sends a batch's spans, metrics and logs as separate requests. When one signal's
request fails and another's went out, the worker retries the whole batch, and the items that went
out would reach the collector twice. This memory holds a digest of each item that went out in a
failed export, so that the retry skips them, item by item: the retry may be regrouped (a spooled
batch read back with the records spooled during the failed attempt), and the items are still known.

Bounded (:data:`MAX_ITEMS`, :data:`TTL_S`): an item forgotten is sent again, a duplicate (OTLP
delivery is at least once), never a loss. The digest covers the item's whole content, resource
and attributes included, so another item with different content is never taken for one sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

from infersight.telemetry import LogItem, MetricItem, SpanItem

MAX_ITEMS = 16384  # four worker batches (4,096 items each): a spool head retried, and more
TTL_S = 600.0  # an item not met again by then (its batch refused, dropped) is forgotten


def _item_key(it: Any) -> tuple[Any, ...]:
    if isinstance(it, SpanItem):
        return (it.trace_id, it.span_id, it.name, it.start_ns, it.end_ns, repr(it.attributes))
    if isinstance(it, LogItem):
        return (it.time_ns, it.body, it.trace_id, it.span_id, it.event_name, repr(it.attributes))
    if isinstance(it, MetricItem):
        return (it.name, it.time_ns, it.start_ns, repr(it.points))
    return (repr(it),)


def item_digest(it: Any) -> bytes:
    """What tells one item from another (a spooled item read back gives the same): its whole content."""
    text = repr((type(it).__name__, repr(getattr(it, "resource", None)), *_item_key(it)))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class DeliveredItems:
    """How many items of each content went out in failed exports, and when (monotonic seconds).

    Counted, not just known: a batch may hold items of the same content (two records of one line in the same
    nanosecond), and a regrouped retry skips as many of them as went out, not all."""

    def __init__(self, max_items: int = MAX_ITEMS, ttl_s: float = TTL_S) -> None:
        self.max_items = max_items
        self.ttl_s = ttl_s
        self._count: dict[bytes, int] = {}
        self._at: dict[bytes, float] = {}  # oldest first

    def __len__(self) -> int:
        return len(self._at)

    def _drop(self, d: bytes) -> None:
        self._at.pop(d, None)
        self._count.pop(d, None)

    def remember(self, items: Iterable[Any], now: float) -> None:
        for it in items:
            d = item_digest(it)
            self._count[d] = self._count.get(d, 0) + 1
            self._at.pop(d, None)  # sent again: now the newest
            self._at[d] = now
        while len(self._at) > self.max_items:
            self._drop(next(iter(self._at)))

    def split(self, items: Sequence[Any], now: float) -> tuple[Sequence[Any], list[bytes]]:
        """(the items to send, the digests of those that went out before and are skipped); ``items`` itself
        while nothing is remembered (every export but a failed one's retries)."""
        if not self._at:
            return items, []
        while self._at:  # oldest first: the expired ones lead
            first = next(iter(self._at))
            if now - self._at[first] <= self.ttl_s:
                break
            self._drop(first)
        send: list[Any] = []
        skipped: list[bytes] = []
        used: dict[bytes, int] = {}
        for it in items:
            d = item_digest(it)
            n = used.get(d, 0)
            if n < self._count.get(d, 0):
                used[d] = n + 1
                skipped.append(d)
            else:
                send.append(it)
        return send, skipped

    def touch(self, digests: Iterable[bytes], now: float) -> None:
        """Skipped again by a retry that failed again: kept for another ``ttl_s`` (a long outage)."""
        for d in set(digests):
            if self._at.pop(d, None) is not None:
                self._at[d] = now

    def forget(self, digests: Iterable[bytes]) -> None:
        """Their batch went out whole at last: a later item of the same content is its own."""
        for d in set(digests):
            self._drop(d)
