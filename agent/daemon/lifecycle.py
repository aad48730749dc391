"""The agent's lifecycle: one object owns startup, the heartbeat, signals, reload and shutdown.

As in uvicorn's ``Server``, :meth:`Agent.serve` is the one way the agent runs: the daemon
(``infersight agent``) serves until a signal, ``infersight launch`` (embedded mode) serves
``until`` its session ends. Startup: exporters, then extensions, then the socket and the
spools of producers that died. While it runs, a heartbeat publishes the agent's health,
runs what extensions asked for on each beat (the cold-start extension re-sends cumulative
cold-start metrics) and picks up dead producers' spools. The first
SIGTERM/SIGINT stops gracefully within a time limit (stop accepting, close the extensions,
drain the exporters' queues, flush); the second forces exit. SIGHUP reloads the
configuration and rules, all or nothing: the configuration and every extension's part are
validated first, and only when all are valid is anything swapped.

Under systemd (``Type=notify``, daemon mode only) the agent reports its state over
``NOTIFY_SOCKET``: READY=1 once it listens with its exporters up, WATCHDOG=1 every
half ``WATCHDOG_USEC`` *from the event loop* (a wedged loop stops the pings and systemd
restarts the agent), RELOADING=1 around SIGHUP, STOPPING=1 at shutdown, and a one-line
STATUS= of its health.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from infersight import __version__
from infersight.agent.daemon import config as cfg
from infersight.agent.daemon import sdnotify, seqstate
from infersight.agent.daemon.assemble import Assembler, KindHandler, Producer, SpanHandler
from infersight.agent.daemon.broadcast import Broadcaster, ExporterWorker
from infersight.agent.daemon.exporter_spool_adopt import adopt_old_spool
from infersight.agent.daemon.extension import Apply, Extension
from infersight.agent.daemon.health import Counters, ProcessStats, code_print, health_metrics
from infersight.agent.daemon.identity import id_parts, proc_start_ticks
from infersight.agent.daemon.ingest import Ingest
from infersight.agent.daemon.sessions import Sessions
from infersight.agent.daemon.spool import DiskSpool
from infersight.agent.errors import AgentError
from infersight.errors import InfersightError
from infersight.exporters.base import Exporter, is_ephemeral
from infersight.settings import Config, ConfigError
from infersight.statefiles import UnsafeStateDirError, chmod_dir, ensure_state_dir
from infersight.telemetry import Item, Origin, Resource

log = logging.getLogger("infersight.agent")
SPOOL_SCAN_S = 5.0
# Startup waits this long at most for the first scan of the hooks' spool directory; a longer one (a huge
# file, planted or real) goes on in the scan's task, after READY=1 and with the watchdog's pings.
START_SCAN_WAIT_S = 10.0
SCAN_LISTING_SPACING = 4  # a scan starts at least this many times its listing's duration after the last
# Keys a reload applies to the running agent, with those its extensions apply
# (``Extension.live_keys``); a change to any other key (socket, spools, exporters, NVML
# sampling) is validated, and applies at the next restart (logged).
LIVE_KEYS = frozenset({
    "agent.allowed_uids", "agent.allowed_gids", "agent.log_level", "agent.shutdown_timeout_s",
    "agent.frame_timeout_s", "agent.health_interval_s", "agent.exporter_stall_s",
})
NO_SINK_WARNING = ("no sink: every sink is disabled, so events are received and dropped "
                   "(set one, or remove exporters.file.enabled = false)")


def problem_text(p: dict[str, str]) -> str:
    """``exporter prometheus: cannot start: ...`` (one problem, as status and STATUS= say it)."""
    return "exporter %s: %s" % (p["exporter"], p["reason"]) if p.get("exporter") else p["reason"]


SINK_TARGETS = ("exporter.path", "exporter.traces_endpoint", "exporter.url", "exporter.address")


def sink_line(state: dict[str, Any]) -> str:
    """``file /var/lib/infersight/infersight.otlp.jsonl``: an exporter and where it sends."""
    target = next((str(state[k]) for k in SINK_TARGETS if state.get(k)), "")
    return ("%s %s" % (state["name"], target)).strip()


EXPORTER_SPOOL_SUBDIR = "exporters"  # under agent.state_dir


class StateDirError(ConfigError, AgentError):
    """``agent.state_dir`` could be written by someone other than the agent: it will not start."""


def check_state_dir(path: str) -> list[str]:
    """The daemon's start check of ``agent.state_dir`` (exit 2 with the reason); returns the
    warnings to log (an ancestor that others may write: see ``ensure_state_dir``). ``infersight
    agent`` runs it before building the extensions, which read the state directory (the
    cold-start history): a mode it fixes is fixed (and logged) before that read; the agent
    checks again here when it starts."""
    try:
        return ensure_state_dir(path)
    except UnsafeStateDirError as exc:
        raise StateDirError(
            "unsafe state directory (agent.state_dir): %s. It holds the agent's own state (exporter "
            "spools, cold-start history, the default OTLP file) and must be a directory of the agent's "
            "uid with mode 0700 or 0750; set agent.state_dir / INFERSIGHT_STATE_DIR elsewhere, or fix it"
            % (exc.strerror or exc)) from None
    except OSError as exc:
        raise StateDirError("cannot use the state directory %s: %s" % (path, exc)) from None


SHARED_SPOOL_MODE = 0o3770  # setgid (the group follows the directory's), sticky, no access for others


def check_hooks_spool_dir(path: str) -> bool:
    """The hooks' spool directory is shared with the socket group: without the sticky bit a
    member could remove or rename another's spool file. One of the agent's own gets the bit
    (logged); another's is reported (the hooks then rescue and count a removed file). A missing
    one in a shared place (a setgid or group-writable parent: a Kubernetes emptyDir is 2777,
    which the hooks refuse to spool in, so the pod's manifest names a subdirectory of it) is
    made, 3770; elsewhere the hooks make a private one. True when the directory is safe as it
    is now."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            parent = os.stat(os.path.dirname(os.path.abspath(path)))
        except OSError:
            return True  # nothing to make it in: the hooks make a private one where they can
        if not stat.S_ISDIR(parent.st_mode) or not parent.st_mode & (stat.S_ISGID | stat.S_IWGRP):
            return True  # not a shared place (a user's own state directory): the hooks make a private one
        try:
            os.mkdir(path, 0o700)
            chmod_dir(path, SHARED_SPOOL_MODE, os.lstat(path))
        except OSError as exc:
            log.warning("cannot make the hooks' spool directory %s: %s (the hooks make a private one)", path, exc)
            return True
        log.info("made the hooks' spool directory %s (%04o)", path, SHARED_SPOOL_MODE)
        return True
    except OSError:
        return True
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode) or not mode & 0o022 or mode & stat.S_ISVTX:
        return True
    if st.st_uid == os.geteuid():
        try:
            chmod_dir(path, mode | stat.S_ISVTX, st)
            log.warning("hooks' spool directory %s was %04o: added the sticky bit (%04o) so that no group "
                        "member can remove another's spool file", path, mode, mode | stat.S_ISVTX)
            return True
        except OSError as exc:
            log.warning("cannot add the sticky bit to the hooks' spool directory %s: %s", path, exc)
            return False
    log.warning("hooks' spool directory %s is %04o without the sticky bit: a group member can remove "
                "another's spool file (the hooks rescue and count it). Make it 3770 (systemd/tmpfiles.d)",
                path, mode)
    return False


