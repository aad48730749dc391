"""Routing hints as units: HAProxy's agent-check grammar, and the unknown / warming / ready /
settled / slow / restarted cases of the decision; the agent-check server closes a stalled
connection, binds 127.0.0.1 by default, and answers from a table without waiting."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess

import pytest
from fleet_env import system_python

from infersight.agent.routing import hints
from infersight.agent.routing.agentcheck import AgentCheckServer
from infersight.agent.routing.extension import parse_config
from infersight.agent.routing.table import RoutingTable
from infersight.instances import InstanceLatency
from infersight.settings import Config, ConfigError
from infersight.telemetry import Origin, Resource, RoutingHint, SpanItem

# HAProxy's agent-check reply (doc/configuration.txt, "agent-check"): words delimited by spaces,
# tabs or commas: "<n>%", "weight:<n>[%]", "maxconn:<n>", ready|drain|maint, up|down|fail|stopped[#why].
_WORD = re.compile(r"\d+%|weight:\d+%?|maxconn:\d+|ready|drain|maint|up|(?:down|fail|stopped)(?:#.*)?")


def haproxy_words(reply: str) -> list[str]:
    """Parse a reply as HAProxy does: up to the first CR or LF, split on space/tab/comma."""
    assert reply.endswith("\n") and "\n" not in reply[:-1] and "\r" not in reply
    words = [w for w in re.split(r"[ \t,]+", reply[:-1]) if w]
    for w in words:
        assert _WORD.fullmatch(w), "not in HAProxy's agent-check grammar: %r" % w
    return words


def percent(reply: str) -> int:
    return int(next(w for w in haproxy_words(reply) if w.endswith("%"))[:-1])


# -- the grammar --------------------------------------------------------------------------


def test_replies_are_haproxy_agent_check_lines() -> None:
    assert haproxy_words(hints.WARMING_REPLY) == ["drain"]
    # fail open, without "ready": HAProxy's agent "ready" also undoes an operator's maint or drain (a review)
    assert haproxy_words(hints.UNKNOWN_REPLY) == ["up", "100%"]
    # a port this agent drained and lost track of: "ready" lifts that drain (it stayed for good: a review)
    assert haproxy_words(hints.LIFT_REPLY) == ["up", "ready", "100%"]
    assert haproxy_words(hints.ready_reply(hints.Weight(37, False, None))) == ["up", "ready", "37%"]
    assert haproxy_words(hints.ready_reply(hints.Weight(50, True, 4))) == ["up", "ready", "50%", "maxconn:4"]
    # "drain" is cancelled only by "ready": every reply for a ready instance carries it.
    assert "ready" in haproxy_words(hints.ready_reply(hints.Weight(10, True, 1)))


@pytest.mark.parametrize(("line", "port"), [
    (b"8000\n", 8000), (b"8000\r\n", 8000), (b" 8000 \n", 8000), (b"65535\n", 65535),
    (b"0\n", None), (b"65536\n", None), (b"80a\n", None), (b"\n", None), (b"-1\n", None), (b"1234567\n", None),
])  # fmt: skip
def test_request_line_is_a_port(line: bytes, port: int | None) -> None:
    assert hints.parse_request(line) == port


# -- the weight ---------------------------------------------------------------------------


def test_full_weight_is_relative_speed_clamped_and_lowered_for_slow_devices() -> None:
    assert hints.full_weight(0.1, [0.1, 0.1], None) == 100
    assert hints.full_weight(0.4, [0.1], None) == 25  # four times slower than its peer
    assert hints.full_weight(0.05, [0.1], None) == 100  # faster: clamped to 100
    assert hints.full_weight(10.0, [0.1], None) == 10  # clamped to 10
    assert hints.full_weight(None, [0.1], None) == 100  # no P50 of its own yet
    assert hints.full_weight(0.1, [], None) == 100  # no peers
    assert hints.full_weight(0.1, [0.1, 0.3, 0.2], None) == 100  # the median of the peers
    assert hints.full_weight(0.1, [0.1], 1.5) == 50  # slow device: at least halved
    assert hints.full_weight(0.1, [0.1], 4.0) == 25  # ... or by its coefficient
    assert hints.full_weight(0.4, [0.1], 4.0) == 10  # never below 10


def test_failed_requests_lower_the_weight() -> None:
    assert hints.full_weight(0.1, [0.1], None, 0.0) == 100
    assert hints.full_weight(0.1, [0.1], None, 0.5) == 50  # half its requests failed
    assert hints.full_weight(None, [0.1], None, 1.0) == 10  # all failed (no P50 of its own): never below 10
    assert hints.full_weight(0.1, [0.1], 2.0, 0.5) == 25  # and a slow device on top


def test_a_backend_that_fails_fast_is_not_weighted_as_the_fastest() -> None:
    """A backend that answers 503 at once beside a healthy one: its failures are no latency samples
    (so its near-zero P50 is no reference for its peer) and its weight falls with its failed share."""
    w = World()
    w.ready("healthy", 11, 8000)
    w.ready("broken", 12, 8001)
    w.clock.t += hints.SETTLE_S
    w.lat = [_lat("healthy", 0.05, 0.05, ("cuda:0",)), _lat("broken", 0.0, None, ("cuda:1",), count=0, failed=60)]
    w.table.refresh()
    assert percent(w.table.reply(8000)) == 100
    assert percent(w.table.reply(8001)) == hints.MIN_WEIGHT


def test_instance_latency_keeps_failed_requests_out_of_the_p50_and_counts_them() -> None:
    import time as _time

    from infersight.agent.requests.kind import ReqEvent, RequestStats

    stats = RequestStats()
    res = Resource.of({"service.name": "llm", "process.pid": 42})
    now = _time.time_ns()
    for i in range(40):
        failed = i % 4 == 0
        stats.record("p", res, ReqEvent(None, "m", None, "http", now, 0.0004 if failed else 0.05, None, None,
                                        "503" if failed else None, None, None, None), now)
    (lat,) = stats.instance_latency()
    assert (lat.count, lat.failed, lat.p50_s) == (30, 10, 0.05)
    assert lat.failed_share() == 0.25
    only_failed = RequestStats()
    only_failed.record("q", res, ReqEvent(None, "m", None, "http", now, 0.0004, None, None, "503", None, None, None),
                       now)
    (lat,) = only_failed.instance_latency()
    assert (lat.count, lat.failed) == (0, 1)
    assert only_failed.instance_metrics(everything=True) == [], "no P50 gauge without a successful request"


def test_an_instances_p50_gauge_is_one_series_whatever_its_request_count() -> None:
    """The per-instance P50/P99 points carried ``infersight.request.count``: a label that changed with every
    update, so Prometheus opened a new series each time (528 after 4 minutes of two busy instances: a review)."""
    import time as _time

    from infersight.agent.requests.kind import ReqEvent, RequestStats

    stats = RequestStats()
    res = Resource.of({"service.name": "llm", "process.pid": 42})
    labels = set()
    for n in (5, 9):
        now = _time.time_ns()
        for _ in range(n):
            stats.record("p", res, ReqEvent(None, "m", None, "http", now, 0.05, None, None, None, None, None, None),
                         now)
        for item in stats.instance_metrics(everything=True):
            labels |= {(item.name, tuple(sorted(pt.attributes.items()))) for pt in item.points}
    assert len(labels) == 2, labels  # P50 and P99: one series each


def test_ramp_from_25_until_settled() -> None:
    assert hints.ramped(100, 0.0, False) == 25
    assert hints.ramped(100, 30.0, False) == 62
    assert hints.ramped(100, 30.0, True) == 100
    assert hints.ramped(20, 0.0, False) == 20  # a full weight under 25 is not raised
    assert hints.has_settled(0.11, [0.1], 1.0)  # within 1.2x of its peers
    assert not hints.has_settled(0.13, [0.1], 1.0)
    assert hints.has_settled(0.13, [0.1], 60.0)  # or 60 s after readiness
    assert not hints.has_settled(None, [0.1], 59.0)  # fewer than 20 requests
    assert not hints.has_settled(0.1, [], 59.0)  # no peer to compare with


def test_maxconn_scales_with_the_weight() -> None:
    assert hints.scaled_maxconn(None, 50) is None
    assert hints.scaled_maxconn(8, 100) == 8
    assert hints.scaled_maxconn(8, 25) == 2
    assert hints.scaled_maxconn(8, 10) == 1


# -- the table: states from the agent's items ---------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def _span(producer: str, name: str, t: float, pid: int, service: str = "llm", **attrs: object) -> SpanItem:
    res = Resource.of({"service.name": service, "process.pid": pid})
    return SpanItem(res, "0" * 32, "1" * 16, "2" * 16, name, int((t - 1) * 1e9), int(t * 1e9),
                    {"infersight.stage": name.split(".", 1)[1], **attrs}, [], None, Origin(producer, 1))


def _lat(producer: str, p50: float, recent: float | None = None, devices: tuple[str, ...] = ("cuda:0",),
         count: int = 50, failed: int = 0) -> InstanceLatency:
    return InstanceLatency(producer, "llm", 0, count, p50, p50 * 2, recent, devices, failed)


class World:
    def __init__(self, max_concurrency: int | None = None) -> None:
        self.clock = Clock()
        self.lat: list[InstanceLatency] = []
        self.slow: dict[str, float] = {}
        self.dead: set[int] = set()
        self.table = RoutingTable(lambda: self.lat, lambda _uid: self.slow, max_concurrency,
                                  alive=lambda pid, _start: pid not in self.dead, clock=self.clock)

    def ready(self, producer: str, pid: int, port: int | None) -> None:
        t = self.clock()
        self.table.observe([_span(producer, "coldstart.runtime_init", t - 5, pid)])
        attrs = {"server.port": port} if port is not None else {}
        self.table.observe([_span(producer, "coldstart.ready_wait", t, pid, **attrs)])


def test_unknown_port_fails_open() -> None:
    w = World()
    w.table.refresh()
    assert w.table.reply(8000) == hints.UNKNOWN_REPLY


def test_warming_instance_is_drained_and_ready_one_ramps() -> None:
    w = World()
    w.ready("a", 11, 8000)
    w.lat = [_lat("a", 0.1)]
    w.table.refresh()
    w.table.observe([_span("b", "coldstart.runtime_init", w.clock(), 12)])  # b warms, port unknown yet
    assert percent(w.table.reply(8000)) == 25  # a: ready, not settled (no peer): ramps from 25%
    w.clock.t += 30
    w.table.refresh()
    assert percent(w.table.reply(8000)) == 62
    w.clock.t += 30
    w.table.refresh()
    assert percent(w.table.reply(8000)) == 100  # 60 s: settled
    assert w.table.snapshot()[0]["settled"] is True


def test_slow_instance_gets_a_smaller_weight_and_a_fast_one_settles_on_its_last_20() -> None:
    w = World(max_concurrency=8)
    w.ready("fast", 11, 8001)
    w.ready("slow", 12, 8002)
    w.lat = [_lat("fast", 0.1, recent=0.1), _lat("slow", 0.4, recent=0.4)]
    w.clock.t += 1
    w.table.refresh()
    assert haproxy_words(w.table.reply(8001)) == ["up", "ready", "100%", "maxconn:8"]  # settled at once
    assert haproxy_words(w.table.reply(8002)) == ["up", "ready", "25%", "maxconn:2"]  # 4x slower
    by_port = {s["port"]: s for s in w.table.snapshot()}
    assert by_port[8001]["settled"] and not by_port[8002]["settled"]
    w.slow = {"cuda:0": 3.0}  # both on a device judged slow: both lowered
    w.table.refresh()
    assert percent(w.table.reply(8001)) == 33 and percent(w.table.reply(8002)) == 10


def test_restart_on_the_same_port_is_drained_until_ready() -> None:
    w = World()
    w.ready("old", 11, 8000)
    w.ready("peer", 13, 8001)
    w.table.refresh()
    w.dead.add(11)
    hints_out = w.table.refresh()
    assert RoutingHint in {type(h) for h in hints_out}
    assert [h.state for h in hints_out if h.port == 8000] == [None]  # its gauges and topic go away
    assert w.table.reply(8000) == hints.UNKNOWN_REPLY  # nobody serves it: fail open (the TCP check says down)
    w.table.observe([_span("new", "coldstart.runtime_init", w.clock(), 21)])  # the same service restarts
    assert w.table.reply(8000) == "drain\n"
    w.table.observe([_span("other", "coldstart.runtime_init", w.clock(), 22, service="embed")])
    assert w.table.reply(8001) != "drain\n"  # another service's start takes nothing
    w.clock.t += 5
    w.table.observe([_span("new", "coldstart.ready_wait", w.clock(), 21)])  # ready (no listen port: mark_ready)
    assert haproxy_words(w.table.reply(8000))[:2] == ["up", "ready"] and w.table.ports.get(8000) == "new"


def test_readiness_port_moves_a_port_to_its_new_holder() -> None:
    w = World()
    w.ready("a", 11, 8000)
    w.ready("b", 12, 8000)  # a new process listens on 8000 (a was replaced)
    w.table.refresh()
    assert [s["port"] for s in w.table.snapshot()] == [None, 8000]


def test_hints_are_published_on_change_only() -> None:
    w = World()
    w.ready("a", 11, 8000)
    first = w.table.refresh()
    assert [(h.port, h.state and h.state["weight_ratio"]) for h in first] == [(8000, 0.25)]
    assert w.table.refresh() == []
    assert [h.state for h in w.table.clear_all()] == [None]


# -- the server ---------------------------------------------------------------------------


def test_config_defaults_and_errors() -> None:
    v = parse_config(Config({}), env={})
    assert v == {"enabled": False, "host": "127.0.0.1", "agent_check_port": 9465, "max_concurrency": None}
    assert parse_config(Config({}), env={"INFERSIGHT_ROUTING": "1", "INFERSIGHT_ROUTING_AGENT_CHECK_PORT": "0"})[
        "agent_check_port"] == 0
    with pytest.raises(ConfigError, match="routing.max_concurrency"):
        parse_config(Config({"routing.max_concurrency": 0}, {"routing.max_concurrency": "file"}), env={})
    with pytest.raises(ConfigError, match="routing.weight"):
        parse_config(Config({"routing.weight": 1}, {"routing.weight": "file"}), env={})


async def _ask(port: int, line: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(line)
    await writer.drain()
    data = await reader.read()  # the server closes after its one line
    writer.close()
    return data


async def test_server_answers_one_line_and_closes_binding_loopback() -> None:
    server = AgentCheckServer(lambda port: "up ready 40%\n" if port == 8000 else hints.UNKNOWN_REPLY, "127.0.0.1", 0)
    await server.start()
    try:
        port = server.bound_port
        assert port is not None
        sock = server._server.sockets[0] if server._server else None  # noqa: SLF001
        assert sock is not None and sock.getsockname()[0] == "127.0.0.1"
        assert await _ask(port, b"8000\n") == b"up ready 40%\n"
        assert await _ask(port, b"9\n") == hints.UNKNOWN_REPLY.encode()
        assert await _ask(port, b"GET / HTTP/1.0\r\n") == hints.UNKNOWN_REPLY.encode()  # not a port: unknown, counted
        assert server.counters.bad_requests == 1 and server.counters.checks == 3
    finally:
        await server.aclose()


async def test_a_stalled_connection_is_closed_and_others_are_answered_meanwhile() -> None:
    server = AgentCheckServer(lambda port: "up ready 50%\n", "127.0.0.1", 0)
    await server.start()
    try:
        port = server.bound_port
        assert port is not None
        stalled_r, stalled_w = await asyncio.open_connection("127.0.0.1", port)
        stalled_w.write(b"80")  # no newline: a peer that stalls
        await stalled_w.drain()
        assert await _ask(port, b"8000\n") == b"up ready 50%\n"  # not held up by the stalled one
        assert await asyncio.wait_for(stalled_r.read(), 30) == b""  # the server closed it, unanswered
        assert server.counters.timeouts == 1
        stalled_w.close()
    finally:
        await server.aclose()


def test_default_host_is_loopback_and_a_taken_port_is_a_clear_error() -> None:
    from infersight.agent.routing.extension import RoutingExtension

    class _Agent:
        def observe(self, tap: object) -> None: ...
        def spawn(self, job: object, name: str) -> None:
            job.close()  # type: ignore[attr-defined]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ext = RoutingExtension(Config({}), list, lambda _uid: {},
                               env={"INFERSIGHT_ROUTING": "1", "INFERSIGHT_ROUTING_AGENT_CHECK_PORT": str(busy)})
        with pytest.raises(ConfigError, match="routing: cannot listen on 127.0.0.1:%d" % busy):
            asyncio.run(ext.start(_Agent()))  # type: ignore[arg-type]
    off = RoutingExtension(Config({}), list, lambda _uid: {}, env={})
    assert off.health() == {"routing": {"enabled": False, "agent_check_port": None}}


def test_mqtt_carries_the_hint_retained_and_clears_it() -> None:
    from infersight.exporters.mqtt_payload import Topics, encode_batch

    topics = Topics.of("infersight", "gpu-1")
    res = Resource.of({"service.name": "llm", "host.name": "gpu-1"})
    state = {"pid": 7, "state": "ready", "weight_ratio": 0.25, "settled": False, "reply": "up ready 25%"}
    older = RoutingHint(res, "llm", 8000, 1, {**state, "weight_ratio": 0.5})
    msgs, skipped = encode_batch([older, RoutingHint(res, "llm", 8000, 2, state)], topics)
    assert skipped == 0 and len(msgs) == 1  # the newest per topic only
    m = msgs[0]
    assert m.topic == "infersight/gpu-1/routing/llm/8000" and m.retain
    import json

    body = json.loads(m.payload)
    assert body["weight_ratio"] == 0.25 and body["settled"] is False and body["server.port"] == 8000
    cleared, _ = encode_batch([RoutingHint(res, "llm", 8000, 3, None)], topics)
    assert cleared[0].payload == b"" and cleared[0].retain


def test_prometheus_gauges_follow_the_hints() -> None:
    from infersight.exporters.prometheus_endpoint import RoutingGauges

    g = RoutingGauges()
    res = Resource.of({"service.name": "llm"})
    g.add([RoutingHint(res, "llm", 8000, 1, {"weight_ratio": 0.4, "settled": True})])
    fams = {f.name: f for f in g.families()}
    assert [(s.labels, s.value) for s in fams["infersight_routing_weight_ratio"].samples] == [
        ({"service": "llm", "port": "8000"}, 0.4)]
    assert fams["infersight_instance_settled"].samples[0].value == 1.0
    g.add([RoutingHint(res, "llm", 8000, 2, None)])
    assert g.families() == []  # gone with the instance


def test_an_instance_whose_process_cannot_be_seen_stays_until_quiet() -> None:
    from infersight.agent.routing import table as rt

    w = World()
    w.table.alive = rt._alive  # the real check: a pid in another namespace has no /proc entry here
    w.table.observe([_span("far", "coldstart.ready_wait", w.clock(), 2**22 + 12345, **{"server.port": 8000})])
    w.table.refresh()
    assert w.table.ports.get(8000) == "far"  # kept: it may well live
    w.clock.t += rt.QUIET_TTL_S + 1
    w.table.refresh()
    assert w.table.reply(8000) == hints.UNKNOWN_REPLY  # no stage, no request for 15 min: forgotten


def test_spooled_hints_survive_the_exporter_spool() -> None:
    from infersight.agent.daemon.itemcodec import from_dict, to_dict

    h = RoutingHint(Resource.of({"service.name": "llm"}), "llm", 8000, 5, {"weight_ratio": 0.5, "settled": True})
    assert from_dict(to_dict(h)) == h


def test_instance_latency_prefers_http_requests_and_keeps_their_devices() -> None:
    import time as _time

    from infersight.agent.requests.kind import ReqEvent, RequestStats

    stats = RequestStats()
    res = Resource.of({"service.name": "llm", "process.pid": 42})
    now = _time.time_ns()

    def ev(klass: str | None, device: str | None, dur: float) -> ReqEvent:
        return ReqEvent(device, "m", None, klass, now, dur, None, None, None, None, None, None)

    for _ in range(30):
        stats.record("p", res, ev(None, "cuda:3", 0.01), now)  # hooks.request inside the app
    (lat,) = stats.instance_latency()
    assert lat.count == 30 and lat.devices == ("cuda:3",) and lat.recent_p50_s == 0.01
    for _ in range(10):
        stats.record("p", res, ev("http", None, 0.05), now)  # the ASGI middleware's requests
        stats.record("p", res, ev(None, "cuda:3", 0.01), now)
    (lat,) = stats.instance_latency()
    assert (lat.count, lat.p50_s, lat.recent_p50_s) == (10, 0.05, None)  # HTTP only, fewer than 20
    assert lat.devices == ("cuda:3",)  # the device verdict still applies to it
    assert lat.service == "llm" and lat.pid == 42


def test_a_restart_seen_warming_before_its_predecessor_ended_still_takes_the_port() -> None:
    w = World()
    w.ready("old", 11, 8000)
    w.table.refresh()
    w.table.observe([_span("new", "coldstart.runtime_init", w.clock(), 21)])  # starts while old still lives
    assert w.table.reply(8000) != "drain\n"  # old serves it still
    w.dead.add(11)
    w.table.refresh()
    assert w.table.reply(8000) == "drain\n"


NO_PID = 4_194_305  # above any pid_max (4194304): never a live process whose netns's listeners the table reads


def _user_span(producer: str, name: str, t: float, pid: int, uid: int, **attrs: object) -> SpanItem:
    """A stage span as the agent makes it: the resource carries the kernel's uid."""
    res = Resource.of({"service.name": "llm", "process.pid": pid, "process.user.id": uid})
    return SpanItem(res, "0" * 32, "1" * 16, "2" * 16, name, int((t - 1) * 1e9), int(t * 1e9),
                    {"infersight.stage": name.split(".", 1)[1], **attrs}, [], None, Origin(producer, 1))


