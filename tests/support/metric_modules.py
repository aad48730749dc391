"""The modules that declare metrics (``MetricRegistry.declare`` at import): imported together,
they fill ``infersight.metricspec.REGISTRY``. Shared by the registry's unit test, which checks
this list is complete, and by the Prometheus rules' test, which reads the names."""

DECLARING = (
    "infersight.agent.coldstart.metrics",
    "infersight.agent.daemon.health",
    "infersight.agent.devices.job",
    "infersight.agent.devices.metrics",
    "infersight.agent.oom.kind",
    "infersight.agent.requests.kind",
    "infersight.exporters.prometheus_endpoint",
)
