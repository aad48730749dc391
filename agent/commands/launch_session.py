"""The agent side of ``infersight launch``, imported after CMD was spawned.

``--ready-url URL`` polls URL like a readiness probe (2xx/3xx). The ready time goes to
the child's hooks through a file (``INFERSIGHT_READY_FILE``), so the child's own
``ready_wait`` ends there and its next forward is ``first_request``; the ``listen()``
heuristic is off in the child unless ``INFERSIGHT_READY_ON_LISTEN`` says otherwise.
``--probe URL`` sends one GET after readiness (without ``--ready-url`` it retries until
the server answers) and records the time to the first body byte as an
``infersight.probe`` client span under the child's ``coldstart`` root. For a CMD that
runs no hooked Python, the launcher's own root gets ``ready_wait`` and
``first_request`` stages from these two instead.

The session uses its agent only through :class:`~infersight.agent.commands.launch_agent.EmbeddedAgent`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from infersight import weights_files
from infersight.agent.commands.engine_cmdline import engine_command
from infersight.agent.commands.launch_agent import EmbeddedAgent
from infersight.agent.commands.launch_base import (
    EXIT_USAGE,
    RELAY_CLOSE_WAIT_S,
    Child,
    LaunchOptions,
    Private,
    config_flags,
    dead_launch_dirs,
    exit_status,
    leftover_command,
    processes_using,
    same_command,
    spool_files,
)
from infersight.agent.commands.launch_hold import Held
from infersight.agent.commands.launcher_root import ProbeResult, Readiness, launcher_root
from infersight.agent.commands.status import lost_text
from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.spool import DiskSpool
from infersight.settings import ConfigError
from infersight.telemetry import Resource, SpanItem

LISTEN_POLL_S = 0.05
HELD_SPOOLS_WAIT_S = 5.0  # how long launch waits at the end for live processes that spooled while held


async def watch_listening(pid: int, spawn_ns: int, rd: Readiness, hooked: Callable[[], bool],
                          proc_done: asyncio.Event, out: TextIO) -> None:
    """Readiness of a CMD that runs no hooked Python: the first listening socket its process
    tree owns, from the kernel's tables (hooked processes watch their own). Stops when CMD
    exits, when that is found (said on ``out``), or once a hooked process of CMD reports."""
    from infersight.hooks._listening import ListenWatch, tree

    watch = ListenWatch(lambda: list(tree(pid)))
    while not proc_done.is_set() and not hooked():
        found = await asyncio.to_thread(watch.poll)  # /proc and netlink reads: off the event loop
        if found is not None:
            note_listening(rd, found, time.time_ns(), spawn_ns, out)
            return
        try:
            await asyncio.wait_for(proc_done.wait(), LISTEN_POLL_S)
        except asyncio.TimeoutError:
            pass


def note_listening(rd: Readiness, found: tuple[str, Any], t_ns: int, spawn_ns: int, out: TextIO) -> None:
    rd.listening_ns, rd.listening = t_ns, found
    out.write("infersight: ready after %.3f s: CMD listens on %s %s\n" % (
        (t_ns - spawn_ns) / 1e9, "tcp port" if found[0] == "tcp" else "unix socket", found[1]))
    out.flush()


def http_get(url: str, timeout_s: float = 5.0) -> ProbeResult:
    """GET url; time the response headers and the first body byte (blocking; run in a thread)."""
    r = ProbeResult(url)
    import http.client  # only with --ready-url/--probe (~15 ms that a plain launch does not pay)

    u = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname or "127.0.0.1", u.port, timeout=timeout_s)
    path = (u.path or "/") + ("?" + u.query if u.query else "")
    try:
        r.connect_ns = time.time_ns()
        conn.connect()
        r.start_ns = time.time_ns()
        conn.request("GET", path, headers={"User-Agent": "infersight-launch"})
        resp = conn.getresponse()
        r.headers_ns = time.time_ns()
        r.status = resp.status
        first = resp.read(1)
        r.first_byte_ns = time.time_ns() if first else r.headers_ns
        resp.read()
    except (OSError, http.client.HTTPException) as exc:
        r.error = "%s: %s" % (type(exc).__name__, exc)
    finally:
        conn.close()
    return r


def write_ready_file(path: str, ready_ns: int, asked_ns: int = 0) -> None:
    """Atomically: the child's hooks poll for this file (a few bytes, local disk):
    ``READY_NS ASKED_NS``, the ready response's time and when that request was sent (what
    the server did after it, e.g. a lazy import in its health handler, is not start-up)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write("%d %d" % (ready_ns, asked_ns) if asked_ns else str(ready_ns))
    os.replace(tmp, path)


