"""A spool file of one uid cannot take over another uid's spooled events (security.md, "Identity").

The review's attack, as the agent meets it at start: the victim's process ran and exited while the
agent was away, leaving its spool file; its name shows the victim's producer id (any group member
may list the directory). The attacker plants two files that sort first: one whose hello id is
``<victim id>@<victim uid>`` (the key the producer table gave a second uid's entry) with sequence
numbers 1..N, and one with the victim's own id and dead pid. The table had then handed the victim's
hello the attacker's entry: with N = 200 every victim event counted as a duplicate (0 of 20 arrived,
and the victim's file was deleted); with N = 0 all 20 went out under the attacker's uid and service.

Files are made as root and given to two uids (1852, 1853) that need not exist: the agent takes a
spool file's uid from its owner (``fstat``), which is all the kernel says of a file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from infersight.agent.daemon.identity import Peer
from infersight.hooks import _paths, _wire
from infersight.telemetry import Item, LogItem

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to give spool files to other uids")

VICTIM_UID, ATTACKER_UID = 1852, 1853
N_VICTIM = 20


async def _agent(tmp_path: Path) -> Any:
    from infersight.agent.coldstart.extension import ColdStartExtension
    from infersight.agent.daemon import config as cfg
    from infersight.agent.daemon.lifecycle import Agent

    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    conf = cfg.load(None, env={}, flags={
        "agent.socket": str(tmp_path / "a.sock"), "agent.spool_dir": str(spool),
        "agent.state_dir": str(tmp_path / "state"), "agent.health_interval_s": 3600,
        "agent.allowed_uids": [0, VICTIM_UID, ATTACKER_UID],
    })  # fmt: skip
    agent = Agent(conf, [], [ColdStartExtension(conf)], embedded=True)
    await agent.start()
    return agent


def dead_pid() -> int:
    """The pid of a process that has ended (reaped)."""
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def plant(spool: Path, name: str, uid: int, producer: dict[str, Any], events: list[list[Any]]) -> Path:
    f = spool / name
    frames = [_wire.hello_frame(producer, 0)]
    frames += [_wire.encode_batch(events[i:i + 512]) for i in range(0, len(events), 512)]
    f.write_bytes(b"".join(frames))
    os.chown(f, uid, uid)
    os.chmod(f, 0o640)
    return f


def hello(pid_id: str, pid: int, service: str) -> dict[str, Any]:
    return {"id": pid_id, "pid": pid, "start_ns": 1, "trace_id": "ab" * 16, "root_span_id": "cd" * 8,
            "service_name": service}


@pytest.mark.parametrize("filler", [200, 0])
async def test_a_forged_id_cannot_take_another_uids_spooled_events(tmp_path: Path, filler: int) -> None:
    agent = await _agent(tmp_path)
    got: list[LogItem] = []

    def tap(items: Sequence[Item]) -> None:
        got.extend(it for it in items if isinstance(it, LogItem))

    agent.observe(tap)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        vpid = dead_pid()
        vid = "0123456789ab-%d-4242" % vpid
        victim = plant(spool, _paths.spool_file_name(vid, "5a" * 8), VICTIM_UID, hello(vid, vpid, "victim-svc"),
                       [[s, 5, "log", {"body": "VICTIM-LOG-%d" % s}] for s in range(1, N_VICTIM + 1)])
        # The attacker's two files, sorted before the victim's: read first.
        plant(spool, "!1.spool", ATTACKER_UID, hello("%s@%d" % (vid, VICTIM_UID), dead_pid(), "attacker-svc"),
              [[s, 5, "log", {"body": "ATTACKER-FILLER-%d" % s}] for s in range(1, filler + 1)])
        plant(spool, "!2.spool", ATTACKER_UID, hello(vid, vpid, "attacker-svc"),
              [[1, 5, "log", {"body": "ATTACKER-HOLDS-VID"}]])
        assert sorted(os.listdir(spool))[-1] == victim.name

        await agent.ingest.replay_spools_async(str(spool))
        deadline = time.monotonic() + 30
        while victim.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

        mine = [it for it in got if it.body.startswith("VICTIM-LOG-")]
        assert sorted(int(it.body.rsplit("-", 1)[1]) for it in mine) == list(range(1, N_VICTIM + 1)), \
            "every victim record arrives, once"
        assert {(it.resource.get("process.user.id"), it.resource.get("service.name")) for it in mine} == \
            {(VICTIM_UID, "victim-svc")}, "under the victim's uid and service"
        forged = [it for it in got if it.body.startswith("ATTACKER")]
        assert all(it.resource.get("process.user.id") == ATTACKER_UID for it in forged)
        assert not [it for it in forged if it.body.startswith("ATTACKER-FILLER")], "the '@' id was refused"
        assert agent.counters.duplicates == 0
        assert agent.counters.malformed_frames >= 1  # the '@' hello
        assert not victim.exists(), "the victim's file goes once its own events are exported"
        # No producer of the attacker's uid holds a key another uid's entry could take.
        for p in agent.assembler.producers.values():
            assert p.uid != ATTACKER_UID or "@" not in p.id
            assert p.uid != VICTIM_UID or p.id in (vid, "%s@%d" % (vid, VICTIM_UID))
    finally:
        await agent.shutdown(5)


async def test_a_hello_of_one_uid_never_finds_another_uids_producer(tmp_path: Path) -> None:
    """Whatever the order of the hellos, each uid's hello of an id reaches that uid's own entry."""
    agent = await _agent(tmp_path)
    try:
        rx = agent.ingest.receiver
        vpid = dead_pid()
        vid = "0123456789ab-%d-4242" % vpid

        def say(pid_id: str, uid: int) -> Any:
            return rx.hello({"t": "hello", "schema": 1, "producer": hello(pid_id, vpid, "s")}, None, Peer(uid, None))

        a1 = say(vid, ATTACKER_UID)
        v1 = say(vid, VICTIM_UID)
        forged = "%s@%d" % (vid, VICTIM_UID)
        assert say(forged, ATTACKER_UID) is None
        # Nor from another pid namespace, whose hello is otherwise taken as it comes: no id spells a uid's key.
        msg = {"t": "hello", "schema": 1, "producer": hello(forged, vpid, "s")}
        assert rx.hello(msg, None, Peer(ATTACKER_UID, 0)) is None
        assert a1 is not None and v1 is not None and a1 is not v1
        assert say(vid, VICTIM_UID) is v1 and say(vid, ATTACKER_UID) is a1
        assert (a1.uid, v1.uid) == (ATTACKER_UID, VICTIM_UID)
        rx.process_batch(a1, [[s, 5, "log", {"body": "x"}] for s in range(1, 101)])
        rx.process_batch(v1, [[s, 5, "log", {"body": "y"}] for s in range(1, 21)])
        assert v1.events == 20 and v1.seq.duplicates == 0
    finally:
        await agent.shutdown(5)


async def test_an_id_of_odd_digits_is_refused_not_raised(tmp_path: Path) -> None:
    """``"\u00b2".isdigit()`` is true and ``int()`` refuses it: such an id raised out of the identity check."""
    agent = await _agent(tmp_path)
    try:
        rx = agent.ingest.receiver
        for uid, pid in ((VICTIM_UID, None), (VICTIM_UID, 4321), (VICTIM_UID, 0)):
            odd = {"t": "hello", "schema": 1, "producer": hello("ab-\u00b2-1", 7, "s")}
            assert rx.hello(odd, None, Peer(uid, pid)) is None
    finally:
        await agent.shutdown(5)


FORGED = "x\n2026-12-04 10:00:00,000 ERROR infersight.agent: FORGED: the agent is compromised-5-1"


class _Writer:
    def __init__(self) -> None:
        self.data = b""

    def write(self, b: bytes) -> None:
        self.data += b


async def test_a_producers_words_cannot_forge_a_line_of_the_agents_log(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    agent = await _agent(tmp_path)
    caplog.set_level(logging.WARNING)
    try:
        rx = agent.ingest.receiver
        w = _Writer()
        msg = {"t": "hello", "schema": 1, "producer": hello(FORGED, 1234, "s")}
        assert rx.hello(msg, w, Peer(VICTIM_UID, 4321)) is None  # type: ignore[arg-type]
        reply = _wire.decode_payload(w.data[_wire.HEADER.size:])
        assert reply is not None and reply["t"] == "refuse"
        assert "\n" not in reply["error"]
        # A file name in the spool directory (any group member may make one) reaches the log too.
        spool = Path(agent.config["agent.spool_dir"])
        named = spool / ("y\n2026-12-04 10:00:01,000 ERROR infersight.agent: FORGED%s" % _paths.SPOOL_SUFFIX)
        named.write_bytes(b"")
        os.chown(named, 4444, 4444)  # a uid not allowed: passed over, and said so
        rx.rlog = type(rx.rlog)(0.0)  # no rate limit: each line is looked at
        await agent.ingest.replay_spools_async(str(spool))
        lines = [r.getMessage() for r in caplog.records]
        assert any("identity refused" in x or "refused a hello" in x for x in lines), lines
        assert any("not replaying" in x for x in lines), lines
        for line in lines:
            assert "\n" not in line, line
            assert len(line) < 2000
    finally:
        await agent.shutdown(5)


async def test_a_producer_kept_under_its_uids_key_has_its_spool_read_when_it_ends(tmp_path: Path) -> None:
    """A producer another uid's hello of its id had preceded is kept as ``<id>@<uid>``; its spool files are
    named by the id it said. When it ended, the agent looked for files named by its table key, found none, and
    closed its cold start before reading what it had spooled (its root, often)."""
    agent = await _agent(tmp_path)
    got: list[LogItem] = []
    agent.observe(lambda items: got.extend(it for it in items if isinstance(it, LogItem)))
    try:
        rx = agent.ingest.receiver
        vpid = dead_pid()
        vid = "0123456789ab-%d-4242" % vpid
        assert rx.hello({"t": "hello", "schema": 1, "producer": hello(vid, vpid, "s")}, None,
                        Peer(ATTACKER_UID, None)) is not None  # the other uid, first
        victim = rx.hello({"t": "hello", "schema": 1, "producer": hello(vid, vpid, "victim-svc")}, None,
                          Peer(VICTIM_UID, None))
        assert victim is not None and victim.id == "%s@%d" % (vid, VICTIM_UID)
        spool = Path(agent.config["agent.spool_dir"])
        f = plant(spool, _paths.spool_file_name(vid, "5a" * 8), VICTIM_UID, hello(vid, vpid, "victim-svc"),
                  [[1, 5, "log", {"body": "SPOOLED-AT-EXIT"}]])
        agent.ingest.publish_lost(victim)
        deadline = time.monotonic() + 30
        while not any(it.body == "SPOOLED-AT-EXIT" for it in got) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert [it.resource.get("process.user.id") for it in got if it.body == "SPOOLED-AT-EXIT"] == [VICTIM_UID]
        assert not f.exists()
    finally:
        await agent.shutdown(5)