def test_another_uid_cannot_take_over_or_drain_a_port_it_does_not_listen_on() -> None:
    """The port a producer says it serves is its word: where the kernel shows who listens on
    it (a real listening socket of this test's uid, 0), another user's readiness span naming
    it is refused and counted; and a vacated port waits for a restart of the same service of
    the same uid, not for another user's process of that name. The other user's spans name
    this test's parent as their process: one in the same network namespace."""
    me, neighbour = os.getpid(), os.getppid()
    uid = os.geteuid()
    w = World()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        t = w.clock()
        w.table.observe([_user_span("victim", "coldstart.runtime_init", t - 5, me, uid),
                         _user_span("victim", "coldstart.ready_wait", t, me, uid, **{"server.port": port})])
        w.table.refresh()
        assert haproxy_words(w.table.reply(port))[:2] == ["up", "ready"] and w.table.ports.get(port) == "victim"
        w.table.observe([_user_span("attacker", "coldstart.runtime_init", t - 1, neighbour, uid + 4242),
                         _user_span("attacker", "coldstart.ready_wait", t, neighbour, uid + 4242,
                                    **{"server.port": port})])
        w.table.refresh()
        assert w.table.ports.get(port) == "victim"  # still the victim's
        assert {s["pid"]: s["port"] for s in w.table.snapshot()} == {me: port, neighbour: None}
        assert w.table.port_claims_refused == 1
    w.dead.add(me)  # the victim's server ends: its port waits for its restart
    w.table.refresh()
    w.clock.t += 1
    w.table.observe([_user_span("attacker2", "coldstart.runtime_init", w.clock(), 67, uid + 4242)])
    assert w.table.reply(port) == hints.UNKNOWN_REPLY  # another user's "llm" is not its restart: fail open
    w.table.observe([_user_span("restart", "coldstart.runtime_init", w.clock(), 21, uid)])
    assert w.table.reply(port) == "drain\n"  # the victim's restart: drained until ready


