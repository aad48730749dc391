"""Per-instance request latency: the value the requests feature offers others (routing).

An *instance* is one serving process on this host (one producer of the agent): its successful
requests' P50/P99 over the sliding window, the P50 of its most recent ones, and how many failed. Neutral: plain
values, so a feature that reads them never imports the one that computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

RECENT_REQUESTS = 20  # "settled" compares the P50 over an instance's last 20 requests


@dataclass(frozen=True, slots=True)
class InstanceLatency:
    producer: str  # the agent's producer id (the process's service.instance.id)
    service: str  # service.name
    pid: int
    count: int  # requests in the window
    p50_s: float
    p99_s: float
    recent_p50_s: float | None  # over the last RECENT_REQUESTS requests; None with fewer
    devices: tuple[str, ...]  # devices its requests ran on (hw.id, else "cuda:N"/"cpu"), in the window
    failed: int = 0  # failed requests in the window (an exception, a 5xx status): not in count nor the P50s

    def failed_share(self) -> float:
        """Its failed requests' share of all its requests in the window."""
        total = self.count + self.failed
        return self.failed / total if total else 0.0

