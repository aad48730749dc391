"""The joined side of ``infersight launch``: CMD's hooks report to a running agent.

Imported after CMD was spawned, like :mod:`launch_session` for the embedded agent. launch
subscribed to the agent already (:func:`infersight.agent.commands.launch.join_agent`); here it
reads the session's items back (:mod:`infersight.agent.daemon.sessions`) and prints each cold
start's waterfall as it arrives, writes them to ``--otlp-file`` when given, waits for CMD, then
asks the agent to *end* the session: the agent answers once no connection of CMD's producers
is open and it has replayed the spool of those that died, so the waterfall is complete.

The agent's sinks record CMD's data; launch keeps no copy unless ``--otlp-file`` asks.

If the agent goes away mid-run, CMD's hooks spool (their own spool directory, the one the
agent replays) and reconnect when it is back; launch re-subscribes with the same session
every ``REJOIN_S`` meanwhile. At CMD's exit it waits up to ``flush_timeout_s`` for the agent
to come back; if it does not, launch says where the undelivered events wait (they are
replayed when the agent is back: nothing is lost) and exits with CMD's status.

A CMD that runs no hooked Python gets the launcher's ``coldstart`` root, printed and written
to ``--otlp-file``; it does not reach the agent's sinks (launch is not a producer). The
``--probe`` span is launch's own too: it goes to ``--otlp-file`` only.

CMD's stderr goes through launch's relay as under the embedded agent, and each capture of a
memory error there goes to the agent on the subscription (``stderr`` frames,
:mod:`infersight.agent.daemon.sessions`): the agent classifies it as CMD's, for every sink, and
launch prints its line with the others it gets back. Captures made while the agent is away wait
(``MAX_WAITING_CAPTURES``) and go when launch has re-subscribed.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from infersight.agent.commands.launch_base import (
    ITEM_KINDS_ALL,
    ITEM_KINDS_CONSOLE,
    RELAY_CLOSE_WAIT_S,
    Child,
    Joined,
    LaunchOptions,
    Private,
    exit_status,
    joined_spool,
    log_events_for,
    printable_reply,
)
from infersight.agent.commands.launch_session import (
    _quiet_logging,
    _readiness_lines,
    _storage_note,
    probe_span,
    wait_child,
    watch_readiness,
)
from infersight.agent.commands.launcher_root import Readiness, launcher_root
from infersight.agent.daemon import itemcodec
from infersight.agent.daemon.lifecycle import short_hostname
from infersight.exporters.base import Exporter
from infersight.exporters.console import ConsoleExporter
from infersight.exporters.file import FileExporter
from infersight.hooks import _paths, _wire
from infersight.telemetry import ColdStart, Item

REJOIN_S = 0.2  # how often launch tries to re-subscribe while the agent is away
SUBSCRIBE_TIMEOUT_S = 3.0
MAX_WAITING_CAPTURES = 64  # stderr captures kept while the agent is away (the relay makes at most 4 a second)


@dataclass
class JoinedSession:
    """One launch's subscription to its agent, kept across the agent's restarts."""

    opts: LaunchOptions
    joined: Joined
    sinks: list[Exporter]
    out: TextIO
    kinds: list[str]
    child_pid: int
    coldstarts: set[str] = field(default_factory=set)  # root span ids printed (a resend is not printed twice)
    first_root: ColdStart | None = None  # CMD's own cold start (the --probe span goes under it)
    items: int = 0
    undecodable: int = 0
    lost: int = 0  # times the agent went away
    rejoined: int = 0
    ended: dict[str, Any] | None = None
    end_deadline: float | None = None  # set once CMD has exited
    connected: bool = False
    argv: list[str] = field(default_factory=list)  # CMD's, for a capture's producer when CMD runs no hooks
    captures: int = 0  # stderr captures sent to the agent
    waiting: collections.deque[bytes] = field(default_factory=lambda: collections.deque(maxlen=MAX_WAITING_CAPTURES))
    captures_lost: int = 0  # pushed out of ``waiting`` while the agent was away, or left there at the end
    captures_after_end: int = 0  # made after CMD exited and the session's end was asked (a daemonised child's)
    _writer: asyncio.StreamWriter | None = None

    async def run(self) -> None:
        """Read the session's items until the agent says ``ended`` (or, once CMD has exited,
        until the agent stayed away past the deadline)."""
        sock = socket.socket(fileno=self.joined.fd)
        self.joined.fd = -1  # ours now
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        while True:
            self._writer, self.connected = writer, True
            if not self.rejoined:  # the first subscription said relay_pending: captures go out at once from here
                writer.write(_wire.encode_frame({"t": "relaying"}))
            if self.rejoined and self.child_pid > 0:  # a new subscription: CMD again (the first named it at spawn)
                writer.write(_wire.encode_frame({"t": "cmd", "pid": self.child_pid}))
            while self.waiting:
                writer.write(self.waiting.popleft())
                self.captures += 1
            if self.end_deadline is not None:
                self._send_end()
            try:
                await self._read(reader)
            except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError):
                pass
            finally:
                self.connected = False
                writer.close()
            if self.ended is not None:
                return
            self.lost += 1
            got = await self._rejoin()
            if got is None:
                return
            reader, writer = got
            self.rejoined += 1

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while self.ended is None:
            (n,) = _wire.HEADER.unpack(await reader.readexactly(_wire.HEADER.size))
            if n > _wire.MAX_FRAME_BYTES:
                raise ValueError("oversized frame from the agent")
            msg = _wire.decode_payload(await reader.readexactly(n))
            if msg is None:
                continue
            if msg.get("t") == "items" and isinstance(msg.get("i"), list):
                await self._deliver(msg["i"])
            elif msg.get("t") == "ended":
                self.ended = msg

    async def _deliver(self, raw: list[Any]) -> None:
        batch: list[Item] = []
        for d in raw:
            try:
                it = itemcodec.from_dict(d)
            except (KeyError, TypeError, ValueError, IndexError):
                self.undecodable += 1
                continue
            if isinstance(it, ColdStart):
                if it.root.span_id in self.coldstarts:
                    continue  # resent after the agent restarted
                self.coldstarts.add(it.root.span_id)
                if self.first_root is None or it.root.resource.get("process.pid") == self.child_pid:
                    self.first_root = it
            batch.append(it)
        self.items += len(batch)
        await export_all(self.sinks, batch)

    async def _rejoin(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Subscribe again with the same session, until it works or (CMD gone) the deadline."""
        while self.end_deadline is None or time.monotonic() < self.end_deadline:
            await asyncio.sleep(REJOIN_S)
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(self.joined.path), SUBSCRIBE_TIMEOUT_S)
            except (OSError, TimeoutError):
                continue
            writer.write(_wire.subscribe_frame(self.joined.session, list(self.kinds), relay=True,
                                               log_events=log_events_for(self.kinds)))
            try:
                (n,) = _wire.HEADER.unpack(await asyncio.wait_for(
                    reader.readexactly(_wire.HEADER.size), SUBSCRIBE_TIMEOUT_S))
                reply = _wire.decode_payload(await asyncio.wait_for(reader.readexactly(n), SUBSCRIBE_TIMEOUT_S))
            except (OSError, TimeoutError, asyncio.IncompleteReadError):
                writer.close()
                continue
            if reply is not None and reply.get("t") == "subscribed":
                self.joined.info = printable_reply(reply)
                return reader, writer
            writer.close()
        return None

    def send_capture(self, text: str) -> None:
        """A capture of CMD's stderr (the relay made it): to the agent now, or once launch has re-subscribed."""
        if self.end_deadline is not None:  # the session's end is asked: the agent reads no more of it
            self.captures_after_end += 1
            return
        frame = _wire.encode_frame({"t": "stderr", "pid": self.child_pid, "text": text, "argv": self.argv,
                                    "service": os.environ.get("OTEL_SERVICE_NAME") or None})
        if self._writer is not None and self.connected:
            self._writer.write(frame)
            self.captures += 1
            return
        if len(self.waiting) == self.waiting.maxlen:
            self.captures_lost += 1
        self.waiting.append(frame)

    def _send_end(self) -> None:
        if self._writer is not None and self.connected and self.end_deadline is not None:
            left = max(0.0, self.end_deadline - time.monotonic())
            self._writer.write(_wire.encode_frame({"t": "end", "timeout_s": left}))

    def end(self, timeout_s: float) -> None:
        """CMD has exited: ask the agent for the rest (now, or once it is back)."""
        self.end_deadline = time.monotonic() + timeout_s
        self._send_end()


