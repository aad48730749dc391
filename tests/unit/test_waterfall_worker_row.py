"""A supervisor's ``worker pid N`` row in the text waterfall (``exporters/waterfall.py``): the worker's whole
cold start, from its start (its fork) to its root's end, not only the part within the supervisor's root. A
gunicorn master closed at its listen's ``ready_wait`` when it was SIGKILLed had a worker row of ``0.000`` s
(the worker started after that end); one closed at its last event cut the worker at it."""

from __future__ import annotations

from infersight.exporters.waterfall import render_waterfall
from infersight.telemetry import ColdStart, Resource, SpanItem

S = 1_000_000_000


def _root(pid: int, sid: str, parent: str | None, start: float, end: float, ended_by: str) -> SpanItem:
    return SpanItem(Resource.of({"service.name": "svc", "process.pid": pid}), "ab" * 16, sid, parent, "coldstart",
                    int(start * S), int(end * S), {"infersight.coldstart.ended_by": ended_by})


def _row(cs: ColdStart) -> list[str]:
    (row,) = [ln for ln in render_waterfall(cs).splitlines() if ln.startswith("  worker pid ")]
    return row.split()


def test_a_worker_that_outlived_its_master_s_root_shows_its_whole_cold_start() -> None:
    master = _root(1, "1" * 16, None, 10.0, 11.0, "producer_lost")
    worker = _root(2, "2" * 16, "1" * 16, 10.5, 13.5, "exit")
    row = _row(ColdStart(master, [], [worker]))
    assert row[3:6] == ["0.500", "3.000", "50.0%"], row  # from its fork, its whole length; within the master: half
    assert " ".join(row).endswith("ended by exit; 2.500 s of it after this cold start's end"), row


def test_a_worker_that_started_after_its_master_s_root_has_no_share_nor_bar() -> None:
    master = _root(1, "1" * 16, None, 10.0, 11.0, "ready")
    worker = _root(2, "2" * 16, "1" * 16, 11.25, 11.75, "exit")
    row = _row(ColdStart(master, [], [worker]))
    assert row[3:7] == ["1.250", "0.500", "-", "its"], row  # (was 0.000, with a bar's cell at the root's end)
    assert "#" not in " ".join(row)


def test_a_worker_within_its_master_s_root_is_as_before() -> None:
    master = _root(1, "1" * 16, None, 10.0, 12.0, "workers")
    worker = _root(2, "2" * 16, "1" * 16, 10.5, 11.5, "first_request")
    row = _row(ColdStart(master, [], [worker]))
    assert row[3:6] == ["0.500", "1.000", "50.0%"], row
    assert " ".join(row).endswith("its own waterfall: ended by first_request"), row
