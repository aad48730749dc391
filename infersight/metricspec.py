"""What a metric is, the one registry of the agent's metrics, and their Prometheus names (pure).

A :class:`MetricSpec` describes one OTel metric (name, kind, unit, help, the attributes beyond
its identity). Every metric the agent makes is declared once, at import, in :data:`REGISTRY`
by the module that makes it (:func:`declare`), and made from its spec (:meth:`MetricSpec.item`):
a second declaration of a name, or of a name that becomes the same Prometheus name, raises
:class:`DuplicateMetricError`. The feature modules' tables (``METRICS``) are what they declared,
and the source of their reference docs. Metrics a program sends through ``infersight.hooks.metric``
are its own and pass through undeclared. :func:`prometheus_name` is the OTel Collector's
translation of a name, shared by those tables and the Prometheus endpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from infersight.errors import InfersightError
from infersight.telemetry import HistogramPoint, MetricItem, MetricKind, NumberPoint, Resource


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: MetricKind
    unit: str
    description: str
    monotonic: bool = False  # for sums
    attributes: tuple[str, ...] = ()  # beyond the series' identity (for devices: hw.type, hw.id, ...)

    def item(self, resource: Resource, time_ns: int, start_ns: int,
             points: list[NumberPoint] | list[HistogramPoint]) -> MetricItem:
        """The metric at ``time_ns`` (cumulative since ``start_ns``) with ``points``."""
        return MetricItem(resource, self.name, self.kind, self.unit, self.description, time_ns, start_ns, points,
                          self.monotonic if self.kind == "sum" else True)


class DuplicateMetricError(InfersightError, ValueError):
    """A metric name (or its Prometheus name) declared a second time."""


class MetricRegistry:
    """Metric specs by name, each declared once."""

    def __init__(self) -> None:
        self._specs: dict[str, MetricSpec] = {}
        self._prometheus: dict[str, str] = {}  # Prometheus name -> the OTel name that has it

    def declare(self, *specs: MetricSpec) -> tuple[MetricSpec, ...]:
        """Add ``specs``, all or none; :class:`DuplicateMetricError` when a name is taken. Returns them."""
        names, proms = dict(self._specs), dict(self._prometheus)
        for spec in specs:
            prom = prometheus_name(spec)
            if spec.name in names:
                raise DuplicateMetricError("metric %s is declared twice" % spec.name)
            if prom in proms:
                raise DuplicateMetricError("metrics %s and %s are both %s in Prometheus"
                                           % (proms[prom], spec.name, prom))
            names[spec.name], proms[prom] = spec, spec.name
        self._specs, self._prometheus = names, proms
        return specs

    def __getitem__(self, name: str) -> MetricSpec:
        return self._specs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[MetricSpec]:
        return iter(list(self._specs.values()))

    def __len__(self) -> int:
        return len(self._specs)


REGISTRY = MetricRegistry()


def declare(*specs: MetricSpec) -> tuple[MetricSpec, ...]:
    """Declare ``specs`` in :data:`REGISTRY` (at import); a name declared before raises."""
    return REGISTRY.declare(*specs)


def declared(name: str, kind: MetricKind, unit: str, description: str, monotonic: bool = False) -> MetricSpec:
    """Declare one metric in :data:`REGISTRY` and return its spec."""
    return declare(MetricSpec(name, kind, unit, description, monotonic))[0]


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
