"""Telemetry items: the pure values that flow from assembly to the exporters.

Everything here is plain data. Exporters encode these into OTLP JSON, OTLP protobuf
(through the OpenTelemetry SDK exporters), MQTT payloads, Prometheus samples or the
console. Timestamps are Unix nanoseconds. Ids are lowercase hex (trace 32, span 16).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeAlias

AttrValue: TypeAlias = str | bool | int | float | list[str] | list[int] | list[float]
Attributes: TypeAlias = dict[str, AttrValue]

SCOPE_NAME = "infersight"


FrozenValue: TypeAlias = str | bool | int | float | tuple[str, ...] | tuple[int, ...] | tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Resource:
    """An OTel resource, hashable: items of one producer share it, and exporters use it as
    a dict key to group them. List values are kept as tuples (``as_dict`` gives lists)."""

    attributes: tuple[tuple[str, FrozenValue], ...]

    def __post_init__(self) -> None:
        if any(isinstance(v, list) for _k, v in self.attributes):  # built from decoded data
            object.__setattr__(self, "attributes", tuple((k, _freeze(v)) for k, v in self.attributes))

    @staticmethod
    def of(attrs: Attributes) -> Resource:
        return Resource(tuple(sorted((k, _freeze(v)) for k, v in attrs.items())))

    def as_dict(self) -> Attributes:
        return {k: _thaw(v) for k, v in self.attributes}

    def get(self, key: str) -> AttrValue | None:
        for k, v in self.attributes:
            if k == key:
                return _thaw(v)
        return None


def _freeze(v: AttrValue | FrozenValue) -> FrozenValue:
    return tuple(v) if isinstance(v, list) else v  # type: ignore[return-value]


def _thaw(v: FrozenValue) -> AttrValue:
    return list(v) if isinstance(v, tuple) else v  # type: ignore[return-value]


class Origin(NamedTuple):
    """Which producer and which event sequence number an item came from."""

    producer: str
    seq: int


@dataclass(slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: Attributes = field(default_factory=dict)


@dataclass(slots=True)
class SpanItem:
    resource: Resource
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: Attributes = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    error: str | None = None  # status message when the span failed
    origin: Origin | None = None


@dataclass(slots=True)
class LogItem:
    resource: Resource
    time_ns: int
    severity_number: int  # OTel SeverityNumber: 9 INFO, 13 WARN, 17 ERROR
    severity_text: str
    body: str
    attributes: Attributes = field(default_factory=dict)
    trace_id: str | None = None
    span_id: str | None = None
    event_name: str | None = None  # MQTT topic family: coldstart, oom, memory, device, agent
    origin: Origin | None = None


MetricKind = Literal["gauge", "sum", "histogram"]


@dataclass(slots=True)
class NumberPoint:
    value: float | int
    attributes: Attributes = field(default_factory=dict)


@dataclass(slots=True)
class HistogramPoint:
    bounds: list[float]
    bucket_counts: list[int]  # len(bounds) + 1
    count: int
    sum: float
    min: float | None
    max: float | None
    attributes: Attributes = field(default_factory=dict)


@dataclass(slots=True)
class MetricItem:
    resource: Resource
    name: str
    kind: MetricKind
    unit: str
    description: str
    time_ns: int
    start_ns: int
    points: list[NumberPoint] | list[HistogramPoint]
    monotonic: bool = True  # for sums


@dataclass(slots=True)
class ColdStart:
    """A completed cold start: the root span and every stage span under it.

    Derived (not exported as spans a second time): the console prints it as a
    waterfall and MQTT publishes it as one message.
    """

    root: SpanItem
    stages: list[SpanItem]
    # Roots of worker processes that nest under this one (a supervisor's cold start is
    # its workers'). Helpers are not workers. A worker's lifetime is not covered time:
    # only its named stages are, in the tree's figure (``worker_stages``).
    workers: list[SpanItem] = field(default_factory=list)
    # The time the named stages of those workers (and of their own workers) cover, as
    # disjoint (start_ns, end_ns) intervals: the tree's coverage.
    worker_covered: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class ColdStartProgress:
    """A process in its cold start: stage, elapsed time and ETA, or ``state=None`` once it ended.

    Derived and ephemeral: MQTT publishes it retained (cleared with an empty message at the
    end), Prometheus shows it as gauges while the cold start lasts, and the console prints
    one updating line. OTLP exporters skip it.
    """

    resource: Resource
    service: str
    pid: int
    time_ns: int
    state: dict[str, Any] | None


@dataclass(slots=True)
class RoutingHint:
    """A serving instance's routing hint (weight ratio 0-1, settled), or ``state=None`` once
    the instance is gone.

    Derived and ephemeral, like :class:`ColdStartProgress`: MQTT publishes it retained on
    ``<prefix>/<host>/routing/<service>/<port>`` (cleared with an empty message), Prometheus
    shows ``infersight_routing_weight_ratio`` and ``infersight_instance_settled`` while the
    instance lives. OTLP exporters skip it.
    """

    resource: Resource
    service: str
    port: int
    time_ns: int
    state: dict[str, Any] | None


Item: TypeAlias = SpanItem | LogItem | MetricItem | ColdStart | ColdStartProgress | RoutingHint
