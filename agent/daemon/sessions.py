"""Launch sessions: ``infersight launch`` joined to a running agent gets its CMD's items back.

When ``launch`` joins an agent (``--agent auto`` finds one, or ``--agent PATH``), CMD's hooks
report to that agent like any producer; launch still prints the waterfall. It gets the items
through a *subscription* on the agent's socket:

    {"t": "subscribe", "schema": 1, "session": S, "kinds": [...]}   launch -> agent
    {"t": "subscribed", "schema": 1, "pid": ..., "version": ..., "sinks": [...]}
    {"t": "items", "i": [item, ...]}        agent -> launch, as the items pass (itemcodec dicts)
    {"t": "relaying"}                       launch -> agent: its relay's captures go out at once from now
    {"t": "stderr", "pid": P, "text": T, "argv": [...]}  launch -> agent: a capture of CMD's stderr
    {"t": "end", "timeout_s": T}            launch -> agent, once CMD has exited
    {"t": "ended", "open": N, "dropped": D, "captures": C, "captures_dropped": K}  agent -> launch, then it closes

``S`` is a random token that launch puts in CMD's environment (``INFERSIGHT_LAUNCH_SESSION``);
CMD's hooks, and its children's, say it in their hello. The subscription receives the items
whose producer said ``S`` (matched by ``service.instance.id``), of the item kinds asked for,
and only producers of the subscriber's own uid (root sees any). Reading another user's token
needs that user's ``/proc/<pid>/environ`` anyway. The subscription is a tap: the agent's own
sinks get everything as before, and a subscriber that does not read loses items (counted,
said in ``ended``), never stalls the agent. ``end`` waits (at most ``timeout_s``) until no
connection of the session's producers is open, replays the spool of those that died, then
answers: what the agent had of the session was sent before ``ended``.

``stderr`` (a subscription that said ``"relay": true``): launch copies CMD's stderr through its relay,
and hands the agent each capture of a memory error there (``agent/oom/stderr_relay.py``), as the
embedded agent gets them: a native engine (llama.cpp's server, ollama, TensorRT-LLM's C++ runtime)
prints its memory errors where no hook sees them. The capture is classified as the session's
producer of pid ``P`` (of the subscriber's uid), or, where CMD runs no hooked Python, as a producer
that stands for CMD (the kernel's uid; the pid only where it is the subscriber's own child). At most
``CAPTURE_RATE`` captures a second per subscription (a burst of ``CAPTURE_BURST``), the rest counted.
An agent older than this ignores the frame (launch then says so). launch subscribes, then spawns CMD, and only
then starts the event loop that forwards the captures: a subscription that says ``"relay_pending": true`` sends
``relaying`` once it does, and an undecided error the hooks report waits for that (bounded) before its own
wait for launch's copy begins (``agent/oom/kind.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from infersight.agent.daemon import itemcodec
from infersight.agent.daemon.assemble import Assembler, Producer
from infersight.agent.daemon.identity import parent_pid, proc_uids
from infersight.hooks import _wire
from infersight.sanitize import clean_key, clean_text, strip_ansi
from infersight.telemetry import ColdStart, ColdStartProgress, Item, LogItem, MetricItem, Resource, SpanItem

log = logging.getLogger("infersight.sessions")
KINDS = ("coldstart", "progress", "span", "log", "metric")
MAX_BUFFERED_BYTES = 8 << 20  # a subscriber that lets this much pile up loses items (counted)
MAX_SUBSCRIBERS = 256
MAX_SUBSCRIBERS_PER_UID = 16  # one user's idle subscriptions cannot take every other user's place
END_POLL_S = 0.02
FRAME_TARGET_BYTES = _wire.MAX_FRAME_BYTES // 2
CAPTURE_RATE = 8.0  # stderr captures classified per second and subscription (launch's relay sends at most 4)
CAPTURE_BURST = 16
MAX_CAPTURE_CHARS = 20_000  # the relay's captures stay under 16 KiB of text
MAX_STAND_INS = 4  # producers that stand for an unhooked CMD, per subscription (one per pid it names)
MAX_ARGV = 512
STAND_IN_PREFIX = "launch-stderr-"  # a stand-in's producer id (agent/oom/kind.py folds a root launch's by it)
Capture = Callable[[Producer, str], None]
Settle = Callable[[str, int], Awaitable[None]]  # (session, the subscriber's uid)


def item_kind(it: Item) -> str:
    if isinstance(it, ColdStart):
        return "coldstart"
    if isinstance(it, ColdStartProgress):
        return "progress"
    if isinstance(it, SpanItem):
        return "span"
    if isinstance(it, LogItem):
        return "log"
    if isinstance(it, MetricItem):
        return "metric"
    return "routing"  # a RoutingHint: the agent's own, for MQTT and Prometheus; no session's


def item_resource(it: Item) -> Resource:
    if isinstance(it, ColdStart):
        return it.root.resource
    return it.resource


def item_frames(items: Sequence[Item]) -> list[bytes]:
    """``items`` frames, each under the wire's frame limit (an item too large alone is left out)."""
    frames: list[bytes] = []
    todo: list[list[Item]] = [list(items)]
    while todo:
        part = todo.pop()
        frame = _wire.encode_frame({"t": "items", "i": [itemcodec.to_dict(it) for it in part]})
        if len(frame) <= FRAME_TARGET_BYTES or len(part) == 1:
            if len(frame) <= _wire.MAX_FRAME_BYTES:
                frames.append(frame)
            continue
        half = len(part) // 2
        todo += [part[half:], part[:half]]  # popped first half first: order kept
    return frames


