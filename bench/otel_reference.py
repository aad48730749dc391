"""The DESIGN's reference unit, measured here: one OpenTelemetry SDK span started and ended
(5 attributes, BatchSpanProcessor to a null exporter). Benchmarks report against it so
their figures compare across machines."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def sdk_span_seconds(n: int = 20_000, repeat: int = 1, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds per SDK span over ``repeat`` rounds of ``n`` spans, timed by ``clock``."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Null(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            return SpanExportResult.SUCCESS

    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(Null()))
    tracer = tp.get_tracer("bench")
    attrs = {"infersight.stage": "warmup", "model": "resnet50", "batch": 8, "bytes": 123456789, "x": "y"}
    rounds = []
    for _ in range(repeat):
        t0 = clock()
        for _i in range(n):
            tracer.start_span("coldstart.warmup", attributes=attrs).end()
        rounds.append((clock() - t0) / n)
    tp.shutdown()
    return statistics.median(rounds)
