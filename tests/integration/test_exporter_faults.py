"""Exporter workers under real faults: a full spool disk, a peer that refuses a batch for
good, a peer that keeps rejecting one record. The worker survives, drops only what it
must (counted), never blocks what is behind, and ``status`` says when it is stuck."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from conftest import wait_for
from otlp_receiver import OtlpReceiver, attrs
from small_fs import tmpfs

from infersight.agent.daemon.broadcast import LOST_SHOWN_S, Completion, ExporterWorker
from infersight.agent.daemon.spool import DiskSpool
from infersight.exporters.base import ExportError
from infersight.exporters.otlp import OtlpExporter
from infersight.telemetry import Item, LogItem, Origin, Resource

RES = Resource.of({"service.name": "faults"})
PROTOCOLS = ["http/protobuf", "grpc"]


def exporter_for(rx: OtlpReceiver, protocol: str, timeout_s: float) -> OtlpExporter:
    endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
    return OtlpExporter(endpoint, protocol=protocol, timeout_s=timeout_s)


def refuse(rx: OtlpReceiver, protocol: str, http: int | None, code: grpc.StatusCode | None) -> None:
    if protocol == "grpc":
        rx.set_grpc_fail(code if http is not None else None)
    else:
        rx.set_fail_status(http)


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)


def tiny_tmpfs(path: Path, size: str = "64k") -> contextlib.AbstractContextManager[Path]:
    """A real small filesystem that fills up (needs root and mount rights)."""
    return tmpfs(path, "size=%s,mode=0700" % size)


def fill(fs: Path) -> Path:
    """Fill ``fs`` to the last byte; returns the filler file."""
    filler = fs / "filler"
    with open(filler, "ab", buffering=0) as f:  # again: takes what was freed since
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass
    return filler


def logs(tag: str, n: int, body: str = "x") -> list[LogItem]:
    return [LogItem(RES, 1, 9, "INFO", body, {"tag": tag, "i": i}, origin=Origin(tag, i + 1)) for i in range(n)]


def received_tags(rx: OtlpReceiver) -> list[str]:
    return [str(attrs(rec.attributes).get("tag")) for _res, _scope, rec in rx.log_records()]


def submit(worker: ExporterWorker, items: list[LogItem]) -> Completion:
    c = Completion()
    c.pending = 1
    worker.submit(items, c)
    return c


async def until(pred, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return bool(pred())


# -- item 4: a full spool disk ---------------------------------------------------------------


def test_full_spool_disk_turns_status_unhealthy_and_recovers(agent_factory, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """ENOSPC while the spool saves its read position used to kill the worker silently."""
    rx = OtlpReceiver(grpc_=False).start()
    rx.stop()  # the collector is away: the agent's own metrics are spooled
    with tiny_tmpfs(tmp_path / "fs", "256k") as fs:
        agent = agent_factory(
            '[exporters.otlp]\nendpoint = "%s"\nprotocol = "http/protobuf"\ntimeout_s = 0.3\n' % rx.http_endpoint,
            root=tmp_path / "a",
        )
        # The exporters' spools are the agent's own state: in state_dir, on the small disk.
        monkeypatch.setenv("INFERSIGHT_STATE_DIR", str(fs / "state"))
        # A batch of the agent's own metrics that comes while the disk is full cannot be spooled: it is lost,
        # counted, and a loss stays a problem for exporter_stall_s (120 s by default, past this test's 40 s wait
        # for recovery: it failed once in a full run). At 20 s, health comes back within the wait.
        agent.config.write_text(agent.config.read_text().replace("[agent]\n", "[agent]\nexporter_stall_s = 20\n"))
        agent.start()

        def otlp() -> dict:  # type: ignore[type-arg]
            return next(e for e in agent.status()["exporters"] if e["name"] == "otlp")

        assert wait_for(lambda: otlp()["spooled_items_pending"] > 0, 20), otlp()
        filler = fill(fs)
        rx.start()  # the collector is back: exports succeed, saving the position fails
        try:
            # A save that straddled the fill frees the old position file's page once it replaces it: the
            # disk would keep that page free for every later save (it failed once in a full run). Each
            # poll takes up again whatever was freed, so the disk stays full.
            assert wait_for(lambda: fill(fs) is not None and not agent.status()["healthy"], 30), otlp()
            st = otlp()
            assert st["internal_errors"] >= 1
            assert "No space left" in str(st["problem"])
            assert agent.proc.poll() is None
            filler.unlink()
            assert wait_for(lambda: agent.status()["healthy"], 40), (agent.status()["problems"], otlp())
            assert wait_for(lambda: otlp()["spooled_items_pending"] == 0, 30), otlp()
            assert rx.point_count() > 0
            log_text = agent.log.read_text()
            assert log_text.count("No space left on device") <= 6, "logged once per kind, not per attempt"
        finally:
            agent.stop()
            rx.stop()


async def test_spool_append_on_full_disk_leaves_no_torn_record(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "fs") as fs:
        spool = DiskSpool(str(fs / "spool"), max_bytes=1 << 20)
        spool.append(logs("a", 10))
        filler = fill(fs)
        with pytest.raises(OSError):
            spool.append(logs("big", 2000, "y" * 64))
        filler.unlink()
        spool.append(logs("b", 10))
        batch, records = spool.peek_many(1000)
        assert records == 2 and spool.corrupt_records == 0
        assert [str(it.attributes["tag"]) for it in batch] == ["a"] * 10 + ["b"] * 10


class FullDiskFile:
    """The file exporter on a full state dir: every write fails with ENOSPC (a peer "away", retried);
    ``room()`` frees the disk."""

    name = "file"

    def __init__(self) -> None:
        self.full = True
        self.written = 0

    async def start(self) -> None:
        pass

    async def export(self, batch: Sequence[Item]) -> None:
        if self.full:
            raise ExportError("cannot write /var/lib/infersight/infersight.otlp.jsonl: "
                              "[Errno 28] No space left on device")
        self.written += len(batch)

    async def force_flush(self, timeout_s: float) -> bool:
        return True

    async def shutdown(self) -> None:
        pass

    def state(self) -> dict[str, int | float | str]:
        return {}


class FullSpool(DiskSpool):
    """A spool on that disk: an append fails as ``DiskSpool.append`` does on a full disk (its own test above)."""

    full = True

    def append(self, batch: Sequence[Item]) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().append(batch)


async def test_items_neither_delivered_nor_spooled_are_a_problem_until_data_moves(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A full state dir: the export and the spool append both failed, the batch was dropped (its hooks acked),
    and the step returned normally, so the worker cleared its fault after every batch: healthy, with
    "recovered" logged at each batch. Now the fault lasts until data moves, and the loss is a problem."""
    caplog.set_level(logging.INFO, logger="infersight.pipeline")
    exp, spool = FullDiskFile(), FullSpool(str(tmp_path / "spool"), max_bytes=1 << 20)
    worker = ExporterWorker(exp, spool, retry_initial_s=0.01, retry_max_s=0.02, stall_s=30)
    worker.start()
    try:
        for n in range(5):
            submit(worker, logs("lost%d" % n, 2))
            assert await until(lambda n=n: worker.dropped_items == 2 * (n + 1)), worker.state()
        why = worker.problem()
        assert why is not None and why.startswith("worker failing for "), why
        assert "No space left on device" in why and "dropped 10 item(s) it could neither deliver nor spool" in why
        assert "recovered" not in caplog.text, caplog.text
        assert worker.state()["problem"] == worker.problem()

        exp.full = spool.full = False  # room again: the next batch goes out
        submit(worker, logs("kept", 3))
        assert await until(lambda: exp.written == 3), worker.state()
        assert await until(lambda: worker.fault_since is None), worker.state()
        assert caplog.text.count("recovered") == 1, caplog.text
        # The loss is still said for stall_s after the last one, then no more.
        assert worker.lost_at is not None
        why = worker.problem(worker.lost_at + 29)
        assert why is not None and why.startswith("dropped 10 item(s) it could neither deliver nor spool"), why
        assert worker.problem(worker.lost_at + 31) is None
    finally:
        await worker.drain(1.0)