def ok_status(status: int) -> bool:
    return 200 <= status < 400


async def watch_readiness(
    opts: LaunchOptions, ready_file: str | None, proc_done: asyncio.Event, out: TextIO
) -> Readiness:
    """Poll --ready-url, hand the ready time to the child, then send the --probe request."""
    res = Readiness()
    deadline = time.monotonic() + opts.ready_timeout_s
    delay = 0.05

    async def poll(url: str) -> ProbeResult | None:
        nonlocal delay
        while not proc_done.is_set() and time.monotonic() < deadline:
            res.attempts += 1
            r = await asyncio.to_thread(http_get, url)
            if not r.error and (ok_status(r.status) or url == opts.probe):
                return r
            try:
                await asyncio.wait_for(proc_done.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 1.5, 0.5)
        return None

    if opts.ready_url:
        res.ready = await poll(opts.ready_url)
        if res.ready is None:
            res.notes.append("never ready at %s" % opts.ready_url)
            return res
        if ready_file:
            write_ready_file(ready_file, res.ready.headers_ns, res.ready.connect_ns)
    if opts.probe:
        if opts.ready_url:
            r = await asyncio.to_thread(http_get, opts.probe)
            res.probe = r if not r.error else None
            if r.error:
                res.notes.append("probe %s failed: %s" % (opts.probe, r.error))
        else:
            res.probe = await poll(opts.probe)
    return res


def probe_span(probe: ProbeResult, trace_id: str, parent: str, resource: Resource) -> SpanItem:
    """The launcher's probe request, a client span under the child's cold-start root."""
    return SpanItem(
        resource, trace_id, os.urandom(8).hex(), parent, "infersight.probe", probe.start_ns, probe.first_byte_ns,
        {
            "http.request.method": "GET",
            "url.full": probe.url,
            "http.response.status_code": probe.status,
            "infersight.probe.headers_s": (probe.headers_ns - probe.start_ns) / 1e9,
            "infersight.probe.ttfb_s": (probe.first_byte_ns - probe.start_ns) / 1e9,
        },
        error=None if ok_status(probe.status) else "HTTP %d" % probe.status,
    )


def _readiness_lines(rd: Readiness, spawn_ns: int) -> list[str]:
    lines = []
    if rd.ready is not None:
        lines.append("infersight: ready at %s after %.3f s (%d attempt(s))"
                     % (rd.ready.url, (rd.ready.headers_ns - spawn_ns) / 1e9, rd.attempts))
    if rd.probe is not None and rd.probe.first_byte_ns:
        p = rd.probe
        lines.append("infersight: probe GET %s: HTTP %d, first byte %.3f s after sending, %.3f s after spawn"
                     % (p.url, p.status, (p.first_byte_ns - p.start_ns) / 1e9, (p.first_byte_ns - spawn_ns) / 1e9))
    lines.extend("infersight: " + n for n in rd.notes)
    return lines


@dataclass
class Leftover:
    """The private directory of an earlier launch that is gone; locked by us while we replay it."""

    path: str
    lock_fd: int
    pid: str
    replayed: int = 0


def find_leftovers(root: str, own: str, command: list[str] | None = None) -> list[Leftover]:
    """Private directories of launches that died (their lock is free), ours by uid and mode;
    with ``command``, only those of the same command (another command's are left alone for a
    launch of that command, and :func:`other_leftovers` reports them)."""
    found: list[Leftover] = []
    for path, fd in dead_launch_dirs(root, own, exclusive=True):
        if command is not None and not same_command(leftover_command(path), command):
            os.close(fd)
            continue
        try:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            os.close(fd)
            continue
        found.append(Leftover(path, fd, pid))
    return found


def other_leftovers(root: str, own: str, command: list[str]) -> list[tuple[str, int]]:
    """Directories of this user's dead launches of other commands that still hold spool
    files: (path, files). They are reported, not replayed into this launch's output."""
    out: list[tuple[str, int]] = []
    for lo in find_leftovers(root, own):
        try:
            if not same_command(leftover_command(lo.path), command):
                n = len(spool_files(os.path.join(lo.path, "spool")))
                if n:
                    out.append((lo.path, n))
        finally:
            os.close(lo.lock_fd)
    return out


