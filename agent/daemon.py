"""The agent's lifecycle: one object owns startup, signals and shutdown.

As in uvicorn: the first SIGTERM/SIGINT stops gracefully within a time limit
(stop accepting, drain the exporters' queues, flush); the second forces exit.
SIGHUP reloads the configuration and rules; an invalid file keeps the old ones.
The same object runs in-process under ``infersight launch`` (embedded mode).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from infersight import __version__
from infersight.agent import config as cfg
from infersight.agent.assemble import Assembler, KindHandler
from infersight.agent.health import Counters, ProcessStats, health_metrics
from infersight.agent.ingest import Ingest
from infersight.agent.model import Resource
from infersight.agent.pipeline import ExporterWorker, Router
from infersight.agent.spool import DiskSpool
from infersight.exporters.base import Exporter

log = logging.getLogger("infersight.agent")
EXPORTER_DOWN_UNHEALTHY_S = 120.0


def short_hostname() -> str:
    return socket.gethostname().split(".")[0]


class Agent:
    def __init__(
        self,
        config: cfg.Config,
        exporters: list[Exporter],
        *,
        embedded: bool = False,
        listen_sock: socket.socket | None = None,
        exporter_spool_root: str | None = None,
        handlers: dict[str, KindHandler] | None = None,
    ) -> None:
        self.config = config
        self.embedded = embedded
        self.listen_sock = listen_sock
        self.started_ns = time.time_ns()
        self.started_mono = time.monotonic()
        self.host_name = config.get("agent.host_name") or short_hostname()
        self.resource = Resource.of(
            {
                "service.name": "infersight-agent",
                "service.version": __version__,
                "host.name": self.host_name,
                "process.pid": os.getpid(),
                "infersight.agent.mode": "embedded" if embedded else "daemon",
            }
        )
        self.counters = Counters()
        self.assembler = Assembler(self.host_name, handlers, max_pending_bytes=config["agent.max_pending_bytes"])
        spool_root = exporter_spool_root or os.path.join(config["agent.spool_dir"], "exporters")
        self.workers: list[ExporterWorker] = []
        for e in exporters:
            spool = None
            if e.name not in ("console",):
                spool = DiskSpool(os.path.join(spool_root, e.name), config["agent.exporter_spool_max_bytes"])
            self.workers.append(ExporterWorker(e, spool, max_attempts=config["agent.exporter_max_attempts"],
                                               down_unhealthy_s=EXPORTER_DOWN_UNHEALTHY_S))
        self.router = Router(self.workers)
        self.ingest = Ingest(
            self.assembler,
            self.router,
            self.counters,
            set(config["agent.allowed_uids"]),
            set(config["agent.allowed_gids"]),
            self.health,
            frame_timeout_s=config["agent.frame_timeout_s"],
            max_connections=config["agent.max_connections"],
            idle_timeout_s=config["agent.idle_timeout_s"],
        )
        self.proc_stats = ProcessStats()
        self._stop = asyncio.Event()
        self._signals = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self.reloaders: list[Callable[[cfg.Config], None]] = []
        self.on_ready: list[Callable[[], Awaitable[None] | None]] = []
        # Long-running jobs beside ingest (the NVML sampler, say): started with the agent,
        # cancelled at shutdown. Each gets the agent and publishes through agent.router.
        self.background: list[Callable[[Agent], Awaitable[None]]] = []
        self.on_shutdown: list[Callable[[], Awaitable[None] | None]] = []
        self.listening = False
        self.nvml_reason: str | None = None

    # -- health ---------------------------------------------------------------------

    def dropped_by_producers(self) -> int:
        return sum(p.dropped_buffer + p.dropped_spool for p in self.assembler.producers.values())

    def health(self) -> dict[str, Any]:
        now = time.monotonic()
        exporters = []
        healthy = self.listening
        for w in self.workers:
            st = {"name": w.name, **w.state()}
            exporters.append(st)
            if w.problem(now) is not None:  # a worker fault at once; a peer away after a grace
                healthy = False
        return {
            "healthy": healthy,
            "version": __version__,
            "mode": "embedded" if self.embedded else "daemon",
            "pid": os.getpid(),
            "uptime_s": round(now - self.started_mono, 3),
            "socket": self.config["agent.socket"],
            "producers": len(self.assembler.producers),
            "events_in": self.counters.events_in,
            "items_out": self.counters.items_out,
            "lost": self.assembler.lost_total(),
            "dropped_by_producers": self.dropped_by_producers(),
            "counters": self.counters.as_dict(),
            "assembler": self.assembler.stats(),
            "exporters": exporters,
        }

    def publish_health(self) -> None:
        cpu, rss = self.proc_stats.sample()
        items = health_metrics(
            self.resource,
            self.started_ns,
            self.counters,
            self.assembler.lost_total(),
            self.dropped_by_producers(),
            [{"name": w.name, **w.state()} for w in self.workers],
            cpu,
            rss,
            self.nvml_reason,
            self.assembler.stats(),
        )
        self.router.publish(items)

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        for w in self.workers:
            try:
                await w.exporter.start()
            except Exception as exc:  # a peer that is away is not fatal: the worker spools
                log.warning("exporter %s did not start cleanly: %s", w.name, exc)
            w.start()
        await self.ingest.start(self.config["agent.socket"], self.config["agent.socket_mode"], self.listen_sock)
        self.listening = True
        replayed = self.ingest.replay_spools(self.config["agent.spool_dir"])
        if replayed:
            log.info("replayed %d spool file(s) of producers that had died", replayed)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._periodic(), name="agent-periodic"))
        for job in self.background:
            self._tasks.append(loop.create_task(self._guard(job), name="agent-job"))
        for cb in self.on_ready:
            r = cb()
            if r is not None:
                await r

    async def _periodic(self) -> None:
        interval = float(self.config["agent.health_interval_s"])
        replay_every = 30.0
        last_replay = time.monotonic()
        while True:
            await asyncio.sleep(min(interval, replay_every))
            self.publish_health()
            if time.monotonic() - last_replay >= replay_every:
                last_replay = time.monotonic()
                self.ingest.replay_spools(self.config["agent.spool_dir"])

    async def _guard(self, job: Callable[[Agent], Awaitable[None]]) -> None:
        try:
            await job(self)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background job failed; the agent keeps running without it")

    def request_stop(self) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("stopping: draining and flushing (send the signal again to force exit)")
            self._stop.set()
        else:
            log.warning("second stop signal: exiting now")
            os._exit(1)

    def reload(self) -> bool:
        """Re-read the config file; keep the running config when the new one is invalid."""
        path = self.config.path
        try:
            new = cfg.load(path, require_file=path is not None)
            for r in self.reloaders:
                r(new)  # raises on an invalid rule file, before anything is swapped
        except (cfg.ConfigError, ValueError) as exc:
            self.counters.reload_failures += 1
            log.error("reload failed, keeping the running configuration: %s", exc)
            return False
        self.config = new
        self.ingest.allowed_uids = set(new["agent.allowed_uids"])
        self.ingest.allowed_gids = set(new["agent.allowed_gids"])
        logging.getLogger("infersight").setLevel(new["agent.log_level"])
        self.counters.reloads += 1
        log.info("configuration reloaded from %s", path or "environment")
        return True

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    async def shutdown(self, timeout_s: float | None = None) -> bool:
        """Stop accepting, export what is queued, flush every exporter. True if all in time."""
        timeout = float(timeout_s if timeout_s is not None else self.config["agent.shutdown_timeout_s"])
        deadline = time.monotonic() + timeout
        await self.ingest.stop_accepting()
        self.listening = False
        for t in self._tasks:
            t.cancel()
        for cb in self.on_shutdown:
            r = cb()
            if r is not None:
                await r
        self.ingest.close_connections()
        await self.ingest.wait_connections_closed(max(0.0, min(1.0, deadline - time.monotonic())))
        self.publish_health()
        ok = True
        for w in self.workers:
            ok = await w.drain(max(0.1, deadline - time.monotonic())) and ok
        for w in self.workers:
            try:
                await asyncio.wait_for(w.exporter.force_flush(max(0.1, deadline - time.monotonic())),
                                       max(0.1, deadline - time.monotonic()) + 0.5)
                await asyncio.wait_for(w.exporter.shutdown(), 5.0)
            except Exception as exc:
                ok = False
                log.warning("exporter %s did not shut down cleanly: %s", w.name, exc)
        if not self.embedded and self.listen_sock is None:
            try:
                os.unlink(self.config["agent.socket"])
            except OSError:
                pass
        return ok

    async def serve_forever(self) -> int:
        """The daemon's main: start, wait for a signal, shut down. Returns the exit code."""
        self.install_signal_handlers()
        await self.start()
        log.info("infersight agent %s listening on %s", __version__, self.config["agent.socket"])
        await self.wait_stopped()
        if not await self.shutdown():
            log.warning("shutdown hit its time limit; what was left is spooled or counted")
        return 0