class Subscriber:
    __slots__ = ("_tokens", "_tokens_at", "captures", "captures_dropped", "children", "dropped", "kinds",
                 "log_events", "peer_pid", "relay", "relay_started", "sent", "session", "stand_ins", "uid", "writer")

    def __init__(self, session: str, uid: int, kinds: frozenset[str], writer: asyncio.StreamWriter,
                 peer_pid: int = 0, relay: bool = False, relay_pending: bool = False) -> None:
        self.session = session
        self.uid = uid
        self.kinds = kinds
        self.writer = writer
        self.peer_pid = peer_pid  # the kernel's word, in the agent's PID namespace (0: unknown)
        self.relay = relay  # launch copies CMD's stderr and sends its captures
        # when its captures started going out at once (monotonic s); None: launch keeps them until its loop runs
        self.relay_started: float | None = None if relay_pending else time.monotonic()
        self.log_events: frozenset[str] | None = None  # of the log records, only these event names (None: all)
        self.sent = 0
        self.dropped = 0
        self.captures = 0  # stderr captures handed to the classifier
        self.captures_dropped = 0  # over the rate, or malformed
        self.stand_ins: dict[int, Producer] = {}  # claimed pid (0: none) -> the producer that stands for CMD
        # CMD's pids that the kernel showed to be the subscriber's own children while they ran (a ``cmd``
        # frame): a capture that comes after CMD exited and launch reaped it still names its pid
        self.children: set[int] = set()
        self._tokens = float(CAPTURE_BURST)
        self._tokens_at = time.monotonic()

    def take_capture(self) -> bool:
        """One capture within the rate (a token bucket)."""
        now = time.monotonic()
        self._tokens = min(float(CAPTURE_BURST), self._tokens + (now - self._tokens_at) * CAPTURE_RATE)
        self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def send(self, items: list[Item]) -> None:
        if self.writer.is_closing():
            return
        if self.writer.transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
            self.dropped += len(items)
            return
        for frame in item_frames(items):
            self.writer.write(frame)
        self.sent += len(items)


