"""The devices extension's configuration: the ``[nvml]`` and ``[devices]`` sections.

One key table (:data:`KEYS`), resolved as every section of the agent is
(:func:`infersight.settings.section_settings`: env > file > default), so a bad or unknown
key is a :class:`~infersight.settings.ConfigError` naming it and its ``file:line``.
``devices.window_s`` is the neutral :data:`infersight.latency.WINDOW_KEY`: the requests
extension reads it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infersight.latency import DEFAULT_WINDOW_S, WINDOW_KEY
from infersight.rules.device_rules import DeviceRulesError, DeviceThresholds, load_device_rules
from infersight.settings import Config, ConfigError, Key, parse_bool, seconds_in, section_settings


@dataclass(frozen=True, slots=True)
class DeviceJobConfig:
    interval_s: float = 1.0
    export_interval_s: float = 10.0
    enabled: bool = True
    proc_root: str = "/proc"
    rules: str | None = None  # None: the shipped rules/devices.toml
    evaluate_interval_s: float = 10.0
    window_s: float = DEFAULT_WINDOW_S


def _path(v: Any) -> str | None:
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise ValueError("expected a path string")
    return v


_D = DeviceJobConfig()
KEYS: tuple[Key, ...] = (
    Key("nvml.interval_s", seconds_in(0.05, 3600.0), lambda: _D.interval_s, "INFERSIGHT_NVML_INTERVAL_S",
        "NVML sampling interval in seconds (0.05 to 3600)"),
    Key("nvml.export_interval_s", seconds_in(0.0, 86400.0), lambda: _D.export_interval_s,
        "INFERSIGHT_NVML_EXPORT_INTERVAL_S",
        "device gauges to the file/OTLP/MQTT this often, changed states at once, "
        "all series every 6 intervals (0: every sample); Prometheus has every sample"),
    Key("nvml.enabled", parse_bool, lambda: _D.enabled, "INFERSIGHT_NVML_ENABLED",
        "sample NVML devices (false: requests and verdicts only)"),
    Key("nvml.proc_root", lambda v: _path(v) or "/proc", lambda: _D.proc_root, "INFERSIGHT_NVML_PROC_ROOT",
        "where host PIDs of GPU processes are looked up (e.g. /host/proc)"),
    Key("devices.rules", _path, lambda: _D.rules, "INFERSIGHT_DEVICES_RULES",
        "slow-device rule file (default: the shipped devices.toml)"),
    Key("devices.evaluate_interval_s", seconds_in(0.1, 86400.0), lambda: _D.evaluate_interval_s,
        "INFERSIGHT_DEVICES_EVALUATE_INTERVAL_S", "how often slow-device verdicts are computed"),
    WINDOW_KEY,
)  # fmt: skip
_SECTIONS = ("nvml.", "devices.")


def parse_config(config: Config, env: Mapping[str, str] | None = None) -> DeviceJobConfig:
    """The ``[nvml]`` and ``[devices]`` keys, env > file > default.

    Raises :class:`~infersight.settings.ConfigError` naming a bad or unknown key and its ``file:line``."""
    env = os.environ if env is None else env
    fields: dict[str, Any] = {}
    for prefix in _SECTIONS:
        fields.update(section_settings(config, prefix, tuple(k for k in KEYS if k.name.startswith(prefix)), env))
    return DeviceJobConfig(**fields)


def load_thresholds(path: str | None) -> DeviceThresholds:
    """The rule file's thresholds; a bad file is a ConfigError naming ``devices.rules``."""
    try:
        return load_device_rules(path).thresholds
    except DeviceRulesError as exc:
        raise ConfigError("devices.rules: %s" % exc) from None