def finish_private(private: Private, out: TextIO) -> None:
    """Remove the private directory, unless a process we started still runs or spooled events
    wait there: then keep the spool for the next launch to replay, and say so."""
    live = processes_using(private.sock)
    left = spool_files(private.spool)
    if not live and not left:
        shutil.rmtree(private.path, ignore_errors=True)
        return
    for name in ("agent.sock", "ready"):
        try:
            os.unlink(os.path.join(private.path, name))
        except OSError:
            pass
    os.makedirs(private.spool, mode=0o700, exist_ok=True)
    why = ("process(es) %s started under launch still run" % ", ".join(map(str, live)) if live
           else "%d spool file(s) were not delivered" % len(left))
    out.write("infersight: %s; their events are kept in %s and the next launch replays them\n"
              % (why, private.spool))


def replay_leftovers(agent: EmbeddedAgent, leftovers: list[Leftover]) -> None:
    for lo in leftovers:
        lo.replayed = agent.replay_spools(os.path.join(lo.path, "spool"))


def close_leftovers(leftovers: list[Leftover], out: TextIO) -> None:
    """After the flush: delete a leftover directory whose spools were delivered; report the rest."""
    for lo in leftovers:
        left = spool_files(os.path.join(lo.path, "spool"))
        if lo.replayed:
            out.write("infersight: replayed %d spool file(s) left by an earlier launch (pid %s)\n"
                      % (lo.replayed, lo.pid or "?"))
        exporter_items = _exporter_spool_files(lo.path)
        if exporter_items:
            out.write("infersight: an earlier launch (pid %s) left %d undelivered exporter item(s) in %s\n"
                      % (lo.pid or "?", exporter_items, os.path.join(lo.path, "exporter-spool")))
        if not left and not exporter_items:
            shutil.rmtree(lo.path, ignore_errors=True)
        elif left:
            out.write("infersight: %d spool file(s) in %s belong to a process that still runs; a later launch "
                      "replays them\n" % (len(left), os.path.join(lo.path, "spool")))
        os.close(lo.lock_fd)


def _exporter_spool_files(path: str) -> int:
    """Items an earlier launch's exporters had spooled and not delivered."""
    root = os.path.join(path, "exporter-spool")
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    n = 0
    for name in names:
        d = os.path.join(root, name)
        if os.path.isdir(d) and not os.path.islink(d):
            try:
                spool = DiskSpool(d)
            except (OSError, ValueError):
                continue
            n += spool.items
            spool.close()
    return n


async def wait_child(child: Child) -> int:
    """CMD's returncode, reaped on SIGCHLD (and once now: it may have exited during our imports)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def on_sigchld() -> None:
        if child.poll() is not None:
            done.set()

    loop.add_signal_handler(signal.SIGCHLD, on_sigchld)
    try:
        on_sigchld()
        await done.wait()
    finally:
        loop.remove_signal_handler(signal.SIGCHLD)
    assert child.returncode is not None
    return child.returncode


def live_spools(directory: str) -> int:
    """Spool files in ``directory`` whose producer lives (it holds the file's lock; a spool
    file is unlinked once all of it was delivered)."""
    import fcntl

    n = 0
    for name in spool_files(directory):
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            n += 1
        finally:
            os.close(fd)
    return n


async def wait_held_spools(directory: str, timeout_s: float) -> None:
    """After launch held its agent back: processes of CMD that live on (a daemon CMD left)
    spooled meanwhile, and connect once the hold ends; wait until they delivered, bounded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not await asyncio.to_thread(live_spools, directory):
            return
        await asyncio.sleep(0.05)


async def wait_producers_gone(agent: EmbeddedAgent, sock: str, timeout_s: float) -> None:
    """Wait for the connections of exiting producers to close; not for a process that lives on
    (a daemonized grandchild): at most as many connections as such processes stay open."""
    deadline = time.monotonic() + timeout_s
    while agent.open_connections and time.monotonic() < deadline:
        if agent.open_connections <= len(processes_using(sock)):
            return
        await asyncio.sleep(0.02)


def stderr_consumer(agent: EmbeddedAgent, child: Child, loop: asyncio.AbstractEventLoop) -> Callable[[str], None]:
    """Hand a stderr capture (from the relay's thread) to the agent's OOM classifier, on the loop."""

    def on_text(text: str) -> None:
        loop.call_soon_threadsafe(agent.classify_stderr, child, text)

    return on_text


def capture_opener(agent: EmbeddedAgent, child: Child) -> Callable[[], None]:
    """When the relay opens a capture (its thread): the OOM rules load, and the engine's live context is read
    while it still runs."""

    def on_open() -> None:
        agent.prepare_oom()
        agent.read_context_early(child)

    return on_open


