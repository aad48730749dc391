"""The producer table under another user's flood of hellos (security.md, "Bounds per producer").

A uid holds at most a quarter of the table (``MAX_PRODUCERS_PER_UID``): past it, that uid's
new producers evict its own oldest ones, or are refused when none of its own may go, counted
(``assembler.over_uid_producers``). When the table itself is full, a producer that is connected
or still in its cold start goes only when nothing else could. Before, the table evicted its
oldest entry whoever it was: another uid's ~4500 hellos pushed out a victim in its cold start
(``pending_stages_dropped`` 2, and its launch session lost it).

The first test runs a real agent (the cold-start extension, a real socket for the victim) and
floods it through the ingest's own hello path, as a connection of another uid reaches it (the
kernel's uid is what ``Peer`` carries; a test cannot connect as another user).
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from infersight.agent.coldstart.assembly import coldstart_assembler
from infersight.agent.daemon import assemble
from infersight.agent.daemon.assemble import MAX_PRODUCERS, Assembler, Producer
from infersight.agent.daemon.health import Counters, health_metrics
from infersight.agent.daemon.identity import Peer
from infersight.hooks import _wire
from infersight.telemetry import Resource

# (looked up so that, on an assembler without a per-uid budget, the tests fail on what it does)
MAX_PRODUCERS_PER_UID: int = getattr(assemble, "MAX_PRODUCERS_PER_UID", MAX_PRODUCERS // 4)
ProducerTableFull = assemble.ProducerTableFull
UID_B = 54321  # the neighbour: never the uid the tests run as
SESSION = "5e" * 16
ROOT_SPAN = "b" * 16
DEAD_PID = 4_194_305  # above any pid_max (4194304): never a live process the identity check could find


def producer(pid: int, pid_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": pid_id, "pid": pid, "start_ns": 1, "trace_id": "%032x" % (pid + 1),
            "root_span_id": ROOT_SPAN, **extra}


def stage(seq: int, span_id: int) -> list[Any]:
    """A cold-start stage span as the hooks send it: kept pending until its root arrives."""
    return [seq, 2_000, "span", {"n": "coldstart.imports", "id": "%016x" % span_id, "p": ROOT_SPAN,
                                 "s": 1_000, "e": 2_000}]


async def _embedded_agent(tmp_path: Path, sock: Path, spool: Path) -> Any:
    """The agent in this process, with its cold-start extension, started."""
    from infersight.agent.coldstart.extension import ColdStartExtension
    from infersight.agent.daemon import config as cfg
    from infersight.agent.daemon.lifecycle import Agent

    conf = cfg.load(None, env={}, flags={
        "agent.socket": str(sock), "agent.spool_dir": str(spool),
        "agent.state_dir": str(tmp_path / "state"), "agent.health_interval_s": 3600,
    })  # fmt: skip
    agent = Agent(conf, [], [ColdStartExtension(conf)], embedded=True)
    await agent.start()
    return agent


async def read_ack(sock: socket.socket, seq: int) -> None:
    loop = asyncio.get_running_loop()
    want, buf = _wire.ack_frame(seq), b""
    while want not in buf:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 30)
        assert chunk, "the agent closed the victim's connection"
        buf += chunk


async def test_another_uids_flood_of_hellos_cannot_evict_a_producer_in_its_cold_start(tmp_path: Path) -> None:
    agent = await _embedded_agent(tmp_path, tmp_path / "a.sock", tmp_path / "spool")
    loop = asyncio.get_running_loop()
    victim = socket.socket(socket.AF_UNIX)
    victim.setblocking(False)
    try:
        await loop.sock_connect(victim, agent.config["agent.socket"])
        await loop.sock_sendall(victim, _wire.hello_frame(producer(os.getpid(), "victim", session=SESSION)))
        await loop.sock_sendall(victim, _wire.encode_frame({"t": "b", "e": [stage(1, 1), stage(2, 2)]}))
        await read_ack(victim, 2)
        assert agent.ingest.connected("victim")
        res: Resource = agent.assembler.producers["victim"].resource

        flood = MAX_PRODUCERS + 400  # more than the whole table, from one neighbour
        accepted = 0
        for i in range(flood):
            msg = {"t": "hello", "schema": 1, "producer": producer(200_000 + i, "flood-%d" % i)}
            accepted += agent.ingest.hello(msg, Peer(UID_B, 0)) is not None

        assert "victim" in agent.assembler.producers, "another uid's hellos evicted a connected producer"
        assert agent.sessions._producer_info(res) is not None, "the launch session still finds the victim"
        assert agent.assembler.live is not None and agent.assembler.live("victim"), \
            "the table knows which producers are connected (the agent's liveness)"
        st = agent.health()["assembler"]
        assert st["pending_stages_dropped"] == 0, "the victim's pending stages were dropped"
        assert accepted == flood, "the neighbour's producers took the place of its own oldest"
        of_b = [p for p in agent.assembler.producers.values() if p.uid == UID_B]
        assert len(of_b) == MAX_PRODUCERS_PER_UID
        assert st["producers"] == MAX_PRODUCERS_PER_UID + 1
        assert st["producers_evicted_uid_budget"] == flood - MAX_PRODUCERS_PER_UID
        assert st["producers_evicted"] == flood - MAX_PRODUCERS_PER_UID
        assert st["producers_evicted_protected"] == 0 and st["over_uid_producers"] == 0
        # The newest of the neighbour's stay, its oldest went.
        assert "flood-%d" % (flood - 1) in agent.assembler.producers and "flood-0" not in agent.assembler.producers
        # The same counts in the agent's own metrics.
        items = health_metrics(agent.resource, 0, Counters(), 0, 0, [], 0.0, 0, st)
        (evicted,) = [m for m in items if m.name == "infersight.agent.producers.evicted"]
        by_reason = {p.attributes["infersight.reason"]: p.value for p in evicted.points}
        assert by_reason == {"uid_budget": flood - MAX_PRODUCERS_PER_UID, "protected": 0, "table_full": 0}
    finally:
        victim.close()
        await agent.shutdown(5)


async def test_a_uid_whose_producers_may_not_go_is_refused_and_counted(tmp_path: Path) -> None:
    """The neighbour's own producers are all in their cold start: its next hello is refused
    (the ingest's refusal path), counted; another uid's hello still gets in."""
    agent = await _embedded_agent(tmp_path, tmp_path / "a.sock", tmp_path / "spool")
    try:
        for i in range(MAX_PRODUCERS_PER_UID):
            p = agent.ingest.hello({"t": "hello", "schema": 1, "producer": producer(300_000 + i, "b-%d" % i)},
                                   Peer(UID_B, 0))
            assert p is not None
            agent.ingest.process_batch(p, [stage(1, i + 1)])
        malformed_before = agent.counters.malformed_frames
        refused = agent.ingest.hello({"t": "hello", "schema": 1, "producer": producer(299_999, "b-more")},
                                     Peer(UID_B, 0))
        assert refused is None
        st = agent.health()["assembler"]
        assert st["over_uid_producers"] == 1 and st["producers_evicted"] == 0
        assert "b-0" in agent.assembler.producers and "b-more" not in agent.assembler.producers
        assert agent.counters.malformed_frames == malformed_before  # "not now", not a bad hello
        other = agent.ingest.hello({"t": "hello", "schema": 1, "producer": producer(299_998, "c-1")},
                                   Peer(UID_B + 1, 0))
        assert other is not None and other.uid == UID_B + 1
        items = health_metrics(agent.resource, 0, Counters(), 0, 0, [], 0.0, 0, st)
        (refusals,) = [m for m in items if m.name == "infersight.agent.producers.refused"]
        assert [p.value for p in refusals.points] == [1]
    finally:
        await agent.shutdown(5)


def hello(asm: Assembler, n: int, uid: int | None, prefix: str = "p") -> Producer:
    return asm.hello(producer(10_000 + n, "%s-%d" % (prefix, n)), uid=uid)


def test_a_full_table_keeps_connected_and_cold_starting_producers_while_others_can_go() -> None:
    """Four neighbours each at their budget fill the table: the next producer evicts an entry
    that is neither connected nor in its cold start (the heaviest uid's oldest), never the
    victims that are older than all of them."""
    asm = coldstart_assembler("h")
    connected: set[str] = set()
    asm.live = connected.__contains__
    online = hello(asm, 0, 1000, "victim-online")  # connected, no cold start state
    connected.add(online.id)
    cold = hello(asm, 1, 1000, "victim-cold")  # hung up, a stage pending: its process may still live
    asm.events(cold, [stage(1, 7)])
    assert asm.awaits_end(cold)
    departed = hello(asm, 2, 1000, "departed")  # neither: may go (but the heaviest uid goes first)
    for uid in (2001, 2002, 2003, 2004):
        for i in range(MAX_PRODUCERS_PER_UID):
            hello(asm, i, uid, "u%d" % uid)
    assert len(asm.producers) == MAX_PRODUCERS
    st = asm.stats()
    assert st["producers_evicted"] == 3 and st["producers_evicted_uid_budget"] == 0
    for p in (online, cold):
        assert p.id in asm.producers
    assert st["pending_stages_dropped"] == 0 and st["producers_evicted_protected"] == 0
    # Each time, the uid holding the most entries gave up its oldest: uid 1000's departed
    # producer (one of three) stays while the neighbours hold a thousand each.
    assert departed.id in asm.producers
    assert [pid for pid in ("u2001-0", "u2002-0", "u2003-0", "u2004-0") if pid not in asm.producers] == [
        "u2001-0", "u2002-0", "u2003-0"]


def test_when_every_entry_must_stay_the_global_bound_still_holds() -> None:
    """All of the table connected: a new producer still gets in, the bound holds, and the
    forced eviction (the heaviest uid's oldest) is counted."""
    asm = Assembler("h", resource_env={})
    asm.live = lambda _pid: True
    for uid in (3001, 3002, 3003, 3004):
        for i in range(MAX_PRODUCERS_PER_UID):
            hello(asm, i, uid, "u%d" % uid)
    extra = hello(asm, 0, 3005, "late")
    assert extra.id in asm.producers and len(asm.producers) == MAX_PRODUCERS
    st = asm.stats()
    assert st["producers_evicted_protected"] == 1 and st["producers_evicted"] == 1


def test_a_uid_at_its_budget_with_nothing_to_give_is_refused() -> None:
    asm = Assembler("h", resource_env={})
    asm.live = lambda _pid: True
    for i in range(MAX_PRODUCERS_PER_UID):
        hello(asm, i, UID_B)
    with pytest.raises(ProducerTableFull) as refused:
        hello(asm, MAX_PRODUCERS_PER_UID, UID_B)
    assert not isinstance(refused.value, assemble.Malformed), "not a bad hello: the hook may come back later"
    assert asm.stats()["over_uid_producers"] == 1 and len(asm.producers) == MAX_PRODUCERS_PER_UID
    # Root and in-process producers are not held to a uid's share (root may speak for anyone).
    for i in range(MAX_PRODUCERS_PER_UID + 10):
        hello(asm, i, 0, "root")
    assert sum(1 for p in asm.producers.values() if p.uid == 0) == MAX_PRODUCERS_PER_UID + 10


async def _full_share(tmp_path: Path, base: Path) -> Any:
    """An embedded agent whose uid UID_B holds its whole share, every producer in its cold start;
    its socket and spool under ``base`` (which other uids can traverse)."""
    spool = base / "spool"
    spool.mkdir(mode=0o700)
    agent = await _embedded_agent(tmp_path, base / "run" / "a.sock", spool)
    for i in range(MAX_PRODUCERS_PER_UID):
        p = agent.ingest.hello({"t": "hello", "schema": 1, "producer": producer(300_000 + i, "b-%d" % i)},
                               Peer(UID_B, 0))
        assert p is not None
        agent.ingest.process_batch(p, [stage(1, i + 1)])
    return agent


async def test_a_spool_file_of_a_uid_at_its_share_waits_for_a_later_scan(tmp_path: Path) -> None:
    """Before, the turned-away hello broke the replay, which then counted the file as replayed and
    unlinked it: a dead producer's events were deleted unread."""
    from infersight.hooks import _paths

    if os.geteuid() != 0:
        pytest.skip("needs root to give the spool file another owner")
    agent = await _full_share(tmp_path, tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        f = spool / _paths.spool_file_name("dead-b", "00" * 8)
        f.write_bytes(_wire.hello_frame(producer(DEAD_PID, "dead-b"), 0)
                      + _wire.encode_frame({"t": "b", "e": [[1, 5, "log", {"m": "kept"}]]}))
        os.chown(f, UID_B, -1)
        assert agent.ingest.replay_spools(str(spool)) == 0
        assert f.exists(), "a spool file was deleted without its events being replayed"
        assert agent.counters.spool_files_replayed == 0
    finally:
        await agent.shutdown(5)


async def test_a_hello_of_a_uid_at_its_share_is_closed_without_a_refusal(tmp_path: Path) -> None:
    """A ``refuse`` frame makes the hooks stop trying for the rest of their process's life: at the
    share, the agent closes the connection without one (as at its connection cap), and the hook
    comes back later."""

    from fleet_env import open_base, system_python

    if os.geteuid() != 0:
        pytest.skip("needs root to connect as the neighbour's uid")
    with open_base("isf-share-") as base:
        await _hello_at_full_share(tmp_path, base, system_python())


async def _hello_at_full_share(tmp_path: Path, base: Path, python: str) -> None:
    import subprocess

    agent = await _full_share(tmp_path, base)
    try:
        sock = agent.config["agent.socket"]
        os.chmod(os.path.dirname(sock), 0o755)
        os.chmod(sock, 0o777)
        # the hello speaks for the connecting process itself (its own pid), as a hook's does
        code = ("import json, os, socket, struct, sys\n"
                "p = {'id': 'b-more', 'pid': os.getpid(), 'start_ns': 1, 'trace_id': '9' * 32, "
                "'root_span_id': 'b' * 16}\n"
                "body = json.dumps({'t': 'hello', 'schema': 1, 'producer': p}).encode()\n"
                "s = socket.socket(socket.AF_UNIX)\ns.settimeout(20)\ns.connect(%r)\n"
                "s.sendall(struct.pack('>I', len(body)) + body)\nbuf = b''\nwhile True:\n"
                "    c = s.recv(65536)\n    if not c:\n        break\n    buf += c\n"
                "sys.stdout.write(buf.hex())\n" % sock)
        proc = await asyncio.create_subprocess_exec(python, "-c", code, user=UID_B,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        reply = bytes.fromhex(out.decode())
        assert b"refuse" not in reply and reply == b"", reply
        assert agent.assembler.stats()["over_uid_producers"] == 1
    finally:
        await agent.shutdown(5)
