"""A stage opened by an asyncio task after the stage that made the task had ended, under a real ``launch``.

``asyncio.create_task`` copies the context, the hooks' current span with it: a loader task made inside
``model_build`` that opens ``weights_load`` once ``model_build`` is over was drawn nested under it, outside
its time, and "biggest stages" left the load out. Here the load hangs under the root, a tokenizer task made in
a ``config_load`` stage hangs under the ``service_init`` around it, both name where they came from, and the
OTLP file, launch's waterfall and the HTML report agree.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import assert_well_formed, launch, stage_name  # noqa: E402

from infersight.agent.cli import main  # noqa: E402
from infersight.agent.commands.show import coldstarts  # noqa: E402

pytestmark = [pytest.mark.slow]

SERVER = textwrap.dedent("""
    import asyncio, time
    from infersight import hooks

    async def loader():
        await asyncio.sleep(0.1)
        with hooks.stage("weights_load"):
            time.sleep(0.4)

    async def tokenizer():
        await asyncio.sleep(0.05)
        with hooks.stage("tokenizer_load"):
            time.sleep(0.1)

    async def main():
        with hooks.stage("model_build"):
            loading = asyncio.create_task(loader())
            time.sleep(0.05)
        await loading
        with hooks.stage("service_init"):
            with hooks.stage("config_load"):
                tokenizing = asyncio.create_task(tokenizer())
            await tokenizing
        hooks.mark_ready()

    asyncio.run(main())
""")


def test_a_task_stage_after_its_makers_end_hangs_under_the_stage_still_open(tmp_path: Path) -> None:
    (tmp_path / "server.py").write_text(SERVER)
    r = launch(str(tmp_path), [sys.executable, "server.py"], "--agent", "embedded", result=False)
    assert r.rc == 0, r.output[-3000:]
    (cs,) = coldstarts(r.spans)
    assert_well_formed(cs.root, cs.stages)  # each span within its parent's interval

    def one(stage: str):  # type: ignore[no-untyped-def]
        (s,) = [s for s in cs.stages if stage_name(s) == stage]
        return s

    build, load, init, config, tok = (one(x) for x in ("model_build", "weights_load", "service_init",
                                                       "config_load", "tokenizer_load"))
    assert load.start_ns >= build.end_ns and load.parent_span_id == cs.root.span_id
    assert load.attributes["infersight.stage.started_in"] == "model_build"
    assert config.parent_span_id == init.span_id and tok.start_ns >= config.end_ns
    assert tok.parent_span_id == init.span_id and tok.attributes["infersight.stage.started_in"] == "config_load"
    assert "infersight.stage.started_in" not in build.attributes | init.attributes | config.attributes
    rows = r.output.splitlines()
    assert any(ln.startswith("  weights_load ") and ln.endswith("started in model_build") for ln in rows), r.output
    assert any(ln.startswith("    tokenizer_load ") and "started in config_load" in ln for ln in rows), r.output
    biggest = next(ln for ln in rows if ln.startswith("biggest stages: "))
    assert biggest.startswith("biggest stages: weights_load "), biggest
    page = tmp_path / "report.html"  # the HTML report's row says it too
    assert main(["report", str(tmp_path / "out.otlp.jsonl"), "-o", str(page)]) == 0
    assert page.read_text().count("started in model_build") == 1