async def test_a_step_that_moved_nothing_logs_no_recovery(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No spool (an ephemeral sink) and the peer away: what memory retries could not deliver is dropped, and
    that is a problem too (it was none: the worker went idle, healthy)."""
    caplog.set_level(logging.INFO, logger="infersight.pipeline")
    exp = FullDiskFile()
    worker = ExporterWorker(exp, None, retry_initial_s=0.01, retry_max_s=0.02, memory_retries=1, stall_s=0)
    worker.start()
    try:
        submit(worker, logs("gone", 4))
        assert await until(lambda: worker.dropped_items == 4), worker.state()
        why = worker.problem()
        assert why is not None and why.startswith("dropped 4 item(s) it could neither deliver nor spool"), why
        assert "No space left on device" in why
        assert worker.lost_at is not None and worker.problem(worker.lost_at + LOST_SHOWN_S + 1) is None
        assert "recovered" not in caplog.text
    finally:
        await worker.drain(1.0)


def test_full_state_dir_makes_status_exit_1_and_clears_with_room(agent_factory, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The reviewer's service: the file exporter and the spools on a full disk. ``status`` said healthy (exit 0)
    and STATUS= too while every batch was dropped; now both name it, and it clears once the disk has room."""
    with tiny_tmpfs(tmp_path / "fs", "512k") as fs:
        agent = agent_factory("", root=fs / "a")  # its file exporter writes on the small disk
        monkeypatch.setenv("INFERSIGHT_STATE_DIR", str(fs / "state"))  # the exporters' spools too
        monkeypatch.setenv("INFERSIGHT_EXPORTER_STALL_S", "2")  # how long a loss is said after the last one
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(tmp_path / "notify"))
        notify.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
        agent.start()

        def file_exp() -> dict:  # type: ignore[type-arg]
            return next(e for e in agent.status()["exporters"] if e["name"] == "file")

        def statuses() -> list[str]:
            out = []
            with contextlib.suppress(BlockingIOError):
                while True:
                    out += [ln[7:] for ln in notify.recv(65536).decode().split("\n") if ln.startswith("STATUS=")]
            return out

        try:
            assert wait_for(lambda: file_exp()["exported_items"] > 0, 20), file_exp()
            filler = fill(fs)
            # Each poll takes up again whatever a truncated write freed (test above): the disk stays full.
            assert wait_for(lambda: fill(fs) is not None and not agent.status()["healthy"], 30), file_exp()
            fill(fs)
            r = subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(agent.sock)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 1, r.stdout + r.stderr
            assert "PROBLEM exporter file:" in r.stdout and "No space left on device" in r.stdout, r.stdout
            assert "could neither deliver nor spool" in r.stdout, r.stdout
            assert file_exp()["dropped_items"] > 0
            said: list[str] = []

            def said_loss() -> bool:
                said.extend(statuses())
                return any("could neither deliver nor spool" in t for t in said)

            assert wait_for(said_loss, 20), said
            assert any(t.startswith("UNHEALTHY: exporter file:") for t in said), said
            filler.unlink()
            assert wait_for(lambda: agent.status()["healthy"], 40), file_exp()
            r = subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(agent.sock)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr
            assert agent.proc.poll() is None
        finally:
            agent.stop()
            notify.close()


