"""The hooks' exit flush is not cut short by a signal whose Python handler raises SystemExit
(``_activate._at_exit``): a launch killed with SIGKILL sends one parent-death SIGTERM per
thread it had, so a graceful handler can be hit again while the hooks spool what is left.
The handlers run once the flush is done. The client is a FAKE that records how far its
close got; the signals are real, sent to this process."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from infersight.hooks import _activate, _runtime, _state


class Closing:
    """FAKE hook client: its close is interrupted by a signal half way, as a spool write
    would be."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def close(self, timeout_s: float) -> None:
        self.steps.append("flush")
        os.kill(os.getpid(), signal.SIGTERM)  # the second parent-death SIGTERM, mid-close
        for _ in range(1000):  # the interpreter runs a handler between bytecodes
            pass
        self.steps.append("spooled")


@pytest.fixture
def graceful(monkeypatch: pytest.MonkeyPatch) -> Any:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run on the main thread only")
    calls: list[str] = []

    def bye(*_a: object) -> None:
        calls.append("bye")
        raise SystemExit(0)

    old = signal.signal(signal.SIGTERM, bye)
    st = _state.HookState()
    monkeypatch.setattr(_state, "current", st)
    monkeypatch.setattr(_runtime, "end_root", lambda **_k: None)  # no cold start here
    yield st, calls
    signal.signal(signal.SIGTERM, old)


def test_a_signal_during_the_exit_flush_waits_for_it(graceful: Any) -> None:
    st, calls = graceful
    client = Closing()
    st.runtime.client = client  # type: ignore[assignment]
    _activate._at_exit()  # nothing escapes: the interpreter is exiting anyway
    assert client.steps == ["flush", "spooled"], "the flush ran to its end"
    assert calls == ["bye"], "the handler ran once the flush was done"
    assert getattr(signal.getsignal(signal.SIGTERM), "__name__", "") == "bye", "its handler is back"


def test_without_holding_them_the_handler_cuts_the_flush(graceful: Any) -> None:
    """The check can fail: the same close, unprotected, stops at the signal."""
    st, calls = graceful
    client = Closing()
    with pytest.raises(SystemExit):
        client.close(1.0)
    assert client.steps == ["flush"] and calls == ["bye"]
