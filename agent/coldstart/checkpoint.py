"""A producer's cold-start checkpoint: what the agent keeps to close the cold start of a
process killed before its root (pure).

The hooks' sampler thread sends a ``cs_tick`` event about every 100 ms while the cold start
runs: the stack samples taken since the last one, and the runs still open in the process
(an import run, ``nn.init`` runs, a warmup run) as stages so far. The agent keeps the
latest open runs and the samples (bounded); when the process dies without its root, the
agent adds those runs and the gaps the samples explain, as the hooks would have at the end.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from infersight.hooks._contract import (
    ENDED_BY,
    ENDED_BY_PRODUCER_LOST,
    STAGE,
    UNATTRIBUTED,
    UNATTRIBUTED_SAMPLES,
    UNATTRIBUTED_TOP,
)
from infersight.hooks._sampler import MIN_GAP_NS, top_labels, uncovered
from infersight.telemetry import Attributes, SpanItem

MAX_SAMPLES = 60_000  # per producer: ten minutes of samples at 10 ms (about 12 bytes each)
MAX_LABELS = 4096  # distinct labels per producer; samples of others count as "?"


@dataclass(slots=True)
class Checkpoint:
    """The latest open runs (by span id) and the samples so far of one producer."""

    open: dict[str, SpanItem] = field(default_factory=dict)
    times: array[int] = field(default_factory=lambda: array("q"))
    label_ids: array[int] = field(default_factory=lambda: array("I"))
    labels: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    dropped_samples: int = 0

    def add_samples(self, times: list[int], ids: list[int], labels: list[str]) -> None:
        """Samples of one tick: ``ids`` index this tick's ``labels``."""
        room = MAX_SAMPLES - len(self.times)
        if room < len(times):
            self.dropped_samples += len(times) - max(room, 0)
            times, ids = times[:max(room, 0)], ids[:max(room, 0)]
        local = [self._label_id(lab) for lab in labels]
        self.times.extend(times)
        self.label_ids.extend(local[i] for i in ids)

    def _label_id(self, label: str) -> int:
        i = self.index.get(label)
        if i is None:
            if len(self.labels) >= MAX_LABELS:
                return self._label_id("?") if label != "?" else 0
            i = self.index[label] = len(self.labels)
            self.labels.append(label)
        return i

    def samples(self) -> list[tuple[int, str]]:
        labels = self.labels
        return [(t, labels[i]) for t, i in zip(self.times, self.label_ids, strict=True)]


def gap_spans(cp: Checkpoint, root: SpanItem, stages: list[SpanItem]) -> list[SpanItem]:
    """``coldstart.unattributed`` spans for the stretches of ``root`` that no stage covers
    (at least 50 ms), each with its sample count and top labels, as the hooks make them."""
    covered = [(s.start_ns, s.end_ns) for s in stages if s.attributes.get(STAGE) != UNATTRIBUTED]
    samples = cp.samples()
    out: list[SpanItem] = []
    for start, stop in uncovered(covered, root.start_ns, root.end_ns, MIN_GAP_NS):
        attrs: Attributes = {
            STAGE: UNATTRIBUTED,
            UNATTRIBUTED_SAMPLES: sum(1 for t, _lab in samples if start <= t < stop),
            ENDED_BY: ENDED_BY_PRODUCER_LOST,
        }
        top = top_labels(samples, start, stop)
        if top:
            attrs[UNATTRIBUTED_TOP] = top
        span_id = hashlib.blake2b(b"%s:%d" % (root.span_id.encode(), start), digest_size=8).hexdigest()
        out.append(SpanItem(root.resource, root.trace_id, span_id, root.span_id, "coldstart.unattributed",
                            start, stop, attrs, [], None, root.origin))
    return out
