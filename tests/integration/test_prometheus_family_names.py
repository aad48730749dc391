"""Two families never share a name in the Prometheus exposition, whatever producers send.

A producer gauge ``process.cpu.time`` (Prometheus ``process_cpu_time_seconds``) beside the agent's counter
``process_cpu_time_seconds_total`` made two families named ``process_cpu_time_seconds`` in the
OpenMetrics output, and prometheus_client's OpenMetrics parser refused the whole scrape ("Received metadata
after samples"). The store now keeps, of the families that would share a name (a family's name or one of
its samples': ``x`` and ``x_total``, ``x_count`` beside a histogram ``x``...), the first; the others are
refused and counted (``type_conflicts``, ``name_conflicts``). The store is fed here directly, past the
agent's ingest (which refuses producers' metrics named as the agent's own): this is the exporter's own
guarantee. Each scrape is parsed by prometheus_client's OpenMetrics and text parsers, and by ``promtool
check metrics`` where it is installed.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from infersight.agent.daemon.health import Counters, health_metrics
from infersight.exporters.prometheus_endpoint import SeriesStore
from infersight.telemetry import HistogramPoint, MetricItem, NumberPoint, Resource

PROMTOOL = shutil.which("promtool")
AGENT = Resource.of({"host.name": "node-1", "service.name": "infersight-agent"})


def producer(uid: int, service: str = "svc") -> Resource:
    return Resource.of({"host.name": "node-1", "service.name": service, "process.user.id": uid})


def agents_own() -> list[MetricItem]:
    return health_metrics(AGENT, 0, Counters(events_in=7), 2, 0, [], 1.5, 1000)


def metric(res: Resource, name: str, kind: str, unit: str = "", value: float = 9e12) -> MetricItem:
    if kind == "histogram":
        return MetricItem(res, name, "histogram", unit, "", 2, 1, [HistogramPoint([1.0], [1, 1], 2, 1.5, None, None)])
    return MetricItem(res, name, kind, unit, "", 2, 1, [NumberPoint(value)], kind == "sum")  # type: ignore[arg-type]


def expositions(store: SeriesStore) -> tuple[str, str]:
    class C:
        def collect(self):  # noqa: ANN202
            return store.families()

    reg = CollectorRegistry(auto_describe=False)
    reg.register(C())  # type: ignore[arg-type]
    return om_exposition.generate_latest(reg).decode(), generate_latest(reg).decode()


def check(store: SeriesStore) -> dict[str, list]:  # type: ignore[type-arg]
    """Both expositions parse, every family name once; returns the OpenMetrics families' samples."""
    om, text = expositions(store)
    fams = list(om_parse(om))
    names = [f.name for f in fams]
    assert len(names) == len(set(names)), names
    text_names = [f.name for f in text_parse(text)]
    assert len(text_names) == len(set(text_names)), text_names
    if PROMTOOL:
        r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert "error while linting" not in r.stdout + r.stderr, r.stdout + r.stderr
    return {f.name: f.samples for f in fams}


def test_a_producers_gauge_of_the_agents_counter_family_is_refused_and_the_scrape_parses() -> None:
    store = SeriesStore()
    store.add(agents_own())
    store.add([metric(producer(1003), "process.cpu.time", "gauge", "s"),
               metric(producer(1003, "infersight-agent"), "process_cpu_time_seconds", "gauge")])
    fams = check(store)
    (cpu,) = fams["process_cpu_time_seconds"]
    assert cpu.name == "process_cpu_time_seconds_total" and cpu.value == 1.5 and "process_user_id" not in cpu.labels
    assert (store.type_conflicts, store.name_conflicts) == (2, 2)


def test_the_first_family_of_a_name_keeps_it_whichever_way_round() -> None:
    """A producer's gauge first, then the agent's counter: the counter is refused (ingest keeps producers off
    the agent's names; the exposition's guarantee does not depend on it), and the scrape still parses."""
    store = SeriesStore()
    store.add([metric(producer(1003), "process.cpu.time", "gauge", "s")])
    store.add(agents_own())
    fams = check(store)
    assert [s.labels.get("process_user_id") for s in fams["process_cpu_time_seconds"]] == ["1003"]
    assert store.name_conflicts == 1


@pytest.mark.parametrize(("first", "second", "kept"), [
    (("x", "sum"), ("x_total", "gauge"), "1003"),  # counter x (x_total) and a gauge x_total
    (("x_total", "gauge"), ("x", "sum"), "1003"),
    (("x", "histogram"), ("x_count", "gauge"), "1003"),
    (("x_bucket", "gauge"), ("x", "histogram"), "1003"),
    (("x", "sum"), ("x_created", "gauge"), "1003"),
    (("x", "histogram"), ("x", "sum"), "1003"),
    (("target.info", "gauge"), ("y", "gauge"), "1004"),  # target_info is the endpoint's (made for each resource)
    (("infersight.prometheus.series", "gauge"), ("y", "gauge"), "1004"),  # and so are the series it renders
])
def test_families_that_would_share_a_name(first: tuple[str, str], second: tuple[str, str], kept: str) -> None:
    store = SeriesStore()
    store.add([metric(producer(1003), *first)])
    store.add([metric(producer(1004), *second)])
    fams = check(store)
    assert store.type_conflicts == 1
    assert {s.labels.get("process_user_id") for name, samples in fams.items() for s in samples
            if not name.startswith("infersight_prometheus_")} == {kept}


NAMES = st.sampled_from(["process.cpu.time", "process_cpu_time_seconds", "process.memory.usage", "x", "x_total",
                         "x_count", "x_sum", "x_bucket", "x_created", "x_info", "target.info", "target_info",
                         "infersight.prometheus.points_dropped", "infersight_prometheus_series",
                         "infersight.coldstart.eta", "y.z", "hw.status"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(NAMES, st.sampled_from(["gauge", "sum", "histogram"]), st.sampled_from(["", "s", "By", "1"]),
                          st.sampled_from([0, 1003, 1004])), min_size=1, max_size=12))
def test_whatever_producers_send_the_exposition_parses(sent: list[tuple[str, str, str, int]]) -> None:
    store = SeriesStore()
    store.add(agents_own())
    for name, kind, unit, uid in sent:
        store.add([metric(producer(uid), name, kind, unit)])
    check(store)
