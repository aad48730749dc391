"""The bounded in-process buffer between the host's threads and the drain thread.

The host's side is the hot path: ``emit`` and ``queue`` never block and never raise; they
number the event, append it to a deque (atomic under the GIL) and wake the drain thread a
few times per batch, not per event. Callers that want to skip even the method call append
to ``events`` themselves while its length is in a calm range (see ``calm``). The drain
thread's side (``take``) pops whole batches and builds what was queued flat.

A full buffer drops the event and counts it (``dropped``); its sequence number still shows
the gap to the agent.
"""

from __future__ import annotations

import itertools
import threading
import time
from _collections import deque  # the C type; the collections module costs ~2.5 ms

from . import _env, _wire

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

# ~516 B per buffered log event with attributes: 131072 events bound the buffer near 64 MiB.
MAX_BUFFER_EVENTS = 131072
BATCH_EVENTS: int = _env.VARS["INFERSIGHT_BATCH_EVENTS"].default  # send once this many are queued

# kind -> build(*args): the dict of an event queued flat, ``(seq, t_ns, kind, *args)``
# (``hooks.stage``, ``hooks.request``): the caller's thread allocates one tuple of its
# atomic values, which the garbage collector stops tracking at its first pass, and the
# drain thread builds the dict.
builders: Dict[str, Callable[..., Dict[str, Any]]] = {}

# Called by ``take`` with the queue and how many events it is about to pop, before they
# leave it (set by ``hooks``: while a cold start is collected, ``_recorder.cover_queued``
# notes the intervals of the stages among them, so that a reader who looks at the queue,
# then at what was noted, misses none, whether the drain thread has taken it yet or not).
before_take: Optional[Callable[[Deque[Tuple[Any, ...]], int], None]] = None

# The last value of a flat event whose attributes dict waits in ``Buffer.held`` under the
# event's sequence number: one dict store instead of flattening the dict on the caller's
# thread. A bare ``object()``: unique, and (no GC type) it lets the tuple be untracked too.
HELD = object()


def built(event: Tuple[Any, ...], held: Dict[int, Dict[str, Any]]) -> Optional[_wire.Event]:
    """The event with its data built: a queued event is ``(seq, t_ns, kind, data)`` with
    ``data`` a dict, or ``(seq, t_ns, kind, *args)`` (more than four items) for
    ``builders[kind]``, its last value ``HELD`` when its attributes wait in ``held``; None
    if building it failed."""
    if len(event) == 4:
        return event  # type: ignore[return-value]
    try:
        args = event[3:]
        if args[-1] is HELD:
            attrs = held.pop(event[0])  # a KeyError drops and counts it, as any failure to build
            args = (*args[:-1], *attrs, *attrs.values())  # as if queued flat
        return (event[0], event[1], event[2], builders[event[2]](*args))
    except Exception:
        return None


def user_events(events: List[_wire.Event]) -> int:
    """Events that count as lost when this batch is: our own ``drops`` reports do not."""
    return sum(1 for e in events if e[2] != "drops")


def _yield() -> None:
    """Past the spill mark, each emit offers the GIL to the drain thread. A host thread in
    a tight loop otherwise holds it for whole switch intervals while the drain thread,
    which gives it up at every write, falls behind and the buffer overflows. This waits
    at most for the drain thread's turn (a switch interval), and only while the buffer is
    more than half full: a burst is absorbed, at the burst's own pace, instead of dropped."""
    time.sleep(0)


class Buffer:
    """``wake`` is the drain thread's event: set at a batch's first event, when a batch is
    full, and at the spill mark (half the bound), past which the drain thread spills to
    the spool rather than wait on the agent."""

    def __init__(self, wake: threading.Event, max_events: int = MAX_BUFFER_EVENTS,
                 batch_events: int = BATCH_EVENTS) -> None:
        self.wake = wake
        self.max_events = max_events
        self.batch_events = max(1, batch_events)
        self.spill_at = max(1, max_events // 2)
        # Lengths at which an append needs no wake-up, spill or drop, so the callers of
        # ``queue`` append to ``events`` directly, without a call: ``0 < n < calm`` (a batch
        # filling) and ``calm_from <= n < calm_to`` (past a full batch, which already woke
        # the drain thread, and below the spill mark: a burst the drain thread is pumping).
        self.calm = min(self.batch_events, self.spill_at) - 1
        self.calm_from = self.batch_events
        self.calm_to = self.spill_at - 1
        self.events: Deque[Tuple[Any, ...]] = deque()  # _wire.Event, or flat for builders
        self.held: Dict[int, Dict[str, Any]] = {}  # seq -> attributes of a queued ``HELD`` event
        self.seq: Iterator[int] = itertools.count(1)
        self.dropped = 0  # events refused by a full buffer, or that failed to build

    def __len__(self) -> int:
        return len(self.events)

    # -- the host's threads ------------------------------------------------------------

    def emit(self, kind: str, data: Any) -> None:
        """Queue one event; ``data`` is a dict, or ``(build, args)`` for the drain thread to
        call: ``build(*args)`` returns the dict (work moved off the caller's thread)."""
        seq = next(self.seq)
        buf = self.events
        n = len(buf)
        if n >= self.max_events:
            self.dropped += 1
            return
        buf.append((seq, time.time_ns(), kind, data))
        if n == 0 or n + 1 == self.batch_events or n + 1 == self.spill_at:
            self.wake.set()
        elif n >= self.spill_at:
            _yield()  # a burst: let the drain thread spill rather than drop (see _yield)

    def queue(self, event: Tuple[Any, ...]) -> bool:
        """Queue an event built by the caller, sequence number included: ``(seq, t_ns, kind,
        *args)`` for ``builders[kind]``. The caller appends to ``events`` itself while its
        length is in a calm range (nothing to wake, spill or drop) and calls this otherwise.
        False when a full buffer refused it."""
        buf = self.events
        n = len(buf)
        if n >= self.max_events:
            self.dropped += 1
            return False
        buf.append(event)
        if n == 0 or n + 1 == self.batch_events or n + 1 == self.spill_at:
            self.wake.set()
        elif n >= self.spill_at:
            _yield()
        return True

    # -- the drain thread --------------------------------------------------------------

    def append_report(self, kind: str, data: Dict[str, Any]) -> None:
        """Queue one of our own events outside the bound (a ``drops`` report: one per pump
        at most, and only when something can carry it)."""
        self.events.append((next(self.seq), time.time_ns(), kind, data))

    def pressed(self) -> bool:
        """Past the spill mark: move events to disk rather than wait on the agent."""
        return len(self.events) >= self.spill_at

    def oldest_ns(self) -> Optional[int]:
        try:
            t: int = self.events[0][1]
        except IndexError:
            return None
        return t

    def take(self, limit: int) -> List[_wire.Event]:
        """Up to ``limit`` events off the buffer, built (one that fails to build is dropped
        and counted: its sequence number shows the gap). Only the drain thread pops."""
        buf = self.events
        k = min(limit, len(buf))
        note = before_take
        if note is not None and k:
            note(buf, k)  # they are still queued: only this thread pops
        pop = buf.popleft
        events = [pop() for _ in range(k)]
        held = self.held
        for i, ev in enumerate(events):
            if len(ev) != 4:
                events[i] = built(ev, held)  # type: ignore[assignment]
        if None in events:
            self.dropped += events.count(None)  # type: ignore[arg-type]
            events = [ev for ev in events if ev is not None]
        return events  # type: ignore[return-value]