# -- item 5: refused batches ---------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_batch_refused_for_good_is_dropped_and_what_is_behind_flows(tmp_path: Path, protocol: str) -> None:
    """A real receiver answering 400 (gRPC INVALID_ARGUMENT): dropped at once and counted."""
    rx = OtlpReceiver().start()
    exp = exporter_for(rx, protocol, 2)
    worker = ExporterWorker(exp, DiskSpool(str(tmp_path / "spool")), retry_initial_s=0.01, retry_max_s=0.05)
    worker.start()
    try:
        refuse(rx, protocol, 400, grpc.StatusCode.INVALID_ARGUMENT)
        submit(worker, logs("poison", 5))
        assert await until(lambda: worker.rejected_items == 5), worker.state()
        refuse(rx, protocol, None, None)
        submit(worker, logs("good", 7))
        assert await until(lambda: received_tags(rx).count("good") == 7), worker.state()
        assert worker.export_errors == 1, "a non-retryable refusal is not retried"
        assert worker.state()["dropped_items"] == 5 and worker.problem() is None
    finally:
        await worker.drain(5)
        await exp.shutdown()
        rx.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_unencodable_record_is_isolated_and_dropped_alone(tmp_path: Path, protocol: str) -> None:
    """A lone surrogate cannot be encoded as protobuf: only its record is dropped, in a spool
    where it sits between good records."""
    rx = OtlpReceiver().start()
    rx.stop()  # away first, so that the records are spooled side by side
    exp = exporter_for(rx, protocol, 0.3)
    spool = DiskSpool(str(tmp_path / "spool"))
    worker = ExporterWorker(exp, spool, retry_initial_s=0.01, retry_max_s=0.05)
    spool.append(logs("before", 3))
    spool.append(logs("poison", 2, "bad \ud800 body"))
    spool.append(logs("after", 4))
    rx.start()
    worker.start()
    try:
        assert await until(lambda: not spool), worker.state()
        tags = received_tags(rx)
        assert sorted(set(tags)) == ["after", "before"]
        assert tags.count("before") >= 3 and tags.count("after") == 4
        assert worker.rejected_items == 2
    finally:
        await worker.drain(5)
        await exp.shutdown()
        rx.stop()