async def export_all(sinks: Sequence[Exporter], batch: list[Item]) -> None:
    if not batch:
        return
    for sink in sinks:
        try:
            await sink.export(batch)
        except Exception as exc:  # a local copy that fails must not cost the waterfall
            sink_error = getattr(sink, "last_error", "") or repr(exc)
            setattr(sink, "launch_error", sink_error)  # noqa: B010


async def _run(opts: LaunchOptions, path: str | None, private: Private, joined: Joined, child: Child,
               spawn_ns: int, out: TextIO) -> int:
    sinks: list[Exporter] = []
    if opts.console:
        sinks.append(ConsoleExporter(out))
    file_sink = FileExporter(path) if path else None
    if file_sink is not None:
        await file_sink.start()
        sinks.append(file_sink)
    info = joined.info
    out.write("infersight: reporting to the agent at %s (pid %s, %s; sinks: %s)\n" % (
        joined.path, info.get("pid"), "healthy" if info.get("healthy") else "UNHEALTHY",
        ", ".join(info.get("sinks") or []) or "none"))
    for p in info.get("problems") or []:
        out.write("infersight: the agent reports a problem: exporter %s: %s\n" % (p.get("exporter"), p.get("reason")))
    for w in info.get("warnings") or []:
        out.write("infersight: the agent warns: %s\n" % w)
    out.flush()
    kinds = ITEM_KINDS_ALL if path else ITEM_KINDS_CONSOLE
    session = JoinedSession(opts, joined, sinks, out, kinds, child.pid, argv=[str(a)[:256] for a in opts.cmd[:512]])
    reading = asyncio.create_task(session.run())
    relay = child.relay
    if relay is not None:  # CMD's memory errors on stderr: the agent classifies them (sessions.py)
        loop = asyncio.get_running_loop()

        def on_text(text: str) -> None:  # the relay's thread
            loop.call_soon_threadsafe(session.send_capture, text)

        relay.set_consumer(on_text)
    ready_file = os.path.join(private.path, "ready") if opts.ready_url else None
    proc_done = asyncio.Event()
    watcher = None
    if opts.ready_url or opts.probe:
        watcher = asyncio.create_task(watch_readiness(opts, ready_file, proc_done, out))
    returncode = await wait_child(child)
    end_ns = time.time_ns()
    if relay is not None:  # what CMD wrote last is captured (and sent) before the session ends
        await asyncio.to_thread(relay.wait_closed, min(RELAY_CLOSE_WAIT_S, opts.flush_timeout_s))
    proc_done.set()
    child.restore_tty()
    readiness = Readiness()
    if watcher is not None:
        try:
            readiness = await asyncio.wait_for(watcher, 10.0)
        except (TimeoutError, OSError) as exc:
            readiness.notes.append("readiness watch: %s" % (exc or type(exc).__name__))
    session.end(opts.flush_timeout_s)
    try:
        await asyncio.wait_for(reading, opts.flush_timeout_s + SUBSCRIBE_TIMEOUT_S)
    except TimeoutError:
        pass
    if session.first_root is None:  # no hooked Python reported: the launcher's view
        cs = launcher_root(opts.cmd, child.pid, spawn_ns, end_ns, short_hostname(), readiness)
        await export_all(sinks, [cs.root, *cs.stages, cs])
    elif readiness.probe is not None and readiness.probe.first_byte_ns:  # local, as the launcher root
        root = session.first_root.root
        await export_all(sinks, [probe_span(readiness.probe, root.trace_id, root.span_id, root.resource)])
    for sink in sinks:
        await sink.force_flush(5.0)
        await sink.shutdown()
    for line in _readiness_lines(readiness, spawn_ns):
        out.write(line + "\n")
    _report(session, path, file_sink, out)
    if path:
        _storage_note(path, out)
    return exit_status(returncode)


