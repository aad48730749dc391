"""The exporters' queues per producer uid (fair_queue.py, broadcast.py): one uid's flood toward a
slow sink neither fills the queue for everyone nor puts another uid's batches behind it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from capture_exporter import CaptureExporter

from infersight.agent.daemon.broadcast import UID_QUEUE_FLOOR, UID_QUEUE_SHARE, Broadcaster, ExporterWorker
from infersight.agent.daemon.fair_queue import FairQueue
from infersight.telemetry import Item, LogItem, Resource

RES = Resource.of({"service.name": "t"})
ATTACKER, VICTIM = 1001, 1002


def test_lanes_are_taken_in_turn_each_in_its_own_order() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.append("a%d" % i, 100, ATTACKER)
    q.append("v0", 1, VICTIM)
    q.append("v1", 1, VICTIM)
    q.append("agent", 3)
    assert len(q) == 7
    assert q.items_of(ATTACKER) == 400 and q.items_of(VICTIM) == 2 and q.items_of(None) == 3
    taken = [q.popleft() for _ in range(7)]
    assert taken == ["a0", "v0", "agent", "a1", "v1", "a2", "a3"]
    assert not q and q.items_of(ATTACKER) == 0


def test_head_is_what_popleft_takes() -> None:
    q: FairQueue[str] = FairQueue()
    q.append("a0", 1, ATTACKER)
    q.append("v0", 1, VICTIM)
    q.popleft()
    assert q.head() == "v0" == q.popleft()


class SlowExporter(CaptureExporter):
    """Takes a batch only when the test lets it: a sink slower than the producers."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def export(self, batch: Sequence[Item]) -> None:
        await self.gate.wait()
        self.gate.clear()
        await super().export(batch)


def items(n: int, body: str) -> list[Item]:
    return [LogItem(RES, 1, 9, "INFO", body) for _ in range(n)]


async def until(predicate, timeout_s: float = 30) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within %s s" % timeout_s)


