"""``launch`` holds its embedded agent back while CMD starts.

The agent side costs launch's process about 0.2 s of CPU (its imports, then its event loop),
which a busy host pays out of CMD's cold start. Nothing in a cold start needs the agent live:
the hooks time every stage themselves and send it all later. So launch waits, on its main
thread and with stdlib calls only, until one of these (``Held.why``):

- ``doorbell``: a hooked process of CMD rang the agent's doorbell (``hooks._wire.URGENT_FRAME``
  on a fresh connection): its hooks saw readiness, or it reports an OOM;
- ``engine``: a hooked process of CMD imported a serving engine's package
  (``hooks._contract.ENGINE_PACKAGES``; its doorbell is ``hooks._wire.ENGINE_FRAME``): an engine's
  memory errors come while it starts, so the agent starts then (at low priority: CMD still starts)
  and loads its OOM rules;
- ``listening``: a CMD that runs no hooked Python listens (the kernel's socket tables, as the
  agent's own watch reads them: the time is noted here, where it happens);
- ``stderr``: CMD's stderr shows a memory error (the relay opened a capture);
- ``workers``: a second hooked process spools: CMD is a supervisor with workers (uvicorn or
  gunicorn workers, Ray, a multiprocessing pool), whose reports to each other go through the
  agent (a worker's root must reach it before its supervisor's ends), so it runs from then on
  as without a hold, at low priority;
- ``spooling``: the spools hold more than ``MAX_SPOOLED_BYTES`` (a process that logs in bulk
  while it starts), at low priority too;
- ``request``: a client asks the agent something (``status``: a CMD that queries its agent);
- ``exited``: CMD exited;
- ``deadline``: ``hold_s`` after CMD's spawn (a cold start that long pays the agent's start
  as 1-2% at most; a job that never serves gets its agent then).

Meanwhile the hooks of CMD's processes see the mark ``HELD_MARK`` beside launch's socket and
do not connect: they spool, as when an agent is away (never blocking the process; a process
that exits spools what it holds at once), ring the doorbell at readiness and at an OOM, and
connect once the mark is gone; the agent replays their spools in order. The doorbells are
accepted here and peeked (never read); a producer's connection (a hook that does not know the
mark) is handed to the agent when it starts, and any other request starts it at once.
"""

from __future__ import annotations

import _socket  # not ``socket`` (5 ms) nor ``dataclasses`` (11 ms): this runs while CMD starts
import os
import select
import time
from typing import Any

from infersight.agent.commands.launch_base import AGENT_HOLD_S, Child
from infersight.hooks import _paths, _wire

HELD_MARK = _wire.AGENT_HELD_MARK  # in launch's private directory while the agent is held back
POLL_S = 0.1  # the stderr relay's captures are looked at this often
LISTEN_POLL_S = 0.05  # ... and the socket tables, while no hooked process has connected
LISTEN_FROM_S = 0.2  # from this long after the spawn (as the agent's own watch did): a hooked
# CMD has spooled by then, and launch need not load the watch at all
MAX_HELD = 4096  # connections accepted while held (one or two per process of CMD)
# A process that logs in bulk while it starts: past this much spooled, the agent takes it live
# (a spool is written and replayed several times slower than the agent reads a socket).
MAX_SPOOLED_BYTES = 4 << 20


class Held:
    """What the hold saw: why it ended, and what the agent takes over."""

    __slots__ = ("connections", "hooked", "listening", "listening_ns", "why")

    def __init__(self) -> None:
        self.why = "deadline"
        self.connections: list[Any] = []  # _socket.socket: accepted here, for the agent
        self.hooked = False  # a hooked process of CMD spooled or connected
        self.listening: tuple[str, Any] | None = None  # an unhooked CMD's first listening socket
        self.listening_ns = 0


def mark_path(private_dir: str) -> str:
    return os.path.join(private_dir, HELD_MARK)


HELLO = b'{"t":"hello"'  # how a producer's first frame begins, after its length
PEEK = 4 + 16  # bytes peeked: a frame's length and the start of its payload


def _first_frame(conn: Any) -> bytes | None:
    """The first bytes a connection sent (peeked: the agent reads them later); None while
    none came. A closed connection with nothing sent gives b""."""
    try:
        return bytes(conn.recv(PEEK, _socket.MSG_PEEK))
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def what_it_wants(first: bytes) -> str | None:
    """``doorbell``, ``engine`` (the doorbell of an engine's import), ``hello`` (a producer: it can
    wait), ``request`` (``status``, a joined launch's ``subscribe``...: someone wants the agent now),
    ``closed``; None: too few bytes yet."""
    if not first:
        return "closed"
    if first.startswith(_wire.URGENT_FRAME):
        return "doorbell"
    if first.startswith(_wire.ENGINE_FRAME[:PEEK]):
        return "engine"
    if first[4:].startswith(HELLO):
        return "hello"
    if len(first) < PEEK and (_wire.URGENT_FRAME.startswith(first) or _wire.ENGINE_FRAME.startswith(first)
                              or HELLO.startswith(first[4:])):
        return None
    return "request"


