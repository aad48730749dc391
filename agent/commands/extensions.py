"""What the agent does beyond the core pipeline, installed the same way in both modes.

The daemon (``infersight agent``) and the embedded agent of ``infersight launch`` get
the same kind handlers and jobs: request latency and device telemetry (NVML, verdicts),
and live OOM classification with its rule reloads.
"""

from __future__ import annotations

from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.devices import job as devices_job
from infersight.agent.oom import kind as oom_kind
from infersight.settings import Config, section_settings


def validate(conf: Config) -> None:
    """Raise ConfigError (naming the key) before anything starts."""
    devices_job.validate(conf)


def validate_exporters(conf: Config) -> None:
    """The exporters' own sections (MQTT, Prometheus): raise ConfigError naming the key.
    A reload checks them so that a file the next restart would refuse is refused now."""
    import os

    from infersight.exporters.mqtt import MQTT_KEYS
    from infersight.exporters.prometheus_endpoint import PROMETHEUS_KEYS

    section_settings(conf, "exporters.mqtt.", MQTT_KEYS, os.environ)
    section_settings(conf, "exporters.prometheus.", PROMETHEUS_KEYS, os.environ)


def install(agent: Agent, conf: Config) -> None:
    job = devices_job.install(agent, conf)
    oom_kind.install(agent, conf, nvml=job.nvml, nvml_guard=job.nvml_call)
    agent.reloaders.append(validate_exporters)  # nothing to swap: a restart applies them
