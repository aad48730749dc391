"""An agent upgraded in place adopts the exporter spool the older agent left in the hooks' spool directory.

Agents before 2026-12-01 spooled a down collector's records in ``<spool_dir>/exporters/<name>``; later ones in
``<state_dir>/exporters/<name>``. After an upgrade the old spool was never read, with no log line, and ``status``
said healthy with spooled=0: 300 records the collector never got. The agent now moves that spool into its
state directory at start, read position and all, and the records reach the collector once each.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

from conftest import wait_for
from otlp_receiver import OtlpReceiver

from infersight.agent.daemon.spool import DiskSpool
from infersight.telemetry import LogItem, Resource

BATCHES, PER_BATCH = 6, 50
RESOURCE = Resource.of({"service.name": "old-agent-spooled"})


def _old_spool(directory: Path, first_delivered: bool = True) -> None:
    """What an older agent left: 6 records of 50 log items ("tick 1" .. "tick 300") over two segments, the first
    record delivered already (its read position past it)."""
    spool = DiskSpool(str(directory), 128 << 10)
    try:
        n = 0
        for _ in range(BATCHES):
            batch = []
            for _ in range(PER_BATCH):
                n += 1
                batch.append(LogItem(RESOURCE, time.time_ns(), 9, "INFO", "tick %d" % n, {"n": n, "pad": "x" * 150}))
            assert spool.append(batch) == 0
        assert len(spool.segments) == 2, spool.segments
        if first_delivered:
            _items, records = spool.peek_many(PER_BATCH)
            spool.pop_many(records)
    finally:
        spool.close()


def _agent(agent_factory, rx: OtlpReceiver, state: Path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("INFERSIGHT_STATE_DIR", str(state))  # (the test session's own beats the file's)
    return agent_factory('[exporters.otlp]\nendpoint = "%s"\nprotocol = "http/protobuf"\ntimeout_s = 2\n'
                         % rx.http_endpoint)


def _otlp(status: dict) -> dict:  # type: ignore[type-arg]
    [e] = [e for e in status["exporters"] if e["name"] == "otlp"]
    return e  # type: ignore[no-any-return]


def test_an_older_agents_exporter_spool_is_adopted_and_delivered_once(  # type: ignore[no-untyped-def]
        agent_factory, tmp_path: Path, monkeypatch) -> None:
    rx = OtlpReceiver(grpc_=False)  # not started: the collector is down
    state = tmp_path / "state"
    agent = _agent(agent_factory, rx, state, monkeypatch)
    old = agent.spool / "exporters" / "otlp"
    _old_spool(old)
    agent.start()
    try:
        log = agent.log.read_text()
        assert "adopted 2 segment(s) of an older agent's spool of exporter otlp: renamed from %s" % old in log, log
        assert not old.exists() and not (agent.spool / "exporters").exists(), "the emptied old place is removed"
        assert sorted(p.name for p in (state / "exporters" / "otlp").iterdir()) == [
            "000000000001.seg", "000000000002.seg", "pos"]
        h = agent.status()
        assert _otlp(h)["spooled_items_pending"] == (BATCHES - 1) * PER_BATCH, _otlp(h)
        assert not [w for w in h["warnings"] if "older agent" in w], h["warnings"]

        rx.start()  # the collector is back
        want = ["tick %d" % n for n in range(PER_BATCH + 1, BATCHES * PER_BATCH + 1)]

        def bodies() -> list[str]:
            return [str(rec.body.string_value) for _r, _s, rec in rx.log_records()
                    if str(rec.body.string_value).startswith("tick ")]

        assert rx.wait_for(lambda: len(set(bodies())) >= len(want), 60), agent.log.read_text()
        assert wait_for(lambda: _otlp(agent.status())["spooled_items_pending"] == 0, 30)
        time.sleep(2.0)  # nothing more comes
        counts = collections.Counter(bodies())
        assert sorted(counts) == sorted(want), "the first record was delivered before the upgrade: not again"
        assert set(counts.values()) == {1}, [b for b, c in counts.items() if c > 1][:5]
    finally:
        rx.stop()
        agent.stop()


def test_an_older_agents_spool_is_not_mixed_into_a_spool_that_holds_records(  # type: ignore[no-untyped-def]
        agent_factory, tmp_path: Path, monkeypatch) -> None:
    """Both places hold records: the old spool is left as it is, and the log and `status` say so and how to move
    it (a merge would renumber segments, and the order of the two is not known)."""
    rx = OtlpReceiver(grpc_=False)
    state = tmp_path / "state"
    agent = _agent(agent_factory, rx, state, monkeypatch)
    old = agent.spool / "exporters" / "otlp"
    _old_spool(old, first_delivered=False)
    state.mkdir(mode=0o700)
    _old_spool(state / "exporters" / "otlp", first_delivered=False)
    before = sorted((p.name, p.stat().st_size) for p in old.iterdir())
    agent.start()
    try:
        [w] = [w for w in agent.status()["warnings"] if "older agent" in w]
        assert "spool of exporter otlp is not adopted: the new spool %s holds records too" % (
            state / "exporters" / "otlp") in w, w
        assert "an older agent's spool of exporter otlp is not adopted" in agent.log.read_text()
        assert sorted((p.name, p.stat().st_size) for p in old.iterdir()) == before
    finally:
        agent.stop()
