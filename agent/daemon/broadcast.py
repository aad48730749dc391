"""Fan-out from assembly to exporters: one bounded queue and worker per exporter.

A full queue pushes back while its exporter's destination is reachable: the worker
keeps the batch in memory and reports itself *full*, the broadcaster tells the ingest to stop
reading from producers until the queue is half empty again, and since a producer's events
are acked only once exported, the hooks keep theirs buffered (or in their own spool)
meanwhile. Only while the destination is unreachable (or the worker itself is failing)
does a full queue spill to the exporter's disk spool (or drop, counted), so a failing
exporter never stalls the others. A batch is *complete* for an exporter once it was
exported, spooled, or counted as dropped; when every exporter completed it, the
producer's events are acked. Failures are retried from the spool with jittered,
capped backoff, in order.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence

from infersight.agent.daemon.export_cost import ExportCost
from infersight.agent.daemon.fair_queue import FairQueue
from infersight.agent.daemon.spool import DiskSpool
from infersight.exporters.base import Exporter, ExportError, is_live
from infersight.sanitize import log_text
from infersight.telemetry import Item

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


# A reachable exporter's queue may hold this many times its bound (the frames already read
# when it filled, batches published from elsewhere) before it spills anyway.
HARD_QUEUE_FACTOR = 4

# A producer uid (root aside) whose batches fill a quarter of an exporter's queue bound is not read
# until that exporter takes some: one uid's flood toward a slow sink no longer fills the queue and
# holds every producer. While a queue is full nonetheless (several uids together), a uid with less
# than 1/64 of the bound queued is still read: its few batches wait in their own lane (FairQueue).
UID_QUEUE_SHARE = 4
UID_QUEUE_FLOOR = 64
LOST_SHOWN_S = 120.0  # items dropped unspooled are a problem this long after, where stall_s is 0 (never a stall)
CONTENDED_S = 1.0  # lanes competed this recently: exports are kept short
REJECTED_LOG_EVERY_S = 60.0  # a peer that refuses batches is said again after this long (counted meanwhile)
CONTENDED_EXPORT_S = 0.1  # while lanes compete, an export holds what this exporter sends in this long
CONTENDED_FLOOR_ITEMS = 512  # and at least this (a hook's batch): a slow peer's round trip is no reason to split

# What one export attempt came to.
OK, AWAY, REJECTED, FINAL = "ok", "away", "rejected", "final"


class ExporterWorker:
    """One exporter's queue, spool and retry loop. It never dies: any exception from its
    spool or exporter is logged (once per kind, then with a count), counted and retried
    after a backoff, and :meth:`problem` says why it cannot make progress meanwhile."""

    def __init__(
        self,
        exporter: Exporter,
        spool: DiskSpool | None = None,
        queue_max_items: int = 65536,
        max_batch_items: int = 4096,
        retry_initial_s: float = 0.2,
        retry_max_s: float = 10.0,
        memory_retries: int = 3,
        max_attempts: int = 10,
        stall_s: float = 120.0,
    ) -> None:
        self.exporter = exporter
        self.spool = spool
        self.queue: FairQueue[tuple[Sequence[Item], Completion]] = FairQueue()
        self.queue_items = 0
        self.queue_max_items = queue_max_items
        self.max_batch_items = max_batch_items
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.memory_retries = memory_retries
        self.max_attempts = max(1, max_attempts)
        self.stall_s = stall_s  # holding data with no delivery this long: unhealthy (0: never)
        self._wake = asyncio.Event()
        self._stop_evt = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._backoff = retry_initial_s
        self._busy = False
        self.peer_up = True
        self.down_since: float | None = None  # monotonic, while the peer is away
        self.fault = ""  # the worker's own failure (spool, exporter bug), while it lasts
        self.fault_since: float | None = None
        self.start_error = ""  # why exporter.start() failed, until its first delivery
        # The last delivery, or when the worker last began to hold data: what "no progress" counts from.
        self.progress_at = time.monotonic()
        self.rejected_at: float | None = None  # when the peer's refusals last cost items
        self.lost_at: float | None = None  # when items it could neither deliver nor spool were last dropped
        self.lost_items = 0  # those items (also in dropped_items)
        self.lost_reason = ""  # why the last of them could be neither delivered nor spooled
        self._rejected_said_at: float | None = None  # when the log last said so
        self._retry_after: float | None = None  # seconds the peer asked to wait (Retry-After), for the next sleep
        self._fault_kinds: dict[str, int] = {}
        # The spooled record at the head and how often the peer rejected it.
        self._head: tuple[int, int] | None = None
        self._head_attempts = 0
        self._isolate = 0  # export this many next records one by one (find a poison record)
        # Counters.
        self.exported_items = 0
        self.export_errors = 0
        self.retries = 0
        self.dropped_items = 0
        self.rejected_items = 0  # dropped: refused for good, or after max_attempts rejections
        self.spilled_items = 0
        self.internal_errors = 0
        self.pushbacks = 0  # times the queue filled while the peer was reachable
        self.last_error = ""
        self.full = False  # pushing back: the ingest waits until the queue is half empty
        self.on_full_change: Callable[[], None] | None = None
        self.on_dequeued: Callable[[], None] | None = None  # a batch left the queue
        self._cost = ExportCost()  # recent whole (uncapped) exports: their size and time
        self._contended_until = 0.0  # exports are kept short until then (_take)
        self._capped = False  # the export being made was kept short

    @property
    def name(self) -> str:
        return self.exporter.name

    def depth(self) -> int:
        return len(self.queue)

    def idle(self) -> bool:
        return not self.queue and not self._busy and not self.spool

    def problem(self, now: float | None = None) -> str | None:
        """Why this exporter is not doing its job now (None when it is): it could not start
        (a port in use, an unwritable path), says it cannot work (:func:`exporter_problem`),
        its worker is failing, it dropped items it could neither deliver nor spool (a full disk, no
        spool) within the last ``stall_s`` (or ``LOST_SHOWN_S``), it holds data and
        delivered nothing for ``stall_s``, or the peer's refusals cost items within the last
        ``stall_s`` and nothing was delivered since (one poison batch dropped among deliveries is
        counted, not a health problem)."""
        now = time.monotonic() if now is None else now
        lost = self._lost_text(now)
        if self.fault_since is not None:
            return "worker failing for %.0f s: %s%s" % (now - self.fault_since, self.fault, lost and "; " + lost)
        if lost:
            return "%s: %s" % (lost, self.lost_reason or self.last_error)
        own = exporter_problem(self.exporter)
        if own:
            return own
        if self.start_error:
            return "cannot start: %s" % self.start_error
        if self.stall_s > 0 and not self.idle() and now - self.progress_at > self.stall_s:
            held = self.queue_items + (self.spool.items if self.spool is not None else 0)
            return "no progress for %.0f s while holding %d item(s): %s" % (
                now - self.progress_at, held, self.last_error or "peer away")
        if (self.stall_s > 0 and self.rejected_at is not None and self.rejected_at > self.progress_at
                and now - self.rejected_at <= self.stall_s):  # refusals, and nothing delivered since
            return "the peer refused %d item(s), dropped (last %.0f s ago): %s" % (
                self.rejected_items, now - self.rejected_at, self.last_error)
        return None

    def _lost_text(self, now: float) -> str:
        """The loss that makes it unhealthy ("" when none): items dropped because they could be neither
        delivered nor spooled, the last within ``stall_s`` (``LOST_SHOWN_S`` where that is 0: a loss is no
        stall). Unlike a peer's refusals, deliveries in between do not excuse it: a disk full for some
        batches loses those (the file exporter's ENOSPC on one batch, its next one written)."""
        if self.lost_at is None or now - self.lost_at > (self.stall_s or LOST_SHOWN_S):
            return ""
        return "dropped %d item(s) it could neither deliver nor spool (last %.0f s ago)" % (
            self.lost_items, now - self.lost_at)

    def lost_total(self) -> int:
        """Items that reached no sink because the worker could not hold them: neither delivered nor
        spooled (a full disk, no spool), or left out of or dropped from the spool (its byte bound, a uid
        past its share, a corrupt record). ``dropped_items`` less the peer's refusals (``rejected_items``)."""
        return self.lost_items + (self.spool.dropped_items if self.spool is not None else 0)

    def reachable(self) -> bool:
        """The destination takes batches and the worker is sound: push back, do not spill."""
        return self.peer_up and self.fault_since is None and not self._stopping

    def _set_full(self, full: bool) -> None:
        if full != self.full:
            self.full = full
            if full:
                self.pushbacks += 1
            if self.on_full_change is not None:
                self.on_full_change()

    def _dequeued(self) -> None:
        if self.full and self.queue_items <= self.queue_max_items // 2:
            self._set_full(False)
        if self.on_dequeued is not None:
            self.on_dequeued()

    def submit(self, items: Sequence[Item], completion: Completion, uid: int | None = None) -> None:
        if self.idle():  # it starts holding data now: "no progress" counts from here
            self.progress_at = time.monotonic()
        if self.queue_items + len(items) > self.queue_max_items:
            if self.reachable() and self.queue_items < self.queue_max_items * HARD_QUEUE_FACTOR:
                # Healthy but behind: hold it and push back on the producers (no spill).
                self.queue.append((items, completion), len(items), uid)
                self.queue_items += len(items)
                self._set_full(True)
                self._wake.set()
                return
            # Unreachable (or far over): everything queued goes to the spool first, so order
            # is kept there.
            self._spill_queue()
            self._spill(items)
            completion.done()
            self._wake.set()
            return
        self.queue.append((items, completion), len(items), uid)
        self.queue_items += len(items)
        self._wake.set()

    def _spill_queue(self) -> None:
        try:
            while self.queue:
                items, c = self.queue.popleft()
                self.queue_items -= len(items)
                try:
                    self._spill(items)
                finally:
                    c.done()
        finally:
            self._dequeued()

    def _spill(self, items: Sequence[Item]) -> None:
        if self.spool is not None:
            try:
                left_out = self.spool.append(items)  # (a uid past its share of the spool: counted there)
                self.spilled_items += len(items) - left_out
                return
            except Exception as exc:  # a full disk, or a value the spool cannot encode
                self.last_error = "spool: %s" % exc
                self._note_fault("spool append", exc, traceback=not isinstance(exc, OSError))
        if items:
            self.lost_at = time.monotonic()
            self.lost_reason = self.last_error  # the spool's error (a full disk), not a later delivery's
            self.lost_items += len(items)
            self.dropped_items += len(items)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="export-" + self.name)

    async def _sleep_backoff(self) -> None:
        delay = self._backoff * (0.5 + random.random() / 2)
        self._backoff = min(self._backoff * 2, self.retry_max_s)
        if self._retry_after is not None:  # the peer's Retry-After (429/503), beyond the backoff's cap if it asks
            delay = max(delay, self._retry_after)
            self._retry_after = None
        try:  # cut short only by drain(), not by new submissions
            await asyncio.wait_for(self._stop_evt.wait(), delay)
        except TimeoutError:
            pass

    # -- faults -----------------------------------------------------------------------

    def _note_fault(self, where: str, exc: BaseException, traceback: bool = True) -> None:
        """Count a failure of the worker itself; log it once per kind, then at 10, 100, ..."""
        self.internal_errors += 1
        kind = "%s: %s" % (where, type(exc).__name__)
        n = self._fault_kinds[kind] = self._fault_kinds.get(kind, 0) + 1
        if self.fault_since is None:
            self.fault_since = time.monotonic()
        self.fault = "%s: %s" % (where, exc)
        said = log_text(exc)  # an exporter's error may quote an item's value: one bounded line
        if n == 1:
            log.error("exporter %s: %s: %s", self.name, where, said, exc_info=exc if traceback else None)
        elif n in (10, 100) or n % 1000 == 0:
            log.error("exporter %s: %s: %s (%d times so far)", self.name, where, said, n)

    def _clear_fault(self) -> None:
        """The worker works again: called after a step that moved data (delivered or spooled) and
        failed nowhere. A step that merely returned proves nothing: one whose spool append failed
        returns too, having dropped the batch (it logged "recovered" at every batch, and status said
        healthy while the disk was full)."""
        if self.fault_since is not None:
            log.info("exporter %s: recovered (%s)", self.name, self.fault)
            self.fault_since = None
            self.fault = ""

    # -- exporting --------------------------------------------------------------------

    async def _export(self, batch: Sequence[Item]) -> str:
        """One attempt: OK, AWAY (peer away: retry without limit), REJECTED (counts toward
        the record's attempts) or FINAL (refused for good: drop)."""
        try:
            await self.exporter.export(batch)
        except ExportError as exc:
            self.export_errors += 1
            self.last_error = str(exc)
            if not exc.retryable:
                return FINAL
            if exc.rejected:
                return REJECTED
            if self.peer_up:
                log.warning("exporter %s: %s", self.name, exc)
                self.down_since = time.monotonic()
            self.peer_up = False
            self._retry_after = exc.retry_after_s  # a throttled peer says when: the next try waits that long
            return AWAY
        except Exception as exc:  # an exporter bug on this data must not kill the worker
            self.export_errors += 1
            self.last_error = repr(exc)
            self._note_fault("export", exc)
            return REJECTED
        if not self.peer_up:
            log.info("exporter %s: peer is back", self.name)
        self.peer_up = True
        self.down_since = None
        self._backoff = self.retry_initial_s
        self.exported_items += len(batch)
        self.progress_at = time.monotonic()
        # A pull endpoint's export succeeds without a listener (it fills a registry): "delivering" only
        # once the exporter itself has nothing to say (it listens), not at the first export after a failed bind.
        if self.start_error and not exporter_problem(self.exporter):
            log.info("exporter %s: delivering now (it could not start: %s)", self.name, self.start_error)
            self.start_error = ""
        return OK

    def _drop_rejected(self, items: Sequence[Item], why: str) -> None:
        """Count a refused batch; say so the first time, then at most once a minute (a collector that refuses
        every batch wrote a line per batch)."""
        now = time.monotonic()
        self.rejected_at = now
        self.rejected_items += len(items)
        self.dropped_items += len(items)
        if self._rejected_said_at is not None and now - self._rejected_said_at < REJECTED_LOG_EVERY_S:
            return
        self._rejected_said_at = now
        log.warning("exporter %s: dropped %d item(s) the peer %s (%d dropped so far; said at most once a "
                    "minute): %s", self.name, len(items), why, self.rejected_items, self.last_error)

    async def _run(self) -> None:
        while True:
            faults, moved = self.internal_errors, self.exported_items + self.spilled_items
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the spool or an exporter failed: count, back off, retry
                self._busy = False
                self._note_fault("spool" if self.spool is not None else "worker", exc,
                                 traceback=not isinstance(exc, OSError))
                if self._stopping:
                    return await self._idle_stop()
                await self._sleep_backoff()
            else:
                if self.internal_errors == faults and self.exported_items + self.spilled_items > moved:
                    self._clear_fault()

    async def _step(self) -> None:
        if self.spool:
            return await self._drain_spool_once()
        if not self.queue:
            if self._stopping:
                return await self._idle_stop()
            self._wake.clear()
            await self._wake.wait()
            return None
        parts, completions = self._take()
        batch = [it for p in parts for it in p]
        self._busy = True
        try:
            began = time.monotonic()
            out = await self._export(batch)
            if out == OK and batch and not self._capped:
                self._cost.add(len(batch), time.monotonic() - began)
            attempts = 0
            while out in (AWAY, REJECTED) and self.spool is None and attempts < self.memory_retries:
                attempts += 1
                self.retries += 1
                await self._sleep_backoff()
                out = await self._export(batch)
            if out == FINAL:
                await self._export_apart(parts)
            elif out != OK:
                self._spill(batch)
                if self.full and not self.reachable():
                    self._spill_queue()  # it went away while full: stop holding producers back
        except asyncio.CancelledError:
            # drain() gave up on it at its deadline (an export in a down collector's retries): spooled, or
            # counted as dropped, never gone unseen; its producer's resend is a duplicate for the next agent
            self._spill(batch)
            raise
        finally:
            self._busy = False
            for c in completions:
                c.done()
        return None

    async def _export_apart(self, parts: list[Sequence[Item]]) -> None:
        """A batch refused for good: drop only the submissions at fault."""
        if len(parts) == 1:
            return self._drop_rejected(parts[0], "refused for good")
        for part in parts:
            out = await self._export(part)
            if out == FINAL:
                self._drop_rejected(part, "refused for good")
            elif out != OK:
                self._spill(part)
        return None

    def _take(self) -> tuple[list[Sequence[Item]], list[Completion]]:
        """The next export: queued batches, a lane at a time in turn, up to ``max_batch_items``. While
        several lanes (uids) wait, or did within ``CONTENDED_S``, up to what this exporter sends in
        ``CONTENDED_EXPORT_S`` too (at least ``CONTENDED_FLOOR_ITEMS``): a batch is acked only once its
        whole export is done, and another uid's batch of one item must not wait for 4,096 of a flood's
        items (a second of MQTT messages) to go out with it, or before it. The sink's speed is read from
        whole exports only (a capped one's round trip would shrink the cap on and on), and only what grows
        with an export's size counts (export_cost.py: a round trip is paid by every export, split or not): a
        fast sink's exports stay whole, a distant collector's too, and a lone lane's are merged as before."""
        parts: list[Sequence[Item]] = []
        completions: list[Completion] = []
        n = 0
        limit = self.max_batch_items
        now = time.monotonic()
        if self.queue.lane_count() > 1:
            self._contended_until = now + CONTENDED_S
        if now < self._contended_until and self._cost.known:
            per_item = self._cost.per_item_s()  # the part that grows with the size (export_cost.py)
            if per_item > 0:
                limit = min(limit, max(CONTENDED_FLOOR_ITEMS, int(CONTENDED_EXPORT_S / per_item)))
        self._capped = limit < self.max_batch_items
        while self.queue and (not parts or n + len(self.queue.head()[0]) <= limit):
            items, c = self.queue.popleft()
            self.queue_items -= len(items)
            parts.append(items)
            n += len(items)
            completions.append(c)
        self._dequeued()
        return parts, completions

    async def _drain_spool_once(self) -> None:
        """Move live batches behind the spool (order), then try its oldest batch."""
        assert self.spool is not None
        self._spill_queue()
        if self._stopping and not self.peer_up:
            return await self._idle_stop()
        batch, records = self.spool.peek_many(1 if self._isolate else self.max_batch_items)
        if not records:
            if self.spool:  # items counted but unreadable now (a segment vanished): no busy loop
                raise OSError("spool holds %d item(s) it cannot read" % self.spool.items)
            return None
        self._busy = True
        try:
            out = await self._export(batch)
            if out == OK:
                self._head = None
                self._isolate = max(0, self._isolate - 1)
                self.spool.pop_many(records)
                return None
            if out in (FINAL, REJECTED) and records > 1:
                self._isolate = records  # one record at a time until the bad one is found
                return None
            if out == FINAL:
                self._head, self._isolate = None, 0  # found it: back to whole batches
                self.spool.pop_many(1)
                return self._drop_rejected(batch, "refused for good")
            if out == REJECTED:
                head = self.spool.head()
                if head != self._head:
                    self._head, self._head_attempts = head, 0
                self._head_attempts += 1
                if self._head_attempts >= self.max_attempts:
                    self._head, self._isolate = None, 0
                    self.spool.pop_many(1)
                    return self._drop_rejected(batch, "rejected %d times" % self.max_attempts)
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
            if not self.queue and not self._busy and (not self.spool or not self.peer_up or self.fault_since):
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
        sp = self.spool
        out: dict[str, int | float | str] = {
            # an endpoint that never started (Prometheus's port in use) is down too: its exports do not fail
            "peer_up": int(self.peer_up and not self.start_error and not exporter_problem(self.exporter)),
            "queue_depth": len(self.queue),
            "exported_items": self.exported_items,
            "export_errors": self.export_errors,
            "retries": self.retries,
            "spilled_items": self.spilled_items,
            "pushbacks": self.pushbacks,
            "dropped_items": self.dropped_items + (sp.dropped_items if sp is not None else 0),
            "rejected_items": self.rejected_items,
            "lost_items": self.lost_total(),
            "internal_errors": self.internal_errors,
            "spooled_items_pending": sp.items if sp is not None else 0,
            "spool_corrupt_records": sp.corrupt_records if sp is not None else 0,
            "spool_over_uid_share_items": sp.over_uid_share_items if sp is not None else 0,
            "problem": self.problem() or "",
            "last_error": self.last_error,
        }
        out.update({"exporter." + k: v for k, v in self.exporter.state().items()})
        return out


