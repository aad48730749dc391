"""Sample telemetry items shared by the OTLP tests."""

from __future__ import annotations

import secrets

from infersight.telemetry import (
    HistogramPoint,
    LogItem,
    MetricItem,
    NumberPoint,
    Resource,
    SpanEvent,
    SpanItem,
)

RES = Resource.of({"service.name": "serve", "host.name": "gpu-01", "process.pid": 4242})
T0 = 1_700_000_000_000_000_000


def make_spans(n_children: int = 2, trace_id: str | None = None) -> list[SpanItem]:
    trace_id = trace_id or secrets.token_hex(16)
    root_id = secrets.token_hex(8)
    root = SpanItem(
        RES, trace_id, root_id, None, "coldstart", T0, T0 + 5_000_000_000,
        attributes={"infersight.stage": "root", "gpu.count": 2, "ok": True, "ratio": 0.5,
                    "devices": ["GPU-a", "GPU-b"]},
        events=[SpanEvent("ready", T0 + 4_000_000_000, {"port": 8000})],
    )
    children = [
        SpanItem(RES, trace_id, secrets.token_hex(8), root_id, "stage-%d" % i,
                 T0 + i * 1_000_000, T0 + (i + 1) * 1_000_000,
                 attributes={"i": i}, error="boom" if i == 1 else None)
        for i in range(n_children)
    ]
    return [root, *children]


def make_logs() -> list[LogItem]:
    return [
        LogItem(RES, T0 + 1, 17, "ERROR", "CUDA out of memory", {"oom.cause": "fragmentation"},
                trace_id="0af7651916cd43dd8448eb211c80319c", span_id="b7ad6b7169203331",
                event_name="oom"),
        LogItem(RES, T0 + 2, 9, "INFO", "model loaded"),
    ]


def make_metrics() -> list[MetricItem]:
    return [
        MetricItem(RES, "hw.gpu.memory.usage", "gauge", "By", "GPU memory used", T0, T0 - 10,
                   [NumberPoint(123456789, {"hw.id": "GPU-a"}), NumberPoint(5, {"hw.id": "GPU-b"})]),
        MetricItem(RES, "infersight.events.in", "sum", "{event}", "events received", T0, T0 - 10,
                   [NumberPoint(42.5)]),
        MetricItem(RES, "infersight.coldstart.duration", "histogram", "s", "cold start time", T0,
                   T0 - 10, [HistogramPoint([1.0, 5.0, 10.0], [1, 2, 0, 1], 4, 30.5, 0.5, 20.0,
                                            {"model": "llama"})]),
    ]