def _report(session: JoinedSession, path: str | None, file_sink: FileExporter | None, out: TextIO) -> None:
    j = session.joined
    if session.ended is not None:
        dropped = int(session.ended.get("dropped") or 0)
        if dropped:
            out.write("infersight: %d item(s) were not sent back to launch (it read too slowly); the agent's "
                      "sinks have them\n" % dropped)
        if session.ended.get("open"):
            out.write("infersight: %s process(es) of this run still report to the agent\n" % session.ended["open"])
        if session.lost and joined_spool(j, _paths) is None and not os.environ.get("INFERSIGHT_SPOOL_DIR"):
            out.write("infersight: the agent at %s went away %d time(s) during the run; launch re-subscribed; "
                      "what the hooks spooled meanwhile is in %s, which the agent does not replay (its spool "
                      "directory %s is not writable here)\n" % (j.path, session.lost, _paths.spool_dir(),
                                                                 j.info.get("spool_dir")))
        elif session.lost:
            out.write("infersight: the agent at %s went away %d time(s) during the run; launch re-subscribed and "
                      "the hooks replayed what they had spooled\n" % (j.path, session.lost))
    else:
        spool = joined_spool(j, _paths) or _paths.spool_dir()
        out.write("infersight: the agent at %s went away and was not back within %.0f s: what this run's hooks "
                  "could not deliver stays in their spool (%s) and the agent replays it when it is back; the "
                  "waterfall above may lack it\n" % (j.path, session.opts.flush_timeout_s, spool))
    if file_sink is not None and path is not None:
        out.write("infersight: wrote %s\n" % os.path.abspath(path))
        err = getattr(file_sink, "launch_error", "")
        if err:
            out.write("infersight: the local copy %s is incomplete: %s\n" % (path, err))
    if session.undecodable:
        out.write("infersight: %d item(s) from the agent could not be read\n" % session.undecodable)
    _report_captures(session, out)
    out.flush()


def _report_captures(session: JoinedSession, out: TextIO) -> None:
    """What became of the memory errors CMD printed on stderr, when not all of them were classified."""
    j = session.joined
    lost = session.captures_lost + len(session.waiting)
    if session.captures and not j.info.get("captures"):
        out.write("infersight: the agent at %s (version %s) does not classify CMD's stderr: %d memory error(s) CMD "
                  "printed there were not classified; upgrade the agent, or run with --agent embedded\n"
                  % (j.path, j.info.get("version"), session.captures))
    if session.captures_after_end:
        out.write("infersight: %d memory error(s) printed on CMD's stderr after CMD exited (by a process it left "
                  "running) were not classified\n" % session.captures_after_end)
    dropped = int((session.ended or {}).get("captures_dropped") or 0)
    if dropped or lost:
        out.write("infersight: %d capture(s) of memory errors on CMD's stderr were not classified (%s)\n" % (
            dropped + lost, "over the agent's rate" if dropped else "the agent was away"))


def run(opts: LaunchOptions, path: str | None, private: Private, joined: Joined, child: Child, spawn_ns: int,
        out: TextIO) -> int:
    _quiet_logging()
    return asyncio.run(_run(opts, path, private, joined, child, spawn_ns, out))
