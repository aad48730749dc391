"""A warmup run nests in the span its forwards ran in. BentoML runs a service's warmup in its constructor,
inside its ``service_init`` stage; the hooks sent every warmup with the root as parent, so launch's and
show's waterfall, the report and the OTLP file drew it as service_init's sibling, overlapping it. Here a
real process under ``infersight launch``: a small torch model (a plain ``nn.Module``) warmed up inside a
user's ``service_init`` stage, then run again outside any stage before its readiness. The first run nests in
the stage; the second is the root's, and the cold-start history (the ETA's) still finds it as a top-level
``warmup``. Also a process SIGKILLed inside such a warmup: its checkpoint's warmup nests in the stage's
stand-in."""

from __future__ import annotations

import io
import itertools
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import assert_well_formed, launch, stage_name  # noqa: E402

from infersight.agent.cli import main  # noqa: E402
from infersight.agent.commands.show import coldstarts, show_file  # noqa: E402

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow]

SERVICE = textwrap.dedent("""
    import torch
    from infersight import hooks

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(16, 32)
            self.b = torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    with hooks.stage("service_init"):  # a service's constructor: its model, and its warmup
        model = Net()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(8, 16))
    with torch.no_grad():  # warmed up again, outside any stage
        for _ in range(2):
            model(torch.randn(8, 16))
    hooks.mark_ready()
""")


def test_a_warmup_in_a_stage_nests_in_it_and_one_outside_any_stage_is_the_roots(tmp_path: Path) -> None:
    (tmp_path / "service.py").write_text(SERVICE)
    state = tmp_path / "state"
    r = launch(str(tmp_path), [sys.executable, "service.py"], "--agent", "embedded", result=False,
               env={"INFERSIGHT_STATE_DIR": str(state)})
    assert r.rc == 0, r.output[-3000:]
    (cs,) = coldstarts(r.spans)
    assert_well_formed(cs.root, cs.stages)  # each span within its parent's interval, no overlap unless nested
    (init,) = [s for s in cs.stages if stage_name(s) == "service_init"]
    inner, outer = sorted((s for s in cs.stages if stage_name(s) == "warmup"), key=lambda s: s.start_ns)
    # the OTLP file's parents
    assert inner.parent_span_id == init.span_id and inner.attributes["infersight.warmup.forwards"] == 3
    assert outer.parent_span_id == cs.root.span_id and outer.attributes["infersight.warmup.forwards"] == 2
    assert init.start_ns <= inner.start_ns and inner.end_ns <= init.end_ns <= outer.start_ns

    def nested_rows(text: str) -> list[str]:  # the rows right under service_init's, one level in
        lines = text.splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.startswith("  service_init* "))
        return list(itertools.takewhile(lambda ln: ln.startswith("    "), lines[at + 1:]))

    for text in (r.output, _show(tmp_path)):  # launch's closing waterfall, and show's
        assert [ln.split()[0] for ln in nested_rows(text)] == ["warmup"], text[-3000:]
        assert any(ln.startswith("  warmup ") for ln in text.splitlines()), text[-3000:]  # the root's run
    page = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "out.otlp.jsonl"), "-o", str(page)]) == 0
    html = page.read_text()
    assert 'data-stage="warmup" data-span-id="%s" data-depth="2"' % inner.span_id in html
    assert 'data-stage="warmup" data-span-id="%s" data-depth="1"' % outer.span_id in html
    # the ETA's history keeps top-level stages: service_init (its warmup within it), then the root's warmup
    (run,) = [json.loads(ln) for ln in (state / "coldstart-history.jsonl").read_text().splitlines()]
    assert [s[0] for s in run["stages"]][-3:] == ["service_init", "warmup", "ready_wait"], run


def _show(tmp_path: Path) -> str:
    out = io.StringIO()
    assert show_file(str(tmp_path / "out.otlp.jsonl"), out, "text", io.StringIO()) == 0
    return out.getvalue()


def test_a_process_killed_in_a_warmup_inside_a_stage_keeps_it_in_the_stage(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from test_coldstart_killed import DIE_AFTER_CHECKPOINT, _named, _run_killed

    script = textwrap.dedent("""
        import os, signal, sys, time
        from infersight import hooks
        from infersight.hooks import _coldstart
        import torch
    """) + DIE_AFTER_CHECKPOINT + textwrap.dedent("""
        m = torch.nn.Linear(4, 4)
        with hooks.stage("service_init"):
            with torch.no_grad():
                m(torch.zeros(1, 4))
                m(torch.zeros(1, 4))  # two warmup forwards; it dies in its stage, before readiness
            die()
    """)
    root, stages = _run_killed(agent_factory, tmp_path, script)
    (warm,) = _named(stages, "warmup")
    (stand_in,) = _named(stages, "interrupted")  # the stage still open when it died: its name was never sent
    assert warm["parentSpanId"] == stand_in["spanId"] and stand_in["parentSpanId"] == root["spanId"]
    assert int(stand_in["startTimeUnixNano"]) <= int(warm["startTimeUnixNano"])
    assert int(warm["endTimeUnixNano"]) <= int(stand_in["endTimeUnixNano"])
