"""A vacated port (its instance ended) waits for a restart of the same service and uid, which is
drained while it warms. Another uid can neither push that wait out of the table with many
short-lived instances of its own (each uid keeps a quarter of it) nor end it by naming the port
in a readiness span: within the window, only a listener the kernel shows takes the port."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator

import pytest
from fleet_env import system_python

from infersight.agent.routing import hints
from infersight.agent.routing import table as rt
from infersight.telemetry import Origin, Resource, SpanItem

VICTIM, ATTACKER = 1000, 2000
PORT = 8000
VICTIM_PID = 4_194_305  # above any pid_max (4194304): never a live process whose netns's listeners the table reads


def _ready(table: rt.RoutingTable, port: int) -> bool:
    """An instance holds ``port`` and it is ready (the fail-open reply for an unknown port says "up ready" too)."""
    return port in table.ports and table.reply(port).split()[:2] == ["up", "ready"]


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


class World:
    """A routing table with a fake clock, fake process liveness and a fake kernel listener table."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch | None) -> None:
        self.clock = Clock()
        self.dead: set[int] = set()
        self.kernel: dict[int, set[int]] = {}  # port -> uids listening on it
        if monkeypatch is not None:
            monkeypatch.setattr(rt, "listener_uids", lambda _pid, port: set(self.kernel.get(port, set())))
        self.table = rt.RoutingTable(list, lambda _uid: {}, alive=lambda pid, _start: pid not in self.dead,
                                     clock=self.clock)

    def span(self, producer: str, name: str, pid: int, uid: int, service: str, **attrs: int | str) -> None:
        t = self.clock()
        res = Resource.of({"service.name": service, "process.pid": pid, "process.user.id": uid})
        self.table.observe([SpanItem(res, "0" * 32, "1" * 16, "2" * 16, name, int((t - 1) * 1e9), int(t * 1e9),
                                     {"infersight.stage": name.split(".", 1)[1], **attrs}, [], None,
                                     Origin(producer, 1))])

    def ready(self, producer: str, pid: int, uid: int, port: int, service: str = "llm") -> None:
        self.span(producer, "coldstart.runtime_init", pid, uid, service)
        self.span(producer, "coldstart.ready_wait", pid, uid, service, **{"server.port": port})

    def warm(self, producer: str, pid: int, uid: int, service: str = "llm") -> None:
        self.span(producer, "coldstart.runtime_init", pid, uid, service)

    def victim_leaves(self) -> None:
        """The victim's server is ready on PORT, then ends: PORT is vacated, nobody listens on it."""
        self.kernel[PORT] = {VICTIM}
        self.ready("victim", VICTIM_PID, VICTIM, PORT)
        self.table.refresh()
        assert _ready(self.table, PORT)
        self.dead.add(VICTIM_PID)
        del self.kernel[PORT]
        self.clock.t += 1
        self.table.refresh()
        assert PORT in self.table.vacated


