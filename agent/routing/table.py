"""Which instance serves which port, in what state, and the reply for each port.

The table watches the items the agent publishes: a producer's first cold-start stage span
makes it a *warming* instance; its ``coldstart.ready_wait`` span makes it *ready*, and the
span's ``server.port`` (the port its first ``listen()`` bound) says which port it serves.
An instance whose process has ended leaves its port *vacated*: the next instance of the same
service that starts warming is taken to be its restart on that port (drained until ready),
so a restarted server is kept out of rotation even while a TCP health check passes.

:meth:`RoutingTable.refresh` recomputes every port's reply from the instances' latency
(the requests feature's windows) and the slow devices (the devices feature's verdicts on the
instance's own uid's requests: another user's requests cannot make your device slow), both
handed in as functions; :meth:`reply` is then a dictionary lookup, so answering HAProxy
never waits on anything.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from infersight.agent.daemon.identity import process_start
from infersight.agent.routing import hints
from infersight.hooks import _contract
from infersight.hooks._listening import listener_uids, listeners_by_port
from infersight.instances import InstanceLatency
from infersight.telemetry import Item, Resource, RoutingHint, SpanItem

READY_STAGE = "coldstart." + _contract.READY_WAIT
MAX_INSTANCES = 1024
MAX_INSTANCES_PER_UID = MAX_INSTANCES // 4  # one user's many processes never crowd another's out
MAX_VACATED = 256
MAX_VACATED_PER_UID = MAX_VACATED // 4  # one user's churn pushes out only its own vacated ports
VACATED_TTL_S = 600.0  # a vacated port waits this long at most for its service to restart
QUIET_TTL_S = 900.0  # an instance whose process cannot be checked is forgotten after this long unseen
LATENCY_EVERY_S = 1.0  # the latency windows are read this often (the decisions, every refresh)
MAX_CANDIDATES = 8  # instances remembered per contested port
MAX_CANDIDATES_PER_UID = 2  # of them live per uid: another user's processes never crowd out your restart
OWNERS_EVERY_S = 10.0  # held and contested ports' listeners are checked this often (a table read per netns)

LatencySource = Callable[[], Sequence[InstanceLatency]]
SlowDevices = Callable[[int | None], Mapping[str, float]]  # a uid's own slow devices -> coefficient
Alive = Callable[[int, str | None], bool]
VisiblePid = Callable[[str], int | None]  # producer -> its PID in this agent's /proc, None when none


def host_listeners() -> dict[int, set[int]] | None:
    """Every listening TCP port of this agent's network namespace -> the uids listening on it (its own
    ``/proc/<pid>/net/tcp{,6}``: readable under any ProtectProc); None when unreadable."""
    return listeners_by_port(os.getpid())


def _alive(pid: int, start: str | None) -> bool:
    """Unknown (no pid, or a process this agent cannot see: another pid namespace) counts as alive."""
    return pid <= 0 or start is None or process_start(pid) == start


_V = TypeVar("_V")


def _make_room(table: dict[int, _V], uid: int | None, uid_of: Callable[[_V], int | None]) -> bool:
    """Room in a port table (oldest first) for one more entry of ``uid``: a uid keeps at most MAX_VACATED_PER_UID
    entries (past it, its own oldest goes: another user's churn never pushes yours out); the table full (more uids
    than shares), the oldest of the uid holding the most goes. Whether one went."""
    of_uid = Counter(uid_of(v) for v in table.values())
    if of_uid[uid] >= MAX_VACATED_PER_UID:
        victim = uid
    elif len(table) >= MAX_VACATED:
        victim = max(of_uid, key=lambda u: of_uid[u])
    else:
        return False
    del table[next(p for p, v in table.items() if uid_of(v) == victim)]
    return True


@dataclass
class Instance:
    producer: str
    service: str
    pid: int
    start: str | None  # /proc start time, to tell its pid reused
    resource: Resource
    uid: int | None = None  # the kernel's (process.user.id); None for an in-process producer
    ready_at_s: float | None = None  # Unix seconds of readiness
    port: int | None = None
    seen_s: float = 0.0  # its last stage span or request in the window
    settled: bool = False
    percent: int = hints.MAX_WEIGHT
    reply: str = hints.WARMING_REPLY
    sent: tuple[Any, ...] | None = None  # what the last RoutingHint said


class RoutingTable:
    def __init__(
        self,
        latency: LatencySource,
        slow_devices: SlowDevices,
        max_concurrency: int | None = None,
        *,
        alive: Alive = _alive,
        clock: Callable[[], float] = time.time,
        visible_pid: VisiblePid | None = None,
    ) -> None:
        self.latency = latency
        self.slow_devices = slow_devices
        self.max_concurrency = max_concurrency
        self.alive = alive
        self.clock = clock
        # The PID this agent's /proc shows a producer's process under (None: none, another PID namespace);
        # without it (tests, launch), the resource's process.pid.
        self.visible_pid = visible_pid
        self.port_claims_refused = 0  # a readiness port whose listener is another uid's
        self.ports_contested = 0  # ports let go: listeners of two uids on the port number
        # port -> its candidates (producer, service, uid, since): instances that listen on a port two uids
        # listen on; the one whose uid is alone on it again gets it back
        self.contested: dict[int, list[tuple[str, str, int | None, float]]] = {}
        self._owners_at = -1e18
        self.instances_refused = 0  # new instances past MAX_INSTANCES (or their uid's share)
        self.instances: dict[str, Instance] = {}  # producer -> instance
        self.ports: dict[int, str] = {}  # port -> producer
        self.vacated: dict[int, tuple[str, int | None, float]] = {}  # port -> (service, uid, since), oldest first
        self.vacated_dropped = 0  # vacated ports forgotten before their window ended: their uid's share was full
        self.replies: dict[int, str] = {}
        self.reply_uids: dict[int, int | None] = {}  # port -> the uid of the instance its reply is of
        # port -> (since, uid): a port this agent drained for an instance of uid, then lost track of
        self.lifted: dict[int, tuple[float, int | None]] = {}
        self._gone: list[tuple[Resource, str, int]] = []  # hints to clear
        self._latency: dict[str, InstanceLatency] = {}
        self._latency_at = -1e18

    # -- input: the agent's items ------------------------------------------------------

    def observe(self, items: Sequence[Item]) -> None:
        for it in items:
            if isinstance(it, SpanItem) and it.name.startswith("coldstart.") and it.origin is not None:
                self._stage(it)

    def _stage(self, span: SpanItem) -> None:
        if span.attributes.get(_contract.PROCESS_ROLE) == _contract.ROLE_HELPER:
            return
        producer = span.origin.producer if span.origin else ""
        inst = self.instances.get(producer)
        if inst is None:
            inst = self._new_instance(producer, span.resource)
            if inst is None:
                return
            self._take_vacated(inst)
        inst.seen_s = self.clock()
        if span.name == READY_STAGE and inst.ready_at_s is None:
            self._ready(inst, span.end_ns, span.attributes.get("server.port"))
        self._answer_now(inst)

    def readmit(self, producer: str, resource: Resource, info: Mapping[str, Any]) -> None:
        """A producer said hello, ready before (its hello's ``ready_ns`` and ``ready_port``) and unknown to this
        table: this agent restarted since its readiness, whose spans went to the one before. It is an instance
        again, ready on its port (checked as a readiness port is), so its weight, and its restart's drain, go on."""
        ready_ns = info.get("ready_ns")
        if producer in self.instances or type(ready_ns) is not int:
            return
        inst = self._new_instance(producer, resource)
        if inst is not None:
            inst.seen_s = self.clock()
            self._ready(inst, ready_ns, info.get("ready_port"))
            self._answer_now(inst)

    def _new_instance(self, producer: str, resource: Resource) -> Instance | None:
        uid_v = resource.get("process.user.id")
        uid = uid_v if type(uid_v) is int else None
        of_uid = sum(1 for i in self.instances.values() if i.uid == uid) if uid is not None else 0
        if len(self.instances) >= MAX_INSTANCES or of_uid >= MAX_INSTANCES_PER_UID:
            self.instances_refused += 1
            return None
        pid_v = resource.get("process.pid") if self.visible_pid is None else self.visible_pid(producer)
        # 0 where this agent cannot see the process (a sidecar's model server in its own PID namespace):
        # taken as alive, its port claims as said, rather than judged by whatever holds that number here
        pid = pid_v if isinstance(pid_v, int) and not isinstance(pid_v, bool) else 0
        service = str(resource.get("service.name") or "unknown_service")
        inst = self.instances[producer] = Instance(producer, service, pid, process_start(pid) if pid > 0 else None,
                                                   resource, uid)
        return inst

    def _ready(self, inst: Instance, ready_ns: int, port: Any) -> None:
        inst.ready_at_s = ready_ns / 1e9
        if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 and self._owns(inst, port):
            self._assign(inst, port)

    def _answer_now(self, inst: Instance) -> None:
        if inst.port is not None:  # answer the new state at once, not at the next refresh
            self._decide(inst, {}, {}, self.clock())
            self.replies[inst.port] = inst.reply
            self.reply_uids[inst.port] = inst.uid

    def _others_on_host(self, inst: Instance, port: int, table: dict[int, set[int]] | None) -> set[int]:
        """The uids other than ``inst``'s (and root's) listening on ``port`` in this agent's network namespace,
        where the balancer on this host connects: the kernel's word, whatever ``inst``'s own namespace shows
        (a private one made with ``unshare -n``, where it alone listens) and whether or not this agent may
        read other users' ``/proc`` (the service's ProtectProc=invisible). Root's sockets (docker-proxy, a
        socket unit) forward to someone else: never held against a claim."""
        return set() if table is None else table.get(port, set()) - {0, inst.uid}

    def _owns(self, inst: Instance, port: int) -> bool:
        """Whether ``inst`` may claim ``port``: the port a producer says it listens on is its
        word, so where the kernel shows listeners on that port in its network namespace, they
        must all be of the instance's uid: another user cannot take over, or drain, the port of
        someone else's server, not even by listening on the same port number at another address
        (``[::1]:P`` beside ``0.0.0.0:P``). Listeners of two uids on one port number: which one
        the balancer reaches cannot be told here, so neither holds it (the port's reply fails
        open), and a holder of another uid lets it go. Not checkable (an in-process producer,
        tables that cannot be read, nobody listening yet): taken as said, but never from a
        holder of another uid, nor from another uid's vacated port in its window."""
        if inst.uid is None or inst.uid == 0:
            return True
        host = host_listeners()
        others = self._others_on_host(inst, port, host)
        if others:  # another user listens on this port where the balancer connects: never this claim
            self.port_claims_refused += 1
            if host is not None and inst.uid in host.get(port, set()):  # it listens there too: a candidate
                holder = self.instances.get(self.ports.get(port, ""))
                if holder is not None and holder.uid != inst.uid:
                    self._release(port)
                self._contest(port, inst)
            return False
        if host is not None and inst.uid in host.get(port, set()):
            return True  # its uid alone (root aside) listens there, in the balancer's namespace
        # a process this agent cannot see (another PID namespace: pid 0) has no listeners to read: as said
        owners = listener_uids(inst.pid, port) if inst.pid > 0 else None
        holder = self.instances.get(self.ports.get(port, ""))
        # Listeners seen only in the instance's own network namespace (one it may have made with
        # ``unshare -Urn``) prove nothing about the port the balancer reaches: they never take a port
        # another uid vacated within its window, nor one another uid's live instance holds.
        foreign = self._vacated_by_other(inst, port) or (holder is not None and holder is not inst
                                                          and holder.uid != inst.uid)
        if owners and owners <= {inst.uid} and not foreign:
            return True
        if not owners and (holder is None or holder is inst or holder.uid == inst.uid) \
                and not self._vacated_by_other(inst, port):
            return True
        self.port_claims_refused += 1
        if owners and inst.uid in owners and not foreign:  # it listens there too: a candidate later
            if holder is not None and holder.uid != inst.uid:
                self._release(port)
            self._contest(port, inst)
        return False

    def _vacated_by_other(self, inst: Instance, port: int) -> bool:
        """``port`` was left by another uid's instance within VACATED_TTL_S: it is kept for that uid's
        restart, so naming it is not enough to take it (the port numbers show in ``status``); listening
        on it is (the kernel's word, checked before this)."""
        left = self.vacated.get(port)
        return left is not None and left[1] != inst.uid and self.clock() - left[2] <= VACATED_TTL_S

    def _vacate(self, port: int, service: str, uid: int | None, now: float) -> None:
        """``port`` waits for a restart of ``service`` of ``uid``. A uid keeps at most MAX_VACATED_PER_UID
        vacated ports: past it, its own oldest goes, so another user's churn of short-lived servers
        never pushes yours out. The table full (more uids than shares), a uid holding the most gives one."""
        self.vacated.pop(port, None)  # vacated again: the newest of its uid
        if _make_room(self.vacated, uid, lambda v: v[1]):
            self.vacated_dropped += 1
        self.vacated[port] = (service, uid, now)

    def _release(self, port: int) -> None:
        """Nobody holds ``port`` for now (contested): its hint goes, its reply fails open. Its holder
        gets it back once the port number is its uid's alone again (``_check_holders``)."""
        holder = self.instances.get(self.ports.pop(port, ""))
        if holder is not None:
            self._gone.append((holder.resource, holder.service, port))
            holder.port, holder.sent = None, None
            self._contest(port, holder)
        self._lift(port, self.replies.pop(port, None), self.reply_uids.pop(port, None))
        self.vacated.pop(port, None)
        self.ports_contested += 1

    def _contest(self, port: int, inst: Instance) -> None:
        """``inst`` listens on contested ``port``: it is a candidate to hold it again. Bounded: at most
        MAX_CANDIDATES_PER_UID live ones of a uid (a user who starts many processes on the port number
        cannot fill the list before the holder's restart comes), and past MAX_CANDIDATES one that ended
        makes room, never the first (the holder when the contest began: its service is vacated)."""
        cands = self.contested.setdefault(port, [])
        if any(c[0] == inst.producer for c in cands):
            return
        if sum(1 for c in cands if c[2] == inst.uid and c[0] in self.instances) >= MAX_CANDIDATES_PER_UID:
            return
        if len(cands) >= MAX_CANDIDATES:
            ended = next((i for i in range(1, len(cands)) if cands[i][0] not in self.instances), None)
            if ended is None:
                return
            del cands[ended]
        cands.append((inst.producer, inst.service, inst.uid, self.clock()))
        while len(self.contested) > MAX_VACATED:
            del self.contested[next(iter(self.contested))]

    def _check_holders(self, now: float) -> None:
        """Every OWNERS_EVERY_S: a port whose listeners are no longer all of its holder's uid (another
        user bound the same port number since the claim) is let go; a contested port whose listeners
        are its last holder's uid's alone again goes back to it (or, the holder gone, waits for its
        restart as a vacated port). One table read per network namespace, not per port."""
        if now - self._owners_at < OWNERS_EVERY_S:
            return
        self._owners_at = now
        tables: dict[str, dict[int, set[int]] | None] = {}

        def owners(pid: int, port: int) -> set[int] | None:
            try:
                ns = os.readlink("/proc/%d/ns/net" % pid)
            except OSError:
                return None
            if ns not in tables:
                tables[ns] = listeners_by_port(pid)
            by_port = tables[ns]
            return None if by_port is None else by_port.get(port, set())

        host = host_listeners()
        for port, producer in list(self.ports.items()):
            inst = self.instances.get(producer)
            if inst is None or inst.uid is None or inst.uid == 0:
                continue
            if self._others_on_host(inst, port, host):  # another user listens there now, where the balancer does
                self._release(port)
                continue
            if inst.pid <= 0:
                continue
            got = owners(inst.pid, port)
            if got and not got <= {inst.uid}:
                self._release(port)
        for port, cands in list(self.contested.items()):
            live = [(self.instances[c[0]], c) for c in cands if c[0] in self.instances]
            back = None
            for inst, (_p, _s, uid, _t) in live:
                if uid is None or self._others_on_host(inst, port, host):
                    continue
                got = owners(inst.pid, port) if inst.pid > 0 else None
                if (got and got <= {uid}) or (host is not None and uid in host.get(port, set())):
                    back = inst  # the port number is this candidate's uid's alone again
                    break
            if back is not None and port not in self.ports:
                del self.contested[port]
                self._assign(back, port)
            elif not live:  # every candidate ended: the last one's restart may take the port
                del self.contested[port]
                _p, service, uid, _t = cands[0]  # the holder when the contest began, if it held it
                self._vacate(port, service, uid, now)
            elif now - max(c[3] for c in cands) > VACATED_TTL_S:
                del self.contested[port]  # contested for long: forget it (bounded)

    def _take_vacated(self, inst: Instance) -> None:
        """A new instance of a service whose instance left a port: its restart, on that port
        (the same service of the same uid: another user's process of that name is not it)."""
        mine = [(since, port) for port, (service, uid, since) in self.vacated.items()
                if service == inst.service and uid == inst.uid]
        if mine:
            self._assign(inst, max(mine)[1])

    def _assign(self, inst: Instance, port: int) -> None:
        left = None  # the port ``inst`` held until now (a restart's guess: the vacated port it was given)
        if inst.port is not None and inst.port != port and self.ports.get(inst.port) == inst.producer:
            left = inst.port
            del self.ports[left]
            self._gone.append((inst.resource, inst.service, left))
            inst.sent = None
        holder = self.instances.get(self.ports.get(port, ""))
        if holder is not None and holder is not inst:
            holder.port = None  # the port moved on: that process no longer serves it
            holder.sent = None
            self._gone.append((holder.resource, holder.service, port))  # its hint goes (another service's topic)
            if left is not None and holder.ready_at_s is None and (holder.service, holder.uid) == (
                    inst.service, inst.uid):
                # Two restarts of one service took each other's vacated port: the one still warming gets the
                # port the other guessed (the other one's, so its drain stays where it serves).
                self.ports[left] = holder.producer
                holder.port = left
        self.ports[port] = inst.producer
        self.vacated.pop(port, None)
        self.contested.pop(port, None)  # held again: its old candidates must not re-vacate it for another uid later
        inst.port = port

    # -- the periodic decision ---------------------------------------------------------

    def refresh(self) -> list[RoutingHint]:
        """Drop ended instances, recompute every reply; the hints that changed."""
        now = self.clock()
        if now - self._latency_at >= LATENCY_EVERY_S:
            self._latency = {lat.producer: lat for lat in self.latency()}
            self._latency_at = now
        by_producer = self._latency
        for producer, inst in list(self.instances.items()):
            if producer in by_producer:
                inst.seen_s = now
            unseen = inst.start is None and now - inst.seen_s > QUIET_TTL_S  # cannot tell it lives: forget it
            if not self.alive(inst.pid, inst.start) or unseen:
                del self.instances[producer]
                if inst.port is not None and self.ports.get(inst.port) == producer:
                    del self.ports[inst.port]
                    self._vacate(inst.port, inst.service, inst.uid, now)
                    self._gone.append((inst.resource, inst.service, inst.port))
        for port, (service, uid, since) in list(self.vacated.items()):
            if now - since > VACATED_TTL_S:
                del self.vacated[port]
                continue
            # Its restart may have started warming before this refresh saw the old process end.
            waiting = [i for i in self.instances.values()
                       if i.service == service and i.uid == uid and i.port is None and i.ready_at_s is None]
            if waiting:
                self._assign(waiting[-1], port)
        self._check_holders(now)
        slow: dict[int | None, Mapping[str, float]] = {}  # per uid: its own requests' verdicts weigh its instances
        for inst in self.instances.values():
            if inst.uid not in slow:
                slow[inst.uid] = self.slow_devices(inst.uid)
            self._decide(inst, by_producer, slow[inst.uid], now)
        replies = {port: self.instances[p].reply for port, p in self.ports.items() if p in self.instances}
        for port, was in self.replies.items():
            if port not in replies:
                self._lift(port, was, self.reply_uids.get(port))
        self.replies = replies
        self.reply_uids = {port: self.instances[self.ports[port]].uid for port in replies}
        for port in [p for p, (since, _u) in self.lifted.items() if now - since > hints.LIFT_S or p in replies]:
            del self.lifted[port]
        return self._hints(now)

    def _lift(self, port: int, was: str | None, uid: int | None) -> None:
        """``port`` is no longer answered for: if its last reply drained it, say ``ready`` for a while (only this
        agent's ``drain`` is lifted so; a port it never drained gets ``up 100%``, which leaves an operator's
        ``maint`` or ``drain`` alone). Bounded as the vacated ports are: a uid keeps at most MAX_VACATED_PER_UID
        (past it, its own oldest goes: another user's churn never pushes yours out), the table MAX_VACATED."""
        if was != hints.WARMING_REPLY:
            return
        self.lifted.pop(port, None)
        _make_room(self.lifted, uid, lambda v: v[1])
        self.lifted[port] = (self.clock(), uid)

    def _peer_p50s(self, inst: Instance, by_producer: Mapping[str, InstanceLatency]) -> list[float]:
        out = []
        for other in self.instances.values():
            lat = by_producer.get(other.producer)
            if (other is not inst and other.service == inst.service and other.uid == inst.uid
                    and other.ready_at_s is not None
                    and lat is not None and lat.count >= hints.MIN_REQUESTS):
                out.append(lat.p50_s)
        return out

    def _decide(self, inst: Instance, by_producer: Mapping[str, InstanceLatency], slow: Mapping[str, float],
                now: float) -> None:
        if inst.ready_at_s is None:
            inst.reply, inst.percent, inst.settled = hints.WARMING_REPLY, 0, False
            return
        lat = by_producer.get(inst.producer)
        peers = self._peer_p50s(inst, by_producer)
        own = lat.p50_s if lat is not None and lat.count >= hints.MIN_REQUESTS else None
        coefficients = [slow[d] for d in (lat.devices if lat is not None else ()) if d in slow]
        failed = lat.failed_share() if lat is not None and lat.count + lat.failed >= hints.MIN_REQUESTS else 0.0
        full = hints.full_weight(own, peers, max(coefficients) if coefficients else None, failed)
        since = max(0.0, now - inst.ready_at_s)
        inst.settled = inst.settled or hints.has_settled(lat.recent_p50_s if lat else None, peers, since)
        percent = hints.ramped(full, since, inst.settled)
        inst.percent = percent
        inst.reply = hints.ready_reply(hints.Weight(percent, inst.settled,
                                                    hints.scaled_maxconn(self.max_concurrency, percent)))

    def reply(self, port: int) -> str:
        """The agent-check line for ``port``: a lookup, never a wait."""
        reply = self.replies.get(port)
        if reply is not None:
            return reply
        lifted = self.lifted.get(port)
        return hints.LIFT_REPLY if lifted is not None and self.clock() - lifted[0] <= hints.LIFT_S \
            else hints.UNKNOWN_REPLY

    # -- output ------------------------------------------------------------------------

    def state_of(self, inst: Instance) -> dict[str, Any]:
        return {
            "pid": inst.pid or inst.resource.get("process.pid"),  # the hello's where this agent sees none
            "state": "ready" if inst.ready_at_s is not None else "warming",
            "weight_ratio": inst.percent / 100.0,
            "settled": inst.settled,
            "reply": inst.reply.strip(),
        }

    def _hints(self, now: float) -> list[RoutingHint]:
        now_ns = int(now * 1e9)
        out = [RoutingHint(resource, service, port, now_ns, None) for resource, service, port in self._gone]
        self._gone = []
        for inst in self.instances.values():
            if inst.port is None or self.ports.get(inst.port) != inst.producer:
                continue
            state = self.state_of(inst)
            key = (state["state"], state["weight_ratio"], state["settled"], state["reply"])
            if key != inst.sent:
                inst.sent = key
                out.append(RoutingHint(inst.resource, inst.service, inst.port, now_ns, state))
        return out

    def clear_all(self) -> list[RoutingHint]:
        """The agent stops: every hint it published goes away."""
        now_ns = int(self.clock() * 1e9)
        out = [RoutingHint(i.resource, i.service, i.port, now_ns, None)
               for i in self.instances.values() if i.port is not None and i.sent is not None]
        self.instances.clear()
        self.ports.clear()
        self.replies = {}
        return out

    def snapshot(self) -> list[dict[str, Any]]:
        """For ``status --json``: each instance with its port and hint."""
        return [{"service": i.service, "port": i.port, **self.state_of(i)} for i in self.instances.values()]