def test_one_uid_cannot_crowd_the_table() -> None:
    """Another user's many warming processes take at most their uid's share of the table: the
    next instance of this user is still tracked (drained while warming, not failed open)."""
    from infersight.agent.routing import table as rt

    w = World()
    uid = os.geteuid()
    for n in range(rt.MAX_INSTANCES + 5):  # enough to fill the whole table
        w.table.observe([_user_span("crowd-%d" % n, "coldstart.runtime_init", w.clock(), 100_000 + n, uid + 4242)])
    assert len(w.table.instances) == rt.MAX_INSTANCES_PER_UID
    w.table.observe([_user_span("mine", "coldstart.runtime_init", w.clock(), 99, uid)])
    assert "mine" in w.table.instances


def test_one_uid_cannot_crowd_the_request_instances() -> None:
    """Per-instance latency (what routing weighs) keeps at most a uid's share for another
    user's many processes: this user's instance still gets its P50."""
    import time as _time

    from infersight.agent.requests import kind as rk

    stats = rk.RequestStats()
    now = _time.time_ns()
    ev = rk.ReqEvent("cuda:0", "m", None, "http", now, 0.02, None, None, None, None, None, None)
    for n in range(rk.MAX_INSTANCES + 5):  # enough to fill every place
        stats.record("crowd-%d" % n, Resource.of({"service.name": "llm", "process.pid": 100_000 + n,
                                                  "process.user.id": 2000}), ev, now)
    stats.record("mine", Resource.of({"service.name": "llm", "process.pid": 7, "process.user.id": 1000}), ev, now)
    by_producer = {lat.producer: lat for lat in stats.instance_latency()}
    assert len(by_producer) == rk.MAX_INSTANCES_PER_UID + 1 and "mine" in by_producer


