"""Console summary: the cold-start waterfall in the terminal, and a line for each classified OOM."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from typing import TextIO

from infersight.exporters.waterfall import is_helper, render_waterfall
from infersight.sanitize import terminal_line
from infersight.telemetry import ColdStart, ColdStartProgress, Item, LogItem

KEEP_COLDSTARTS = 64


def progress_line(state: dict[str, object]) -> str:
    """``warming: weights_load 3.1 s, ~4.2 s left (5 runs)``; without history, no ETA."""
    stage = state.get("stage") or "starting"
    elapsed = state.get("elapsed_s")
    eta = state.get("eta_s")
    line = "warming: %s %.1f s" % (stage, float(elapsed) if isinstance(elapsed, (int, float)) else 0.0)
    if isinstance(eta, (int, float)):
        runs = state.get("eta_runs")
        line += ", ~%.1f s left (%s run%s)" % (eta, runs, "" if runs == 1 else "s")
    return line


class ConsoleExporter:
    """Prints a waterfall for every completed cold start (to stderr by default), except
    helper processes' (resource trackers, compile workers, ``python -c`` probes), and one line
    for every classified OOM (its class, rule and remedy) as it comes. The last few cold starts
    are kept (``coldstarts``) for an embedding program; a long-lived agent keeps no more."""

    ephemeral = True  # a terminal shows the present: nothing is spooled to show it later

    def __init__(self, stream: TextIO | None = None, keep: int = KEEP_COLDSTARTS) -> None:
        self.name = "console"
        self.stream = stream
        self.coldstarts: deque[ColdStart] = deque(maxlen=keep)
        self.printed = 0
        self._progress_shown = False
        self.helpers = 0
        self.ooms = 0

    async def start(self) -> None:
        return None

    def _progress(self, it: ColdStartProgress) -> None:
        """One updating line while a process warms, on a terminal only (a log file gets none)."""
        out = self.stream or sys.stderr
        if not getattr(out, "isatty", lambda: False)():
            return
        if it.state is None:
            if self._progress_shown:
                out.write("\r\x1b[K")
                out.flush()
                self._progress_shown = False
            return
        out.write("\r\x1b[K" + progress_line(it.state))
        out.flush()
        self._progress_shown = True

    async def export(self, batch: Sequence[Item]) -> None:
        for it in batch:
            if isinstance(it, ColdStartProgress):
                self._progress(it)
                continue
            if isinstance(it, LogItem):
                if it.event_name == "oom":
                    self._oom(it)
                continue
            if isinstance(it, ColdStart):
                if self._progress_shown:
                    self._progress(ColdStartProgress(it.root.resource, "", 0, 0, None))
                self.coldstarts.append(it)
                if is_helper(it):
                    self.helpers += 1
                    continue
                out = self.stream or sys.stderr
                out.write(render_waterfall(it) + "\n")
                out.flush()
                self.printed += 1

    def _oom(self, it: LogItem) -> None:
        """``infersight: pid 4242: OOM [vllm]: reservation_conflict by rule ...: <reason> <remedy>``."""
        if self._progress_shown:
            self._progress(ColdStartProgress(it.resource, "", 0, 0, None))
        pid = it.resource.get("process.pid")
        out = self.stream or sys.stderr
        out.write("infersight: %s%s\n" % ("pid %d: " % pid if type(pid) is int else "", terminal_line(it.body)))
        out.flush()
        self.ooms += 1

    async def force_flush(self, timeout_s: float) -> bool:
        return True

    async def shutdown(self) -> None:
        return None

    def state(self) -> dict[str, int | float | str]:
        return {"printed": self.printed, "helpers": self.helpers, "ooms": self.ooms}
