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
