"""The composition root of the agent: which extensions it runs, built by name.

The daemon (``infersight agent``) and the embedded agent of ``infersight launch`` both build
their agent here (:func:`new_agent`), so both get the same extensions: cold-start progress,
request latency, device telemetry (NVML, verdicts), live OOM classification and routing hints. A factory
gets the configuration and the extensions built before it (the table's order), for the
parts they share.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import TypeVar

from infersight.agent.coldstart.extension import ColdStartExtension
from infersight.agent.daemon.extension import Extension
from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.devices.extension import DevicesExtension
from infersight.agent.oom.extension import OomExtension
from infersight.agent.requests.extension import RequestsExtension
from infersight.agent.routing.extension import RoutingExtension
from infersight.exporters.base import Exporter
from infersight.settings import Config, section_settings

E = TypeVar("E")
Factory = Callable[[Config, Mapping[str, Extension]], Extension]


def _built(built: Mapping[str, Extension], name: str, kind: type[E]) -> E:
    ext = built[name]
    if not isinstance(ext, kind):
        raise TypeError("extension %r is a %s, not a %s" % (name, type(ext).__name__, kind.__name__))
    return ext


def _devices(conf: Config, built: Mapping[str, Extension]) -> Extension:
    return DevicesExtension(conf, _built(built, "requests", RequestsExtension).stats)


def _oom(conf: Config, built: Mapping[str, Extension]) -> Extension:
    job = _built(built, "devices", DevicesExtension).job  # OOMs read NVML under the job's lock
    return OomExtension(conf, nvml=job.nvml, nvml_guard=job.nvml_call)


def _routing(conf: Config, built: Mapping[str, Extension]) -> Extension:
    # Routing reads the requests' per-instance latency and the devices' slow verdicts.
    stats = _built(built, "requests", RequestsExtension).stats
    job = _built(built, "devices", DevicesExtension).job
    return RoutingExtension(conf, stats.instance_latency, job.slow_devices_of)  # a uid's own verdicts


EXTENSIONS: dict[str, Factory] = {
    "coldstart": lambda conf, _: ColdStartExtension(conf),
    "requests": lambda conf, _: RequestsExtension.from_config(conf),
    "devices": _devices,
    "oom": _oom,
    "routing": _routing,
}


def build_extensions(conf: Config) -> list[Extension]:
    """Every extension of :data:`EXTENSIONS`, in order. Raises ConfigError naming the key."""
    built: dict[str, Extension] = {}
    for name, factory in EXTENSIONS.items():
        built[name] = factory(conf, built)
    return list(built.values())


def validate_exporters(conf: Config) -> None:
    """The exporters' own sections (MQTT, Prometheus, OTLP): raise ConfigError naming the key.
    A reload checks them so that a file the next restart would refuse is refused now: the
    values, and the files the exporters read at start (MQTT's password_file and TLS files, as
    the service's user reads them; a root-only 0600 password file once passed a reload and took
    the agent down at the next restart)."""
    from infersight.agent.commands.compose import check_exporter_settings
    from infersight.exporters.mqtt_settings import MQTT_KEYS
    from infersight.exporters.prometheus_endpoint import PROMETHEUS_KEYS

    section_settings(conf, "exporters.mqtt.", MQTT_KEYS, os.environ)
    section_settings(conf, "exporters.prometheus.", PROMETHEUS_KEYS, os.environ)
    mqtt = check_exporter_settings(conf)  # its password file read once, here
    if mqtt is not None and mqtt.address.tls:
        from infersight.exporters.mqtt import tls_context

        tls_context(mqtt)


def new_agent(
    conf: Config,
    exporters: list[Exporter],
    extensions: list[Extension] | None = None,
    *,
    embedded: bool = False,
    listen_sock: socket.socket | None = None,
    exporter_spool_root: str | None = None,
) -> Agent:
    """The agent of either mode: every extension (built now unless given), and reloads that
    check the exporters' sections too."""
    return Agent(
        conf,
        exporters,
        build_extensions(conf) if extensions is None else extensions,
        embedded=embedded,
        listen_sock=listen_sock,
        exporter_spool_root=exporter_spool_root,
        check_config=validate_exporters,
    )
