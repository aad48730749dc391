"""Launch sessions: ``infersight launch`` joined to a running agent gets its CMD's items back.

When ``launch`` joins an agent (``--agent auto`` finds one, or ``--agent PATH``), CMD's hooks
report to that agent like any producer; launch still prints the waterfall. It gets the items
through a *subscription* on the agent's socket:

    {"t": "subscribe", "schema": 1, "session": S, "kinds": [...]}   launch -> agent
    {"t": "subscribed", "schema": 1, "pid": ..., "version": ..., "sinks": [...]}
    {"t": "items", "i": [item, ...]}        agent -> launch, as the items pass (itemcodec dicts)
    {"t": "end", "timeout_s": T}            launch -> agent, once CMD has exited
    {"t": "ended", "open": N, "dropped": D}  agent -> launch, then the agent closes

``S`` is a random token that launch puts in CMD's environment (``INFERSIGHT_LAUNCH_SESSION``);
CMD's hooks, and its children's, say it in their hello. The subscription receives the items
whose producer said ``S`` (matched by ``service.instance.id``), of the item kinds asked for,
and only producers of the subscriber's own uid (root sees any). Reading another user's token
needs that user's ``/proc/<pid>/environ`` anyway. The subscription is a tap: the agent's own
sinks get everything as before, and a subscriber that does not read loses items (counted,
said in ``ended``), never stalls the agent. ``end`` waits (at most ``timeout_s``) until no
connection of the session's producers is open, replays the spool of those that died, then
answers: what the agent had of the session was sent before ``ended``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from infersight.agent.daemon import itemcodec
from infersight.agent.daemon.assemble import Assembler
from infersight.hooks import _wire
from infersight.telemetry import ColdStart, ColdStartProgress, Item, LogItem, MetricItem, Resource, SpanItem

log = logging.getLogger("infersight.sessions")
KINDS = ("coldstart", "progress", "span", "log", "metric")
MAX_BUFFERED_BYTES = 8 << 20  # a subscriber that lets this much pile up loses items (counted)
MAX_SUBSCRIBERS = 256
MAX_SUBSCRIBERS_PER_UID = 16  # one user's idle subscriptions cannot take every other user's place
END_POLL_S = 0.02
FRAME_TARGET_BYTES = _wire.MAX_FRAME_BYTES // 2


def item_kind(it: Item) -> str:
    if isinstance(it, ColdStart):
        return "coldstart"
    if isinstance(it, ColdStartProgress):
        return "progress"
    if isinstance(it, SpanItem):
        return "span"
    if isinstance(it, LogItem):
        return "log"
    return "metric"


def item_resource(it: Item) -> Resource:
    if isinstance(it, ColdStart):
        return it.root.resource
    assert isinstance(it, (SpanItem, LogItem, MetricItem, ColdStartProgress))
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
    __slots__ = ("dropped", "kinds", "sent", "session", "uid", "writer")

    def __init__(self, session: str, uid: int, kinds: frozenset[str], writer: asyncio.StreamWriter) -> None:
        self.session = session
        self.uid = uid
        self.kinds = kinds
        self.writer = writer
        self.sent = 0
        self.dropped = 0

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
                 live: Callable[[str], bool], replay: Callable[[], Awaitable[int]]) -> None:
        self.assembler = assembler
        self.info = info  # what ``subscribed`` tells launch (version, pid, sinks)
        self.live = live  # producer id -> has an open connection
        self.replay = replay  # replay dead producers' spools now
        self.subscribers: dict[str, list[Subscriber]] = {}

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
            info = self._producer_info(item_resource(it))
            if info is None:
                continue
            session = info.get("session")
            if isinstance(session, str) and session in self.subscribers:
                out.setdefault(session, []).append(it)
        for session, got in out.items():
            for sub in self.subscribers.get(session, ()):
                mine = [it for it in got if item_kind(it) in sub.kinds and self._visible(sub, it)]
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
        if p is None or p.info.get("uid") != uid:
            return None
        return p.info

    def _visible(self, sub: Subscriber, it: Item) -> bool:
        """Only the subscriber's own uid's producers (root: any)."""
        if sub.uid == 0:
            return True
        info = self._producer_info(item_resource(it))
        return info is not None and info.get("uid") == sub.uid

    def _session_open(self, session: str) -> int:
        return sum(1 for p in list(self.assembler.producers.values())
                   if p.info.get("session") == session and self.live(p.id))

    async def serve(self, msg: dict[str, Any], uid: int, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        """One subscription, from ``subscribe`` to ``ended`` (or the subscriber's hang-up)."""
        session = msg.get("session")
        kinds = msg.get("kinds") or list(KINDS)
        if (not isinstance(session, str) or not 16 <= len(session) <= 64 or not isinstance(kinds, list)
                or not all(k in KINDS for k in kinds) or len(self) >= MAX_SUBSCRIBERS
                or (uid != 0 and self.of_uid(uid) >= MAX_SUBSCRIBERS_PER_UID)):
            writer.write(_wire.refuse_frame("malformed subscription (or too many)"))
            await writer.drain()
            return
        sub = Subscriber(session, uid, frozenset(kinds), writer)
        self.subscribers.setdefault(session, []).append(sub)
        try:
            writer.write(_wire.subscribed_frame(self.info()))
            while True:  # no read limit: a launch may run a server for weeks; EOF ends it
                hdr = await reader.readexactly(_wire.HEADER.size)
                (n,) = _wire.HEADER.unpack(hdr)
                if n > _wire.MAX_FRAME_BYTES:
                    return
                req = _wire.decode_payload(await reader.readexactly(n))
                if req is not None and req.get("t") == "end":
                    await self._end(sub, req.get("timeout_s"))
                    return
        finally:
            subs = self.subscribers.get(session, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self.subscribers.pop(session, None)

    async def _end(self, sub: Subscriber, timeout: Any) -> None:
        limit = float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else 10.0
        deadline = time.monotonic() + max(0.0, min(limit, 600.0))
        while self._session_open(sub.session) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(END_POLL_S)
        await self.replay()  # producers of the session that died with a spool: theirs go out now
        open_now = self._session_open(sub.session)
        sub.writer.write(_wire.encode_frame({"t": "ended", "open": open_now, "dropped": sub.dropped,
                                             "sent": sub.sent}))
        await sub.writer.drain()