def _set_mark(private_dir: str) -> bool:
    try:
        with open(mark_path(private_dir), "w", encoding="ascii") as f:
            f.write(str(os.getpid()))
    except OSError:
        return False  # no hold then: the hooks would connect and wait for a welcome
    return True


def clear_mark(private_dir: str) -> None:
    try:
        os.unlink(mark_path(private_dir))
    except OSError:
        pass


def hold(child: Child, listen_fd: int, spawn_ns: int, private_dir: str, hold_s: float = AGENT_HOLD_S) -> Held:
    """Wait as the module says; the caller starts the agent after, with ``Held.connections``."""
    held = Held()
    pidfd_open = getattr(os, "pidfd_open", None)
    try:
        pidfd = pidfd_open(child.pid) if pidfd_open is not None else -1
    except OSError:
        pidfd = -1
    if pidfd < 0:  # an old kernel: no hold (the agent's path as before)
        clear_mark(private_dir)  # launch put it down before CMD's spawn
        held.why = "no pidfd"
        return held
    if not _set_mark(private_dir):
        os.close(pidfd)
        clear_mark(private_dir)
        held.why = "no mark"
        return held
    listener = _socket.socket(fileno=os.dup(listen_fd))
    listener.setblocking(False)
    unseen: list[Any] = []  # accepted, nothing sent yet
    partial: list[Any] = []  # accepted, too few bytes sent to tell what it wants
    spool = os.path.join(private_dir, "spool")
    watch = None
    pid = child.pid
    deadline = spawn_ns / 1e9 + hold_s
    try:
        while True:
            now = time.time()
            if now >= deadline:
                held.why = "deadline"
                return held
            relay = child.relay
            if relay is not None and relay.memory_error_seen:
                held.why = "stderr"
                return held
            wait = min(deadline - now, LISTEN_POLL_S if not held.hooked or partial else POLL_S)
            readable, _, _ = select.select([pidfd, listener, *unseen], [], [], wait)
            if pidfd in readable:
                child.exit_ns = time.time_ns()
                held.why = "exited"
                return held
            # Job control (a terminal): CMD stopped by Ctrl-Z or a background read of the terminal
            # stops launch too within a turn, as after the hold (the shell must see its job stop),
            # not at the hold's end; the pidfd says nothing of a stop.
            if child.tty is not None and child.poll() is not None:
                held.why = "exited"
                return held
            if listener in readable:
                _accept_all(listener, unseen, held)
            # A connection that sent a few bytes, too few to tell, leaves the select (it would
            # stay readable: a spin) and is peeked again at each turn.
            for conn in [c for c in unseen if c in readable] + partial:
                first = _first_frame(conn)
                wants = None if first is None else what_it_wants(first)
                if wants is None:
                    if first and conn in unseen:
                        unseen.remove(conn)
                        partial.append(conn)
                    continue
                (unseen if conn in unseen else partial).remove(conn)
                if wants == "closed":
                    conn.close()
                elif wants in ("doorbell", "engine"):
                    conn.close()  # the doorbell did its work: the agent starts now
                    held.why = wants
                    return held
                else:
                    held.connections.append(conn)  # for the agent, unread
                    if wants == "request":
                        held.why = "request"
                        return held
                    held.hooked = True
            producers, spooled = _spools(spool)  # a hooked process spools while the mark is there
            held.hooked = held.hooked or producers > 0
            if producers > 1:
                held.why = "workers"
                return held
            if spooled > MAX_SPOOLED_BYTES:
                held.why = "spooling"
                return held
            if not held.hooked and now - spawn_ns / 1e9 >= LISTEN_FROM_S:
                if watch is None:
                    from infersight.hooks._listening import ListenWatch, tree

                    watch = ListenWatch(lambda: list(tree(pid)))
                found = watch.poll()
                if found is not None:
                    held.listening, held.listening_ns = found, time.time_ns()
                    held.why = "listening"
                    return held
    finally:
        held.connections.extend(unseen + partial)
        listener.close()
        os.close(pidfd)
        clear_mark(private_dir)


def _spools(path: str) -> tuple[int, int]:
    """Spool files in ``path`` (one per hooked process that spooled; not the supervisors'
    ``children-N`` directories beside them) and their bytes."""
    n = size = 0
    try:
        names = [name for name in os.listdir(path) if name.endswith(_paths.SPOOL_SUFFIX)]
    except OSError:
        return 0, 0
    for name in names:
        n += 1
        try:
            size += os.stat(os.path.join(path, name)).st_size
        except OSError:
            pass
    return n, size


def _accept_all(listener: Any, into: list[Any], held: Held) -> None:
    while len(into) + len(held.connections) < MAX_HELD:
        try:
            fd, _addr = listener._accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return  # out of descriptors: the rest wait in the backlog for the agent
        conn = _socket.socket(fileno=fd)
        conn.setblocking(False)
        into.append(conn)