@dataclass
class Session:
    """What ``launch`` does while its agent serves: replay what earlier launches left, wait for
    CMD, watch its readiness, and hand the agent what CMD's hooks could not say."""

    opts: LaunchOptions
    private: Private
    child: Child
    spawn_ns: int
    out: TextIO
    returncode: int | None = None
    readiness: Readiness = field(default_factory=Readiness)
    leftovers: list[Leftover] = field(default_factory=list)
    held: Held | None = None  # what launch saw while it held the agent back (launch_hold)

    async def run(self, agent: EmbeddedAgent) -> None:
        """Awaited by ``agent.serve(until=...)`` once the agent is up; the agent stops when it returns."""
        opts, private, child, held = self.opts, self.private, self.child, self.held
        if held is not None:
            logging.getLogger("infersight.launch").debug("the agent starts: launch held it back until %s", held.why)
        if held is not None and held.connections:
            agent.adopt(held.connections)  # the hooks' connections: their frames wait unread
        root, command = os.path.dirname(private.path), leftover_command(private.path) or []
        self.leftovers = find_leftovers(root, private.path, command)
        replay_leftovers(agent, self.leftovers)
        for path, n in other_leftovers(root, private.path, command):
            self.out.write("infersight: an earlier launch of another command left %d spool file(s) in %s; "
                           "a launch of that command replays them\n" % (n, os.path.join(path, "spool")))
        ready_file = os.path.join(private.path, "ready") if opts.ready_url else None
        proc_done = asyncio.Event()
        watcher = None
        if opts.ready_url or opts.probe:
            watcher = asyncio.create_task(watch_readiness(opts, ready_file, proc_done, self.out))
        relay = child.relay
        if relay is not None:
            loop = asyncio.get_running_loop()
            relay.set_consumer(stderr_consumer(agent, child, loop), capture_opener(agent, child))
        engine = engine_command(opts.cmd)
        if engine is not None:  # an engine's memory errors come while it starts
            agent.prepare_oom("CMD is a serving engine (%s)" % engine)
        elif held is not None and held.why == "engine":  # (hooks._contract.ENGINE_PACKAGES)
            agent.prepare_oom("a process of CMD imported a serving engine's package")
        listening = Readiness()

        def hooked() -> bool:
            return bool(agent.launched())

        if held is not None and held.listening is not None:  # found while held, when it happened
            note_listening(listening, held.listening, held.listening_ns, self.spawn_ns, self.out)
        watching = held is None or not (held.hooked or held.listening)  # hooked processes watch their own
        sockets = asyncio.create_task(watch_listening(child.pid, self.spawn_ns, listening, hooked, proc_done, self.out)
                                      if watching else asyncio.sleep(0))
        self.returncode = await wait_child(child)
        end_ns = child.exit_ns or time.time_ns()  # seen by launch's cheap half, if CMD exited during our imports
        if relay is not None:  # what CMD wrote last is copied (and classified) before our own lines
            await asyncio.to_thread(relay.wait_closed, min(RELAY_CLOSE_WAIT_S, opts.flush_timeout_s))
        proc_done.set()
        child.restore_tty()
        readiness = self.readiness
        if watcher is not None:
            try:
                readiness = self.readiness = await asyncio.wait_for(watcher, 10.0)
            except (asyncio.TimeoutError, OSError) as exc:
                readiness.notes.append("readiness watch: %s" % (exc or type(exc).__name__))
        await sockets
        readiness.listening_ns, readiness.listening = listening.listening_ns, listening.listening
        # Processes of CMD that live on (a daemon it left) and spooled while the hold's mark was up: launch writes
        # the mark before CMD starts, so they did even where CMD exited before a hold began (``held`` None)
        await wait_held_spools(private.spool, min(HELD_SPOOLS_WAIT_S, opts.flush_timeout_s))
        # The child's hooks flushed at exit; let the agent read what is in flight.
        await wait_producers_gone(agent, private.sock, opts.flush_timeout_s)
        agent.replay_spools(private.spool)
        launched = agent.launched(child.pid) or agent.launched()
        if not launched:
            cs = launcher_root(opts.cmd, child.pid, self.spawn_ns, end_ns, agent.host_name, readiness)
            agent.publish_coldstart(cs, end_ns)
        elif readiness.probe is not None and readiness.probe.first_byte_ns:
            p0 = launched[0]
            agent.publish([probe_span(readiness.probe, p0.info["trace_id"], p0.info["root_span_id"], p0.resource)])
        await agent.settle()


