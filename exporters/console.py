"""Console summary: the cold-start waterfall in the terminal."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from infersight.agent.model import ColdStart, Item
from infersight.exporters.waterfall import is_helper, render_waterfall


class ConsoleExporter:
    """Prints a waterfall for every completed cold start (to stderr by default), except
    helper processes' (resource trackers, compile workers, ``python -c`` probes)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.name = "console"
        self.stream = stream
        self.coldstarts: list[ColdStart] = []
        self.printed = 0
        self.helpers = 0

    async def start(self) -> None:
        return None

    async def export(self, batch: Sequence[Item]) -> None:
        for it in batch:
            if isinstance(it, ColdStart):
                self.coldstarts.append(it)
                if is_helper(it):
                    self.helpers += 1
                    continue
                out = self.stream or sys.stderr
                out.write(render_waterfall(it) + "\n")
                out.flush()
                self.printed += 1

    async def force_flush(self, timeout_s: float) -> bool:
        return True

    async def shutdown(self) -> None:
        return None

    def state(self) -> dict[str, int | float | str]:
        return {"printed": self.printed, "helpers": self.helpers}
