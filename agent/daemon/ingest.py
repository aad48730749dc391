"""The agent's intake from the hooks: one facade over the parts that each do one job.

- :mod:`ingest_server`: the listening socket and the loop that accepts connections;
- :mod:`connections`: a connection from its first frame to its close (allow list, caps,
  status, subscriptions, a producer's batches and acks), read through :mod:`framing`;
- :mod:`liveness`: which producers are connected, and whether a departed one's process ended;
- :mod:`replay`: the spool files of producers that died before they could send them;
- :mod:`receive`: what all of them share: the hello check, the batch path to the exporters.

I/O shell around the pure :mod:`assemble` core. Who a producer is comes from the kernel
(:mod:`identity`): SO_PEERCRED for a connection, the owner for a spool file; a hello the
kernel contradicts is refused. The frames themselves are :mod:`infersight.hooks._wire`'s.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from infersight.agent.daemon.assemble import Assembler, Producer, ProducerTableFull
from infersight.agent.daemon.broadcast import Broadcaster
from infersight.agent.daemon.connections import STATUS_RESERVE, Connections, Subscribe
from infersight.agent.daemon.framing import GATE_S, ReadGate
from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.identity import Peer
from infersight.agent.daemon.ingest_server import Listener, fd_limit
from infersight.agent.daemon.liveness import Liveness
from infersight.agent.daemon.receive import Receiver
from infersight.agent.daemon.replay import SpoolReplay
from infersight.hooks import _paths

FD_HEADROOM = 64  # descriptors kept free for the spool, exporters and status probes


class Ingest:
    def __init__(
        self,
        assembler: Assembler,
        broadcaster: Broadcaster,
        counters: Counters,
        allowed_uids: set[int],
        allowed_gids: set[int],
        health: Callable[[], dict[str, Any]],
        frame_timeout_s: float = 10.0,
        max_connections: int = 1024,
        idle_timeout_s: float | None = 300.0,
        gate_s: float = GATE_S,
    ) -> None:
        self.receiver = Receiver(assembler, broadcaster, counters, allowed_uids, allowed_gids)
        self.liveness = Liveness(self.publish_lost, assembler.awaits_end)
        self.spools = SpoolReplay(self.receiver, self._file_ended)
        # Never more producers than the descriptor limit leaves room for.
        cap = max(1, min(max_connections, fd_limit() - FD_HEADROOM - STATUS_RESERVE))
        self.connections = Connections(self.receiver, self.liveness, health, cap, frame_timeout_s,
                                       idle_timeout_s, gate_s)
        self.listener = Listener(self.connections.handle, counters, self.receiver.rlog,
                                 lambda: self.connections.open)
        self.spool_dir: str | None = None  # the hooks' spool directory (agent.spool_dir)
        # The producer table keeps connected producers when it must evict (assemble.py).
        assembler.live = self.connected

    # -- what the rest of the agent reads and sets ---------------------------------------

    @property
    def assembler(self) -> Assembler:
        return self.receiver.assembler

    @property
    def broadcaster(self) -> Broadcaster:
        return self.receiver.broadcaster

    @property
    def counters(self) -> Counters:
        return self.receiver.counters

    @property
    def health(self) -> Callable[[], dict[str, Any]]:
        return self.connections.health

    @property
    def gate(self) -> ReadGate:
        return self.connections.gate

    @property
    def allowed_uids(self) -> set[int]:
        return self.receiver.allowed_uids

    @allowed_uids.setter
    def allowed_uids(self, uids: set[int]) -> None:
        self.receiver.allowed_uids = uids

    @property
    def allowed_gids(self) -> set[int]:
        return self.receiver.allowed_gids

    @allowed_gids.setter
    def allowed_gids(self, gids: set[int]) -> None:
        self.receiver.allowed_gids = gids

    @property
    def frame_timeout_s(self) -> float:
        return self.connections.frame_timeout_s

    @frame_timeout_s.setter
    def frame_timeout_s(self, seconds: float) -> None:
        self.connections.frame_timeout_s = seconds

    @property
    def subscribe(self) -> Subscribe | None:
        """A joined launch's subscription (``sessions.Sessions.serve``)."""
        return self.connections.subscribe

    @subscribe.setter
    def subscribe(self, serve: Subscribe | None) -> None:
        self.connections.subscribe = serve

    @property
    def open_connections(self) -> int:
        return self.connections.open

    def allowed(self, uid: int, gid: int) -> bool:
        return self.receiver.allowed(uid, gid)

    def connected(self, producer_id: str) -> bool:
        """The producer has a connection open now."""
        return self.liveness.connected(producer_id)

    def connected_producers(self) -> int:
        """How many producers have a connection open now (the producer table also keeps those that left)."""
        return self.liveness.connected_count()

    # -- start and stop ------------------------------------------------------------------

    async def start(self, path: str, mode: int, sock: socket.socket | None = None) -> None:
        await self.listener.start(path, mode, sock)

    @property
    def socket_group(self) -> int | None:
        """The group a root agent gave its socket (its directory's), None when it gave none."""
        return self.listener.socket_group

    def adopt(self, conns: Sequence[Any]) -> None:
        self.listener.adopt(conns)

    async def stop_accepting(self) -> None:
        self.listener.stop()

    def close_connections(self) -> None:
        self.liveness.cancel()  # first: the connections it closes are the shutdown's, not their producers' ends
        self.connections.cancel()

    async def wait_connections_closed(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.open_connections and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        self.sweep_lost()  # close the cold starts of producers that died just before
        self.release()
        return self.open_connections == 0

    def release(self) -> None:
        """Close the descriptors that watch departed producers (at shutdown)."""
        self.liveness.release()

    # -- producers -----------------------------------------------------------------------

    def hello(self, msg: dict[str, Any], peer: Peer | None = None) -> Producer | None:
        """The producer of a hello (``peer`` None: in-process, trusted); None when refused, or
        turned away for now (its uid holds its share of the producer table)."""
        try:
            return self.receiver.hello(msg, None, peer)
        except ProducerTableFull:
            return None

    def process_batch(
        self,
        producer: Producer,
        events: Any,
        acks: deque[list[int]] | None = None,
        send_acks: Callable[[], None] | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self.receiver.process_batch(producer, events, acks, send_acks, on_done)

    def replay_spools(self, directory: str, prefix: str = "") -> int:
        """Replay spool files whose producer has died (its lock is free); returns files done."""
        return self.spools.replay(directory, prefix)

    async def replay_spools_async(self, directory: str) -> int:
        """:meth:`replay_spools` for the whole directory, giving the event loop back as it goes."""
        return await self.spools.replay_async(directory)

    def sweep_lost(self) -> int:
        """Producers found dead: close their open cold start and free their state."""
        return self.liveness.sweep()

    def publish_lost(self, producer: Producer) -> None:
        """Its process has ended. What it spooled (its root, often: written at exit when the
        agent was busy) is read first, so that the agent closes its root only if it really
        never came."""
        if self.spool_dir and not producer.gone:
            prefix = _paths.spool_prefix(str(producer.info.get("id", producer.id)))  # the id it said, not its key
            self.spools.replay(self.spool_dir, prefix, producer.uid)
            if self.spools.reading(prefix):
                self.spools.wait_for(prefix, producer.id)
                return  # the scan is reading its file (a piece at a time): the file's end closes it, if need be
        self.receiver.close_lost(producer)

    def _file_ended(self, producer: Producer) -> None:
        """A replayed file's lock was free: its process has ended, unless it is connected again."""
        if not self.liveness.connected(producer.id):
            self.receiver.close_lost(producer)
