"""A spool file costs the agent bounded work, and no file holds its event loop.

The spool directory is writable by the socket group, so any member can plant a file there. A
sparse 32 MiB ``*.spool`` file (no disk blocks: ``truncate -s``) is 8 Mi empty frames, and the
agent used to read the whole file, split it and decode every frame in one go on its event loop
(28 s without answering; 256 MiB: minutes, SIGTERM ignored). Now a run of frames that are not
the wire's ends the file (refused and counted once), frames are taken a piece at a time, and a
scan of the whole directory gives the loop back every few hundred frames.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from infersight.agent.daemon import replay
from infersight.hooks import _paths, _wire

ROOT_SPAN = "b" * 16
DEAD_PID = 4_194_305  # above any pid_max (4194304): never a live process the identity check could find


async def _agent(tmp_path: Path) -> Any:
    from infersight.agent.coldstart.extension import ColdStartExtension
    from infersight.agent.daemon import config as cfg
    from infersight.agent.daemon.lifecycle import Agent

    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    conf = cfg.load(None, env={}, flags={
        "agent.socket": str(tmp_path / "a.sock"), "agent.spool_dir": str(spool),
        "agent.state_dir": str(tmp_path / "state"), "agent.health_interval_s": 3600,
    })  # fmt: skip
    agent = Agent(conf, [], [ColdStartExtension(conf)], embedded=True)
    await agent.start()
    return agent


class LoopTicks:
    """Counts the event loop's turns while the block runs: a block that holds the loop counts none."""

    def __init__(self) -> None:
        self.n = 0
        self._done = False
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while not self._done:
            self.n += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> LoopTicks:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        await asyncio.sleep(0)
        self.n = 0
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self._done = True
        if self._task is not None:
            await self._task


def _spool_file(spool: Path, producer_id: str, batches: int) -> Path:
    """A dead producer's spool file as the hooks write it: its hello, then ``batches`` batches."""
    f = spool / _paths.spool_file_name(producer_id, "00" * 8)
    hello = {"id": producer_id, "pid": DEAD_PID, "start_ns": 1, "trace_id": "%032x" % 299_001,
             "root_span_id": ROOT_SPAN}
    frames = [_wire.hello_frame(hello, 0)]
    frames += [_wire.encode_frame({"t": "b", "e": [[k + 1, 2_000, "log", {"m": "line %d" % k}]]})
               for k in range(batches)]
    f.write_bytes(b"".join(frames))
    return f


async def test_a_planted_sparse_file_is_refused_after_a_few_frames_and_the_victims_file_still_replays(
        tmp_path: Path) -> None:
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        planted = spool / "0000-attack.spool"  # sorted first: read before the victim's file
        with open(planted, "wb") as f:
            f.truncate(32 << 20)  # 8 Mi frames of length 0, none of them on disk
        victim = _spool_file(spool, "dead-victim", 3)
        counters = agent.counters
        malformed_before = counters.malformed_frames
        assert await agent.ingest.replay_spools_async(str(spool)) == 1  # the victim's, not the planted one
        assert counters.malformed_frames - malformed_before == replay.MAX_MALFORMED_RUN  # not 8 Mi of them
        assert counters.spool_files_refused == 1
        assert planted.exists()  # not ours to delete; passed over
        await agent.ingest.replay_spools_async(str(spool))  # the next scan: counted once
        assert counters.spool_files_refused == 1
        deadline = time.monotonic() + 30
        while victim.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not victim.exists(), "the victim's replayed spool file was not removed once exported"
    finally:
        await agent.shutdown(5)


async def test_a_directory_scan_gives_the_event_loop_back_while_it_replays(tmp_path: Path) -> None:
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        _spool_file(spool, "dead-long", 10 * replay.STEP_FRAMES)
        async with LoopTicks() as ticks:
            assert await agent.ingest.replay_spools_async(str(spool)) == 1
        assert ticks.n >= 9, "the replay of a long file held the event loop"
    finally:
        await agent.shutdown(5)


