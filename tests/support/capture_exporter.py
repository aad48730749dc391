"""A sink for tests that keeps what it gets: the agent's exporter protocol, nothing more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CaptureExporter:
    """Every item it got (``items``), and each export's batch (``batches``)."""

    name = "capture"

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.batches: list[list[Any]] = []

    async def start(self) -> None:
        pass

    async def export(self, batch: Sequence[Any]) -> None:
        self.batches.append(list(batch))
        self.items.extend(batch)

    async def force_flush(self, timeout_s: float) -> bool:
        return True

    async def shutdown(self) -> None:
        pass

    def state(self) -> dict[str, int | float | str]:
        return {}
