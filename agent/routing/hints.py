"""The routing decision, pure: an instance's weight, whether it has settled, and the
HAProxy agent-check line that says so.

HAProxy's agent-check (doc/configuration.txt, "agent-check") reads one ASCII line, ended by
the first ``\\r`` or ``\\n``, of words delimited by spaces, tabs or commas: a percentage
(``75%``: the weight relative to the server's configured weight), ``maxconn:N``, ``ready`` /
``drain`` / ``maint`` (administrative state; only ``ready`` cancels a ``drain``), and
``up`` / ``down`` (operating state). The replies here:

- an instance still in its cold start: ``drain``;
- a port no instance is known on: ``up 100%`` (fail open; no ``ready``, which would also undo an operator's
  ``maint`` or ``drain`` set through HAProxy's runtime API);
- a port this agent answered ``drain`` for and no longer knows (its warming instance ended, the port became
  contested): ``up ready 100%`` for LIFT_S, so that the drain it set does not outlive its knowledge;
- a ready instance: ``up ready W%`` (with `` maxconn:N`` when ``max_concurrency`` is set).

W is 100 x (median P50 of its peers, the other ready instances of its ``service.name`` and its
user) / (its own P50), clamped to 10-100, then lowered for its failed requests (x the share that
succeeded, once it has MIN_REQUESTS in the window: an exception or a 5xx status; P50s are of the
successful ones) and for a slow device verdict (x min(0.5, 1/coefficient)), floor 10. Until it
has *settled* (the P50 of its last 20 requests within 1.2x its peers', or 60 s after readiness),
W ramps linearly from 25 to that value.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_WEIGHT = 10
MAX_WEIGHT = 100
RAMP_START = 25
SETTLE_S = 60.0
SETTLE_RATIO = 1.2
SLOW_FACTOR = 0.5  # a slow device verdict halves the weight at least
MIN_REQUESTS = 5  # fewer requests in the window: no P50 to weigh by
MAX_REQUEST_BYTES = 64  # "<port>\n" is at most 6 bytes; anything longer is not HAProxy's agent-send

WARMING_REPLY = "drain\n"
UNKNOWN_REPLY = "up 100%\n"
LIFT_REPLY = "up ready 100%\n"
LIFT_S = 60.0  # how long a port this agent drained, then lost track of, says ``ready`` (HAProxy asks every second)


@dataclass(frozen=True, slots=True)
class Weight:
    percent: int  # MIN_WEIGHT..MAX_WEIGHT
    settled: bool
    maxconn: int | None


def parse_request(line: bytes) -> int | None:
    """The port HAProxy's ``agent-send "<port>\\n"`` names, or None when it names none."""
    text = line.strip(b" \t\r\n")
    if not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def full_weight(own_p50_s: float | None, peer_p50s_s: Sequence[float], slow_coefficient: float | None,
                failed_share: float = 0.0) -> int:
    """The settled weight in percent: relative speed to the peers, lowered for a slow device and
    for the share of its requests that failed (a server that answers 503 at once is not fast)."""
    w = float(MAX_WEIGHT)
    if own_p50_s is not None and own_p50_s > 0 and peer_p50s_s:
        w = MAX_WEIGHT * statistics.median(peer_p50s_s) / own_p50_s
    w = min(float(MAX_WEIGHT), max(float(MIN_WEIGHT), w))
    w *= 1.0 - min(1.0, max(0.0, failed_share))
    if slow_coefficient is not None:
        w *= min(SLOW_FACTOR, 1.0 / slow_coefficient) if slow_coefficient > 0 else SLOW_FACTOR
    return max(MIN_WEIGHT, min(MAX_WEIGHT, round(w)))


def has_settled(recent_p50_s: float | None, peer_p50s_s: Sequence[float], since_ready_s: float) -> bool:
    """Settled: the P50 of its last 20 requests within 1.2x its peers' median P50, or 60 s ready."""
    if since_ready_s >= SETTLE_S:
        return True
    if recent_p50_s is None or not peer_p50s_s:
        return False
    return recent_p50_s <= SETTLE_RATIO * statistics.median(peer_p50s_s)


def ramped(full: int, since_ready_s: float, settled: bool) -> int:
    """The weight while settling: from 25% up to ``full`` over the 60 s settling bound."""
    if settled or full <= RAMP_START:
        return full
    share = min(1.0, max(0.0, since_ready_s / SETTLE_S))
    return min(full, round(RAMP_START + (full - RAMP_START) * share))


def scaled_maxconn(max_concurrency: int | None, percent: int) -> int | None:
    if max_concurrency is None:
        return None
    return max(1, round(max_concurrency * percent / MAX_WEIGHT))


def ready_reply(w: Weight) -> str:
    """``up ready W%`` (and ``maxconn:N``): ``ready`` also cancels an earlier ``drain``."""
    line = "up ready %d%%" % w.percent
    if w.maxconn is not None:
        line += " maxconn:%d" % w.maxconn
    return line + "\n"
