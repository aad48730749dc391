"""A planted spool file or directory holds the agent's event loop only briefly.

A member of the socket group planted one file of 512 frames of 2,048 log events (about 1 MiB each): the
scan, which gave the loop back every 256 frames, held it 63-78 s (past the watchdog). 1.5 million planted
names (hard links) had every scan list, sort and open each name on the loop (7 s). Now a scan gives the
loop back every ``SLICE_S`` of loop time, waits for its batches' share of the exporters' queues, lists a
large directory in a thread and considers at most ``MAX_SCAN_NAMES`` names, owner uids in turn.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from infersight.agent.daemon import replay
from infersight.hooks import _paths, _wire

DEAD_PID = 4_194_305  # above any pid_max (4194304): never a live process the identity check could find


async def _agent(tmp_path: Path, sink: bool = False) -> Any:
    from infersight.agent.daemon import config as cfg
    from infersight.agent.daemon.lifecycle import Agent

    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700, exist_ok=True)
    flags: dict[str, Any] = {"agent.socket": str(tmp_path / "a.sock"), "agent.spool_dir": str(spool),
                             "agent.state_dir": str(tmp_path / "state"), "agent.health_interval_s": 3600}
    if sink:
        flags["exporters.file.path"] = str(tmp_path / "out.jsonl")
    conf = cfg.load(None, env={}, flags=flags)
    agent = Agent(conf, [], [], embedded=True)
    await agent.start()
    return agent


def _wide_file(spool: Path, producer_id: str, frames: int, events: int = _wire.MAX_BATCH_EVENTS_READ,
               width: int = 400) -> Path:
    """A spool file of ``frames`` batches of ``events`` log events (the attack's, smaller)."""
    f = spool / _paths.spool_file_name(producer_id, "00" * 8)
    hello = {"id": producer_id, "pid": DEAD_PID, "start_ns": 1, "trace_id": "%032x" % 299_001,
             "root_span_id": "b" * 16}
    with open(f, "wb") as out:
        out.write(_wire.hello_frame(hello, 0))
        seq = 0
        for _ in range(frames):
            batch = []
            for _ in range(events):
                seq += 1
                batch.append([seq, 2_000, "log", {"m": "x" * width}])
            frame = _wire.encode_frame({"t": "b", "e": batch})
            assert len(frame) <= _wire.MAX_FRAME_BYTES
            out.write(frame)
    return f


async def test_the_scan_gives_the_loop_back_after_each_slice_of_loop_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames were counted, not time: 8 frames of 2,048 events (each tens of milliseconds) ran in one go.
    With a clock on which every frame takes a whole slice, the loop gets control back between every two."""
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        frames = 8
        _wide_file(spool, "dead-wide", frames, events=64, width=16)
        now = [0.0]

        def clock() -> float:
            now[0] += replay.SLICE_S  # every look at the clock: one more slice of loop time spent
            return now[0]

        agent.ingest.spools.clock = clock
        ticks, done = [0], [False]

        async def ticker() -> None:
            while not done[0]:
                ticks[0] += 1
                await asyncio.sleep(0)

        t = asyncio.get_running_loop().create_task(ticker())
        await asyncio.sleep(0)
        ticks[0] = 0
        assert await agent.ingest.replay_spools_async(str(spool)) == 1
        done[0] = True
        await t
        assert ticks[0] >= frames, "the replay held the loop across frames that each took a slice of it"
    finally:
        await agent.shutdown(5)


async def test_a_status_probe_is_answered_while_a_planted_file_of_wide_batches_is_replayed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviewer's file, smaller: before, its frames ran in one go and the probe waited for all. Each
    batch is made to cost 20 ms of the loop (as the reviewer's, with their exporters, cost more)."""
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        _wide_file(spool, "dead-planted", 24, events=512, width=100)
        receiver = agent.ingest.receiver
        real = receiver.process_batch

        def costly(*a: Any, **kw: Any) -> None:
            time.sleep(0.02)
            real(*a, **kw)

        monkeypatch.setattr(receiver, "process_batch", costly)
        task = asyncio.get_running_loop().create_task(agent.ingest.replay_spools_async(str(spool)))
        await asyncio.sleep(0)
        reader, writer = await asyncio.open_unix_connection(agent.config["agent.socket"])
        try:
            writer.write(_wire.STATUS_FRAME)
            n = _wire.frame_size(await asyncio.wait_for(reader.readexactly(_wire.HEADER.size), 30))
            await reader.readexactly(n)
            answered_mid_replay = not task.done()
        finally:
            writer.close()
        assert await task == 1
        assert answered_mid_replay, "status waited for the whole planted file"
        assert agent.ingest.spools.gave_back >= 2
    finally:
        await agent.shutdown(5)


async def test_a_batch_of_more_events_than_the_wire_allows_is_refused_whole(tmp_path: Path) -> None:
    """As over a connection (350,000 empty events in one frame cost the loop 0.3 s)."""
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        _wide_file(spool, "dead-huge", 1, events=_wire.MAX_BATCH_EVENTS_READ + 1, width=1)
        before = agent.counters.events_in
        assert await agent.ingest.replay_spools_async(str(spool)) == 1
        assert agent.counters.events_in == before and agent.counters.malformed_frames == 1
    finally:
        await agent.shutdown(5)


async def test_a_scan_waits_for_its_share_of_the_exporters_queues(tmp_path: Path) -> None:
    """Replay published every batch at once (RSS 89 -> 300 MiB): now it reads on only while the owner's
    batches fit their share of the queues, as a connection does."""
    agent = await _agent(tmp_path, sink=True)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        _wide_file(spool, "dead-queued", 6, events=512, width=16)
        broadcaster = agent.ingest.receiver.broadcaster
        waits = [0]
        real = broadcaster.wait_turn

        async def wait_turn(uid: int) -> None:
            waits[0] += 1
            await real(uid)

        full = iter([True, True] + [False] * 10_000)
        broadcaster.must_wait = lambda uid: next(full)  # type: ignore[method-assign]
        broadcaster.wait_turn = wait_turn  # type: ignore[method-assign]
        assert await agent.ingest.replay_spools_async(str(spool)) == 1
        assert waits[0] >= 1, "the replay never asked whether the exporters had room"
    finally:
        await agent.shutdown(5)


async def test_a_large_directory_is_listed_off_the_loop_and_a_scan_opens_a_bounded_number_of_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted hard links (any member can make 65,000 per file): the loop neither lists them nor opens
    more than MAX_SCAN_NAMES per scan; each file is refused once; a victim's file still replays."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the planted names another owner")
    monkeypatch.setattr(replay, "MAX_SCAN_NAMES", 32)
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        target = spool / "0000-attack.spool"
        target.write_bytes(b"")
        os.chown(target, 54_321, -1)
        for k in range(1000):  # sorted before the victim's
            os.link(target, spool / ("0000-attack-%04d.spool" % k))
        for k in range(200):  # plain files of the attacker's, also before the victim's
            f = spool / ("0001-attack-%04d.spool" % k)
            f.write_bytes(b"")
            os.chown(f, 54_321, -1)
        victim = spool / _paths.spool_file_name("dead-victim", "00" * 8)
        victim.write_bytes(_wire.hello_frame({"id": "dead-victim", "pid": 299_000, "start_ns": 1,
                                              "trace_id": "%032x" % 1, "root_span_id": "b" * 16}, 0))
        main = threading.get_ident()
        opened, listed = [0], [0]
        real_open, real_listdir, real_scandir = os.open, os.listdir, os.scandir

        def counting_open(path: Any, *a: Any, **kw: Any) -> int:
            if threading.get_ident() == main and "dir_fd" in kw:
                opened[0] += 1
            return real_open(path, *a, **kw)

        def counting_listdir(*a: Any) -> list[str]:
            if threading.get_ident() == main:
                listed[0] += 1
            return real_listdir(*a)

        def counting_scandir(*a: Any) -> Any:
            it = real_scandir(*a)
            if threading.get_ident() != main:
                return it

            def entries() -> Any:
                with it:
                    for e in it:
                        listed[0] += 1
                        yield e

            class _Ctx:
                def __enter__(self) -> Any:
                    return entries()

                def __exit__(self, *exc: Any) -> None:
                    it.close()

            return _Ctx()

        monkeypatch.setattr(os, "open", counting_open)
        monkeypatch.setattr(os, "listdir", counting_listdir)
        monkeypatch.setattr(os, "scandir", counting_scandir)
        await agent.ingest.replay_spools_async(str(spool))
        assert not victim.exists(), "the victim's file waited behind another uid's planted names"
        assert opened[0] <= replay.MAX_SCAN_NAMES, "a scan opened %d names on the loop" % opened[0]
        assert listed[0] <= 4 * replay.MAX_SCAN_NAMES + 1, "the loop listed %d names" % listed[0]
        assert agent.ingest.spools.names_waiting.get(54_321, 0) > 1000, agent.ingest.spools.names_waiting
        refused = agent.counters.spool_files_refused
        await agent.ingest.replay_spools_async(str(spool))
        assert agent.counters.spool_files_refused == refused  # the hard-linked file: counted once
    finally:
        await agent.shutdown(5)


def test_owner_uids_take_turns_and_a_uid_goes_on_after_its_cursor(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give names other owners")
    for k in range(50):
        f = tmp_path / ("a-%03d.spool" % k)
        f.write_bytes(b"")
        os.chown(f, 54_321, -1)
    (tmp_path / "z-victim.spool").write_bytes(b"")
    first = replay.list_spool(str(tmp_path), "", 10, {})
    assert first.total == 51 and len(first.names) == 10 and "z-victim.spool" in first.names
    assert first.waiting == {54_321: 41}
    second = replay.list_spool(str(tmp_path), "", 10, first.cursors)
    assert not set(second.names) & (set(first.names) - {"z-victim.spool"})  # the attacker's next names


# -- an ended producer's files in a large directory (deferred to a task) -------------------------------

ENDED_ID = "boot-299000-1"
ENDED_HELLO = {"id": ENDED_ID, "pid": 299_000, "start_ns": 1, "trace_id": "%032x" % 299_001, "root_span_id": "b" * 16}


def _ended_file(spool: Path, frames: int) -> Path:
    f = spool / _paths.spool_file_name(ENDED_ID, "00" * 8)
    with open(f, "wb") as out:
        out.write(_wire.hello_frame(ENDED_HELLO, 0))
        for s in range(1, frames + 1):
            out.write(_wire.encode_frame({"t": "b", "e": [[s, 2_000, "log", {"m": "x%d" % s}]]}))
    for k in range(30):  # a large directory, for MAX_SCAN_NAMES = 4: names of others
        (spool / ("zz-%02d" % k)).write_bytes(b"")
    return f


async def test_an_ended_producer_is_not_closed_while_the_scan_still_reads_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan was mid-file (the root is often its last frames) when the producer's process ended; the
    deferred look for its files found that file taken, and closed the producer as lost at once."""
    from infersight.agent.daemon.identity import Peer

    monkeypatch.setattr(replay, "MAX_SCAN_NAMES", 4)
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        ingest = agent.ingest
        p = ingest.receiver.hello({"t": "hello", "schema": 1, "producer": ENDED_HELLO}, None, Peer(0, None))
        assert p is not None
        _ended_file(spool, 40)
        now = [0.0]

        def clock() -> float:  # every frame takes a whole slice: the scan gives the loop back after each
            now[0] += replay.SLICE_S
            return now[0]

        ingest.spools.clock = clock
        gone_while_reading: list[bool] = []
        real_step = replay._Pace.step

        async def step(self: Any, uid: Any) -> None:
            if ingest.spools._reading:
                gone_while_reading.append(p.gone)
            await real_step(self, uid)

        monkeypatch.setattr(replay._Pace, "step", step)
        scan = asyncio.get_running_loop().create_task(ingest.replay_spools_async(str(spool)))
        # until it reads the file (a large directory: listed in a thread first, late on a loaded machine); it then
        # gives the loop back after each of its 40 frames, so this sees it mid-file
        deadline = time.monotonic() + 30
        while not ingest.spools._reading and not scan.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        assert ingest.spools._reading, "the scan is mid-file"
        ingest.publish_lost(p)
        assert not p.gone
        await scan
        assert gone_while_reading and not any(gone_while_reading)
        deadline = time.monotonic() + 30  # its end closes it, once read
        while not p.gone and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert p.gone
    finally:
        await agent.shutdown(5)


async def test_the_agents_stop_ends_the_deferred_replays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deferred replay of an ended producer's files went on publishing after the drain and the exporters'
    shutdown (and the sequence state saved for the next agent, which would then take its events for
    duplicates). The stop now cancels and awaits it; the file stays for the next agent."""
    from infersight.agent.daemon.identity import Peer

    monkeypatch.setattr(replay, "MAX_SCAN_NAMES", 4)
    agent = await _agent(tmp_path, sink=True)
    ingest = agent.ingest
    p = ingest.receiver.hello({"t": "hello", "schema": 1, "producer": ENDED_HELLO}, None, Peer(0, None))
    f = _ended_file(Path(agent.config["agent.spool_dir"]), 200)
    real_step = replay._Pace.step

    async def slow_step(self: Any, uid: Any) -> None:  # busy exporters: each frame takes a while
        await asyncio.sleep(0.01)
        await real_step(self, uid)

    monkeypatch.setattr(replay._Pace, "step", slow_step)
    ingest.publish_lost(p)
    await asyncio.sleep(0.05)
    await agent.shutdown(1)
    at_end = agent.counters.events_in
    assert not [t for t in ingest.spools._later if not t.done()]
    await asyncio.sleep(0.3)
    assert agent.counters.events_in == at_end, "nothing published after the stop"
    assert f.exists()


async def test_an_ended_producers_listing_leaves_the_scans_turns_alone(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The deferred replay's listing (one prefix) replaced the periodic scan's per-uid cursors and its listing
    time: every producer's end started the scan's turns over from the first names."""
    monkeypatch.setattr(replay, "MAX_SCAN_NAMES", 4)
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        for k in range(30):
            (spool / ("a-%03d.spool" % k)).write_bytes(b"")  # empty: refused, stay
        spools = agent.ingest.spools
        await spools.replay_async(str(spool))
        cursors, list_s = dict(spools._cursors), spools.list_s
        assert cursors
        await spools.replay_async(str(spool), "boot-1-2-")
        assert spools._cursors == cursors and spools.list_s == list_s
    finally:
        await agent.shutdown(5)
