"""``hooks.request`` queues one flat tuple; the drain thread builds the same ``req`` event."""

from __future__ import annotations

import sys
import threading
import types

import pytest
from conftest import FlatQueue

from infersight.hooks import _buffer, _request, _runtime, _state


def _built(event: tuple[object, ...]) -> dict[str, object]:
    built = _buffer.built(event, {})
    assert built is not None and built[2] == "req"
    return built[3]  # type: ignore[return-value]


def _fail_a_request() -> None:
    try:
        with _request.request(device=" cuda:1 ", model="m" * 300, input_len=7, request_class=8) as r:
            r.first_token()
            raise KeyError("x")
    except KeyError:
        return
    raise AssertionError("the request swallowed the exception")


def _producing_into(monkeypatch: pytest.MonkeyPatch, queue: FlatQueue) -> None:
    """A fresh hook state (``_state``) whose client is ``queue``."""
    st = _state.HookState()
    st.runtime.client = queue
    monkeypatch.setattr(_state, "current", st)


def test_a_request_is_queued_flat_and_built_into_the_same_event(monkeypatch: pytest.MonkeyPatch) -> None:
    queue = FlatQueue()
    _producing_into(monkeypatch, queue)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    token = _runtime.current_span.set("c" * 16)
    try:
        _fail_a_request()
        with _request.request(device=3, input_len=True):
            pass
    finally:
        _runtime.current_span.reset(token)
    first, second = queue.events
    assert len(first) > 4 and all(v is None or v.__class__ in (str, int, float) for v in first)
    data = _built(first)
    assert set(data) == {"d", "m", "n", "c", "s", "dur", "ttft", "sp", "err", "vis"}
    assert data["d"] == "cuda:1" and data["m"] == "m" * 256 and data["n"] == 7 and data["c"] == "8"
    assert data["sp"] == "c" * 16 and data["err"] == "KeyError" and data["vis"] == "2,0"
    assert isinstance(data["dur"], float) and 0 <= data["ttft"] <= data["dur"]  # type: ignore[operator]
    assert isinstance(data["s"], int) and data["s"] <= first[1]  # type: ignore[operator]
    data = _built(second)
    assert (data["d"], data["m"], data["n"], data["c"], data["err"], data["ttft"]) == ("cuda:3", None, None, None,
                                                                                      None, None)


def test_cuda_is_resolved_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"cuda"`` is the caller's current device: the drain thread's would be another."""
    current = threading.local()
    cuda = types.SimpleNamespace(is_initialized=lambda: True, current_device=lambda: current.index,
                                 get_device_properties=lambda i: types.SimpleNamespace(uuid="", name="x"))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    queue = FlatQueue()
    _producing_into(monkeypatch, queue)  # a fresh state: nothing cached of any device
    current.index = 5
    with _request.request(device="cuda"):
        pass
    with _request.request(device=" cuda "):  # padded, as a config file may give it
        pass
    current.index = 0  # as another thread would see it
    assert [_built(e)["d"] for e in queue.events] == ["cuda:5", "cuda:5"]
