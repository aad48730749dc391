"""The exporter worker under pressure: submissions that ignore the push-back (the ingest
honours it; replays and jobs publish regardless) and take the queue past its hard bound spill
to the disk spool, nothing is lost or duplicated, and order is kept."""

from __future__ import annotations

import asyncio
from pathlib import Path

from conftest import log_records, read_otlp_lines

from infersight.agent.daemon.broadcast import Completion, ExporterWorker
from infersight.agent.daemon.spool import DiskSpool
from infersight.exporters.file import FileExporter
from infersight.telemetry import LogItem, Origin, Resource

RES = Resource.of({"service.name": "t"})


async def test_spill_under_pressure_keeps_every_item_once_in_order(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    exporter = FileExporter(str(out))
    await exporter.start()
    worker = ExporterWorker(exporter, DiskSpool(str(tmp_path / "spool")), queue_max_items=1500, max_batch_items=700)
    worker.start()
    done = 0

    def one() -> None:
        nonlocal done
        done += 1

    n_batches, per = 200, 512
    for b in range(n_batches):
        c = Completion(one)
        c.pending = 1
        worker.submit([LogItem(RES, 1, 9, "INFO", "x", {"i": b * per + j}, origin=Origin("p", b * per + j + 1))
                       for j in range(per)], c)
        if b % 20 == 0:
            await asyncio.sleep(0)
    for _ in range(600):
        if worker.idle():
            break
        await asyncio.sleep(0.05)
    assert await worker.drain(10)
    await exporter.shutdown()
    assert done == n_batches, "every batch completed"
    got = [int(r["attributes"][0]["value"]["intValue"]) for r in log_records(read_otlp_lines(out))]
    assert worker.spilled_items > 0, "the test must exercise the spill path"
    assert len(got) == n_batches * per, "nothing lost, nothing duplicated"
    assert got == list(range(n_batches * per)), "order kept through the spool"


def _logs(uid: int | None, n: int, body: str, start: int = 0) -> list[LogItem]:
    res = Resource.of({"service.name": "s", **({"process.user.id": uid} if uid is not None else {})})
    return [LogItem(res, 1, 9, "INFO", body, {"i": start + j}) for j in range(n)]


def test_one_uids_flood_cannot_push_another_uids_spooled_records_out(tmp_path: Path) -> None:
    """A broker is away; a victim's record is spooled, then two other members flood (a review's attack: the
    victim's record was pushed out with the oldest segment). One uid holds at most a quarter of the spool: past
    it, its new items are left out at the door and counted; the victim's record stays, and the agent's own
    items (no uid) are never held back."""
    from infersight.agent.daemon import spool as sp

    s = DiskSpool(str(tmp_path / "spool"), max_bytes=256 << 10)
    assert s.append(_logs(1001, 1, "VICTIM-MARKER cuda OOM in request 42")) == 0
    left_out = 0
    for k in range(200):
        for uid in (1002, 1003):
            left_out += s.append(_logs(uid, 10, "A" * 400, k * 10))
    assert left_out > 0 and s.over_uid_share_items == left_out
    held = s.held_by_uid()
    assert all(held[uid] <= sp.UID_SHARE * s.max_bytes for uid in (1002, 1003)), held
    assert s.size_bytes() <= s.max_bytes
    assert s.append(_logs(None, 50, "the agent's own" + "x" * 400)) == 0
    first, _records = s.peek_many(1)
    assert first[0].body == "VICTIM-MARKER cuda OOM in request 42"  # still the oldest, still there
    # what is exported frees its uid's share again
    s.pop_many(1)
    while True:
        items, records = s.peek_many(100)
        if not records:
            break
        s.pop_many(records)
    assert s.held_by_uid() == {}
    assert s.append(_logs(1002, 10, "A" * 400)) == 0
    s.close()


def test_records_an_earlier_agent_spooled_count_for_nobody_and_keep_the_accounting_right(tmp_path: Path) -> None:
    d = str(tmp_path / "spool")
    s = DiskSpool(d, max_bytes=256 << 10)
    s.append(_logs(1002, 5, "before"))
    s.close()
    s = DiskSpool(d, max_bytes=256 << 10)  # a restart: the same segment gets new records after the old ones
    s.append(_logs(1002, 5, "after"))
    assert set(s.held_by_uid()) == {1002}
    items, records = s.peek_many(5)
    assert [i.body for i in items] == ["before"] * 5
    s.pop_many(records)
    assert set(s.held_by_uid()) == {1002}, "the earlier agent's record was not this one's"
    items, records = s.peek_many(5)
    assert [i.body for i in items] == ["after"] * 5
    s.pop_many(records)
    assert s.held_by_uid() == {}
    s.close()


def test_a_uid_alone_in_the_spool_may_fill_it_until_another_uid_holds_items(tmp_path: Path) -> None:
    """A single-tenant host: one uid's burst while the collector is away kept a quarter of the spool and dropped
    the rest, newest first, though three quarters stayed free (a review). Alone, a uid may fill the spool (the
    oldest go, as when the spool is full); once another uid holds items, the first is held to its share again."""
    from infersight.agent.daemon import spool as sp

    s = DiskSpool(str(tmp_path / "spool"), max_bytes=256 << 10)
    for k in range(100):
        assert s.append(_logs(1002, 10, "A" * 400, k * 10)) == 0
    assert s.over_uid_share_items == 0
    assert s.held_by_uid()[1002] > 0.75 * s.max_bytes  # (the oldest segment goes as the spool fills)
    assert s.append(_logs(1001, 1, "VICTIM-MARKER")) == 0  # another uid's record: stored (the oldest go)
    assert s.append(_logs(1002, 10, "A" * 400)) == 10, "the first uid is held to its share now"
    assert s.held_by_uid()[1001] > 0 and s.held_by_uid()[1002] > sp.UID_SHARE * s.max_bytes
    s.close()


def test_after_a_restart_an_earlier_agents_records_count_for_their_uids(tmp_path: Path) -> None:
    """Records spooled before a restart counted for nobody: a uid was then 'alone' and its flood pushed a victim's
    earlier records out (a review of the change above). They count for their uids now: the flooder has its quarter."""
    d = str(tmp_path / "spool")
    s = DiskSpool(d, max_bytes=256 << 10)
    for k in range(10):
        s.append(_logs(1001, 5, "VICTIM" + "v" * 400, k * 5))
    s.close()
    s = DiskSpool(d, max_bytes=256 << 10)  # the agent restarted, the collector still away
    for k in range(200):
        s.append(_logs(1002, 10, "A" * 400, k * 10))
    assert s.over_uid_share_items > 0
    bodies: list[str] = []
    while True:
        items, records = s.peek_many(500)
        if not records:
            break
        bodies += [i.body for i in items]
        s.pop_many(records)
    s.close()
    assert sum(b.startswith("VICTIM") for b in bodies) == 50, "the victim's records stay"


def test_after_a_restart_a_uid_alone_still_fills_the_spool(tmp_path: Path) -> None:
    """The agent's own records (no uid) and the uid's own, spooled before a restart, leave it alone: it fills the
    spool (held to a quarter after any restart with a collector away: a re-review, 878 of 50,000 kept)."""
    d = str(tmp_path / "spool")
    s = DiskSpool(d, max_bytes=256 << 10)
    s.append(_logs(None, 5, "the agent's own health"))
    s.append(_logs(1002, 5, "A" * 400))
    s.close()
    s = DiskSpool(d, max_bytes=256 << 10)
    assert set(s.held_by_uid()) == {1002}
    for k in range(100):
        assert s.append(_logs(1002, 10, "A" * 400, k * 10)) == 0
    assert s.over_uid_share_items == 0 and s.held_by_uid()[1002] > 0.75 * s.max_bytes
    s.close()


def test_a_corrupt_record_of_valid_json_does_not_stop_the_spool_opening(tmp_path: Path) -> None:
    """A record whose JSON parses but is not an item (a cold start whose root is a list; nesting too deep for the
    decoder) is a corrupt record, skipped and counted by ``peek_many``, as before the start-up read of owners."""
    from infersight.agent.daemon.spool import REC
    d = tmp_path / "spool"
    s = DiskSpool(str(d))
    s.append(_logs(1000, 1, "x"))
    s.close()
    for payload in (b'[{"k":"coldstart","root":[1,2],"stages":[]}]', b"[" * 100000 + b"]" * 100000):
        with open(d / ("%012d.seg" % 1), "ab") as f:
            f.write(REC.pack(len(payload), 1) + payload)
    s = DiskSpool(str(d))
    items, records = s.peek_many(10)
    assert len(items) == 1
    s.pop_many(records)
    assert s.peek_many(10) == ([], 0)
    assert s.corrupt_records == 2
    assert s.held_by_uid() == {}
    s.close()


def test_a_record_torn_by_a_crash_is_cut_off_at_start_so_later_records_are_read(tmp_path: Path) -> None:
    """The agent died while writing a record (a header, or a header saying more bytes than follow): the next agent
    cuts it off, counted, rather than reading past the end of the file, which hid every record appended after it
    (and kept their uid's bytes counted until the segment went, its items then dropped uncounted)."""
    from infersight.agent.daemon.spool import REC
    for k, torn in enumerate((REC.pack(5000, 2) + b'[{"k":', b"\0\0\0")):
        d = tmp_path / ("spool%d" % k)
        s = DiskSpool(str(d), max_bytes=1 << 20)
        s.append(_logs(1000, 3, "x"))
        s.close()
        with open(d / ("%012d.seg" % 1), "ab") as f:
            f.write(torn)
        s = DiskSpool(str(d), max_bytes=1 << 20)
        assert s.corrupt_records == 1 and s.items == 3
        s.append(_logs(1001, 4, "y"))
        got = 0
        while True:
            items, records = s.peek_many(100)
            if not records:
                break
            got += len(items)
            s.pop_many(records)
        assert got == 7, "the records appended after the torn one are read"
        assert s.held_by_uid() == {}
        s.close()
