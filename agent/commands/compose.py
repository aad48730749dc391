"""Build the exporters a configuration asks for."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO

from infersight.exporters.base import Exporter, is_ephemeral, is_live
from infersight.exporters.console import ConsoleExporter
from infersight.exporters.file import FileExporter
from infersight.settings import Config, ConfigError, section_unset

if TYPE_CHECKING:
    from infersight.exporters.mqtt_settings import MqttSettings

DEFAULT_FILE_NAME = "infersight.otlp.jsonl"
# The sections of the exporters that are off unless configured, and the prefix of their
# environment variables: an unset one costs no import (~50 ms for Prometheus, ~15 ms for MQTT).
MQTT_SECTION = ("exporters.mqtt.", "INFERSIGHT_MQTT_")
PROMETHEUS_SECTION = ("exporters.prometheus.", "INFERSIGHT_PROMETHEUS")


def otlp_requested(config: Config, env: Mapping[str, str]) -> bool:
    """OTLP only when an endpoint is configured (the file's or the environment's): there is no
    implicit localhost."""
    endpoint = config.get("exporters.otlp.endpoint")
    if not endpoint and not any(v and k.startswith("OTEL_EXPORTER_OTLP_") and k.endswith("ENDPOINT")
                                for k, v in env.items()):
        return False  # no endpoint anywhere: the OTLP exporter's module is not imported
    from infersight.exporters import otlp

    return otlp.otlp_requested(endpoint, env)


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
    launch_pid = os.getpid() if embedded else None
    if not section_unset(config, *MQTT_SECTION, env):
        from infersight.exporters.mqtt_settings import settings_from_config as mqtt_settings

        if mqtt_settings(config, env=env, embedded=embedded, launch_pid=launch_pid) is not None:
            from infersight.exporters import mqtt  # aiomqtt and paho: ~0.1 s, only for a broker

            broker = mqtt.from_config(config, env=env, embedded=embedded, launch_pid=launch_pid)
            if broker is not None:
                out.append(broker)
    if not section_unset(config, *PROMETHEUS_SECTION, env):
        from infersight.exporters.prometheus_endpoint import from_config as prometheus_from_config

        prometheus = prometheus_from_config(config, env=env)
        if prometheus is not None:
            out.append(prometheus)
    if config.get("exporters.console.enabled"):
        out.append(ConsoleExporter(console_stream))
    path = file_path(config, recording=any(records(e) for e in out))
    if path:
        in_state = path == default_file_path(config)  # the agent's own state: opened without links
        out.insert(0, FileExporter(path, config["exporters.file.max_bytes"], config["exporters.file.backups"],
                                   state_dir=config["agent.state_dir"] if in_state else None))
    return out


def records(exporter: Exporter) -> bool:
    """A sink that keeps every item (file, OTLP, MQTT); not the terminal, not a scrape endpoint."""
    return not is_ephemeral(exporter) and not is_live(exporter)


def default_file_path(config: Config) -> str:
    """The daemon's embedded default: the OTLP JSON file in the agent's state directory."""
    return os.path.join(config["agent.state_dir"], DEFAULT_FILE_NAME)


def file_path(config: Config, recording: bool) -> str | None:
    """Where the file exporter writes, or None: ``exporters.file.path`` when set; the default
    file when ``exporters.file.enabled`` is true, or ``auto`` and no other sink records
    (``recording``); never when it is false."""
    enabled = config.get("exporters.file.enabled", "auto")
    if enabled is False:
        return None
    path: str | None = config.get("exporters.file.path")
    if path:
        return path
    if enabled is True or not recording:
        return default_file_path(config)
    return None


def file_is_default(config: Config, exporters: list[Exporter]) -> str | None:
    """The default file's path when ``exporters`` write it (for the start-up log line)."""
    default = default_file_path(config)
    for e in exporters:
        if isinstance(e, FileExporter) and e.path == default and not config.get("exporters.file.path"):
            return default
    return None


def check_exporter_settings(config: Config, env: Mapping[str, str] | None = None, *,
                            embedded: bool = False) -> MqttSettings | None:
    """Check what :func:`build_exporters` would read, without starting any exporter (no
    bind, no connection): ``launch`` calls it before CMD starts. Raises ConfigError. Returns the
    MQTT settings it read (its password file among them), None without an MQTT section."""
    env = os.environ if env is None else env
    mqtt: MqttSettings | None = None
    if not section_unset(config, *MQTT_SECTION, env):
        from infersight.exporters.mqtt_settings import settings_from_config

        mqtt = settings_from_config(config, env=env, embedded=embedded, launch_pid=os.getpid() if embedded else None)
    if not section_unset(config, *PROMETHEUS_SECTION, env):
        from infersight.exporters.prometheus_endpoint import PROMETHEUS_KEYS
        from infersight.settings import section_settings

        section_settings(config, PROMETHEUS_SECTION[0], PROMETHEUS_KEYS, env)
    if otlp_requested(config, env):
        from infersight.exporters import otlp

        try:
            for signal in otlp.SIGNALS:
                otlp.resolve_protocol(signal, config.get("exporters.otlp.protocol"), env)
                otlp.resolve_timeout(signal, config.get("exporters.otlp.timeout_s"), env)
        except ValueError as exc:
            raise ConfigError("exporters.otlp: %s" % exc) from None
    return mqtt