async def test_an_unencodable_record_is_final_behind_a_proxy_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """With HTTP_PROXY set, the reason that names the proxy had taken the place of the "not encodable" verdict: a
    record that never left was called the collector's absence, and retried for ever."""
    from infersight.exporters.base import ExportError

    rx = OtlpReceiver().start()
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # never reached: the batch is not sent
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    exp = exporter_for(rx, "http/protobuf", 0.5)
    try:
        with pytest.raises(ExportError) as ei:
            await exp.export(logs("poison", 1, "bad \ud800 body"))
        assert not ei.value.retryable and "(not encodable)" in str(ei.value), str(ei.value)
        assert "proxy" not in str(ei.value)
    finally:
        await exp.shutdown()
        rx.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_record_rejected_max_attempts_times_is_dropped(tmp_path: Path, protocol: str) -> None:
    """A peer answering 500 (gRPC INTERNAL) to one record: retried, then dropped after max_attempts."""
    rx = OtlpReceiver().start()
    exp = exporter_for(rx, protocol, 2)
    worker = ExporterWorker(exp, DiskSpool(str(tmp_path / "spool")), retry_initial_s=0.01, retry_max_s=0.05,
                            max_attempts=4)
    worker.start()
    try:
        refuse(rx, protocol, 500, grpc.StatusCode.INTERNAL)
        submit(worker, logs("rejected", 3))
        assert await until(lambda: worker.rejected_items == 3), worker.state()
        assert worker.export_errors == 1 + 4, "one live attempt, then max_attempts from the spool"
        refuse(rx, protocol, None, None)
        submit(worker, logs("good", 2))
        assert await until(lambda: received_tags(rx).count("good") == 2), worker.state()
    finally:
        await worker.drain(5)
        await exp.shutdown()
        rx.stop()


async def test_peer_away_is_never_capped(tmp_path: Path) -> None:
    """A collector that is down is not a poison batch: nothing is dropped, however long."""
    rx = OtlpReceiver(grpc_=False).start()
    rx.stop()
    exp = OtlpExporter(rx.http_endpoint, timeout_s=0.2)
    worker = ExporterWorker(exp, DiskSpool(str(tmp_path / "spool")), retry_initial_s=0.01, retry_max_s=0.02,
                            max_attempts=2)
    worker.start()
    try:
        submit(worker, logs("kept", 6))
        assert await until(lambda: worker.export_errors >= 6), worker.state()
        assert worker.rejected_items == 0
        rx.start()
        assert await until(lambda: received_tags(rx).count("kept") == 6), worker.state()
    finally:
        await worker.drain(5)
        await exp.shutdown()
        rx.stop()


async def test_position_saved_for_a_retired_segment_is_not_applied_to_the_next(tmp_path: Path) -> None:
    spool = DiskSpool(str(tmp_path / "spool"), max_bytes=8192)  # 4 KiB segments
    for i in range(12):
        spool.append(logs("s%d" % i, 5, "z" * 60))
    assert len(spool.segments) > 1
    batch, records = spool.peek_many(1)
    spool.pop_many(records)
    # A crash after the first segment was retired, with its old position still on disk.
    (tmp_path / "spool" / "pos").write_text("%d %d" % (spool.segments[0] - 1, spool.read_pos + 40))
    spool.close()  # the crash: its lock goes with it
    reopened = DiskSpool(str(tmp_path / "spool"), max_bytes=8192)
    assert reopened.read_pos == 0
    batch, records = reopened.peek_many(1000)
    assert records > 0 and reopened.corrupt_records == 0
