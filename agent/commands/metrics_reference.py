"""The table of docs/telemetry.md for the agent's metrics that no feature table lists: request latency, OOMs,
the allocator, device verdicts and the agent's own health, generated from the metric registry
(:mod:`infersight.metricspec`) as each module declared them.

    python -m infersight.agent.commands.metrics_reference     # prints it; tests/unit/test_metrics_reference.py
                                                              # checks that docs/telemetry.md holds it

The cold-start metrics and the device gauges have their own tables (agent/coldstart/metrics.py,
docs/device_metrics.md); routing's two gauges are in docs/routing.md.
"""

from __future__ import annotations

import importlib

from infersight.metricspec import REGISTRY, MetricSpec, prometheus_name

# The modules that declare the table's metrics (each at import); the rows come by name.
MODULES = ("infersight.agent.daemon.health", "infersight.agent.requests.kind", "infersight.agent.oom.kind",
           "infersight.agent.devices.job", "infersight.agent.devices.metrics", "infersight.agent.coldstart.metrics",
           "infersight.exporters.prometheus_endpoint")
ROUTING = ("infersight.routing.weight", "infersight.instance.settled")  # in docs/routing.md


def specs() -> list[MetricSpec]:
    """Every registered metric except those of the features' own tables."""
    for m in MODULES:
        importlib.import_module(m)
    from infersight.agent.coldstart.metrics import METRICS as COLDSTART
    from infersight.agent.devices.metrics import METRICS as DEVICES

    own_tables = {s.name for s in (*COLDSTART, *DEVICES)}
    # by name: the registry's order is the order of the imports, which differs from one process to another
    return sorted((s for s in REGISTRY if s.name not in own_tables and s.name not in ROUTING), key=lambda s: s.name)


def _kind(s: MetricSpec) -> str:
    if s.kind == "sum":
        return "counter" if s.monotonic else "updowncounter"
    return s.kind


def _prometheus(s: MetricSpec) -> str:
    name = prometheus_name(s)
    return "`%s_bucket/_sum/_count`" % name if s.kind == "histogram" else "`%s`" % name


def render() -> str:
    lines = ["| OTel name | kind | unit | Prometheus name | meaning |", "| --- | --- | --- | --- | --- |"]
    lines += ["| `%s` | %s | `%s` | %s | %s |" % (s.name, _kind(s), s.unit, _prometheus(s), s.description)
              for s in specs()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render().rstrip("\n"))
