"""``infersight show`` counts a span once when the file holds it twice.

A producer resends what an agent had not acked when it reconnects (delivery is at least once),
so after an agent restart the file may hold a stage span twice, with one trace and span id.
The waterfall must not list it twice nor double its share; stderr says how many repeats were
skipped. The spans come from the agent's real assembler (tests/support/report_data.py).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import report_data as rd
from trace_checks import complete_events

from infersight.agent.commands.show import coldstarts, show_file
from infersight.agent.report.parse import parse_lines
from infersight.exporters.otlp_json import traces_request


def show(path: Path, fmt: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = show_file(str(path), out, fmt, err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """The same cold start twice: as written once, and with its runtime_init stage (altered
    after the first copy: the first one counts) and its root written again, in later lines."""
    once = rd.write(tmp_path / "once.jsonl", rd.gpu_items(time.time_ns()))
    text = once.read_text()
    spans = parse_lines(text.splitlines(True)).spans
    stage = next(s for s in spans if s.name == "coldstart.runtime_init")
    root = next(s for s in spans if s.name == "coldstart")
    again = stage.__class__(stage.resource, stage.trace_id, stage.span_id, stage.parent_span_id, stage.name,
                            stage.start_ns, stage.end_ns + 10**9, stage.attributes, stage.events)
    twice = tmp_path / "twice.jsonl"
    twice.write_text(text + traces_request([again]) + "\n" + traces_request([root]) + "\n")
    return once, twice


def test_text_lists_a_repeated_stage_once(files: tuple[Path, Path]) -> None:
    once, twice = files
    rc1, out1, err1 = show(once, "text")
    rc2, out2, err2 = show(twice, "text")
    assert rc1 == rc2 == 0, err2
    assert sum("runtime_init" in line for line in out1.splitlines()) == 1, out1
    assert out2 == out1  # the same waterfall: the stage once, its share not doubled
    assert "duplicate" not in err1
    assert "infersight show: 2 duplicate spans skipped" in err2, err2


def test_json_and_chrome_trace_count_it_once_too(files: tuple[Path, Path]) -> None:
    once, twice = files
    rc1, out1, _ = show(once, "json")
    rc2, out2, err2 = show(twice, "json")
    assert rc1 == rc2 == 0 and json.loads(out2) == json.loads(out1)
    assert "2 duplicate spans skipped" in err2, err2
    rc1, out1, _ = show(once, "chrome-trace")
    rc2, out2, err2 = show(twice, "chrome-trace")
    assert rc1 == rc2 == 0
    assert len(complete_events(json.loads(out2))) == len(complete_events(json.loads(out1)))
    assert "2 duplicate spans skipped" in err2, err2


def test_coldstarts_keeps_the_first_of_repeated_spans(files: tuple[Path, Path]) -> None:
    _once, twice = files
    spans = parse_lines(twice.read_text().splitlines(True)).spans
    (cs,) = [c for c in coldstarts(spans) if c.root.parent_span_id is None]
    stages = [s for s in cs.stages if s.name == "coldstart.runtime_init"]
    first = next(s for s in spans if s.name == "coldstart.runtime_init")
    assert stages == [first]
