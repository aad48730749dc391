"""Which producers are alive: their open connections, and the processes of those that left.

A producer's connection closing does not mean its process ended (the hooks reconnect after
an agent restart, a full outbox, an idle timeout). When the last connection of a producer
whose cold start is still open closes, its process is watched: through a pidfd (which works
even where ``/proc`` hides other users' processes), else by polling ``/proc/<pid>/stat``'s
start time (which also tells a reused pid). Once the process has ended, ``lost(producer)``
runs (the ingest closes that cold start for it), unless it connected again meanwhile.

A producer whose pid the agent cannot see (``SO_PEERCRED`` gives pid 0: a model server in
another pid namespace, the sidecar case) has no process to watch. There the end of its last
connection is the evidence: a live hook reconnects after any hang-up (an agent-side close, an
idle timeout) within its backoff, so one that has not connected again within
``PIDLESS_GRACE_S`` is taken as ended (``lost``, counted in ``Counters.producers_lost_unseen``);
one that reconnects in time is not.

The watch tables are bounded (``MAX_WATCHED`` each: a pidfd is a descriptor). A watch pushed out
(one uid's departed producers push out their own first) is not forgotten, which held the
producer's cold-start state and its place in the producer table for good: its process is
checked at once (ended: ``lost`` now), else it joins the overflow poll, checked every second
without a descriptor (``MAX_POLLED``, a quarter of it per uid: the producer table's figures).
"""

from __future__ import annotations

import asyncio
import os
import select
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from infersight.agent.daemon.assemble import MAX_PRODUCERS, MAX_PRODUCERS_PER_UID, Producer
from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.identity import process_start

LOST_CHECK_S = (0.05, 0.2, 0.5, 1.0)  # a producer that hung up: is its process gone? then every second
HAVE_PROC = os.path.isdir("/proc/self")
MAX_WATCHED = 256  # departed producers whose process is watched (one descriptor each)
# Watches pushed out of those, polled without a descriptor: no more than the producer table holds
# (one uid's share included), so only producers already evicted from it can overflow this too.
MAX_POLLED = MAX_PRODUCERS
MAX_POLLED_PER_UID = MAX_PRODUCERS_PER_UID
POLL_PER_SWEEP = 256
# A producer whose pid the agent cannot see, gone from its last connection this long without
# connecting again, has ended. A live hook comes back well before: an idle hook notices a close
# by the agent at its next wake-up, at most hooks/_client.py's IDLE_LONG_S (5 s) later, then
# reconnects after a jittered backoff of at most hooks/_connection.py's RECONNECT_MAX_S (5 s)
# x 1.5, woken for that try (Client._idle_wait): 12.5 s at worst; 30 s is more than twice that
# (checked against the hooks' constants in tests/integration/test_pidns_producer_lost.py).
PIDLESS_GRACE_S = 30.0


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def process_ended(pid: int, start: str | None) -> bool:
    """Whether process ``pid`` (started at ``start``, when known) has ended: its /proc start time
    (which tells a reused pid), else a pidfd opened and closed at once (where /proc hides it)."""
    if start is not None and HAVE_PROC:
        return process_start(pid) != start
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (OSError, AttributeError):  # cannot tell: it may live
        return False
    try:
        return _readable(fd)  # a zombie
    finally:
        os.close(fd)


def fairest_victim(entries: Mapping[str, Sequence[Any]]) -> str:
    """The entry to let go when a watch table is full: the oldest of the uid holding the most, so that
    one user's many departed producers push out their own, never another user's watch (whose process
    would then end with its cold start left open, or be taken as ended while it lives)."""
    by_uid: dict[int | None, list[str]] = {}
    for producer_id, entry in entries.items():  # oldest first
        by_uid.setdefault(entry[0].uid, []).append(producer_id)
    return max(by_uid.values(), key=len)[0]


