"""Cold starts as an agent extension: span assembly, live progress with ETAs and history,
and fleet metrics.

Its span handler (:class:`~infersight.agent.coldstart.assembly.ColdStartAssembly`) takes the
``coldstart`` roots and ``coldstart.*`` stages from the agent's assembler, the hooks'
``cs_tick`` checkpoints, and closes the cold start of a producer that died before its root.

The tracker watches every published batch; a job publishes its updates (on each stage
change, and at most once a second per service); the status reply lists the processes in
their cold start under ``coldstarts``. At shutdown, what still shows as warming is cleared.

Each finished cold start feeds :class:`~infersight.agent.coldstart.metrics.ColdStartMetrics`,
whose snapshot goes out in the cold start's own batch, right after its summary (the MQTT
payload and ``launch`` read them together); on each heartbeat the services that did not start
for a while are re-sent, so the series of rarely starting services stay live.

The storage ceilings known (the agent measures its state directory's device at start;
``launch`` caches those of weights files) go out as the gauge ``infersight.storage.ceiling``,
one point per device: read from the cache off the loop, sent when they change and every minute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from infersight import weights_files
from infersight.agent.coldstart import storage_ceiling
from infersight.agent.coldstart.assembly import DEFAULT_MAX_PENDING_BYTES, ColdStartAssembly
from infersight.agent.coldstart.metrics import REFRESH_NS, ColdStartMetrics, ceiling_item
from infersight.agent.coldstart.progress import ProgressTracker, history_path_from
from infersight.agent.daemon.assemble import KindHandler, SpanHandler
from infersight.agent.daemon.extension import AgentContext, Extension
from infersight.settings import Config, env_flag
from infersight.telemetry import ColdStart, Item, SpanEvent

log = logging.getLogger("infersight.agent.coldstart")
MEASURE_NICE = 19  # the storage measurement at start: the lowest CPU priority (its thread only)

PROGRESS_TICK_S = 0.2
CEILING_POLL_S = 15.0  # the ceiling cache is re-read this often (launch may add a device)


class ColdStartExtension(Extension):
    name = "coldstart"  # agent.state_dir and agent.max_pending_bytes apply at the next restart

    def __init__(self, config: Config) -> None:
        self.metrics = ColdStartMetrics()  # per service, across producers
        # The weights files go on the root first: the metrics read the summaries.
        self.assembly = ColdStartAssembly(config.get("agent.max_pending_bytes", DEFAULT_MAX_PENDING_BYTES),
                                          observers=[add_weights_files, self.metrics.observe])
        self.tracker = ProgressTracker(history_path_from(config.get("agent.state_dir")))
        self.state_dir = config.get("agent.state_dir")
        self.ceiling_poll_s = CEILING_POLL_S
        self.ceilings: dict[str, float] = {}  # device label -> bytes/s, as last exported
        self._measured = asyncio.Event()  # a measurement ended: read the cache now
        self._agent: AgentContext | None = None

    def kinds(self) -> Mapping[str, KindHandler]:
        return {"cs_tick": self.assembly.checkpoint}

    def spans(self) -> SpanHandler:
        return self.assembly

    def finished(self, cs: ColdStart, t_ns: int) -> list[Item]:
        """A cold start only the launcher saw (``launch``'s own root): its root, stages and
        summary, with what the observers add (its fleet metrics), as one batch."""
        return [cs.root, *cs.stages, cs, *self.assembly.observe(cs, t_ns)]

    async def start(self, agent: AgentContext) -> None:
        self._agent = agent
        self.tracker.producer_info = agent.producer_info
        self.tracker.visible_pid = getattr(agent, "visible_pid", None)  # (an AgentContext of an older make has none)
        agent.observe(self.tracker.observe)
        if self.state_dir and measure_storage_enabled():
            agent.spawn(self._measure_storage(str(self.state_dir)), "coldstart-storage-ceiling")
        agent.spawn(self._export_ceilings(agent), "coldstart-ceiling-gauge")
        agent.on_heartbeat(lambda: agent.broadcaster.publish(self.metrics.due(time.time_ns())))
        agent.spawn(self._publish_progress(agent), "coldstart-progress")

    async def _measure_storage(self, directory: str) -> None:
        """The storage ceiling of the state directory's device, once (cached): off the hot path,
        on a thread at the lowest CPU and I/O priority, so that a first cold load already has a
        ceiling without competing with it for the disk."""

        def measure() -> dict[str, Any] | None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MEASURE_NICE)
            except (OSError, AttributeError):
                pass
            storage_ceiling.idle_io_priority()  # a served process's own reads go first
            return storage_ceiling.ensure_for_dir(directory)

        # A thread of its own: the priorities it lowers must not stay on a shared pool thread.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="infersight-ceiling")
        try:
            entry = await asyncio.get_running_loop().run_in_executor(pool, measure)
        finally:
            pool.shutdown(wait=False)
            self._measured.set()
        if entry is not None:
            log.debug("storage ceiling of device %s: %.0f MiB/s", entry.get("device"),
                      float(entry.get("bytes_per_s", 0)) / 2**20)

    async def _export_ceilings(self, agent: AgentContext) -> None:
        """The ``infersight.storage.ceiling`` gauge while a ceiling is known: the cache is read on
        a worker thread; sent at once when it changed, else every minute (a pull endpoint expires
        series nobody refreshed)."""
        sent_ns = 0
        start_ns = time.time_ns()
        while True:
            self._measured.clear()  # a measurement that ends while the cache is read wakes the next round
            known = await asyncio.to_thread(storage_ceiling.known_ceilings)
            now = time.time_ns()
            if known != self.ceilings or now - sent_ns >= REFRESH_NS:
                self.ceilings = known
                item = ceiling_item(agent.resource, known, now, start_ns)
                if item is not None:
                    agent.broadcaster.publish([item])
                    sent_ns = now
            # Not wait_for: before Python 3.12 it swallows a cancellation that comes as the event is set (the
            # measurement's end, which a shutdown also cancels), and the agent's shutdown then waited its
            # whole timeout (10 s) for this task.
            measured = asyncio.ensure_future(self._measured.wait())
            try:
                await asyncio.wait((measured,), timeout=self.ceiling_poll_s)
            finally:
                measured.cancel()

    async def _publish_progress(self, agent: AgentContext) -> None:
        while True:
            await asyncio.sleep(PROGRESS_TICK_S)
            updates = self.tracker.tick()
            if updates:
                agent.broadcaster.publish(updates)

    def health(self) -> Mapping[str, Any]:
        return {"coldstarts": self.tracker.snapshot(), "coldstarts_not_tracked": self.tracker.refused_warming,
                "coldstart_history_lines_skipped": self.tracker.history.corrupt_lines,
                "coldstart_history_runs_cut": self.tracker.history.runs_cut,
                "coldstart_history_runs_pushed_out": self.tracker.history.runs_pushed_out,
                "storage_ceilings": dict(self.ceilings)}

    async def aclose(self) -> None:
        """Nothing warms any more: clear what still shows as warming."""
        self.tracker.end_all()
        if self._agent is not None:
            self._agent.broadcaster.publish(self.tracker.tick())


def measure_storage_enabled() -> bool:
    return env_flag("INFERSIGHT_MEASURE_STORAGE", True)


def add_weights_files(cs: ColdStart, t_ns: int) -> list[Item]:
    """(Cold-start observer) One ``weights_file`` event per weights file on the root, before the
    root goes out (same batch), with the ceiling ratio of a cold file from the cached ceiling."""
    if weights_files.events(cs):
        return []
    for attrs in weights_files.summarize(cs.stages, storage_ceiling.ceiling_of):
        cs.root.events.append(SpanEvent(weights_files.EVENT, cs.root.end_ns, attrs))
        rate, counted, path = attrs.get("bytes_per_s"), attrs.get("counted_bytes"), attrs.get("path")
        if "ceiling_raised_from" in attrs and isinstance(rate, float) and isinstance(counted, int) \
                and isinstance(path, str):
            storage_ceiling.raise_to(path, rate, counted)
    return []
