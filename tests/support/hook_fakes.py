"""FAKE hook parts for in-process unit tests of the cold-start code: a client that keeps what
the hooks emit, one that keeps what the request path queues, and a fresh hook state collecting
a cold start whose root is open."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from infersight.hooks import _state


class Emitted:
    """FAKE hook client: keeps what the hooks emit."""

    enabled = True

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        self.events.append((kind, data))

    def stage_attrs(self) -> list[dict[str, Any]]:
        """The attributes of each stage span emitted, in order."""
        return [d["a"] for k, d in self.events if k == "span"]

    def stages(self) -> list[str]:
        return [str(a["infersight.stage"]) for a in self.stage_attrs()]


class QueueClient:
    """FAKE hook client: the parts the request path (``hooks.asgi``, ``_request``) queues into."""

    enabled = True
    calm = 0  # nothing counts as calm: every event goes through queue()
    calm_from = 1
    calm_to = 0

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self._buf: list[Any] = []
        self.queued: list[tuple[Any, ...]] = []

    def queue(self, event: tuple[Any, ...]) -> None:
        self.queued.append(event)


def collecting(monkeypatch: pytest.MonkeyPatch) -> tuple[Emitted, _state.HookState]:
    """A fresh hook state (made current) collecting a cold start whose root is open,
    emitting into a FAKE client."""
    client = Emitted()
    st = _state.HookState()
    st.runtime.client = client  # type: ignore[assignment]
    st.runtime.root_span_id = "a" * 16
    st.runtime.root_start_ns = 1
    st.coldstart.collecting = True
    monkeypatch.setattr(_state, "current", st)
    return client, st
