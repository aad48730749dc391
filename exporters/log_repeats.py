"""Repeated log lines, said once a minute: a collector that refuses every batch, or is away for an hour,
must not write a line per batch into the journal (pure stdlib; a ``logging.Filter``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

EVERY_S = 60.0  # the same kind of line again after this long, with how many were held back
MAX_KINDS = 256  # kinds remembered (a message template per logger); the oldest forgotten first


class QuietRepeats(logging.Filter):
    """Lets a record through the first time its kind (logger and message template) is seen, then at most once
    per ``every_s``, the text then saying how many like it were held back. Thread-safe: the OTLP SDK logs from
    the export threads."""

    def __init__(self, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self.held_back = 0  # records not written, in all
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # kind -> (last written, held back since)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg))
        now = self.clock()
        with self._lock:
            last = self._seen.get(kind)
            if last is not None and now - last[0] < self.every_s:
                self._seen[kind] = (last[0], last[1] + 1)
                self.held_back += 1
                return False
            if len(self._seen) >= MAX_KINDS and kind not in self._seen:
                self._seen.pop(next(iter(self._seen)))
            self._seen.pop(kind, None)
            self._seen[kind] = (now, 0)
        if last is not None and last[1]:
            record.msg = "%s (%d more like this in the last %.0f s)" % (record.msg, last[1], now - last[0])
        return True


_SHARED = QuietRepeats()


def quiet(*loggers: str) -> QuietRepeats:
    """Put the shared filter on ``loggers`` (once each); returns it."""
    for name in loggers:
        lg = logging.getLogger(name)
        if _SHARED not in lg.filters:
            lg.addFilter(_SHARED)
    return _SHARED