class Liveness:
    def __init__(self, lost: Callable[[Producer], None], awaits_end: Callable[[Producer], bool]) -> None:
        self.lost = lost
        self.awaits_end = awaits_end  # whether the producer's end closes something (its cold start)
        self._live: dict[str, int] = {}  # producer id -> open connections
        # Producers that hung up with a cold start still open: (producer, pid, start time).
        self._watch: dict[str, tuple[Producer, int, str]] = {}
        self._pidfds: dict[str, tuple[Producer, int, int, str | None]] = {}  # (producer, fd, pid, start)
        # Watches pushed out of the tables above, polled every second: (producer, pid, start time).
        self._polled: dict[str, tuple[Producer, int, str | None]] = {}
        self.watches_polled = 0  # watches pushed out of a full table into the poll (or found ended then)
        self.watches_dropped = 0  # pushed out of the full poll too, their process alive: not watched any more
        # Producers without a visible pid that hung up with a cold start open: their grace timer.
        self._pidless: dict[str, tuple[Producer, asyncio.TimerHandle]] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self.grace_s = PIDLESS_GRACE_S
        self._stopping: set[str] | None = None  # at shutdown: the pidless producers that hung up before it
        self.counters: Counters | None = None  # the agent's (set by Connections): counts pidless ends

    def connected(self, producer_id: str) -> bool:
        """The producer has a connection open now."""
        return self._live.get(producer_id, 0) > 0

    def connected_count(self) -> int:
        return sum(1 for n in self._live.values() if n > 0)

    def joined(self, producer: Producer, pid: int) -> str | None:
        """A connection of ``producer`` was welcomed; returns its process's start time (to
        tell a reused pid later), None when unknown."""
        self._live[producer.id] = self._live.get(producer.id, 0) + 1
        self._unwatch(producer.id)  # it is back: alive
        return process_start(pid) if pid > 0 and HAVE_PROC else None

    def left(self, producer: Producer, pid: int, start: str | None) -> None:
        """A connection of ``producer`` closed. If it was its last one and its cold start is
        still open, find out whether its process has ended, now or later."""
        n = self._live.get(producer.id, 1) - 1
        if n > 0:
            self._live[producer.id] = n
            return None
        self._live.pop(producer.id, None)
        if producer.gone or not self.awaits_end(producer):
            return None
        if pid <= 0:  # no process to watch (another pid namespace): wait for it to reconnect
            if self._stopping is not None:
                return None  # the agent's own shutdown closed it: the producer lives on, to the next agent
            return self._await_reconnect(producer)
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return self.lost(producer)
        except (OSError, AttributeError):  # no pidfds here: poll /proc
            return self._watch_by_proc(producer, pid, start)
        if _readable(fd):  # it has exited (a zombie)
            os.close(fd)
            return self.lost(producer)
        self._unwatch(producer.id)
        if len(self._pidfds) >= MAX_WATCHED:
            victim, _fd, vpid, vstart = self._pidfds[fairest_victim(self._pidfds)]
            self._unwatch(victim.id)
            self._poll(victim, vpid, vstart)
        self._pidfds[producer.id] = (producer, fd, pid, start)
        asyncio.get_running_loop().add_reader(fd, self._process_ended, producer.id)
        return None

    def sweep(self) -> int:
        """Producers found dead: ``lost`` for each; returns how many."""
        done = 0
        for producer_id, (_producer, fd, _pid, _start) in list(self._pidfds.items()):
            if _readable(fd):
                self._process_ended(producer_id)
                done += 1
        # The overflow poll, POLL_PER_SWEEP entries a sweep in turn (4096 /proc reads at once took 83 ms
        # of the loop every second): a producer there is found ended within 16 s at most.
        for producer_id in list(self._polled)[:POLL_PER_SWEEP]:
            producer, pid, polled_start = self._polled.pop(producer_id)
            if producer.id in self._live or producer.gone or not self.awaits_end(producer):
                continue  # it reconnected, or nothing waits for its end any more
            if process_ended(pid, polled_start):
                self.lost(producer)
                done += 1
            else:
                self._polled[producer_id] = (producer, pid, polled_start)  # to the back of the turn
        for producer_id, (producer, pid, start) in list(self._watch.items()):
            if producer.id in self._live:  # it reconnected
                del self._watch[producer_id]
                continue
            if process_start(pid) == start:
                continue
            del self._watch[producer_id]
            self.lost(producer)
            done += 1
        return done

    def release(self) -> None:
        """Close the descriptors that watch departed producers (at shutdown). A producer without a visible pid
        that hung up before the shutdown began and has not come back is taken as ended now: its grace would
        outlast the agent, and its cold start with it (a pod's native sidecar is stopped right after the main
        containers exit, in another pid namespace: a model server killed mid-load left no root). One the
        shutdown itself disconnected lives on and reconnects to the next agent."""
        for producer_id in [p for p in self._pidless if self._stopping is None or p in self._stopping]:
            self._pidless[producer_id][1].cancel()
            self._grace_over(producer_id)
        for producer_id in [*self._pidfds, *self._pidless]:
            self._unwatch(producer_id)

    def cancel(self) -> None:
        """The shutdown begins (before the agent closes its connections)."""
        self._stopping = set(self._pidless)
        if self._watch_task is not None:
            self._watch_task.cancel()

    def _process_ended(self, producer_id: str) -> None:
        entry = self._pidfds.get(producer_id)
        self._unwatch(producer_id)
        if entry is not None and producer_id not in self._live:
            self.lost(entry[0])

    def _await_reconnect(self, producer: Producer) -> None:
        self._unwatch(producer.id)
        if len(self._pidless) >= MAX_WATCHED:
            # the longest waiting ends now rather than never (an unwatched one would hold its cold
            # start, and its place in the producer table, for good)
            oldest = fairest_victim(self._pidless)
            self._pidless[oldest][1].cancel()
            self._grace_over(oldest)
        handle = asyncio.get_running_loop().call_later(self.grace_s, self._grace_over, producer.id)
        self._pidless[producer.id] = (producer, handle)

    def _grace_over(self, producer_id: str) -> None:
        """A producer without a visible pid did not connect again within the grace: it ended."""
        entry = self._pidless.pop(producer_id, None)
        if entry is None or producer_id in self._live:
            return
        producer = entry[0]
        if producer.gone or not self.awaits_end(producer):
            return  # closed meanwhile (its spool file replayed, its own root arrived)
        if self.counters is not None:
            self.counters.producers_lost_unseen += 1
        self.lost(producer)

    def _unwatch(self, producer_id: str) -> None:
        self._watch.pop(producer_id, None)
        self._polled.pop(producer_id, None)
        timer = self._pidless.pop(producer_id, None)
        if timer is not None:
            timer[1].cancel()
        entry = self._pidfds.pop(producer_id, None)
        if entry is not None:
            try:
                asyncio.get_running_loop().remove_reader(entry[1])
            except RuntimeError:  # no loop any more
                pass
            os.close(entry[1])

    def _watch_by_proc(self, producer: Producer, pid: int, start: str | None) -> None:
        if not HAVE_PROC or start is None:
            return
        if len(self._watch) >= MAX_WATCHED:
            victim, vpid, vstart = self._watch.pop(fairest_victim(self._watch))
            self._poll(victim, vpid, vstart)
        self._watch[producer.id] = (producer, pid, start)
        self._start_sweeps()

    def _poll(self, producer: Producer, pid: int, start: str | None) -> None:
        """A watch pushed out of a full table: ``lost`` now if its process has ended, else polled.
        A uid past its share of the poll (or the poll full) lets go of its own oldest the same way."""
        self.watches_polled += 1
        if self.counters is not None:
            self.counters.watches_polled += 1
        if process_ended(pid, start):
            return self.lost(producer)
        mine = [k for k, entry in self._polled.items() if entry[0].uid == producer.uid]
        if len(mine) >= MAX_POLLED_PER_UID or len(self._polled) >= MAX_POLLED:
            victim, vpid, vstart = self._polled.pop(mine[0] if len(mine) >= MAX_POLLED_PER_UID
                                                    else fairest_victim(self._polled))
            if process_ended(vpid, vstart):
                self.lost(victim)
            else:
                self.watches_dropped += 1  # only producers already evicted from the table get here
                if self.counters is not None:
                    self.counters.watches_dropped += 1
        self._polled[producer.id] = (producer, pid, start)
        self._start_sweeps()
        return None

    def _start_sweeps(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_lost(), name="ingest-lost")

    async def _watch_lost(self) -> None:
        """A process's socket closes while it exits: look again shortly after, then every second."""
        for delay in (*LOST_CHECK_S, *([1.0] * 1000000)):
            await asyncio.sleep(delay)
            self.sweep()
            if not self._watch and not self._polled:
                return
