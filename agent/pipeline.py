"""Fan-out from assembly to exporters: one bounded queue and worker per exporter.

A slow or failing exporter never stalls the others: its queue spills to its disk
spool (or drops, counted) when full. A batch is *complete* for an exporter once it
was exported, spooled, or counted as dropped; when every exporter completed it, the
producer's events are acked. Failures are retried from the spool with jittered,
capped backoff, in order.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence

from infersight.agent.model import Item
from infersight.agent.spool import DiskSpool
from infersight.exporters.base import Exporter, ExportError

log = logging.getLogger("infersight.pipeline")


class Completion:
    """Counts down the exporters that still hold a batch; calls back at zero."""

    __slots__ = ("on_done", "pending")

    def __init__(self, on_done: Callable[[], None] | None = None) -> None:
        self.pending = 0
        self.on_done = on_done

    def done(self) -> None:
        self.pending -= 1
        if self.pending == 0 and self.on_done is not None:
            self.on_done()


class ExporterWorker:
    def __init__(
        self,
        exporter: Exporter,
        spool: DiskSpool | None = None,
        queue_max_items: int = 65536,
        max_batch_items: int = 4096,
        retry_initial_s: float = 0.2,
        retry_max_s: float = 10.0,
        memory_retries: int = 3,
    ) -> None:
        self.exporter = exporter
        self.spool = spool
        self.queue: deque[tuple[Sequence[Item], Completion]] = deque()
        self.queue_items = 0
        self.queue_max_items = queue_max_items
        self.max_batch_items = max_batch_items
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.memory_retries = memory_retries
        self._wake = asyncio.Event()
        self._stop_evt = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._backoff = retry_initial_s
        self._busy = False
        self.peer_up = True
        # Counters.
        self.exported_items = 0
        self.export_errors = 0
        self.retries = 0
        self.dropped_items = 0
        self.spilled_items = 0
        self.last_error = ""

    @property
    def name(self) -> str:
        return self.exporter.name

    def depth(self) -> int:
        return len(self.queue)

    def idle(self) -> bool:
        return not self.queue and not self._busy and not self.spool

    def submit(self, items: Sequence[Item], completion: Completion) -> None:
        if self.queue_items + len(items) > self.queue_max_items:
            # Full: everything queued goes to the spool first, so order is kept there.
            self._spill_queue()
            self._spill(items)
            completion.done()
            self._wake.set()
            return
        self.queue.append((items, completion))
        self.queue_items += len(items)
        self._wake.set()

    def _spill_queue(self) -> None:
        while self.queue:
            items, c = self.queue.popleft()
            self.queue_items -= len(items)
            self._spill(items)
            c.done()

    def _spill(self, items: Sequence[Item]) -> None:
        if self.spool is not None:
            try:
                self.spool.append(items)
                self.spilled_items += len(items)
                return
            except OSError as exc:
                self.last_error = "spool: %s" % exc
        self.dropped_items += len(items)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="export-" + self.name)

    async def _sleep_backoff(self) -> None:
        delay = self._backoff * (0.5 + random.random() / 2)
        self._backoff = min(self._backoff * 2, self.retry_max_s)
        try:  # cut short only by drain(), not by new submissions
            await asyncio.wait_for(self._stop_evt.wait(), delay)
        except TimeoutError:
            pass

    async def _export(self, batch: Sequence[Item]) -> bool:
        try:
            await self.exporter.export(batch)
        except ExportError as exc:
            self.export_errors += 1
            self.last_error = str(exc)
            if self.peer_up:
                log.warning("exporter %s: %s", self.name, exc)
            self.peer_up = False
            return False
        except Exception as exc:  # an exporter bug must not kill the worker
            self.export_errors += 1
            self.last_error = repr(exc)
            log.exception("exporter %s failed", self.name)
            self.peer_up = False
            return False
        if not self.peer_up:
            log.info("exporter %s: peer is back", self.name)
        self.peer_up = True
        self._backoff = self.retry_initial_s
        self.exported_items += len(batch)
        return True

    async def _run(self) -> None:
        while True:
            if self.spool:
                await self._drain_spool_once()
                continue
            if not self.queue:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, completions = self._take()
            self._busy = True
            try:
                ok = await self._export(batch)
                attempts = 0
                while not ok and self.spool is None and attempts < self.memory_retries:
                    attempts += 1
                    self.retries += 1
                    await self._sleep_backoff()
                    ok = await self._export(batch)
                if not ok:
                    self._spill(batch)
            finally:
                self._busy = False
                for c in completions:
                    c.done()

    def _take(self) -> tuple[list[Item], list[Completion]]:
        batch: list[Item] = []
        completions: list[Completion] = []
        while self.queue and (not batch or len(batch) + len(self.queue[0][0]) <= self.max_batch_items):
            items, c = self.queue.popleft()
            self.queue_items -= len(items)
            batch.extend(items)
            completions.append(c)
        return batch, completions

    async def _drain_spool_once(self) -> None:
        """Move live batches behind the spool (order), then try its oldest batch."""
        assert self.spool is not None
        self._spill_queue()
        if self._stopping and not self.peer_up:
            return await self._idle_stop()
        batch, records = self.spool.peek_many(self.max_batch_items)
        if not records:
            return None
        self._busy = True
        try:
            if await self._export(batch):
                self.spool.pop_many(records)
            else:
                self.retries += 1
                if self._stopping:
                    return await self._idle_stop()
                await self._sleep_backoff()
        finally:
            self._busy = False
        return None

    async def _idle_stop(self) -> None:
        # Stopping with the peer down: the spool keeps the rest for the next start.
        self._wake.clear()
        await self._wake.wait()

    async def drain(self, timeout_s: float) -> bool:
        """Stop taking new work once the queue is exported; True if it finished in time."""
        self._stopping = True
        self._stop_evt.set()
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.queue and not self._busy and (not self.spool or not self.peer_up):
                break
            await asyncio.sleep(0.01)
        done = not self.queue and not self._busy
        # Whatever is still queued goes to the spool (or is counted as dropped).
        self._spill_queue()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        return done

    def state(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = {
            "peer_up": int(self.peer_up),
            "queue_depth": len(self.queue),
            "exported_items": self.exported_items,
            "export_errors": self.export_errors,
            "retries": self.retries,
            "spilled_items": self.spilled_items,
            "dropped_items": self.dropped_items + (self.spool.dropped_items if self.spool is not None else 0),
            "spooled_items_pending": self.spool.items if self.spool is not None else 0,
            "last_error": self.last_error,
        }
        out.update({"exporter." + k: v for k, v in self.exporter.state().items()})
        return out


class Router:
    """Hands every batch to every exporter worker, after showing it to the taps.

    A tap sees items as they pass (the cold-start progress tracker, say); it must be
    quick and must not raise: an exception is logged and the batch still goes out.
    """

    def __init__(self, workers: list[ExporterWorker]) -> None:
        self.workers = workers
        self.taps: list[Callable[[Sequence[Item]], None]] = []

    def publish(self, items: Sequence[Item], on_done: Callable[[], None] | None = None) -> None:
        for tap in self.taps:
            try:
                tap(items)
            except Exception:
                log.exception("a tap failed on a batch; the batch goes on")
        c = Completion(on_done)
        if not items or not self.workers:
            if on_done is not None:
                on_done()
            return
        c.pending = len(self.workers)
        for w in self.workers:
            w.submit(items, c)

    def idle(self) -> bool:
        return all(w.idle() for w in self.workers)