def _uid_lat(producer: str, p50: float) -> InstanceLatency:
    return InstanceLatency(producer, "llm", 0, 50, p50, p50 * 2, p50, ("cuda:0",))


def test_another_uids_instances_of_the_same_service_name_are_not_peers() -> None:
    """Peers set an instance's weight (their median P50 over its own): another user's processes that
    call themselves "llm" and answer in 1 ms must not cut this user's two identical backends to 10%."""
    w = World()
    t = w.clock()
    for producer, pid, uid, port in (("a", NO_PID + 11, 1000, 8000), ("b", NO_PID + 12, 1000, 8001),
                                     ("x1", 21, 2000, None), ("x2", 22, 2000, None), ("x3", 23, 2000, None)):
        attrs = {"server.port": port} if port else {}
        w.table.observe([_user_span(producer, "coldstart.runtime_init", t - 5, pid, uid),
                         _user_span(producer, "coldstart.ready_wait", t, pid, uid, **attrs)])
    w.clock.t += hints.SETTLE_S
    w.lat = [_uid_lat("a", 0.05), _uid_lat("b", 0.05), _uid_lat("x1", 0.001), _uid_lat("x2", 0.001),
             _uid_lat("x3", 0.001)]
    w.table.refresh()
    assert [percent(w.table.reply(p)) for p in (8000, 8001)] == [100, 100]


