"""Repeated log lines once a minute (exporters/log_repeats.py; the exporter worker's refusals)."""

from __future__ import annotations

import logging

import pytest

from infersight.exporters.log_repeats import QuietRepeats


def _record(msg: str, *args: object, name: str = "opentelemetry.x") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_a_kind_is_let_through_once_a_minute_with_what_was_held_back() -> None:
    now = [0.0]
    f = QuietRepeats(every_s=60.0, clock=lambda: now[0])
    assert f.filter(_record("Failed to export %s batch code: %s", "spans", 400))
    for _ in range(99):  # a refused batch a second for a minute and a half
        now[0] += 0.6
        assert not f.filter(_record("Failed to export %s batch code: %s", "logs", 400))
    assert f.filter(_record("another kind"))  # another template is its own kind
    now[0] += 1.0
    r = _record("Failed to export %s batch code: %s", "spans", 400)
    assert f.filter(r) and "99 more like this" in r.getMessage()
    assert f.held_back == 99


def test_the_workers_refusals_are_said_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """A collector answering 400 to every batch wrote a warning per batch (about a hundred in 9 s)."""
    import asyncio

    from infersight.agent.daemon.broadcast import ExporterWorker

    class Quiet:
        name = "x"

    async def main() -> ExporterWorker:
        w = ExporterWorker(Quiet())  # type: ignore[arg-type]
        with caplog.at_level(logging.WARNING, logger="infersight.pipeline"):
            for _ in range(100):
                w._drop_rejected([object()] * 3, "refused for good")  # type: ignore[list-item]
        return w

    w = asyncio.run(main())
    said = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(said) == 1 and w.rejected_items == 300 and w.dropped_items == 300
