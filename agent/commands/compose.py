"""Build the exporters a configuration asks for."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TextIO

from infersight.exporters.base import Exporter
from infersight.exporters.console import ConsoleExporter
from infersight.exporters.file import FileExporter
from infersight.settings import Config, ConfigError

OTLP_ENDPOINT_ENV = re.compile(r"OTEL_EXPORTER_OTLP_(TRACES_|METRICS_|LOGS_)?ENDPOINT\Z")


def otlp_requested(config: Config, env: Mapping[str, str]) -> bool:
    """OTLP only when an endpoint is configured: there is no implicit localhost."""
    if str(env.get("OTEL_SDK_DISABLED", "")).strip().lower() == "true":
        return False
    if config.get("exporters.otlp.endpoint"):
        return True
    return any(OTLP_ENDPOINT_ENV.match(k) and v for k, v in env.items())


def build_exporters(
    config: Config,
    env: Mapping[str, str] | None = None,
    console_stream: TextIO | None = None,
    *,
    embedded: bool = False,
) -> list[Exporter]:
    """The sinks ``config`` asks for. ``embedded``: under ``infersight launch`` (MQTT presence
    on ``launch/<pid>/status`` with its own client id instead of the daemon's status)."""
    env = os.environ if env is None else env
    out: list[Exporter] = []
    path = config.get("exporters.file.path")
    if path:
        out.append(FileExporter(path, config["exporters.file.max_bytes"], config["exporters.file.backups"]))
    if otlp_requested(config, env):
        from infersight.exporters.otlp import OtlpExporter

        try:
            out.append(
                OtlpExporter(
                    config.get("exporters.otlp.endpoint"),
                    config.get("exporters.otlp.protocol"),
                    timeout_s=config.get("exporters.otlp.timeout_s"),
                    env=env,
                )
            )
        except (ImportError, ValueError) as exc:
            raise ConfigError("exporters.otlp: %s" % exc) from exc
    from infersight.exporters.mqtt_settings import settings_from_config as mqtt_settings
    from infersight.exporters.prometheus_endpoint import from_config as prometheus_from_config

    launch_pid = os.getpid() if embedded else None
    if mqtt_settings(config, env=env, embedded=embedded, launch_pid=launch_pid) is not None:
        from infersight.exporters import mqtt  # aiomqtt and paho: ~0.1 s, only for a broker

        broker = mqtt.from_config(config, env=env, embedded=embedded, launch_pid=launch_pid)
        if broker is not None:
            out.append(broker)

    prometheus = prometheus_from_config(config, env=env)
    if prometheus is not None:
        out.append(prometheus)
    if config.get("exporters.console.enabled"):
        out.append(ConsoleExporter(console_stream))
    return out