# -- ports two users listen on: real listening sockets of two uids (root only) -------------

LISTENER = """
import socket, sys, time
family = socket.AF_INET6 if sys.argv[1] == "v6" else socket.AF_INET
s = socket.socket(family)
if family == socket.AF_INET6:
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::1" if family == socket.AF_INET6 else "0.0.0.0", int(sys.argv[2])))
s.listen()
print("listening", flush=True)
time.sleep(120)
"""


class Listeners:
    """Processes of given uids listening on one TCP port number (IPv4 any, or IPv6 loopback only)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, uid: int, family: str, port: int) -> int:
        p = subprocess.Popen([system_python(), "-c", LISTENER, family, str(port)], stdout=subprocess.PIPE, text=True,
                             user=uid)  # (this venv's interpreter may live where other uids cannot run it)
        self.procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "listening"
        return p.pid

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(10)


@pytest.fixture
def listeners():  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("needs root: listeners of two uids")
    if not socket.has_ipv6:
        pytest.skip("needs IPv6")
    ls = Listeners()
    yield ls
    ls.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _claim(w: World, producer: str, pid: int, uid: int, port: int | None, service: str = "llm") -> None:
    t = w.clock()
    res = Resource.of({"service.name": service, "process.pid": pid, "process.user.id": uid})
    attrs: dict[str, object] = {"server.port": port} if port else {}
    for name, at in (("coldstart.runtime_init", t - 5), ("coldstart.ready_wait", t)):
        w.table.observe([SpanItem(res, "0" * 32, "1" * 16, "2" * 16, name, int((at - 1) * 1e9), int(at * 1e9),
                                  {"infersight.stage": name.split(".", 1)[1], **attrs}, [], None,
                                  Origin(producer, 1))])


def test_a_port_number_another_uid_also_listens_on_is_held_by_nobody(listeners: Listeners) -> None:
    """Another user binds [::1]:P beside the victim's 0.0.0.0:P (Linux allows it) and says its hooked
    process is ready on P: it does not take P over (and cannot later drain it through a warming
    process of its own), and the victim's claim is let go too, since which server the balancer
    reaches cannot be told: the port fails open and is counted."""
    port = _free_port()
    w = World()
    victim = listeners.start(1000, "v4", port)
    _claim(w, "victim", victim, 1000, port)
    w.table.refresh()
    assert haproxy_words(w.table.reply(port))[:2] == ["up", "ready"]
    attacker = listeners.start(2000, "v6", port)
    _claim(w, "attacker", attacker, 2000, port, service="evil")
    w.table.refresh()
    assert w.table.reply(port) == hints.UNKNOWN_REPLY  # neither holds it
    assert (w.table.port_claims_refused, w.table.ports_contested) == (1, 1)
    w.dead.add(attacker)  # its listener leaves; its other process starts warming
    w.table.observe([_user_span("attacker2", "coldstart.runtime_init", w.clock(), 4242, 2000)])
    w.table.refresh()
    assert w.table.reply(port) == hints.UNKNOWN_REPLY, "never drained through another user's process"


def test_a_squatter_that_claimed_the_port_first_lets_it_go(listeners: Listeners) -> None:
    port = _free_port()
    w = World()
    squatter = listeners.start(2000, "v6", port)
    _claim(w, "squatter", squatter, 2000, port)  # alone on the port number for now: its claim holds
    w.table.refresh()
    assert haproxy_words(w.table.reply(port))[:2] == ["up", "ready"]
    victim = listeners.start(1000, "v4", port)
    _claim(w, "victim", victim, 1000, port)
    w.table.refresh()
    assert w.table.reply(port) == hints.UNKNOWN_REPLY
    assert w.table.ports_contested == 1


def test_a_held_port_another_uid_binds_later_is_let_go_at_the_next_check(listeners: Listeners) -> None:
    """The victim's server is not hooked; a squatter's hooked process holds the port number. Once the
    victim listens on it too, the periodic check lets the port go: the squatter cannot drain it."""
    from infersight.agent.routing import table as rt

    port = _free_port()
    w = World()
    squatter = listeners.start(2000, "v6", port)
    _claim(w, "squatter", squatter, 2000, port)
    w.table.refresh()
    listeners.start(1000, "v4", port)
    w.clock.t += rt.OWNERS_EVERY_S
    w.table.refresh()
    assert w.table.reply(port) == hints.UNKNOWN_REPLY
    assert w.table.ports_contested == 1


def test_another_uids_many_claims_do_not_crowd_out_the_holders_restart(listeners: Listeners) -> None:
    """Another user binds [::1]:P beside the victim's server and has eight hooked processes say they are ready
    on P: the port is contested (fails open). The victim's server restarts meanwhile; once the other user
    leaves the port number, the restart holds P again. Before, the other user's claims filled the candidates
    before the restart came: P was left vacated with nobody to hold it (its reply failing open, its hints
    gone) until the victim's next restart."""
    from infersight.agent.routing import table as rt

    port = _free_port()
    w = World()
    victim = listeners.start(1000, "v4", port)
    _claim(w, "victim", victim, 1000, port)
    w.table.refresh()
    attacker = listeners.start(2000, "v6", port)
    for n in range(rt.MAX_CANDIDATES):
        _claim(w, "attacker%d" % n, attacker, 2000, port, service="evil")
    assert sum(1 for c in w.table.contested[port] if c[2] == 2000) == rt.MAX_CANDIDATES_PER_UID
    w.dead.add(victim)  # the victim's process ends (its socket stays bound: the restart's, in this test)
    w.table.refresh()
    restart = listeners.start(1000, "v4", _free_port())  # a live process of the victim's uid in this netns
    _claim(w, "restart", restart, 1000, port)  # refused for now: the port is contested
    assert w.table.reply(port) == hints.UNKNOWN_REPLY
    intruder = listeners.procs[1]
    intruder.kill()
    intruder.wait(10)
    w.dead.add(attacker)
    w.clock.t += rt.OWNERS_EVERY_S
    w.table.refresh()
    assert {s["pid"]: s["port"] for s in w.table.snapshot() if s["port"] is not None} == {restart: port}
    assert haproxy_words(w.table.reply(port))[:2] == ["up", "ready"]