def exporter_problem(exporter: Exporter) -> str:
    """What an exporter says keeps it from working ("" when nothing), through its optional
    ``problem()`` (a scrape endpoint that could not bind: its exports never fail)."""
    probe = getattr(exporter, "problem", None)
    if probe is None:
        return ""
    try:
        return str(probe() or "")
    except Exception as exc:  # a broken probe is a problem too, not a crash of the health check
        return "problem() failed: %r" % (exc,)


class Broadcaster:
    """Hands every batch to every exporter worker, after showing it to the taps.

    A tap sees items as they pass (the cold-start progress tracker, say); it must be
    quick and must not raise: an exception is logged and the batch still goes out.
    """

    def __init__(self, workers: list[ExporterWorker]) -> None:
        self.workers = workers
        self.taps: list[Callable[[Sequence[Item]], None]] = []
        self._ready = asyncio.Event()  # clear while some reachable exporter is full
        self._ready.set()
        self._moved: asyncio.Event | None = None  # set when a queue moved, while a uid waits for its share
        self.uid_bound = min((w.queue_max_items for w in workers), default=0)
        for w in workers:
            w.on_full_change = self._recheck
            w.on_dequeued = self._queue_moved

    def _recheck(self) -> None:
        if any(w.full for w in self.workers):
            self._ready.clear()
        else:
            self._ready.set()
        self._queue_moved()

    def _queue_moved(self) -> None:
        if self._moved is not None:
            self._moved.set()
            self._moved = None

    def queued_of(self, uid: int) -> int:
        """Items of producers of ``uid`` waiting in the fullest exporter queue."""
        return max((w.queue.items_of(uid) for w in self.workers), default=0)

    def over_share(self, uid: int) -> bool:
        """``uid`` (root aside) has a quarter of an exporter queue's bound waiting (no exporter: no queue)."""
        if uid == 0 or not self.workers:
            return False
        return self.queued_of(uid) >= max(1, self.uid_bound // UID_QUEUE_SHARE)

    def must_wait(self, uid: int) -> bool:
        """Whether ``uid``'s producers must not be read now: its share of the queues is full, or a queue
        is full and ``uid`` has more than a trickle in it (root: whenever a queue is full)."""
        if not self._ready.is_set():
            return uid == 0 or self.queued_of(uid) >= max(1, self.uid_bound // UID_QUEUE_FLOOR)
        return self.over_share(uid)

    async def wait_turn(self, uid: int) -> None:
        """Until ``uid``'s producers may be read again (:meth:`must_wait`)."""
        while self.must_wait(uid):
            if self._moved is None:
                self._moved = asyncio.Event()
            await self._moved.wait()

    @property
    def congested(self) -> bool:
        """Some exporter's queue is full while its destination is reachable: stop reading."""
        return not self._ready.is_set()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    def publish(self, items: Sequence[Item], on_done: Callable[[], None] | None = None,
                uid: int | None = None) -> None:
        """Show ``items`` to the taps and hand them to every exporter, in the lane of ``uid`` (the
        producer's; None for the agent's own); ``on_done`` once every exporter completed them."""
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
            w.submit(items, c, uid)

    def publish_to(self, items: Sequence[Item], live: bool) -> None:
        """Only to the exporters that show live values (``live``: Prometheus), or only to
        those that record (file, OTLP, MQTT): device samples go to each at its own rate."""
        if not items:
            return
        workers = [w for w in self.workers if is_live(w.exporter) == live]
        if not workers:
            return
        c = Completion()
        c.pending = len(workers)
        for w in workers:
            w.submit(items, c)

    def idle(self) -> bool:
        return all(w.idle() for w in self.workers)

