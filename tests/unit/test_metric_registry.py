"""One metric registry: every metric the agent makes is declared once, and made as declared.

The producers are driven with FAKE inputs (``report_data``: no GPU, the agent's real handlers);
each metric they emit must be the one its declaration makes (name, kind, unit, help, monotonic).
A source scan keeps the list of declaring modules and the makers of metric items complete.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import report_data as rd
from metric_modules import DECLARING  # the modules that declare metrics: importing them all fills the registry

from infersight.metricspec import REGISTRY, DuplicateMetricError, MetricRegistry, MetricSpec, prometheus_name
from infersight.telemetry import ColdStart, MetricItem

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("agent", "exporters", "infersight", "rules")
# Where a MetricItem may be built from parts rather than from a declared spec: the spec itself,
# the spool's decoder (items the agent made before), the hooks' own metrics (named by the program).
MAKERS = {"infersight/metricspec.py", "agent/daemon/itemcodec.py", "agent/daemon/assemble.py"}


def _python_files() -> list[Path]:
    return sorted(p for d in SOURCES for p in (ROOT / d).rglob("*.py"))


def _calls(path: Path, names: set[str]) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and ((isinstance(n.func, ast.Name) and n.func.id in names)
                 or (isinstance(n.func, ast.Attribute) and n.func.attr in names))]


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts if parts[0] == "infersight" else ["infersight", *parts])


@pytest.fixture(scope="module")
def registry() -> MetricRegistry:
    for name in DECLARING:
        importlib.import_module(name)
    return REGISTRY


def test_a_name_declared_twice_raises() -> None:
    reg = MetricRegistry()
    spec = MetricSpec("app.queue.depth", "gauge", "{request}", "Requests waiting")
    assert reg.declare(spec) == (spec,)
    with pytest.raises(DuplicateMetricError, match="app.queue.depth is declared twice"):
        reg.declare(MetricSpec("app.queue.depth", "sum", "{request}", "Another help text", monotonic=True))
    # Two OTel names that become one Prometheus name are one series family on a scrape.
    reg.declare(MetricSpec("app.read", "gauge", "By", "Bytes read"))
    with pytest.raises(DuplicateMetricError, match="app_read_bytes"):
        reg.declare(MetricSpec("app.read.bytes", "gauge", "By", "Bytes read, again"))
    # A batch with a taken name adds nothing.
    with pytest.raises(DuplicateMetricError):
        reg.declare(MetricSpec("app.new", "gauge", "", "New"), MetricSpec("app.new", "gauge", "", "New, again"))
    assert [s.name for s in reg] == ["app.queue.depth", "app.read"]


def test_declaring_a_taken_name_fails_at_import(registry: MetricRegistry) -> None:
    """A module declaring a name another module declared cannot be imported."""
    import types

    source = ("from infersight.metricspec import MetricSpec, declare\n"
              "declare(MetricSpec('infersight.events.received', 'sum', '{event}', 'Events, again', monotonic=True))\n")
    module = types.ModuleType("second_declaration")
    with pytest.raises(DuplicateMetricError, match="infersight.events.received is declared twice"):
        exec(compile(source, "second_declaration.py", "exec"), module.__dict__)
    assert registry["infersight.events.received"].description == "Valid events accepted from producers"


def test_every_declaring_module_is_listed() -> None:
    found = {_module(p) for p in _python_files() if _calls(p, {"declare", "declared"})
             and not p.match("infersight/metricspec.py")}
    assert found == set(DECLARING)


def test_metric_items_are_made_from_declared_specs_only() -> None:
    """No producer builds a MetricItem from parts: it asks its declared spec (``spec.item``)."""
    bad = ["%s:%d" % (p.relative_to(ROOT), line) for p in _python_files()
           if str(p.relative_to(ROOT)) not in MAKERS for line in _calls(p, {"MetricItem"})]
    assert bad == []


def _emitted() -> list[MetricItem]:
    from infersight.agent.coldstart.metrics import ColdStartMetrics, ceiling_item
    from infersight.agent.daemon.health import Counters, health_metrics
    from infersight.agent.devices.metrics import device_metrics, nvml_unavailable
    from infersight.agent.devices.nvml import DeviceSample, GpuProcess
    from infersight.agent.requests.kind import RequestStats

    items = rd.gpu_items(10**18)  # memory, OOM counts, device metrics and coefficients, requests
    every_reading = DeviceSample(
        time_ns=10**18, index=0, uuid=rd.GPU[0], name="FAKE H100", utilization_gpu_pct=50, utilization_memory_pct=20,
        memory_used_bytes=1 << 30, memory_total_bytes=80 << 30, clock_sm_mhz=1500, clock_sm_max_mhz=1980,
        clock_memory_mhz=2600, clock_memory_max_mhz=2619, power_w=300.0, power_limit_w=700.0, temperature_c=60,
        throttle_mask=0, pcie_link_gen=5, pcie_link_gen_max=5, pcie_link_width=16, pcie_link_width_max=16,
        pcie_replay=0, ecc_corrected_volatile=0, ecc_uncorrected_volatile=0, retired_pages_sbe=0, retired_pages_dbe=0,
        remapped_rows_corrected=0, remapped_rows_uncorrected=0, remap_pending=False, remap_failure=False,
        nvlink_active=(True, False), processes=(GpuProcess(7, 1 << 30, 7, "python"),))
    items += device_metrics([every_reading], resource=rd.AGENT, start_ns=1)
    acc = ColdStartMetrics()
    for cs in (i for i in items if isinstance(i, ColdStart)):
        items += acc.observe(cs, cs.root.end_ns)
    ceiling = ceiling_item(rd.AGENT, {"8:1": 1e9}, 10**18, 10**18)
    assert ceiling is not None
    items.append(ceiling)
    items += RequestStats().self_metrics(rd.AGENT, 1, 2)
    worker = {"name": "otlp", "queue_depth": 1, "export_errors": 0, "retries": 0, "dropped_items": 0,
              "exported_items": 3}
    items += health_metrics(rd.AGENT, 1, Counters(), 0, 0, [worker], 0.5, 1 << 20,
                            assembler={"gaps_forgotten": 0})
    items.append(nvml_unavailable(rd.AGENT, "absent", 1, 10**18))
    return [i for i in items if isinstance(i, MetricItem)]


def test_every_metric_emitted_is_declared_and_made_as_declared(registry: MetricRegistry) -> None:
    from infersight.agent.devices.metrics import METRICS

    emitted = _emitted()
    names = {m.name for m in emitted}
    assert names >= {s.name for s in METRICS}  # a reading of everything NVML tells
    assert names >= {"infersight.oom.count", "infersight.memory.reserved", "infersight.memory.alloc_retries",
                     "infersight.request.duration", "infersight.instance.request.p99", "infersight.requests.dropped",
                     "infersight.device.coefficient", "infersight.coldstart.duration", "infersight.coldstart.count",
                     "infersight.storage.ceiling", "infersight.events.received", "infersight.exporter.queue.depth",
                     "infersight.events.gaps_forgotten", "infersight.nvml.available"}
    for m in emitted:
        assert m.name in registry, m.name
        assert registry[m.name].item(m.resource, m.time_ns, m.start_ns, m.points) == m, m.name


def test_the_endpoints_own_series_are_declared(registry: MetricRegistry) -> None:
    from infersight.exporters.prometheus_endpoint import RoutingGauges, SeriesStore, WarmingGauges
    from infersight.telemetry import ColdStartProgress, RoutingHint

    warming, routing = WarmingGauges(), RoutingGauges()
    warming.add([ColdStartProgress(rd.AGENT, "svc", 7, 1, {"eta_s": 3.0, "progress": 0.5})])
    routing.add([RoutingHint(rd.AGENT, "svc", 8000, 1, {"weight_ratio": 1.0, "settled": 1})])
    families = [*SeriesStore().families(), *warming.families(), *routing.families()]
    by_prometheus = {prometheus_name(s).removesuffix("_total"): s for s in registry}
    assert len(families) == 6
    for f in families:
        assert f.documentation == by_prometheus[f.name].description, f.name