def foreign_spool_dir(path: str) -> str | None:
    """Why the agent cannot read the hooks' spool directory ``path``, when another uid made it: a served
    process's hook that started before the agent (a pod whose sidecar came up second) makes it its own,
    2700, and what it spools there is never replayed. None when the agent can read it (or it is absent)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid in (os.geteuid(), 0) or os.access(path, os.R_OK | os.X_OK):
        return None
    return ("the hooks' spool directory %s belongs to uid %d (mode %04o): a hooked process made it before the "
            "agent did, and the agent cannot read what is spooled there; remove it and restart the agent, which "
            "makes it %04o (in a pod: start the agent first, a native sidecar)"
            % (path, st.st_uid, stat.S_IMODE(st.st_mode), SHARED_SPOOL_MODE))


def short_hostname() -> str:
    return socket.gethostname().split(".")[0]


class Agent:
    """One agent: its pipeline (ingest -> assembler -> broadcaster -> exporter workers), the
    extensions it was built with, and the lifecycle that runs them (:meth:`serve`).

    ``check_config``: what a reloaded configuration must also pass, beyond the agent's own keys
    and its extensions' parts (the exporters' sections, which the composition root knows);
    it raises ConfigError and changes nothing, since exporters apply at the next restart.
    """

    def __init__(
        self,
        config: Config,
        exporters: list[Exporter],
        extensions: Sequence[Extension] = (),
        *,
        embedded: bool = False,
        listen_sock: socket.socket | None = None,
        exporter_spool_root: str | None = None,
        check_config: Callable[[Config], None] | None = None,
    ) -> None:
        self.config = config
        self.started_values = dict(config.values)  # what runs until a restart (a reload swaps only live keys)
        self.pending_restart: list[str] = []  # settings the file changed that apply at the next restart
        self.env_warnings = cfg.unknown_env_warnings()  # INFERSIGHT_* names nothing reads (typos), in status
        self.embedded = embedded
        self.listen_sock = listen_sock
        self.extensions = tuple(extensions)
        self.check_config = check_config
        self.started_ns = time.time_ns()
        # The code it loaded (a few ms): `status` tells it from a newer install (health.code_predates). Not launch's
        # agent: it lives as long as its CLI, and its CMD waits for its start.
        self.code = code_print() if not embedded else None
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
        self.assembler = Assembler(self.host_name, self._kind_handlers(), self._span_handlers())
        # The daemon's exporter spools are its own state: in state_dir (checked; only the agent
        # may write it), never in the hooks' group-writable spool directory. ``launch`` gives
        # its private directory; another embedded agent (tests) keeps them under its spool dir.
        state_dir = config["agent.state_dir"]
        if exporter_spool_root is None and embedded:
            exporter_spool_root = os.path.join(config["agent.spool_dir"], "exporters")
        self.state_dir_warnings: list[str] = []
        if exporter_spool_root is None:
            self.state_dir_warnings = check_state_dir(state_dir)
            for w in self.state_dir_warnings:
                log.warning("state directory: %s", w)
        self.workers: list[ExporterWorker] = []
        for e in exporters:
            spool = None
            if not is_ephemeral(e):
                limit = config["agent.exporter_spool_max_bytes"]
                if exporter_spool_root is None:
                    self._adopt_old_spool(config["agent.spool_dir"], state_dir, e.name)
                try:
                    spool = (DiskSpool(os.path.join(exporter_spool_root, e.name), limit)
                             if exporter_spool_root is not None
                             else DiskSpool(os.path.join(EXPORTER_SPOOL_SUBDIR, e.name), limit, state_dir=state_dir))
                except OSError as exc:
                    raise StateDirError("cannot use the disk spool of exporter %s: %s" % (e.name, exc)) from None
            self.workers.append(ExporterWorker(e, spool, max_attempts=config["agent.exporter_max_attempts"],
                                               stall_s=config["agent.exporter_stall_s"]))
        self.broadcaster = Broadcaster(self.workers)
        self.ingest = Ingest(
            self.assembler,
            self.broadcaster,
            self.counters,
            set(config["agent.allowed_uids"]),
            set(config["agent.allowed_gids"]),
            self.health,
            frame_timeout_s=config["agent.frame_timeout_s"],
            max_connections=config["agent.max_connections"],
            idle_timeout_s=config["agent.idle_timeout_s"],
        )
        self.ingest.spool_dir = config["agent.spool_dir"]
        self.ingest.spools.loop_share = self.ingest.connections.loop_share  # a scan's time is its files' owners'
        # Joined launches subscribe to their CMD's items (sessions.py); a tap like any other.
        self.sessions = Sessions(self.assembler, self._session_info, self.ingest.connected,
                                 lambda: self.ingest.replay_spools_async(self.config["agent.spool_dir"]),
                                 capture=self._session_capture, settle=self._session_settle)
        self.broadcaster.taps.append(self.sessions.tap)
        self.ingest.subscribe = self.sessions.serve
        self.proc_stats = ProcessStats()
        self._stop = asyncio.Event()
        self._signals = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self.listening = False
        self._watchdog_task: asyncio.Task[None] | None = None
        # Opened now, before any producer can take the last file descriptor.
        self._notifier = sdnotify.Notifier() if not embedded else None
        self._status_sent = ""
        self.last_reload_error: str | None = None
        self._heartbeat_jobs: list[Callable[[], None]] = []
        self.live_keys = LIVE_KEYS.union(*(ext.live_keys for ext in self.extensions))

    def _adopt_old_spool(self, spool_dir: str, state_dir: str, name: str) -> None:
        """Exporter ``name``'s spool an older agent left in the hooks' spool directory: moved into state_dir before
        the spool opens (delivered first), or a warning (log and ``status``) saying why its records wait there."""
        adopted = adopt_old_spool(spool_dir, state_dir, os.path.join(EXPORTER_SPOOL_SUBDIR, name), name)
        if adopted.done:
            log.info("%s", adopted.done)
        if adopted.warning:
            log.warning("%s", adopted.warning)
            self.state_dir_warnings.append(adopted.warning)

    def _kind_handlers(self) -> dict[str, KindHandler]:
        handlers: dict[str, KindHandler] = {}
        for ext in self.extensions:
            for kind, handler in ext.kinds().items():
                if kind in handlers:
                    raise ValueError("event kind %r is handled by two extensions (one is %s)" % (kind, ext.name))
                handlers[kind] = handler
        return handlers

    def _span_handlers(self) -> list[SpanHandler]:
        handlers: list[SpanHandler] = []
        for ext in self.extensions:
            handler = ext.spans()
            if handler is None:
                continue
            for prefix in handler.prefixes:
                if any(p.startswith(prefix) or prefix.startswith(p) for h in handlers for p in h.prefixes):
                    raise ValueError("span names %r are taken by two extensions (one is %s)" % (prefix, ext.name))
            handlers.append(handler)
        return handlers

    # -- what extensions get (AgentContext) -------------------------------------------

    def producer_info(self, producer: str) -> dict[str, Any] | None:
        p = self.assembler.producers.get(producer)
        return p.info if p is not None else None

    def hooked_pids(self, uid: int | None) -> frozenset[int]:
        return frozenset(p.peer_pid for p in self.assembler.producers.values()
                         if p.uid == uid and not p.gone and p.peer_pid)

    def visible_pid(self, producer: str) -> int | None:
        p = self.assembler.producers.get(producer)
        if p is None or p.peer_pid == 0:
            return None
        pid = p.info.get("pid")
        if type(pid) is not int or pid <= 0:
            return None
        if p.peer_pid is None:  # a spool file's hello (a pod's spool is shared across PID namespaces): only a
            # live process here whose start is the one its id says is that producer's
            parts = id_parts(str(p.info.get("id", "")))
            if parts is None or parts[0] != pid or parts[1] in ("", "0") or proc_start_ticks(pid) != parts[1]:
                return None
        return pid

    def observe(self, tap: Callable[[Sequence[Item]], None]) -> None:
        self.broadcaster.taps.append(tap)

    def on_hello(self, tap: Callable[[Producer], None]) -> None:
        self.ingest.receiver.hello_taps.append(tap)

    def on_heartbeat(self, job: Callable[[], None]) -> None:
        self._heartbeat_jobs.append(job)

    def spawn(self, job: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._guard(job), name=name))

    async def _guard(self, job: Coroutine[Any, Any, None]) -> None:
        try:
            await job
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background job failed; the agent keeps running without it")

    # -- the session API: what an embedded session (launch) uses -----------------------
    # (agent/commands/launch_agent.py is its one user; nothing there reaches further in)

    def producers(self) -> list[Producer]:
        """The producers the agent knows now (their hello in ``info``, their ``resource``)."""
        return list(self.assembler.producers.values())

    @property
    def open_connections(self) -> int:
        """Producers' connections open now."""
        return self.ingest.open_connections

    def replay_spools(self, directory: str) -> int:
        """Read the spool files in ``directory`` whose producers died (their lock is free),
        as at start; how many."""
        return self.ingest.replay_spools(directory)

    def adopt(self, conns: Sequence[Any]) -> None:
        """Serve connections that were accepted before the agent started (``launch``)."""
        self.ingest.adopt(conns)

    def inject(self, p: Producer, kind: str, data: dict[str, Any]) -> list[Item] | None:
        """An event the agent makes for ``p`` (a capture of CMD's stderr, say), now: the items
        the handler of ``kind`` made, or None when no extension handles it. Raises what the
        handler raises (Malformed for data it refuses). Nothing is published."""
        handler = self.assembler.handlers.get(kind)
        if handler is None:
            return None
        out: list[Item] = []
        handler(p, Origin(p.id, 0), time.time_ns(), data, out)
        return out

    def publish(self, items: Sequence[Item]) -> None:
        """Hand ``items`` to every exporter (and the taps), as the producers' items go."""
        self.broadcaster.publish(items)

    async def settle_exporters(self) -> None:
        """The session's last items are published: before :meth:`shutdown`, let each exporter
        that asks for it finish delivering what its worker holds (an exporter's optional
        ``settle(worker)``; MQTT waits up to ``exporters.mqtt.exit_wait_s`` for its broker)."""
        for w in self.workers:
            settle = getattr(w.exporter, "settle", None)
            if settle is not None:
                await settle(w)

    # -- health ---------------------------------------------------------------------

    def _session_capture(self, p: Producer, text: str) -> None:
        """A joined launch's capture of its CMD's stderr, as ``p``'s: classified and published now."""
        items = self.inject(p, "oom", {"source": "stderr", "text": text})
        if items:
            self.publish(items)

    def stderr_relayed(self, info: dict[str, Any]) -> bool:
        """Whether a joined launch copies the stderr of the producer of hello ``info`` (its captures come)."""
        return self.sessions.relays(info)

    def stderr_relay_started(self, info: dict[str, Any]) -> float | None:
        """When that launch's relay started forwarding captures (monotonic s); None: not yet; 0.0: no relay."""
        return self.sessions.relay_started(info)

    async def _session_settle(self, session: str, uid: int) -> None:
        """A joined launch's session ends: what the extensions still hold of it (its uid's) goes out first."""
        for ext in self.extensions:
            try:
                await ext.session_ended(session, uid)
            except Exception:
                log.exception("extension %s failed at the end of a launch's session", ext.name)

    def _session_info(self) -> dict[str, Any]:
        """What a joining launch is told: who answers, and where its CMD's data goes."""
        h = self.health()
        return {"version": __version__, "pid": os.getpid(), "mode": h["mode"], "sinks": h["sinks"],
                "healthy": h["healthy"], "problems": h["problems"], "warnings": h["warnings"],
                "spool_dir": self.config["agent.spool_dir"]}

    def dropped_by_producers(self) -> int:
        return sum(p.dropped_buffer + p.dropped_spool + p.dropped_texts for p in self.assembler.producers.values())

    def problems(self, now: float | None = None) -> list[dict[str, str]]:
        """What makes the agent unhealthy: each exporter that is not doing its job, and why."""
        now = time.monotonic() if now is None else now
        out = [{"exporter": w.name, "reason": why} for w in self.workers if (why := w.problem(now)) is not None]
        if not self.listening:
            out.insert(0, {"exporter": "", "reason": "not listening on %s" % self.config["agent.socket"]})
        return out

    def warnings(self) -> list[str]:
        """What the operator should know that is not a failure (an agent with no sink)."""
        pending = (["changed in the config file, waiting for a restart: %s" % ", ".join(self.pending_restart)]
                   if self.pending_restart else [])
        # A reload that failed keeps the running configuration: an operator who edited the file and checks
        # with `status` must not take the edit for live.
        failed = (["the last reload failed, the running configuration is the one before it: %s"
                   % self.last_reload_error] if self.last_reload_error else [])
        return [*self.state_dir_warnings, *([] if self.workers else [NO_SINK_WARNING]), *failed, *pending,
                *self.env_warnings, *self.ingest.spools.unreadable_warnings(SPOOL_SCAN_S)]

    def health(self, extensions: bool = True) -> dict[str, Any]:
        """The status reply; ``extensions=False`` leaves out the extensions' sections (what
        launch's closing report does not show: the device rules need not load for it)."""
        now = time.monotonic()
        exporters = [{"name": w.name, **w.state()} for w in self.workers]
        problems = self.problems(now)
        h: dict[str, Any] = {
            "healthy": not problems,
            "problems": problems,
            "warnings": self.warnings(),
            "version": __version__,
            "mode": "embedded" if self.embedded else "daemon",
            "pid": os.getpid(),
            "uptime_s": round(now - self.started_mono, 3),
            "socket": self.config["agent.socket"],
            "producers": len(self.assembler.producers),  # every producer the table holds, those that left too
            "producers_connected": self.ingest.connected_producers(),
            "events_in": self.counters.events_in,
            "items_out": self.counters.items_out,
            "lost": self.assembler.lost_total(),
            "dropped_by_producers": self.dropped_by_producers(),
            # Items that reached the agent and no sink: its exporters could not hold them (a full disk, a full
            # spool), beside ``lost`` (events that never reached it). Items, per exporter: not added to ``lost``.
            "lost_at_exporters": sum(int(e["lost_items"]) for e in exporters),
            "counters": self.counters.as_dict(),
            "assembler": self.assembler.stats(),
            "exporters": exporters,
            "sinks": [sink_line(e) for e in exporters],
            "subscribers": len(self.sessions),
            "extensions": [ext.name for ext in self.extensions],
        }
        if self.code is not None:
            h["code"] = self.code.as_dict()
        for ext in self.extensions if extensions else ():
            for key, value in ext.health().items():
                h.setdefault(key, value)  # an extension adds sections; it never hides the agent's
        return h

    def status_line(self) -> str:
        """One short line of health for ``systemctl status`` (STATUS=): what is wrong first,
        each unhealthy exporter with its reason, as ``infersight status`` names them."""
        h = self.health()
        line = "%s: %d producer(s) (%d connected), %d events in, %d items out, %d lost" % (
            "healthy" if h["healthy"] else "UNHEALTHY", h["producers"], h["producers_connected"], h["events_in"],
            h["items_out"], h["lost"])
        if h["lost_at_exporters"]:
            line += ", %d item(s) lost at exporters" % h["lost_at_exporters"]
        if h["problems"]:
            line = "UNHEALTHY: %s; %s" % (
                "; ".join(problem_text(p) for p in h["problems"]), line.split(": ", 1)[1])
        named = {p.get("exporter") for p in h["problems"]}  # (a problem names its exporter already)
        down = [e["name"] for e in h["exporters"] if not e.get("peer_up", True) and e["name"] not in named]
        if down:
            line += "; exporter(s) down: " + ", ".join(down)
        for w in h["warnings"]:
            line += "; WARNING " + (w.split(":", 1)[0] if w.startswith("the last reload failed") else w)
        return line

    def _notify(self, *fields: str) -> None:
        """sd_notify in daemon mode; the embedded agent of ``launch`` is not the service."""
        if self._notifier is not None:
            self._notifier.send(*fields)

    def _notifies(self) -> bool:
        """Whether sd_notify goes anywhere: a daemon under systemd (``NOTIFY_SOCKET``)."""
        return self._notifier is not None and self._notifier.target is not None

    def notify_status(self) -> None:
        """STATUS= when the line changed since it was last sent (the line is the whole health:
        not computed where nothing listens, as in launch's embedded agent)."""
        if not self._notifies():
            return
        text = self.status_line()
        if text != self._status_sent:
            self._status_sent = text
            self._notify("STATUS=" + text)

    async def _watchdog(self, interval_s: float) -> None:
        """WATCHDOG=1 from the event loop: when the loop is stuck, the pings stop."""
        while True:
            self._notify("WATCHDOG=1")
            await asyncio.sleep(interval_s)

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
            self.assembler.stats(),
        )
        self.broadcaster.publish(items)

    # -- lifecycle ------------------------------------------------------------------

    async def serve(self, until: Awaitable[object] | None = None, *, shutdown_timeout_s: float | None = None) -> bool:
        """Run the agent: start, serve until stopped, shut down. True when the shutdown
        delivered or spooled everything in time.

        The daemon serves until SIGTERM/SIGINT (signals, SIGHUP reloads and sd_notify are
        daemon mode only). ``until`` (``launch``: its session with CMD) is awaited once the
        agent is up; when it completes, the agent stops as on the first SIGTERM; when it
        raises, the agent still shuts down, then the error propagates. ``shutdown_timeout_s``
        overrides ``agent.shutdown_timeout_s``.
        """
        if not self.embedded:
            self.install_signal_handlers()
        await self.start()
        log.info("infersight agent %s listening on %s", __version__, self.config["agent.socket"])
        try:
            await self._run_until_stopped(until)
        finally:
            self._notify("STOPPING=1", "STATUS=stopping: draining exporters")
            ok = await self.shutdown(shutdown_timeout_s)
            if not ok:
                log.warning("shutdown hit its time limit; what was left is spooled or counted")
        return ok

    async def _run_until_stopped(self, until: Awaitable[object] | None) -> None:
        stop = asyncio.ensure_future(self._stop.wait())
        if until is None:
            await stop
            return
        session = asyncio.ensure_future(until)
        try:
            await asyncio.wait((stop, session), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not session.done():  # stopped first: the session ends with the agent
                session.cancel()
                await asyncio.gather(session, return_exceptions=True)
        if not session.cancelled():
            session.result()  # its error, if any, after the shutdown

    async def start(self) -> None:
        """Startup: exporters, extensions, the socket, dead producers' spools, the heartbeat;
        then READY=1. :meth:`serve` calls it; tests may drive start/shutdown themselves."""
        for w in self.workers:
            try:
                await w.exporter.start()
            except Exception as exc:  # not fatal: the worker spools and retries; health says so
                w.start_error = str(exc) or type(exc).__name__
                log.error("exporter %s cannot start: %s (the agent runs on, unhealthy, and retries)",
                          w.name, w.start_error)
            w.start()
        if not self.workers:
            log.warning("%s", NO_SINK_WARNING)
        for ext in self.extensions:  # before the socket: their taps see the first replayed spool
            await ext.start(self)
        if not self.embedded and self.config.get("agent.state_dir"):
            self.assembler.resume_hints = seqstate.load(str(self.config["agent.state_dir"]))
        await self.ingest.start(self.config["agent.socket"], self.config["agent.socket_mode"], self.listen_sock)
        self.ingest.allowed_gids = self._allowed_gids(self.config)
        self.listening = True
        if not self.embedded:
            check_hooks_spool_dir(self.config["agent.spool_dir"])
            foreign = foreign_spool_dir(self.config["agent.spool_dir"])
            if foreign:
                log.warning("%s", foreign)
                self.state_dir_warnings.append(foreign)
        loop = asyncio.get_running_loop()
        first = loop.create_task(self._first_spool_scan(), name="agent-spool-first-scan")
        await asyncio.wait({first}, timeout=START_SCAN_WAIT_S)
        self._tasks.append(loop.create_task(self._heartbeat(), name="agent-heartbeat"))
        self._tasks.append(loop.create_task(self._spool_scan(first), name="agent-spool-scan"))
        interval = sdnotify.watchdog_interval_s()
        if interval is not None and not self.embedded:
            self._watchdog_task = loop.create_task(self._watchdog(interval), name="agent-watchdog")
        if self._notifies():
            self._status_sent = self.status_line()
            self._notify("READY=1", "STATUS=" + self._status_sent)

    def _allowed_gids(self, config: Config) -> set[int]:
        """``agent.allowed_gids``; left at its default (the agent's gid), with the group a root agent gave its
        socket (its directory's: the socket's audience, as a service agent's gid is)."""
        gids = set(config["agent.allowed_gids"])
        given = self.ingest.socket_group
        if given is not None and config.sources.get("agent.allowed_gids", "default") == "default":
            gids.add(given)
        return gids

    async def _heartbeat(self) -> None:
        """Every ``agent.health_interval_s``: the agent's own metrics, then the extensions' heartbeat jobs.
        It wakes at least every SPOOL_SCAN_S, so that a reloaded interval applies that soon and systemd's
        STATUS= line stays current; it used to publish on each of those wakes, every 5 s whatever the
        interval said."""
        last = time.monotonic()
        while True:
            interval = float(self.config["agent.health_interval_s"])  # reloadable
            await asyncio.sleep(max(0.0, min(interval - (time.monotonic() - last), SPOOL_SCAN_S)))
            if time.monotonic() - last >= float(self.config["agent.health_interval_s"]):
                last = time.monotonic()
                self.publish_health()
                for job in self._heartbeat_jobs:
                    job()
            self.notify_status()

    async def _first_spool_scan(self) -> None:
        replayed = await self.ingest.replay_spools_async(self.config["agent.spool_dir"])
        if replayed:
            log.info("replayed %d spool file(s) of producers that had died", replayed)

    async def _spool_scan(self, first: asyncio.Task[None]) -> None:
        # Spools of producers that died (their lock is free) are picked up within this long: a
        # directory scan and a lock probe per file, cheap enough to keep a dead producer's last
        # events from waiting half a minute. A task of its own: a long file's replay (given back
        # to the loop as it goes) delays no health publication. The listing runs in a thread; one of
        # a huge directory (planted names) spaces the scans, so that it does not take a core.
        try:
            await first  # the startup's scan, if it outlasted the startup's wait
        except Exception:
            log.exception("the first scan of the spool directory failed; the next one runs in %.0f s", SPOOL_SCAN_S)
        while True:
            await asyncio.sleep(max(SPOOL_SCAN_S, SCAN_LISTING_SPACING * self.ingest.spools.list_s))
            try:
                await self.ingest.replay_spools_async(self.config["agent.spool_dir"])
            except Exception:  # one failed scan must not end replay until a restart
                log.exception("a scan of the spool directory failed; the next one runs in %.0f s", SPOOL_SCAN_S)

    def request_stop(self) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("stopping: draining and flushing (send the signal again to force exit)")
            self._stop.set()
        else:
            log.warning("second stop signal: exiting now")
            os._exit(1)

    def reload(self) -> bool:
        """SIGHUP: re-read the config file and rules. All or nothing: the config, the
        exporters' sections and every extension's part (OOM rules, device rules) are all
        validated before anything is swapped; when one is invalid, everything keeps running
        as it was."""
        self._notify("RELOADING=1", "MONOTONIC_USEC=%d" % (time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000))
        try:
            ok = self._reload()
        finally:
            self._notify("READY=1", "STATUS=" + self.status_line())
        return ok

    def _reload(self) -> bool:
        path = self.config.path
        # Command-line flags (--socket) still beat the file, as at start.
        flags = {k: self.config.values[k] for k, src in self.config.sources.items() if src == "flag"}
        try:
            new = cfg.load(path, require_file=path is not None, flags=flags)
            if self.check_config is not None:
                self.check_config(new)
            # Each extension validates and returns its swap; none swaps anything here.
            applies: list[Apply | None] = [ext.reload(new) for ext in self.extensions]
        except Exception as exc:  # whatever a bad file causes, the agent keeps running
            self.counters.reload_failures += 1
            self.last_reload_error = str(exc) or type(exc).__name__
            if isinstance(exc, InfersightError):  # raised on purpose (ConfigError, rule files): names file:line
                log.error("reload failed, keeping the running configuration: %s", exc)
            else:
                log.error("reload failed, keeping the running configuration: %s: %s", type(exc).__name__, exc)
            return False
        for apply in applies:
            if apply is not None:
                apply()
        self.last_reload_error = None
        self.config = new
        self.ingest.allowed_uids = set(new["agent.allowed_uids"])
        self.ingest.allowed_gids = self._allowed_gids(new)
        self.ingest.frame_timeout_s = new["agent.frame_timeout_s"]
        logging.getLogger("infersight").setLevel(new["agent.log_level"])
        self.counters.reloads += 1
        log.info("configuration reloaded from %s", path or "environment")
        # Against what runs (the values at start), not the last file read: a setting changed and changed
        # back waits for nothing.
        started = self.started_values
        later = sorted(k for k in set(started) | set(new.values)
                       if k not in self.live_keys and started.get(k) != new.values.get(k))
        if later:  # names only: values may be secrets
            log.warning("changed setting(s) that apply at the next restart: %s", ", ".join(later))
        elif self.pending_restart:
            log.info("the file's settings are again those running: nothing waits for a restart")
        self.pending_restart = later
        return True

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

    async def shutdown(self, timeout_s: float | None = None) -> bool:
        """Stop accepting, close the extensions, export what is queued, flush every exporter.
        True if all in time. The watchdog pings on while it drains, and stops at the end."""
        try:
            return await self._shutdown(timeout_s)
        finally:
            if self._watchdog_task is not None:
                self._watchdog_task.cancel()
            if self._notifier is not None:
                self._notifier.close()

    async def _shutdown(self, timeout_s: float | None) -> bool:
        timeout = float(timeout_s if timeout_s is not None else self.config["agent.shutdown_timeout_s"])
        deadline = time.monotonic() + timeout
        await self.ingest.stop_accepting()
        self.listening = False
        for t in self._tasks:
            t.cancel()
        if self._tasks:  # a job finishes what it holds on cancellation (the device job publishes)
            await asyncio.wait(self._tasks, timeout=max(0.1, deadline - time.monotonic()))
        await self.ingest.spools.close()  # deferred replays of ended producers' files: none past this point
        self.ingest.close_connections()
        await self.ingest.wait_connections_closed(max(0.0, min(1.0, deadline - time.monotonic())))
        for ext in self.extensions:  # what they still hold (OOMs waiting on NVML, progress) goes out
            try:
                await ext.aclose()
            except Exception:
                log.exception("extension %s did not close cleanly", ext.name)
        self.publish_health()
        ok = True
        dropped_before = sum(w.dropped_items for w in self.workers)
        for w in self.workers:
            ok = await w.drain(max(0.1, deadline - time.monotonic())) and ok
        # What the drain could neither deliver nor spool is gone: its producers' resends must not be taken for
        # duplicates by the next agent, so no sequence state is kept then (at-least-once, as before).
        keep_sequences = sum(w.dropped_items for w in self.workers) == dropped_before
        for w in self.workers:
            try:
                await asyncio.wait_for(w.exporter.force_flush(max(0.1, deadline - time.monotonic())),
                                       max(0.1, deadline - time.monotonic()) + 0.5)
                await asyncio.wait_for(w.exporter.shutdown(), 5.0)
            except Exception as exc:
                ok = False
                log.warning("exporter %s did not shut down cleanly: %s", w.name, exc)
        if not self.embedded and self.listen_sock is None:
            self.ingest.listener.unlink_own(self.config["agent.socket"])
        if not self.embedded and self.config.get("agent.state_dir") and keep_sequences:
            # After the drain: every number processed is exported or spooled.
            seqstate.save(str(self.config["agent.state_dir"]), self.assembler.sequences())
        return ok
