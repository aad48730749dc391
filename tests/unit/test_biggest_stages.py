"""``biggest stages``: the one computation behind ``show``'s text waterfall and the HTML report's summary.

A stage run twice is one entry (its top-level spans added up), nested spans and the gaps are not stages of
their own here, and what started after the root's end (a first request once the root ended at readiness)
is no part of the cold start. The two displays computed it apart and could drift; both now call
``coldstart_stages.biggest_stages``. And where the text waterfall draws the cold start's end.
"""

from __future__ import annotations

from typing import Any

from infersight.agent.report.views import waterfalls
from infersight.coldstart_stages import biggest_stages
from infersight.exporters.waterfall import render_waterfall
from infersight.telemetry import ColdStart, Resource, SpanItem

S = 10**9
T0 = 1_800_000_000 * S
TRACE = "cd" * 16
ROOT = "1" * 16
RES = Resource.of({"service.name": "svc", "process.pid": 4242, "host.name": "h", "process.user.id": 1000})


def span(sid: str, parent: str | None, stage: str | None, s: float, e: float, **attrs: Any) -> SpanItem:
    a: dict[str, Any] = {"infersight.stage": stage} if stage else {"faas.coldstart": True}
    a.update(attrs)
    return SpanItem(RES, TRACE, sid, parent, "coldstart." + stage if stage else "coldstart", T0 + int(s * S),
                    T0 + int(e * S), a, [])


def spans() -> list[SpanItem]:
    return [
        span(ROOT, None, None, 0.0, 10.0, **{"infersight.coldstart.ended_by": "ready"}),
        span("2" * 16, ROOT, "weights_load", 0.5, 3.5),
        span("3" * 16, ROOT, "model_build", 3.5, 5.0),
        span("4" * 16, ROOT, "weights_load", 5.0, 6.0),  # a second run: 3 + 1 s
        span("5" * 16, "3" * 16, "graph_compile", 3.6, 4.9),  # nested: in model_build's time
        span("6" * 16, ROOT, "unattributed", 6.0, 9.0),  # a gap: no stage
        span("7" * 16, ROOT, "warmup", 9.0, 9.5),
        span("8" * 16, ROOT, "first_request", 12.0, 20.0),  # after the root's end
    ]


def test_a_stage_run_twice_is_one_entry_and_gaps_and_later_spans_are_none() -> None:
    root, *stages = spans()
    assert biggest_stages(root, stages) == [("weights_load", 4 * S), ("model_build", int(1.5 * S)),
                                            ("warmup", S // 2)]
    assert biggest_stages(root, stages, n=1) == [("weights_load", 4 * S)]


def test_a_stage_running_past_the_roots_end_counts_its_part_within_the_cold_start() -> None:
    """An import still running when ``--ready-url`` answered (the root ended at that readiness): its row is drawn up
    to the root's end, and "biggest stages" said its whole length (0.769 s beside a row of 0.408 s)."""
    root = span(ROOT, None, None, 0.0, 2.0, **{"infersight.coldstart.ended_by": "ready"})
    stages = [span("2" * 16, ROOT, "framework_import", 0.5, 3.5), span("3" * 16, ROOT, "ready_wait", 2.0, 2.0)]
    assert biggest_stages(root, stages) == [("framework_import", int(1.5 * S))]  # (a ready_wait at the end: none)
    lines = render_waterfall(ColdStart(root, stages)).splitlines()
    (line,) = [x for x in lines if x.startswith("biggest stages: ")]
    assert line.startswith("biggest stages: framework_import 1.500 s"), line
    (row,) = [x for x in lines if x.split()[:1] == ["framework_import"]]
    assert row.split()[2] == "1.500", row  # the row says the same


def test_show_and_the_report_name_the_same_biggest_stages() -> None:
    root, *stages = spans()
    text = render_waterfall(ColdStart(root, stages))
    (line,) = [x for x in text.splitlines() if x.startswith("biggest stages: ")]
    assert line == "biggest stages: weights_load 4.000 s, model_build 1.500 s, warmup 0.500 s"
    (fam,) = waterfalls([root, *stages])
    (wf,) = fam.processes
    assert wf.summary.biggest == [("weights_load", 4.0), ("model_build", 1.5), ("warmup", 0.5)]


def test_a_ready_wait_of_no_length_at_the_roots_end_is_drawn_within_the_cold_start() -> None:
    """A gunicorn worker ready as it enters its accept loop, right after its last stage: its ``ready_wait`` has no
    length and lies at the root's end. It was drawn after ``(waiting for traffic)``, among what came after the
    cold start; a first request that starts at the root's end, with a length, still is."""
    root = span(ROOT, None, None, 0.0, 2.0, **{"infersight.coldstart.ended_by": "ready"})
    stages = [span("2" * 16, ROOT, "framework_import", 0.1, 2.0), span("3" * 16, ROOT, "ready_wait", 2.0, 2.0),
              span("4" * 16, ROOT, "first_request", 2.0, 2.5)]
    rows = [ln.split()[0] for ln in render_waterfall(ColdStart(root, stages)).splitlines()[2:6]]
    assert rows == ["coldstart", "framework_import", "ready_wait", "(waiting"], rows
    lines = render_waterfall(ColdStart(root, stages)).splitlines()
    (first,) = [ln for ln in lines if ln.split()[:1] == ["first_request"]]
    assert first.split()[3] == "-"  # no share: after the cold start
