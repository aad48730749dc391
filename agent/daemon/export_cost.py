"""How long an exporter takes for an export of n items: a part per export (a round trip, a TLS record, a
fsync) and a part per item (encoding, one MQTT publish each), fitted on recent whole exports (pure).

While several uids' batches compete for one exporter, its worker keeps each export to what the sink sends
in ``CONTENDED_EXPORT_S`` (broadcast.py): another uid's batch must not wait for a flood's 4,096 items. Only
the part per item grows with the size; the part per export is paid by every export whatever its size, so
splitting an export for it shortens nobody's wait and divides the throughput (8x with a 1 s round trip).
:meth:`ExportCost.per_item_s` is therefore the slope of duration over size where recent exports varied
enough in size to tell the two apart, else the mean time per item (the round trip counted per item: the
cautious side, as before the fit).
"""

from __future__ import annotations

from collections import deque

WINDOW = 32  # recent whole exports fitted
MIN_FIT = 8  # at least this many, whose largest is at least SPREAD x their smallest
SPREAD = 2.0


class ExportCost:
    """Recent exports' (size, seconds), and what they say an item costs."""

    def __init__(self, window: int = WINDOW) -> None:
        self._obs: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, n: int, seconds: float) -> None:
        if n > 0 and seconds >= 0.0:
            self._obs.append((n, seconds))

    @property
    def known(self) -> bool:
        return bool(self._obs)

    def mean_item_s(self) -> float:
        """Seconds per item with each export's whole time spread over its items (0: nothing seen)."""
        if not self._obs:
            return 0.0
        return sum(d / n for n, d in self._obs) / len(self._obs)

    def per_item_s(self) -> float:
        """The time an export grows by per item: the least-squares slope of seconds over size where the
        sizes spread enough, never above :meth:`mean_item_s` nor below 0; else :meth:`mean_item_s`."""
        mean = self.mean_item_s()
        sizes = [n for n, _ in self._obs]
        if len(sizes) < MIN_FIT or max(sizes) < SPREAD * min(sizes):
            return mean
        k = len(self._obs)
        mn = sum(sizes) / k
        md = sum(d for _, d in self._obs) / k
        var = sum((n - mn) ** 2 for n in sizes)
        if var <= 0:
            return mean
        slope = sum((n - mn) * (d - md) for n, d in self._obs) / var
        return min(mean, max(0.0, slope))