class Sessions:
    """The subscriptions of joined launches; :meth:`tap` is one of the broadcaster's taps."""

    def __init__(self, assembler: Assembler, info: Callable[[], dict[str, Any]],
                 live: Callable[[str], bool], replay: Callable[[], Awaitable[int]],
                 capture: Capture | None = None, settle: Settle | None = None, proc_root: str = "/proc") -> None:
        self.assembler = assembler
        self.info = info  # what ``subscribed`` tells launch (version, pid, sinks)
        self.live = live  # producer id -> has an open connection
        self.replay = replay  # replay dead producers' spools now
        self.capture = capture  # a capture of CMD's stderr, as that producer's: classify and publish
        self.settle = settle  # before ``ended``: what the agent still holds of the session goes out
        self.proc_root = proc_root
        self.subscribers: dict[str, list[Subscriber]] = {}
        self._stand_ins: dict[str, Producer] = {}  # stand-in id -> producer, while its subscription lasts

    def __len__(self) -> int:
        return sum(len(v) for v in self.subscribers.values())

    def of_uid(self, uid: int) -> int:
        """The subscriptions open for ``uid``."""
        return sum(1 for subs in self.subscribers.values() for sub in subs if sub.uid == uid)

    def tap(self, items: Sequence[Item]) -> None:
        if not self.subscribers:
            return
        out: dict[str, list[Item]] = {}
        for it in items:
            if item_kind(it) not in KINDS:
                continue
            info = self._producer_info(item_resource(it))
            if info is None:
                continue
            session = info.get("session")
            if isinstance(session, str) and session in self.subscribers:
                out.setdefault(session, []).append(it)
        for session, got in out.items():
            for sub in self.subscribers.get(session, ()):
                mine = [it for it in got if item_kind(it) in sub.kinds and self._visible(sub, it)
                        and (sub.log_events is None or not isinstance(it, LogItem) or it.event_name in sub.log_events)]
                if mine:
                    sub.send(mine)

    def _producer_info(self, resource: Resource) -> dict[str, Any] | None:
        """The hello of the producer whose items carry ``resource``. A second uid that presents
        the same producer id is kept as ``<id>@<uid>`` but its items carry the same
        service.instance.id: the kernel's uid (process.user.id) tells the two apart."""
        pid, uid = resource.get("service.instance.id"), resource.get("process.user.id")
        if not isinstance(pid, str):
            return None
        p = self.assembler.find(pid, uid if type(uid) is int else None)  # its uid's own entry, never another's
        if p is None:
            p = self._stand_ins.get(pid)
        if p is None or p.info.get("uid") != uid:
            return None
        return p.info

    def _visible(self, sub: Subscriber, it: Item) -> bool:
        """Only the subscriber's own uid's producers (root: any)."""
        if sub.uid == 0:
            return True
        info = self._producer_info(item_resource(it))
        return info is not None and info.get("uid") == sub.uid

    def relays(self, info: dict[str, Any]) -> bool:
        """Whether a joined launch of the producer's own uid (or root's) copies the stderr of the producer of hello
        ``info`` (its session's): another uid that learnt the token cannot make its errors wait."""
        session, uid = info.get("session"), info.get("uid")
        return isinstance(session, str) and any(sub.relay and sub.uid in (0, uid)
                                                for sub in self.subscribers.get(session, ()))

    def relay_started(self, info: dict[str, Any]) -> float | None:
        """When the relays of ``relays`` started forwarding their captures at once (the latest, monotonic s); None
        while one has not yet (``relaying`` not sent); 0.0 when none relays that producer's stderr now."""
        session, uid = info.get("session"), info.get("uid")
        subs = [sub for sub in self.subscribers.get(session, ()) if sub.relay and sub.uid in (0, uid)] \
            if isinstance(session, str) else []
        if any(sub.relay_started is None for sub in subs):
            return None
        return max((sub.relay_started or 0.0 for sub in subs), default=0.0)

    def _session_open(self, session: str) -> int:
        return sum(1 for p in list(self.assembler.producers.values())
                   if p.info.get("session") == session and self.live(p.id))

    async def serve(self, msg: dict[str, Any], uid: int, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter, peer_pid: int = 0) -> None:
        """One subscription, from ``subscribe`` to ``ended`` (or the subscriber's hang-up)."""
        session = msg.get("session")
        kinds = msg.get("kinds") or list(KINDS)
        if (not isinstance(session, str) or not 16 <= len(session) <= 64 or not isinstance(kinds, list)
                or not all(k in KINDS for k in kinds) or len(self) >= MAX_SUBSCRIBERS
                or (uid != 0 and self.of_uid(uid) >= MAX_SUBSCRIBERS_PER_UID)):
            writer.write(_wire.refuse_frame("malformed subscription (or too many)"))
            await writer.drain()
            return
        relay = msg.get("relay") is True
        sub = Subscriber(session, uid, frozenset(kinds), writer, peer_pid, relay,
                         relay and msg.get("relay_pending") is True)
        events = msg.get("log_events")
        if isinstance(events, list) and len(events) <= 16 and all(isinstance(e, str) for e in events):
            sub.log_events = frozenset(events)
        self.subscribers.setdefault(session, []).append(sub)
        try:
            writer.write(_wire.subscribed_frame({**self.info(), "captures": self.capture is not None}))
            while True:  # no read limit: a launch may run a server for weeks; EOF ends it
                hdr = await reader.readexactly(_wire.HEADER.size)
                (n,) = _wire.HEADER.unpack(hdr)
                if n > _wire.MAX_FRAME_BYTES:
                    return
                req = _wire.decode_payload(await reader.readexactly(n))
                if req is not None and req.get("t") == "stderr":
                    self._capture(sub, req)
                elif req is not None and req.get("t") == "relaying":
                    if sub.relay_started is None:
                        sub.relay_started = time.monotonic()
                elif req is not None and req.get("t") == "cmd":
                    self._cmd(sub, req.get("pid"))
                elif req is not None and req.get("t") == "end":
                    await self._end(sub, req.get("timeout_s"))
                    return
        finally:
            for p in sub.stand_ins.values():
                self._stand_ins.pop(p.id, None)
            subs = self.subscribers.get(session, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self.subscribers.pop(session, None)

    def _cmd(self, sub: Subscriber, pid: Any) -> None:
        """launch names CMD, which it has just spawned: kept as its own child where the kernel says so now
        (its parent is the subscriber, of its uid), so that a capture sent once CMD has exited names its pid."""
        if type(pid) is int and pid > 0 and len(sub.children) < MAX_STAND_INS and self._own_child(sub, pid):
            sub.children.add(pid)

    def _capture(self, sub: Subscriber, req: dict[str, Any]) -> None:
        """A capture of CMD's stderr from the subscriber's launch: classified as CMD's."""
        if self.capture is None:
            return
        text, pid = req.get("text"), req.get("pid")
        if (not sub.relay or not isinstance(text, str) or not text
                or (pid is not None and (type(pid) is not int or pid <= 0)) or not sub.take_capture()):
            sub.captures_dropped += 1
            if sub.captures_dropped in (1, 100, 10_000):
                log.warning("a launch of uid %d sent %d stderr capture(s) the agent did not classify (over %g a "
                            "second, or malformed)", sub.uid, sub.captures_dropped, CAPTURE_RATE)
            return
        text = text[:MAX_CAPTURE_CHARS]
        text = strip_ansi(text)
        p = self._producer_of(sub, pid, req.get("argv"), req.get("service"))
        sub.captures += 1
        try:
            self.capture(p, clean_text(text, MAX_CAPTURE_CHARS))
        except Exception as exc:  # a capture the classifier refuses is dropped, never the subscription
            log.debug("stderr capture not classified: %s", exc)

    def _producer_of(self, sub: Subscriber, pid: int | None, argv: Any, service: Any) -> Producer:
        """The session's producer of ``pid`` (the subscriber's uid's; root's: any), else one that stands for CMD."""
        if pid is not None:
            for p in list(self.assembler.producers.values()):
                if p.info.get("session") == sub.session and p.info.get("pid") == pid and sub.uid in (0, p.uid):
                    return p
        key = pid if pid is not None and (pid in sub.stand_ins or len(sub.stand_ins) < MAX_STAND_INS) else 0
        stand_in = sub.stand_ins.get(key)
        if stand_in is None:
            stand_in = sub.stand_ins[key] = self._stand_in(sub, pid if key else None, argv, service)
            self._stand_ins[stand_in.id] = stand_in
        return stand_in

    def _stand_in(self, sub: Subscriber, pid: int | None, argv: Any, service: Any) -> Producer:
        """A producer for a CMD that runs no hooked Python. Its uid is the kernel's word; its pid is kept only
        where it is the subscriber's own child, of the subscriber's uid (launch spawned CMD itself)."""
        if pid is not None and pid not in sub.children and not self._own_child(sub, pid):
            pid = None
        args = [clean_text(str(a), 256) for a in argv[:MAX_ARGV]] if isinstance(argv, list) else []
        exe = os.path.basename(args[0]) if args else ""
        name = clean_key(service, 256) if isinstance(service, str) and service else "unknown_service:%s" % exe
        sid = STAND_IN_PREFIX + os.urandom(8).hex()
        attrs: dict[str, Any] = {"service.name": name, "service.instance.id": sid,
                                 "host.name": self.assembler.host_name or "", "process.executable.name": exe,
                                 "process.user.id": sub.uid, "telemetry.sdk.name": "infersight"}
        if pid is not None:
            attrs["process.pid"] = pid
        info = {"id": sid, "pid": pid, "launched": True, "session": sub.session, "uid": sub.uid, "argv": args}
        p = Producer(sid, info, Resource.of(attrs))
        p.uid = sub.uid
        return p

    def _own_child(self, sub: Subscriber, pid: int) -> bool:
        if sub.peer_pid <= 0 or parent_pid(pid, self.proc_root) != sub.peer_pid:
            return False
        uids = proc_uids(pid, self.proc_root)
        return uids is not None and (sub.uid == 0 or sub.uid in uids)

    async def _end(self, sub: Subscriber, timeout: Any) -> None:
        limit = float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else 10.0
        deadline = time.monotonic() + max(0.0, min(limit, 600.0))
        while self._session_open(sub.session) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(END_POLL_S)
        await self.replay()  # producers of the session that died with a spool: theirs go out now
        if self.settle is not None:
            await self.settle(sub.session, sub.uid)
        open_now = self._session_open(sub.session)
        sub.writer.write(_wire.encode_frame({"t": "ended", "open": open_now, "dropped": sub.dropped,
                                             "sent": sub.sent, "captures": sub.captures,
                                             "captures_dropped": sub.captures_dropped}))
        await sub.writer.drain()
