"""What a metric is, and its Prometheus name (pure).

A :class:`MetricSpec` describes one OTel metric (name, kind, unit, help, the attributes
beyond its identity); the feature modules list theirs as the single source of their reference
tables. :func:`prometheus_name` is the OTel Collector's translation of such a name, shared by
those tables and the Prometheus endpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from infersight.telemetry import MetricKind


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: MetricKind
    unit: str
    description: str
    monotonic: bool = False
    attributes: tuple[str, ...] = ()  # beyond the series' identity (for devices: hw.type, hw.id, ...)


# UCUM -> Prometheus unit words (the OTel collector's translator table, for the units used here).
_PROM_UNITS = {"By": "bytes", "s": "seconds", "MHz": "megahertz", "W": "watts", "Cel": "celsius"}
_PER_UNITS = {"s": "second", "m": "minute", "h": "hour", "d": "day"}


def prometheus_name(spec: MetricSpec) -> str:
    """OTel -> Prometheus name: dots to underscores, unit suffix, ``_ratio`` for unit ``1`` on
    gauges only, ``{...}`` units dropped, ``_total`` for monotonic sums."""
    name = re.sub(r"[^a-zA-Z0-9_:]", "_", spec.name)
    unit = spec.unit
    if "/" in unit:
        # A rate unit, as the Collector translates it: ``By/s`` -> ``_bytes`` (unless the name
        # already has that word) and ``_per_second`` (likewise); ``{request}/s`` -> ``_per_second``.
        main, _, per = unit.partition("/")
        words = name.split("_")
        skip = main in ("", "1") or main.startswith("{")
        main_word = "" if skip else _PROM_UNITS.get(main, re.sub(r"[^a-zA-Z0-9]", "", main))
        if main_word and main_word not in words:
            name += "_" + main_word
        per_word = _PER_UNITS.get(per, re.sub(r"[^a-zA-Z0-9]", "", per))
        if per_word and per_word not in words:
            name += "_per_" + per_word
        return name + ("_total" if spec.kind == "sum" and spec.monotonic else "")
    if unit == "1":
        suffix = "ratio" if spec.kind == "gauge" else ""
    elif unit.startswith("{") or not unit:
        suffix = ""
    else:
        suffix = _PROM_UNITS.get(unit, re.sub(r"[^a-zA-Z0-9]", "", unit))
    if suffix and not name.endswith("_" + suffix):
        name += "_" + suffix
    if spec.kind == "sum" and spec.monotonic:
        name += "_total"
    return name