async def test_a_file_too_long_to_replay_in_one_go_waits_for_the_scan(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay of one ended producer's files runs in one go: a file above the hooks' default
    size (raised INFERSIGHT_SPOOL_MAX_BYTES, or planted under the producer's prefix) is left to the
    scan, which reads it a piece at a time."""
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        f = _spool_file(spool, "dead-big", 50)
        monkeypatch.setattr(replay, "SYNC_MAX_BYTES", os.path.getsize(f) - 1)
        assert agent.ingest.replay_spools(str(spool), _paths.spool_prefix("dead-big")) == 0
        assert f.exists() and agent.counters.spool_files_replayed == 0
        assert await agent.ingest.replay_spools_async(str(spool)) == 1
        assert agent.counters.spool_files_replayed == 1
    finally:
        await agent.shutdown(5)


async def test_a_producer_found_dead_while_the_scan_reads_its_file_is_closed_by_the_files_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan now gives the loop back while it reads: a producer found dead meanwhile was closed as lost
    at once (its one-go replay skips a file being read), before the scan had read the rest of its file (its
    root, often). Its close now waits for the file's end, which closes it if it is still not connected."""
    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        _spool_file(spool, "dead-mid", 4 * replay.STEP_FRAMES)
        closed: list[str] = []
        real = agent.ingest.receiver.close_lost
        monkeypatch.setattr(agent.ingest.receiver, "close_lost", lambda p: (closed.append(p.id), real(p)))
        task = asyncio.get_running_loop().create_task(agent.ingest.replay_spools_async(str(spool)))
        for _ in range(100):  # until the scan has taken the producer's hello and paused in its file
            await asyncio.sleep(0)
            producer = agent.assembler.producers.get("dead-mid")
            if producer is not None and agent.ingest.spools.reading(_paths.spool_prefix("dead-mid")):
                break
        assert producer is not None
        agent.ingest.publish_lost(producer)  # liveness found it dead meanwhile
        assert closed == [], "closed before its file was read to the end"
        assert await task == 1
        assert closed == ["dead-mid"]  # by the file's end
    finally:
        await agent.shutdown(5)


def _hello(producer_id: str, trace: int) -> dict[str, Any]:
    return {"t": "hello", "schema": _wire.SCHEMA_VERSION, "producer": {
        "id": producer_id, "pid": DEAD_PID, "start_ns": 1, "trace_id": "%032x" % trace, "root_span_id": ROOT_SPAN}}


async def test_an_ended_producers_files_past_a_small_budget_are_read_a_piece_at_a_time(tmp_path: Path) -> None:
    """A member's own producer ends with large files planted under its prefix (five of 60 MiB held the loop 79 s,
    past the service's watchdog: review finding). What is read in one go is at most SYNC_TOTAL_BYTES; the rest
    is read by a task that gives the loop back, and the producer's end waits for it."""
    from infersight.agent.daemon.identity import Peer

    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        pid_id = "dead-planted"
        producer = agent.ingest.hello(_hello(pid_id, 299_002), Peer(os.getuid(), None))
        assert producer is not None
        f = _spool_file(spool, pid_id, 24 * replay.STEP_FRAMES)
        assert replay.SYNC_TOTAL_BYTES < f.stat().st_size < replay.SYNC_MAX_BYTES
        closed: list[str] = []
        real = agent.ingest.receiver.close_lost
        agent.ingest.receiver.close_lost = lambda p: (closed.append(p.id), real(p))  # type: ignore[method-assign]
        async with LoopTicks() as ticks:
            agent.ingest.publish_lost(producer)
            assert ticks.n == 0 and agent.counters.spool_files_replayed == 0, "read in one go"
            assert closed == [], "closed before its files were read"
            assert agent.ingest.spools.reading(_paths.spool_prefix(pid_id))
            for _ in range(2000):
                await asyncio.sleep(0.005)
                if closed:
                    break
        assert agent.counters.spool_files_replayed == 1 and closed == [pid_id]
        assert ticks.n >= 5, "the deferred replay held the event loop"
    finally:
        await agent.shutdown(5)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
async def test_another_uids_file_under_an_ended_producers_prefix_is_left_to_the_paced_scan(tmp_path: Path) -> None:
    from infersight.agent.daemon.identity import Peer

    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        producer = agent.ingest.hello(_hello("dead-victim", 299_003), Peer(0, None))
        assert producer is not None
        planted = _spool_file(spool, "dead-victim", 3)
        os.chown(planted, 65534, 65534)  # another member's file, named under the victim's prefix
        agent.ingest.receiver.allowed = lambda uid, gid: True  # type: ignore[method-assign]  # (a member: allowed)
        agent.ingest.publish_lost(producer)
        assert agent.counters.spool_files_replayed == 0 and planted.exists()
    finally:
        await agent.shutdown(5)


async def test_a_file_appended_to_while_it_is_read_is_read_only_as_far_as_it_was_once_locked(
        tmp_path: Path) -> None:
    """The file's owner kept a descriptor without the lock and appended while the agent read its ended producer's
    file in one go: the read went on as long as it appended (87 s, and 300 s with 2.7 GB: a review's attack).
    Only what the file held once locked is read; the rest waits for a later scan."""
    import threading

    from infersight.agent.daemon.identity import Peer

    agent = await _agent(tmp_path)
    try:
        spool = Path(agent.config["agent.spool_dir"])
        pid_id = "dead-appended"
        producer = agent.ingest.hello(_hello(pid_id, 299_004), Peer(os.getuid(), None))
        assert producer is not None
        f = _spool_file(spool, pid_id, 3)
        inode = f.stat().st_ino
        appended = [0]
        extra = b"".join(_wire.encode_frame({"t": "b", "e": [[100 + k, 2_000, "log", {"m": "more"}]]})
                         for k in range(2_000))
        appender = open(f, "ab")  # noqa: SIM115 - the owner's descriptor, no lock
        real_read = os.read

        def read_and_append(fd: int, n: int) -> bytes:  # the owner appends each time the agent reads
            got = real_read(fd, n)
            if os.fstat(fd).st_ino == inode and not threading.current_thread().daemon and appended[0] < 50:
                appender.write(extra)
                appender.flush()
                appended[0] += 1
            return got

        os.read = read_and_append  # type: ignore[assignment]
        try:
            agent.ingest.publish_lost(producer)
        finally:
            os.read = real_read  # type: ignore[assignment]
            appender.close()
        assert agent.counters.spool_files_replayed == 1
        assert appended[0] >= 1  # it appended while the agent read, and the agent stopped where the file ended
        events = [p for p in agent.assembler.producers.values() if p.info.get("id") == pid_id][0].events
        assert events == 3
    finally:
        await agent.shutdown(5)
