"""OTLP files for the report tests, made by the agent's real code (assembler, OOM and memory
handlers, request statistics, device job, device metrics, OTLP JSON exporter).

There is no GPU here: the device readings are FAKE ``DeviceSample`` values (two "FAKE H100"
devices, the second thermally throttled, its PCIe link downtrained, one corrected ECC error and
an Xid), and the allocator statistics are what a FAKE torch would report. Everything downstream
of those readings is the production code path.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from infersight.agent.coldstart.assembly import coldstart_assembler
from infersight.agent.devices.job import DeviceJob, _event_log
from infersight.agent.devices.metrics import device_metrics
from infersight.agent.devices.nvml import DeviceEvent, DeviceSample
from infersight.agent.oom import kind as oom_kind
from infersight.agent.report.parse import Telemetry
from infersight.agent.report.scan import memory_source
from infersight.agent.report.trace import plan_trace, write_chrome_trace
from infersight.agent.requests.kind import RequestStats
from infersight.exporters.otlp_json import encode_lines
from infersight.rules.device_rules import DeviceThresholds
from infersight.telemetry import Item, Resource

GIB = 1 << 30
MIB = 1 << 20
S = 1_000_000_000
TRACE = "7a" * 16
ROOT = "10" * 8
GPU = ("GPU-fa4e0000-0000-4000-8000-000000000000", "GPU-fa4e0000-0000-4000-8000-000000000001")
FAKE_PID = 424242
AGENT = Resource.of({"service.name": "infersight-agent", "host.name": "fakehost", "process.pid": 99999})

# (stage, span id, parent, start s, end s, attributes)
STAGES: list[tuple[str, str, str, float, float, dict[str, Any]]] = [
    ("runtime_init", "11" * 8, ROOT, 0.0, 0.1, {}),
    ("framework_import", "12" * 8, ROOT, 0.1, 1.5, {"infersight.framework": "torch"}),
    ("cuda_init", "13" * 8, ROOT, 1.5, 2.0, {}),
    ("weights_load", "14" * 8, ROOT, 2.0, 3.0, {
        "infersight.weights.bytes": 2 * GIB, "infersight.weights.bytes_per_s": 2.0 * GIB,
        "infersight.weights.page_cache_ratio": 1.0, "infersight.weights.api": "safetensors",
        "infersight.weights.path": "/models/fake/model.safetensors", "x.unknown.attribute": "kept as is"}),
    ("weights_to_device", "15" * 8, ROOT, 3.0, 3.6, {}),
    ("warmup", "16" * 8, ROOT, 3.6, 5.0, {}),
    ("graph_compile", "17" * 8, "16" * 8, 3.7, 4.5, {"infersight.compile.backend": "inductor",
                                                    "infersight.compile.cache": "miss"}),
    ("unattributed", "18" * 8, ROOT, 5.0, 5.3, {"infersight.unattributed.top": [
        "mylib.setup:build_index 61%", "json.decoder:raw_decode 22%"]}),
    ("ready_wait", "19" * 8, ROOT, 5.3, 5.4, {"infersight.ready.source": "listen"}),
]
WARMUP = "16" * 8
END_S = 5.5


def stage_events(base: int) -> list[list[Any]]:
    evs: list[list[Any]] = []
    for name, sid, parent, s, e, attrs in STAGES:
        a = {"infersight.stage": name, **attrs}
        evs.append(["span", base + int(e * S), {"n": "coldstart." + name, "id": sid, "p": parent,
                                                  "s": base + int(s * S), "e": base + int(e * S), "a": a}])
    root_a = {"infersight.coldstart.ready_s": 5.4, "infersight.ready.source": "listen",
              "infersight.coldstart.ended_by": "ready"}
    evs.append(["span", base + int(END_S * S), {"n": "coldstart", "id": ROOT, "s": base, "e": base + int(END_S * S),
                                                "a": root_a}])
    return evs


def samples_at(t: int, i: int) -> list[DeviceSample]:
    """FAKE NVML readings at step ``i`` (every 0.25 s)."""
    hot = 8 <= i < 16
    base: dict[str, Any] = {"name": "FAKE NVIDIA H100 80GB", "memory_total_bytes": 80 * GIB, "clock_sm_max_mhz": 1980,
                            "pcie_link_gen_max": 5, "pcie_link_width_max": 16, "utilization_gpu_pct": 90,
                            "temperature_c": 60}
    s0 = DeviceSample(time_ns=t, index=0, uuid=GPU[0], memory_used_bytes=(2 + i // 2) * GIB, clock_sm_mhz=1980,
                      throttle_mask=0, pcie_link_gen=5, pcie_link_width=16, ecc_corrected_volatile=0,
                      **base)  # type: ignore[arg-type]
    s1 = DeviceSample(time_ns=t, index=1, uuid=GPU[1], memory_used_bytes=3 * GIB, clock_sm_mhz=1200 if hot else 1980,
                      throttle_mask=0x40 if hot else 0, throttle_reasons=("hw_thermal_slowdown",) if hot else (),
                      pcie_link_gen=3, pcie_link_width=16, ecc_corrected_volatile=1 if i >= 16 else 0,
                      **base)  # type: ignore[arg-type]
    return [s0, s1]


def gpu_items(base: int) -> list[Item]:
    """One FAKE GPU worker's cold start with memory, an OOM, device metrics and verdicts."""
    handlers = oom_kind.OomHandlers(oom_kind.OomClassifier([]), None)
    stats = RequestStats()
    asm = coldstart_assembler("fakehost", {"oom": handlers.oom, "mem": handlers.mem, "req": stats.handle})
    p = asm.hello({"id": "fake-gpu-worker", "pid": FAKE_PID, "start_ns": base, "trace_id": TRACE,
                   "root_span_id": ROOT, "service_name": "fake-gpu-worker", "exe": "python"})
    raw: list[list[Any]] = []
    for i in range(13):  # allocator samples from cuda_init to the end of warmup
        t = base + int((2.0 + 0.25 * i) * S)
        st = {"allocated": min(i, 9) * 2 * GIB, "reserved": min(i, 9) * 2 * GIB + GIB, "device_alloc": i,
              "device_free": 0, "retries": 1 if i >= 11 else 0}
        ev = [{"n": "large_alloc", "count": 1, "bytes": 4 * GIB}] if i == 8 else None
        d: dict[str, Any] = {"dev": 0, "uuid": GPU[0], "s": st, "sp": WARMUP}
        if ev:
            d["ev"] = ev
        raw.append(["mem", t, d])
    raw.append(["oom", base + int(4.8 * S), {
        "source": "observer", "dev": 0, "uuid": GPU[0], "req": 4 * GIB, "total": 80 * GIB, "free": GIB,
        "stats": {"allocated": 18 * GIB, "reserved": 19 * GIB}, "sp": WARMUP}])
    for i in range(60):  # requests on both devices; cuda:1 has a slow tail
        for dev, h in (("cuda:0", GPU[0]), ("cuda:1", GPU[1])):
            dur = 0.003 if dev == "cuda:0" or i % 20 != 19 else 0.06
            t = base + int((3.0 + 0.03 * i) * S)
            raw.append(["req", t, {"d": dev, "h": h, "hn": "FAKE NVIDIA H100 80GB", "m": "llama-fake", "n": 16,
                                   "s": t - int(dur * S), "dur": dur}])
    raw += stage_events(base)
    raw.sort(key=lambda e: e[1])
    items: list[Item] = asm.events(p, [[n + 1, t, kind, d] for n, (kind, t, d) in enumerate(raw)])
    assert p.malformed == 0, "the fixture sent a malformed event"
    # 60 requests a device and one evaluation: below the shipped min_requests (100) and hysteresis (3)
    job = DeviceJob(enabled=False, requests=stats, thresholds=DeviceThresholds(min_requests=20, slow_evaluations=1))
    job._agent = SimpleNamespace(resource=AGENT)  # the job's agent: only its resource is used here
    for i in range(23):
        t = base + int(0.25 * i * S)
        ss = samples_at(t, i)
        job._keep(ss, t)
        items += device_metrics(ss, resource=AGENT, start_ns=base, time_ns=t)
    coefficients, verdicts = job.evaluate(base + int(END_S * S))
    items += coefficients + verdicts
    items += stats.collect(base + int(END_S * S), everything=True)
    items.append(_event_log(job._agent, DeviceEvent(base + int(4.2 * S), "xid", 1, GPU[1], 48,
                                                    "Xid 48 on GPU 1: double-bit ECC error (FAKE)")))
    return items


def write(path: Path, items: list[Item]) -> Path:
    path.write_text("".join(line + "\n" for line in encode_lines(items)))
    return path


def only(items: list[Item], kind: type) -> list[Item]:
    return [i for i in items if isinstance(i, kind)]


def replace_resource(items: list[Item], **attrs: Any) -> list[Item]:
    out: list[Item] = []
    for i in items:
        res = Resource.of({**i.resource.as_dict(), **attrs}) if hasattr(i, "resource") else None
        out.append(dataclasses.replace(i, resource=res) if res is not None else i)  # type: ignore[type-var]
    return out


def chrome_trace(t: Telemetry) -> Any:
    """What ``show --format chrome-trace`` writes for ``t``, parsed."""
    source, out = memory_source(t), io.StringIO()
    write_chrome_trace(source, plan_trace(source), out)
    return json.loads(out.getvalue())