def test_another_uids_churn_does_not_push_the_victims_vacated_port_out(monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(monkeypatch)
    w.victim_leaves()
    n = rt.MAX_VACATED + 4  # more than the whole table
    for i in range(n):
        w.kernel[40_000 + i] = {ATTACKER}
        w.ready("flood-%d" % i, 100_000 + i, ATTACKER, 40_000 + i, service="flood-%d" % i)
        w.dead.add(100_000 + i)
        if i % 32 == 31 or i == n - 1:
            w.clock.t += 0.25
            w.table.refresh()
    w.warm("restart", 21, VICTIM)
    assert w.table.reply(PORT) == hints.WARMING_REPLY, "the victim's restart is drained while it warms"
    assert sum(1 for v in w.table.vacated.values() if v[1] == ATTACKER) == rt.MAX_VACATED_PER_UID
    assert w.table.vacated_dropped == n - rt.MAX_VACATED_PER_UID  # what its full share pushed out: counted


def test_the_table_full_of_many_uids_a_uid_holding_the_most_gives_way(monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(monkeypatch)
    w.victim_leaves()
    pid, port = 200_000, 40_000
    for uid in range(5000, 5000 + 5):  # five uids, each its full share: more than the table
        for _ in range(rt.MAX_VACATED_PER_UID):
            w.ready("p%d" % pid, pid, uid, port, service="s%d" % pid)
            w.dead.add(pid)
            pid, port = pid + 1, port + 1
        w.table.refresh()
    assert len(w.table.vacated) <= rt.MAX_VACATED
    assert w.table.vacated.get(PORT, ("", None))[1] == VICTIM
    assert w.table.vacated_dropped > 0


def test_another_uid_cannot_claim_a_vacated_port_it_does_not_listen_on(monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(monkeypatch)
    w.victim_leaves()
    w.ready("evil", 31, ATTACKER, PORT, service="evil")  # names the port (seen in status), listens nowhere
    assert w.table.port_claims_refused == 1
    assert w.table.reply(PORT) == hints.UNKNOWN_REPLY
    w.warm("restart", 21, VICTIM)
    assert w.table.reply(PORT) == hints.WARMING_REPLY, "the victim's restart is drained while it warms"


def test_another_uid_that_really_listens_takes_the_vacated_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first server left for good and another user's service now serves the port."""
    w = World(monkeypatch)
    w.victim_leaves()
    w.kernel[PORT] = {ATTACKER}
    # it listens where the balancer connects: this agent's own table shows it
    monkeypatch.setattr(rt, "host_listeners", lambda: {p: set(u) for p, u in w.kernel.items()})
    w.ready("other", 31, ATTACKER, PORT, service="other")
    assert w.table.port_claims_refused == 0
    assert _ready(w.table, PORT)
    assert PORT not in w.table.vacated


def test_another_uid_listening_in_a_namespace_of_its_own_does_not_take_the_vacated_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``unshare -Urn``: the attacker alone listens on PORT in its own network namespace; this agent's
    (the balancer's) shows nobody there. The victim's restart must still be drained on PORT."""
    w = World(monkeypatch)
    w.victim_leaves()
    monkeypatch.setattr(rt, "host_listeners", dict)  # nobody listens on PORT where the balancer connects
    w.kernel[PORT] = {ATTACKER}  # what the attacker's own namespace shows
    w.ready("squatter", 31, ATTACKER, PORT, service="evil")
    assert w.table.port_claims_refused == 1
    assert PORT in w.table.vacated
    assert w.table.reply(PORT) == hints.UNKNOWN_REPLY
    w.clock.t += rt.OWNERS_EVERY_S + 1
    w.table.refresh()  # nor later, as a candidate of a contested port
    assert w.table.reply(PORT) == hints.UNKNOWN_REPLY
    w.warm("restart", 21, VICTIM)
    assert w.table.reply(PORT) == hints.WARMING_REPLY, "the victim's restart is drained while it warms"


def test_once_the_window_ends_another_uids_claim_is_taken_as_said(monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(monkeypatch)
    w.victim_leaves()
    w.clock.t += rt.VACATED_TTL_S + 1
    w.ready("other", 31, ATTACKER, PORT, service="other")  # not checkable (nobody listens yet): believed
    assert w.table.port_claims_refused == 0
    assert _ready(w.table, PORT)


def test_the_same_uids_other_service_may_take_its_own_vacated_port(monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(monkeypatch)
    w.victim_leaves()
    w.ready("mine", 41, VICTIM, PORT, service="embed")
    assert w.table.port_claims_refused == 0
    assert _ready(w.table, PORT)


# -- the kernel's real listener table -------------------------------------------------------


def test_a_real_port_nobody_listens_on_is_refused_to_another_uid_while_vacated() -> None:
    """The claimant is a live process (this test's) whose network namespace shows nobody on the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
        w = World(None)
        w.ready("victim", 0, VICTIM, port)  # no pid: not checkable, taken as said
        w.dead.add(0)
        w.table.refresh()
        w.ready("evil", os.getpid(), ATTACKER, port, service="evil")
        assert w.table.port_claims_refused == 1
        w.warm("restart", 21, VICTIM)
        assert w.table.reply(port) == hints.WARMING_REPLY


LISTENER = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


@pytest.fixture
def listener_of_another_uid() -> Iterator[tuple[int, int]]:
    """(pid, port) of a process of uid ATTACKER listening on a TCP port (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a listener of another uid")
    p = subprocess.Popen([system_python(), "-c", LISTENER], stdout=subprocess.PIPE, text=True, user=ATTACKER)
    try:
        assert p.stdout is not None
        yield p.pid, int(p.stdout.readline())
    finally:
        p.kill()
        p.wait(10)


def test_a_real_listener_of_another_uid_takes_the_vacated_port(listener_of_another_uid: tuple[int, int],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pid, port = listener_of_another_uid
    w = World(None)
    with monkeypatch.context() as m:  # the victim's claim, before that listener came (this host's table then)
        m.setattr(rt, "host_listeners", dict)
        w.ready("victim", 0, VICTIM, port)
    w.dead.add(0)
    w.table.refresh()
    assert port in w.table.vacated
    w.ready("other", pid, ATTACKER, port, service="other")
    assert w.table.port_claims_refused == 0
    assert _ready(w.table, port)


def test_a_claim_from_a_private_network_namespace_does_not_take_a_port_another_uid_listens_on_here(
        listener_of_another_uid: tuple[int, int]) -> None:
    """A member claimed a victim's port from a network namespace of its own (``unshare -Urn``), where it alone
    listened: the agent read that namespace's table and gave it the port (a review's attack). The balancer
    connects in the agent's namespace, where the kernel shows the victim on it: the claim is refused, and the
    victim's holds."""
    pid, port = listener_of_another_uid  # the "victim" here: uid ATTACKER's real listener on this host
    w = World(None)
    w.ready("evil", 0, VICTIM, port, service="evil")  # pid 0: another PID namespace, its word only
    assert w.table.port_claims_refused == 1 and port not in w.table.ports
    w.ready("llm", pid, ATTACKER, port)
    assert w.table.ports[port] == "llm"


def test_a_holder_whose_port_another_uid_listens_on_here_lets_it_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the service's ProtectProc=invisible the agent cannot read other users' /proc: a squatter that
    claimed a port, then closed it, kept it against the real server that listened there next (a review's
    attack). This agent's own table shows who listens: the holder lets the port go, the listener gets it."""
    w = World(monkeypatch)
    host: dict[int, set[int]] = {}
    monkeypatch.setattr(rt, "host_listeners", lambda: host)
    monkeypatch.setattr(rt, "listener_uids", lambda _pid, _port: None)  # other users' /proc: unreadable
    w.ready("squatter", 0, ATTACKER, PORT, service="evil")  # nobody listens yet: taken as said
    assert w.table.ports.get(PORT) == "squatter"
    host[PORT] = {VICTIM}  # the squatter closed its socket; the victim's server listens
    w.ready("llm", 0, VICTIM, PORT)
    assert w.table.ports.get(PORT) == "llm"
    w.clock.t += rt.OWNERS_EVERY_S + 1
    w.table.refresh()
    assert w.table.ports.get(PORT) == "llm"


def test_two_restarts_that_took_each_others_port_are_set_right_at_readiness(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two instances of one service end (8000, then 8001) and restart: each restart is given a vacated port before
    it listens, the first the newest (8001). When the other one is ready on 8001 (its readiness names the port), it
    takes 8001 and the first, still warming, is drained on 8000, the port it serves on: before, 8000 answered
    "ready" for a server still loading and 8001 stayed drained though ready (a review: p99 12.9 s)."""
    w = World(monkeypatch)
    other = PORT + 1
    for name, pid, port in (("a", 31, PORT), ("b", 32, other)):
        w.kernel[port] = {VICTIM}
        w.ready(name, pid, VICTIM, port)
    w.table.refresh()
    for pid, port in ((31, PORT), (32, other)):
        w.dead.add(pid)
        del w.kernel[port]
        w.clock.t += 1
        w.table.refresh()
    w.warm("slow", 41, VICTIM)  # restarts on 8000 (20 s to load)
    w.warm("fast", 42, VICTIM)  # restarts on 8001 (5 s)
    assert (w.table.ports[other], w.table.ports[PORT]) == ("slow", "fast")  # the guesses, crossed
    w.kernel[PORT] = w.kernel[other] = {VICTIM}
    w.clock.t += 5
    w.span("fast", "coldstart.ready_wait", 42, VICTIM, "llm", **{"server.port": other})
    w.table.refresh()
    assert _ready(w.table, other) and w.table.ports[other] == "fast"
    assert w.table.ports[PORT] == "slow" and w.table.reply(PORT) == hints.WARMING_REPLY


@pytest.mark.parametrize(("ready_ns", "ready_port", "want"), [
    (5 * 10**18, 8000, {"ready_ns": 5 * 10**18, "ready_port": 8000}),
    (5 * 10**18, 70000, {"ready_ns": 5 * 10**18}),  # no such port: left out
    (5 * 10**18, True, {"ready_ns": 5 * 10**18}),
    ("soon", 8000, {}),  # not a time: neither is kept, the hello is taken
    (-1, 8000, {}),
])
def test_a_hellos_readiness_fields_are_kept_only_when_well_formed(ready_ns: object, ready_port: object,
                                                                   want: dict[str, int]) -> None:
    from infersight.agent.daemon.assemble import validate_hello

    info = validate_hello({"id": "p-1", "pid": 1, "start_ns": 1, "trace_id": "1" * 32, "root_span_id": "2" * 16,
                           "ready_ns": ready_ns, "ready_port": ready_port})
    assert {k: v for k, v in info.items() if k.startswith("ready_")} == want


def test_a_hello_that_says_ready_makes_an_instance_its_port_checked_as_a_readiness_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After an agent restart: the victim's server says hello, ready on PORT; an attacker's hello naming PORT while
    the victim's instance holds it takes nothing."""
    w = World(monkeypatch)
    w.kernel[PORT] = {VICTIM}
    res = Resource.of({"service.name": "llm", "process.pid": 31, "process.user.id": VICTIM})
    w.table.readmit("victim", res, {"ready_ns": int((w.clock() - 100) * 1e9), "ready_port": PORT})
    assert _ready(w.table, PORT) and w.table.ports[PORT] == "victim"
    w.table.readmit("victim", res, {"ready_ns": 1, "ready_port": PORT + 1})  # known: a reconnect changes nothing
    assert w.table.instances["victim"].port == PORT
    evil = Resource.of({"service.name": "llm", "process.pid": 32, "process.user.id": ATTACKER})
    w.table.readmit("evil", evil, {"ready_ns": int(w.clock() * 1e9), "ready_port": PORT})
    assert w.table.ports[PORT] == "victim" and w.table.port_claims_refused == 1


def test_a_port_this_agent_drained_and_lost_track_of_says_ready_for_a_while_others_plain_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a drain this agent set is lifted (HAProxy's agent "ready" also undoes an operator's maint or drain, so
    a port the agent never drained gets "up 100%"): a warming restart that ends, a drained port made contested."""
    w = World(monkeypatch)
    w.victim_leaves()
    assert w.table.reply(PORT) == hints.UNKNOWN_REPLY  # it was ready, never drained: plain fail-open
    w.warm("restart", 21, VICTIM)
    assert w.table.reply(PORT) == hints.WARMING_REPLY
    w.dead.add(21)  # the restart dies while warming
    w.clock.t += 1
    w.table.refresh()
    assert w.table.reply(PORT) == hints.LIFT_REPLY, "the drain this agent set is lifted"
    w.clock.t += hints.LIFT_S + 1
    w.table.refresh()
    assert w.table.reply(PORT) == hints.UNKNOWN_REPLY
    assert w.table.reply(PORT + 7) == hints.UNKNOWN_REPLY  # never known


def test_a_port_held_again_forgets_its_contest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A contest's candidates must not vacate the port for another uid once its owner holds it again (a review: the
    squatter's uid got the port for 10 minutes and the victim's next restart was not drained)."""
    w = World(monkeypatch)
    w.kernel[PORT] = {VICTIM, ATTACKER}
    w.ready("squatter", 31, ATTACKER, PORT, service="llm")  # refused: a candidate of a contested port
    w.ready("victim", 32, VICTIM, PORT)
    w.kernel[PORT] = {VICTIM}
    w.clock.t += rt.OWNERS_EVERY_S + 1
    w.table.refresh()
    w.table._assign(w.table.instances["victim"], PORT)  # held again (as _check_holders does)
    assert PORT not in w.table.contested


def test_another_users_churn_of_drained_ports_never_pushes_out_a_lift(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lifted ports were one list of 256 for all users: another user who churned more drained ports than that
    within a minute pushed a victim's lift out, and its port stayed drained (a review). Each uid keeps a quarter."""
    w = World(monkeypatch)
    w.victim_leaves()
    w.warm("restart", 21, VICTIM)
    w.dead.add(21)
    w.clock.t += 1
    w.table.refresh()
    assert w.table.reply(PORT) == hints.LIFT_REPLY
    for k in range(rt.MAX_VACATED + 10):  # the attacker's warming restarts on ports it vacated, each dying
        port = 20000 + k
        w.kernel[port] = {ATTACKER}
        w.ready("a%d" % k, 100_000 + k, ATTACKER, port, service="evil")
        w.table.refresh()
        w.dead.add(100_000 + k)
        w.table.refresh()
        w.warm("b%d" % k, 200_000 + k, ATTACKER, service="evil")
        w.table.refresh()
        w.dead.add(200_000 + k)
        w.table.refresh()
    assert w.table.reply(PORT) == hints.LIFT_REPLY, "the victim's lift stays"
    assert sum(1 for _s, u in w.table.lifted.values() if u == ATTACKER) <= rt.MAX_VACATED_PER_UID
