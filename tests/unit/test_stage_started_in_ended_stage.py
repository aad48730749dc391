"""A stage opened by a task that an earlier stage made, after that stage ended.

``asyncio.create_task`` copies the current context, and with it the hooks' current span: a task made inside
``model_build`` that opens ``weights_load`` once ``model_build`` has ended sent ``weights_load`` with the ended
stage as parent. The waterfalls drew it nested under a stage that was over before it began, and "biggest
stages" (top-level spans only) left it out. The agent hangs such a stage under the innermost stage of its
chain still open at its start, the root at the top, and names the stage it came from
(``infersight.stage.started_in``). Pure: spans in, parents out.
"""

from __future__ import annotations

from infersight.agent.coldstart.assembly import hang_under_open_stage
from infersight.telemetry import Resource, SpanItem

S = 10**9
RES = Resource.of({"service.name": "svc", "process.pid": 4242})
ROOT = "1" * 16
STARTED_IN = "infersight.stage.started_in"


def span(sid: str, parent: str | None, stage: str, s: float, e: float) -> SpanItem:
    return SpanItem(RES, "ab" * 16, sid, parent, "coldstart." + stage, int(s * S), int(e * S),
                    {"infersight.stage": stage}, [])


def test_a_stage_begun_after_its_parent_ended_hangs_under_the_root() -> None:
    build = span("2" * 16, ROOT, "model_build", 1.0, 2.0)
    load = span("3" * 16, build.span_id, "weights_load", 2.5, 4.0)
    hang_under_open_stage(load, {build.span_id: build})
    assert load.parent_span_id == ROOT
    assert load.attributes[STARTED_IN] == "model_build"


def test_it_hangs_under_the_nearest_stage_still_open_at_its_start() -> None:
    init = span("2" * 16, ROOT, "service_init", 1.0, 9.0)  # ends later: it comes later, not among the ended
    config = span("3" * 16, init.span_id, "config_load", 1.0, 1.5)
    tok = span("4" * 16, config.span_id, "tokenizer_load", 2.0, 3.0)
    hang_under_open_stage(tok, {config.span_id: config})
    assert tok.parent_span_id == init.span_id and tok.attributes[STARTED_IN] == "config_load"
    # two levels ended, the third ended too but after the start: that one takes it
    a = span("5" * 16, ROOT, "app_startup", 0.0, 2.5)
    b = span("6" * 16, a.span_id, "model_build", 0.5, 1.5)
    c = span("7" * 16, b.span_id, "custom", 0.6, 1.0)
    d = span("8" * 16, c.span_id, "weights_load", 1.6, 2.2)
    hang_under_open_stage(d, {x.span_id: x for x in (a, b, c)})
    assert d.parent_span_id == a.span_id and d.attributes[STARTED_IN] == "custom"


def test_a_stage_within_its_parents_time_or_under_an_open_one_keeps_its_parent() -> None:
    build = span("2" * 16, ROOT, "model_build", 1.0, 2.0)
    load = span("3" * 16, build.span_id, "weights_load", 1.5, 2.5)  # began inside, outlived it: nested by start
    hang_under_open_stage(load, {build.span_id: build})
    assert load.parent_span_id == build.span_id and STARTED_IN not in load.attributes
    orphan = span("4" * 16, "9" * 16, "warmup", 3.0, 4.0)  # its parent still open (or the root)
    hang_under_open_stage(orphan, {build.span_id: build})
    assert orphan.parent_span_id == "9" * 16 and STARTED_IN not in orphan.attributes


def test_forged_parents_in_a_cycle_end_the_walk() -> None:
    a = span("2" * 16, "3" * 16, "model_build", 0.0, 1.0)
    b = span("3" * 16, "2" * 16, "custom", 0.0, 1.0)  # each the other's parent
    late = span("4" * 16, a.span_id, "warmup", 2.0, 3.0)
    hang_under_open_stage(late, {a.span_id: a, b.span_id: b})
    assert late.parent_span_id == a.span_id and STARTED_IN not in late.attributes