def test_a_slow_verdict_from_another_uids_requests_does_not_lower_your_instance() -> None:
    """Routing weighs an instance by the verdicts of its own uid's requests (the device job's
    ``slow_devices_of``): another user who finds the shared GPU slow moves only its own instances."""
    per_uid = {2000: {"cuda:0": 4.0}}
    w = World()
    w.table.slow_devices = lambda uid: per_uid.get(uid, {})
    t = w.clock()
    for producer, pid, uid, port in (("mine", NO_PID + 11, 1000, 8000), ("theirs", NO_PID + 12, 2000, 8001)):
        w.table.observe([_user_span(producer, "coldstart.runtime_init", t - 5, pid, uid),
                         _user_span(producer, "coldstart.ready_wait", t, pid, uid, **{"server.port": port})])
    w.clock.t += hints.SETTLE_S
    w.lat = [_lat("mine", 0.05, 0.05), _lat("theirs", 0.05, 0.05)]
    w.table.refresh()
    assert percent(w.table.reply(8000)) == 100
    assert percent(w.table.reply(8001)) == 25


def test_a_contested_port_goes_back_to_its_holder_once_the_other_uid_leaves(listeners: Listeners) -> None:
    """A brief bind of the same port number by another user must not cancel the victim's routing for
    good: once the victim's uid is alone on the port again, its instance holds it again (the next
    check); and had the victim ended meanwhile, its restart would be drained on it."""
    from infersight.agent.routing import table as rt

    port = _free_port()
    w = World()
    victim = listeners.start(1000, "v4", port)
    _claim(w, "victim", victim, 1000, port)
    w.table.refresh()
    listeners.start(2000, "v6", port)
    w.clock.t += rt.OWNERS_EVERY_S
    w.table.refresh()
    assert w.table.reply(port) == hints.UNKNOWN_REPLY  # contested: fails open
    intruder = listeners.procs.pop()
    intruder.kill()
    intruder.wait(10)
    w.clock.t += rt.OWNERS_EVERY_S
    w.table.refresh()
    assert haproxy_words(w.table.reply(port))[:2] == ["up", "ready"], "the victim holds its port again"
    assert {s["pid"]: s["port"] for s in w.table.snapshot()} == {victim: port}
    listeners.start(2000, "v6", port)  # contested again; then the victim's process ends
    w.clock.t += rt.OWNERS_EVERY_S
    w.table.refresh()
    w.dead.add(victim)
    w.clock.t += rt.OWNERS_EVERY_S
    w.table.refresh()
    w.table.observe([_user_span("restart", "coldstart.runtime_init", w.clock(), 4321, 1000)])
    assert w.table.reply(port) == hints.WARMING_REPLY, "its restart is drained on the port"