async def test_a_uid_past_a_quarter_of_the_queue_waits_and_another_uid_does_not() -> None:
    exporter = SlowExporter()
    worker = ExporterWorker(exporter, None, queue_max_items=1024, max_batch_items=64)
    b = Broadcaster([worker])
    worker.start()
    try:
        for _ in range(1024 // UID_QUEUE_SHARE // 64 + 1):  # a quarter of the bound and one batch, by 64
            b.publish(items(64, "flood"), uid=ATTACKER)
        b.publish(items(1, "victim"), uid=VICTIM)
        await until(lambda: b.queued_of(ATTACKER) == 256)  # the sink holds the first batch
        assert b.over_share(ATTACKER) and b.must_wait(ATTACKER)
        assert not b.congested, "one uid alone no longer fills the queue for everyone"
        assert not b.must_wait(VICTIM)
        assert not b.must_wait(0) and not b.over_share(0)  # root has no share
        waiter = asyncio.ensure_future(b.wait_turn(ATTACKER))
        exporter.gate.set()
        await until(lambda: len(exporter.batches) == 1)
        exporter.gate.set()  # the next turn is the victim's lane, not the attacker's next batch
        await until(lambda: len(exporter.batches) == 2)
        assert [it.body for it in exporter.batches[1]] == ["victim"], [len(x) for x in exporter.batches]
        await asyncio.wait_for(waiter, 30)  # the attacker's next batch left the queue: under its share
        assert not b.must_wait(ATTACKER)
    finally:
        exporter.gate.set()
        assert worker._task is not None
        worker._task.cancel()


async def test_while_a_queue_is_full_a_uid_with_a_trickle_queued_is_still_read() -> None:
    exporter = SlowExporter()
    worker = ExporterWorker(exporter, None, queue_max_items=1024, max_batch_items=64)
    b = Broadcaster([worker])
    worker.peer_up = True
    for uid in range(2000, 2005):  # five uids together fill it, each under its share
        for _ in range(4):
            b.publish(items(60, "many"), uid=uid)
    assert b.congested
    assert b.must_wait(2000), "a uid with more than a trickle queued waits while the queue is full"
    assert b.must_wait(0), "root waits while a queue is full, as before"
    b.publish(items(1, "victim"), uid=VICTIM)
    assert b.queued_of(VICTIM) < 1024 // UID_QUEUE_FLOOR
    assert not b.must_wait(VICTIM)


def test_an_agent_with_no_exporter_holds_no_producer() -> None:
    """No sink configured: there is no queue, so no uid has filled a share of it (every non-root
    producer was held for good, its batches never acked)."""
    b = Broadcaster([])
    assert not b.over_share(ATTACKER) and not b.must_wait(ATTACKER) and not b.must_wait(0)


async def test_another_lane_does_not_split_a_fast_sinks_exports() -> None:
    """While lanes compete an export holds what the sink sends in 0.1 s: a fast sink's exports stay
    merged. One batch a lane, as before, let one item a second from another uid cut a heavy uid's
    exports to one of its batches each (200x slower to a sink with a cost per export)."""
    exporter = CaptureExporter()  # takes every batch at once
    worker = ExporterWorker(exporter, None, queue_max_items=1 << 16, max_batch_items=4096)
    b = Broadcaster([worker])
    b.publish(items(10, "warm"), uid=VICTIM)
    worker.start()
    try:
        await until(lambda: len(exporter.batches) == 1)  # the sink's speed is known
        for i in range(500):
            b.publish(items(10, "victim"), uid=VICTIM)
            if i % 100 == 0:
                b.publish(items(1, "other"), uid=ATTACKER)
        await until(lambda: sum(len(x) for x in exporter.batches) == 10 + 5000 + 5)
        assert len(exporter.batches) <= 12, [len(x) for x in exporter.batches]
    finally:
        assert worker._task is not None
        worker._task.cancel()


def test_the_cost_per_item_is_the_slope_not_the_round_trip() -> None:
    from infersight.agent.daemon.export_cost import ExportCost

    sizes = [10, 50, 100, 500, 1000, 2000, 3000, 4000]
    distant = ExportCost()  # a collector 200 ms away, 10 us an item
    near = ExportCost()  # an MQTT broker next door: 100 us an item, nothing per export
    for n in sizes:
        distant.add(n, 0.2 + 1e-5 * n)
        near.add(n, 1e-4 * n)
    assert abs(distant.per_item_s() - 1e-5) < 1e-7  # not 0.2 / 4000 = 5e-5, nor the mean over sizes
    assert abs(near.per_item_s() - 1e-4) < 1e-7
    same = ExportCost()  # every export the same size: the two parts cannot be told apart
    for _ in range(10):
        same.add(4000, 0.24)
    assert same.per_item_s() == same.mean_item_s() and abs(same.mean_item_s() - 0.24 / 4000) < 1e-12
    few = ExportCost()
    few.add(100, 0.3)
    assert few.per_item_s() == 0.003  # too few to fit: the whole time per item, as before


class DistantExporter(CaptureExporter):
    """FAKE distant sink: 0.2 s a round trip, 1 us an item."""

    async def export(self, batch: Sequence[Item]) -> None:
        await asyncio.sleep(0.2 + 1e-6 * len(batch))
        await super().export(batch)


async def test_another_lane_does_not_split_a_distant_sinks_exports() -> None:
    """A round trip is paid by every export, split or not: while another uid sends, a distant collector's
    exports stay whole (before, the round trip counted per item capped them at a tenth of its size)."""
    exporter = DistantExporter()
    worker = ExporterWorker(exporter, None, queue_max_items=1 << 16, max_batch_items=4096)
    b = Broadcaster([worker])
    worker.start()
    try:
        for n in (10, 50, 100, 500, 1000, 2000, 3000, 4000):  # whole exports of several sizes: the cost is known
            b.publish(items(n, "warm"), uid=VICTIM)
            await until(lambda n=n: bool(exporter.batches) and len(exporter.batches[-1]) == n)
        start = len(exporter.batches)
        for _ in range(40):
            b.publish(items(400, "victim"), uid=VICTIM)
        for _ in range(300):  # 30 s at most
            if sum(1 for x in exporter.batches[start:] for it in x if it.body == "victim") == 16000:
                break
            b.publish(items(1, "other"), uid=ATTACKER)  # another uid all along: the lanes compete
            await asyncio.sleep(0.1)
        sizes = [len(x) for x in exporter.batches[start:] if len(x) > 2]
        # about 4,000 a time: not 512 (the round trip counted per item: 0.1 s of it is a few items)
        assert sorted(sizes)[len(sizes) // 2] >= 3000, sizes
    finally:
        assert worker._task is not None
        worker._task.cancel()
