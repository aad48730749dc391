"""``_workers.DeferredSignals``: a stop signal that comes while the hooks end a gunicorn worker's
cold start (its first request going out) waits for that to finish, then its handler runs."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from infersight.hooks._workers import DeferredSignals


def test_a_stop_signal_waits_for_the_block_then_its_handler_runs() -> None:
    seen: list[str] = []

    def handler(sig: int, _frame: Any) -> None:
        seen.append("handler %d" % sig)
        raise SystemExit(0)  # gunicorn's handle_quit: sys.exit wherever the main thread is

    old = signal.signal(signal.SIGTERM, handler)
    try:
        def stopped_mid_work() -> None:
            with DeferredSignals():
                os.kill(os.getpid(), signal.SIGTERM)
                seen.append("work done")  # the block is not interrupted

        with pytest.raises(SystemExit):
            stopped_mid_work()
        assert seen == ["work done", "handler %d" % signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is handler  # put back
    finally:
        signal.signal(signal.SIGTERM, old)


def test_nothing_held_means_nothing_raised_and_other_threads_are_left_alone() -> None:
    old = signal.getsignal(signal.SIGINT)
    with DeferredSignals():
        assert signal.getsignal(signal.SIGINT) is not old  # held while inside
    assert signal.getsignal(signal.SIGINT) is old
    out: list[object] = []

    def other() -> None:
        with DeferredSignals() as d:
            out.append(d.saved)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert out == [[]]  # signal handlers belong to the main thread: nothing touched
