"""N OpenTelemetry SDK spans (start+end, 5 attributes, ``BatchSpanProcessor``, as in
``otel_reference.py``), then exit: the SDK side of ``stage_cold_loop.py``'s instruction
counts (issue 25). The processor's thread is left running, as in the timed bench; only the
calling thread's instructions are counted.

    valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file=sp.2k \\
        python bench/span_loop.py 2000     # then 6000 into sp.6k
    # (totals of sp.6k-01 - totals of sp.2k-01) / 4000 = instructions per span

Run: python bench/span_loop.py N
"""

from __future__ import annotations

import gc
import os
import sys


def main() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Null(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            return SpanExportResult.SUCCESS

    n = int(sys.argv[1])
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(Null()))
    tracer = tp.get_tracer("bench")
    attrs = {"infersight.stage": "warmup", "model": "resnet50", "batch": 8, "bytes": 123456789, "x": "y"}

    def spans(k: int) -> None:
        for _i in range(k):
            tracer.start_span("coldstart.warmup", attributes=attrs).end()

    spans(1000)  # warm
    gc.collect()
    spans(n)
    os._exit(0)  # no exit handlers: nothing after the loop is counted


if __name__ == "__main__":
    main()