async def _run(opts: LaunchOptions, path: str, private: Private, listen_fd: int, child: Child,
               spawn_ns: int, out: TextIO, held: Held | None) -> int:
    conf = cfg.load(None, flags=config_flags(opts, path, private))
    listener = socket.socket(fileno=listen_fd)
    agent = EmbeddedAgent.build(conf, out, listener, os.path.join(private.path, "exporter-spool"))
    agent.know_command(child.pid, opts.cmd)  # before any event of CMD's is read
    if child.relay is not None:
        agent.relay_started()  # likewise: CMD's stderr copies will come
    session = Session(opts, private, child, spawn_ns, out, held=held)
    ok = await agent.serve(session.run(agent), opts.flush_timeout_s)
    for line in _readiness_lines(session.readiness, spawn_ns):
        out.write(line + "\n")
    _report(agent, path, ok, out)
    close_leftovers(session.leftovers, out)
    finish_private(private, out)
    _storage_note(path, out)
    assert session.returncode is not None  # the session returned: CMD was reaped
    return exit_status(session.returncode)


def _quiet_logging() -> None:
    """Agent warnings as one-line notes on stderr; an absent NVML is no news on a workstation
    (``infersight doctor`` reports it)."""
    logger = logging.getLogger("infersight")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("infersight: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("INFERSIGHT_LOG_LEVEL", "WARNING").upper())
        logger.propagate = False
    logging.getLogger("infersight.agent.devices.nvml").setLevel(logging.ERROR)
    logging.getLogger("infersight.agent.devices.job").setLevel(logging.ERROR)


def _report(agent: EmbeddedAgent, path: str, ok: bool, out: TextIO) -> None:
    h = agent.health()
    out.write("infersight: wrote %s\n" % os.path.abspath(path))
    problems = []
    if h["lost"] or h.get("lost_at_exporters"):
        # as ``infersight status`` says it: the producers' sequence gaps, and what the exporters could not hold
        problems.append("lost " + lost_text(h))
    if h["dropped_by_producers"]:
        problems.append("%d event(s) dropped by hooks" % h["dropped_by_producers"])
    for st in h["exporters"]:
        left = int(st["spooled_items_pending"]) + int(st["dropped_items"])
        if left:
            problems.append("%d item(s) not delivered to %s (%s)" % (left, st["name"], st["last_error"] or "peer away"))
    if not ok:
        problems.append("flush hit its time limit")
    if problems:
        out.write("infersight: " + "; ".join(problems) + "\n")
    out.flush()


def _storage_note(path: str, out: TextIO) -> None:
    """For each cold weights file: its throughput against the storage ceiling of its device.
    A device with no ceiling cached yet is measured by a detached process that outlives launch
    (the terminal is not held): ``infersight show`` and ``report`` quote the ratio from then on."""
    from infersight.agent.coldstart.extension import measure_storage_enabled

    if not measure_storage_enabled():
        return
    from infersight.agent.coldstart import storage_ceiling
    from infersight.bytesize import human_bytes

    cold: dict[str, float] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if weights_files.EVENT in line:
                    cold.update(storage_ceiling.cold_files(json.loads(line)))
    except (OSError, ValueError):
        return
    unmeasured: dict[str, str] = {}  # device -> a file on it
    for wpath, rate in cold.items():
        try:
            entry = storage_ceiling.lookup(wpath)
            if entry is None:
                unmeasured.setdefault(storage_ceiling.device_key(wpath), wpath)
                continue
        except OSError:
            continue
        ceiling = float(entry["bytes_per_s"])
        out.write(
            "infersight: storage ceiling of device %s (%s of %s): %.0f MiB/s; %s loaded at %.0f MiB/s (%s)\n"
            % (entry["device"], entry["method"] if entry["method"] == "cold read" else entry["method"] + " read",
               human_bytes(int(entry["sample_bytes"])), ceiling / 2**20, os.path.basename(wpath), rate / 2**20,
               weights_files.ceiling_share(rate / ceiling))
        )
    for device, wpath in unmeasured.items():
        pid = storage_ceiling.measure_detached(wpath)
        if pid:
            out.write("infersight: measuring the storage ceiling of device %s in the background (pid %d); "
                      "'infersight show %s' quotes the ratio once it is done\n" % (device, pid, path))


def run(opts: LaunchOptions, path: str, private: Private, listen_fd: int, child: Child, spawn_ns: int,
        out: TextIO, held: Held | None = None) -> int:
    _quiet_logging()
    try:
        return asyncio.run(_run(opts, path, private, listen_fd, child, spawn_ns, out, held))
    except ConfigError as exc:
        out.write("infersight launch: %s\n" % exc)
        # An exporter setting that only the exporters check: CMD had started already.
        child.stop(opts.flush_timeout_s)
        return EXIT_USAGE
