"""Another user's text in a log line or an error reply: one line, bounded (``log_text``)."""

from __future__ import annotations

from infersight.sanitize import MAX_LOG_TEXT, log_text


def test_no_character_of_a_producer_can_start_a_line_of_its_own() -> None:
    forged = "x\n2026-12-04 10:00:00,000 ERROR infersight.agent: FORGED\r\x1b[2K\u2028\u2029\x85\u202e\ud800\\n"
    out = log_text(forged)
    assert out.isprintable() and len(out.splitlines()) == 1
    assert out.startswith("x\\n2026-12-04") and "\\x1b" in out and "\\u2028" in out and out.endswith("\\\\n")
    assert log_text("svc-é 1") == "svc-é 1" and log_text(42) == "42"


def test_long_text_is_cut_and_says_how_much() -> None:
    out = log_text("a" * (MAX_LOG_TEXT + 100))
    assert out == "a" * MAX_LOG_TEXT + "...(100 more)"
    assert len(log_text("\n" * 10_000)) <= 2 * MAX_LOG_TEXT + 20


def test_an_exporters_fault_is_logged_on_one_line(caplog) -> None:  # type: ignore[no-untyped-def]
    """An exporter's exception can quote an item's value (a producer's text): the worker logged it as it came,
    and a value holding a newline wrote a line of its own into the agent's log."""
    import asyncio
    import logging

    from infersight.agent.daemon.broadcast import ExporterWorker

    class Quiet:
        name = "x"

    async def main() -> None:
        w = ExporterWorker(Quiet())  # type: ignore[arg-type]
        with caplog.at_level(logging.ERROR, logger="infersight.agent"):
            w._note_fault("worker", ValueError("bad value 'a\n2026-12-04 ERROR infersight.agent: FORGED'"),
                          traceback=False)

    asyncio.run(main())
    (rec,) = [r for r in caplog.records if "bad value" in r.getMessage()]
    assert "\n" not in rec.getMessage() and "\\n2026-12-04" in rec.getMessage()


def test_a_left_mqtt_clients_disconnect_error_is_read() -> None:
    """A stalled broker's client, left after a connect timeout, had its disconnect future's exception never
    awaited: asyncio logged "Future exception was never retrieved" (an ERROR) at the agent's stop."""
    import asyncio
    import gc

    from infersight.exporters.mqtt import _retrieve_disconnect

    unread: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: unread.append(ctx.get("message", "")))

        class Client:
            def __init__(self) -> None:
                self._disconnected: asyncio.Future[None] = loop.create_future()

        for early in (True, False):
            c = Client()
            if early:
                c._disconnected.set_exception(RuntimeError("Unexpected disconnection"))
            _retrieve_disconnect(c)
            if not early:
                c._disconnected.set_exception(RuntimeError("Unexpected disconnection"))
                await asyncio.sleep(0)  # its callbacks run
            del c
            gc.collect()
        c2 = Client()  # not given to _retrieve_disconnect: asyncio says so, as before
        c2._disconnected.set_exception(RuntimeError("Unexpected disconnection"))
        del c2
        gc.collect()

    asyncio.run(main())
    assert unread == ["Future exception was never retrieved"]
