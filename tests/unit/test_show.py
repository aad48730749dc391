"""``infersight show --format text|json|chrome-trace``.

The spans and the OOM come from the agent's real assembler and OOM handler (tests/support/report_data.py,
FAKE device readings); the chrome-trace of a real launched workload is checked in
test_report.py, beside the launch it needs.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import report_data as rd
from trace_checks import check_nesting, complete_events

from infersight.agent.cli import main
from infersight.agent.commands.show import show_file
from infersight.agent.report.parse import parse_lines
from infersight.exporters.otlp_json import traces_request
from infersight.telemetry import Resource, SpanItem


def show(path: Path, fmt: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = show_file(str(path), out, fmt, err)
    return rc, out.getvalue(), err.getvalue()


def test_chrome_trace_one_complete_event_per_span(tmp_path: Path) -> None:
    items = rd.gpu_items(time.time_ns())
    src = rd.write(tmp_path / "gpu.jsonl", items)
    spans = parse_lines(src.read_text().splitlines(True)).spans
    rc, out, err = show(src, "chrome-trace")
    assert rc == 0, err
    trace = json.loads(out)
    xs = complete_events(trace)
    assert len(xs) == len(spans)
    t0 = min(s.start_ns for s in spans)
    for s in spans:
        (e,) = [e for e in xs if e["args"]["span_id"] == s.span_id]
        assert e["name"] == s.name
        assert abs(e["dur"] * 1000 - (s.end_ns - s.start_ns)) < 1
        assert abs(e["ts"] * 1000 - (s.start_ns - t0)) < 1
        assert e["pid"] == rd.FAKE_PID
        assert {k: v for k, v in e["args"].items() if k in s.attributes} == s.attributes
    check_nesting(xs)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names[rd.FAKE_PID] == "fake-gpu-worker (pid %d)" % rd.FAKE_PID
    instants = {e["name"] for e in trace["traceEvents"] if e["ph"] == "i"}
    assert {"ready", "OOM: reservation_conflict", "infersight.memory.large_alloc"} <= instants
    (oom,) = [e for e in trace["traceEvents"] if e["name"].startswith("OOM")]
    assert oom["args"]["infersight.oom.rule"] and oom["s"] == "p"
    assert not [e for e in trace["traceEvents"] if e["name"] == "infersight.oom"], "the OOM is not doubled"


def _span(pid: int, sid: str, parent: str | None, name: str, s: float, e: float, **attrs: Any) -> SpanItem:
    return SpanItem(Resource.of({"service.name": "svc", "process.pid": pid}), "ab" * 16, sid, parent, name,
                    int(s * 1e9), int(e * 1e9), dict(attrs))


def test_overlapping_spans_get_their_own_lanes_and_threads_are_kept(tmp_path: Path) -> None:
    spans = [
        _span(7, "01" * 8, None, "coldstart", 0, 10),
        _span(7, "02" * 8, "01" * 8, "coldstart.framework_import", 1, 5),
        _span(7, "03" * 8, "01" * 8, "coldstart.weights_load", 4, 8),  # overlaps import, does not nest
        _span(7, "04" * 8, "03" * 8, "coldstart.custom", 4.5, 5.5, **{"thread.id": 4242}),
        _span(8, "05" * 8, "02" * 8, "coldstart", 2, 9),  # another process
    ]
    src = tmp_path / "t.jsonl"
    src.write_text(traces_request(spans) + "\n")
    rc, out, _ = show(src, "chrome-trace")
    assert rc == 0
    xs = complete_events(json.loads(out))
    tid = {e["args"]["span_id"]: (e["pid"], e["tid"]) for e in xs}
    assert tid["01" * 8] == tid["02" * 8] == (7, 7)
    assert tid["03" * 8][0] == 7 and tid["03" * 8][1] != 7
    assert tid["04" * 8] == (7, 4242)
    assert tid["05" * 8] == (8, 8)
    check_nesting(xs)
    lanes = [e for e in json.loads(out)["traceEvents"] if e["name"] == "thread_name"]
    assert {e["args"]["name"] for e in lanes} == {"stages", "stages (lane 1)"}


def test_json_format_is_the_waterfall(tmp_path: Path) -> None:
    src = rd.write(tmp_path / "gpu.jsonl", rd.gpu_items(time.time_ns()))
    rc, out, _ = show(src, "json")
    assert rc == 0
    (cs,) = json.loads(out)["coldstarts"]
    assert cs["service"] == "fake-gpu-worker" and cs["pid"] == rd.FAKE_PID
    assert cs["total_s"] == rd.END_S and cs["ready_s"] == 5.4
    assert [s["stage"] for s in cs["stages"]] == [
        "runtime_init", "framework_import", "cuda_init", "weights_load", "weights_to_device", "warmup",
        "graph_compile", "unattributed", "ready_wait"]
    gc = next(s for s in cs["stages"] if s["stage"] == "graph_compile")
    assert gc["depth"] == 2 and abs(gc["duration_s"] - 0.8) < 1e-9
    wl = next(s for s in cs["stages"] if s["stage"] == "weights_load")
    assert wl["weights"].startswith("2.0 GiB @ 2.0 GiB/s, warm")
    assert next(s for s in cs["stages"] if s["stage"] == "unattributed")["kind"] == "unattributed"
    assert [m["label"] for m in cs["marks"]] == ["ready"]


def test_text_stays_the_default_and_a_cut_line_is_skipped(tmp_path: Path, capsys: Any) -> None:
    src = rd.write(tmp_path / "gpu.jsonl", rd.gpu_items(time.time_ns()))
    with open(src, "a") as f:
        f.write('{"resourceSpans": [{"resource"')  # cut short
    assert main(["show", str(src)]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("infersight cold start: fake-gpu-worker (pid %d) 5.500 s" % rd.FAKE_PID)
    assert "not JSON (no newline: cut short?)" in cap.err
    assert main(["show", "--format", "chrome-trace", str(src)]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["traceEvents"] and "cut short" in cap.err  # stdout stays pure JSON


def test_errors(tmp_path: Path, capsys: Any) -> None:
    assert main(["show", "--format", "chrome-trace", str(tmp_path / "missing")]) == 2
    assert "infersight show: cannot read" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["show", "--format", "chrome-trace", str(empty)]) == 1
    assert main(["show", "--format", "json", str(empty)]) == 1
    assert "no coldstart span" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["show", "--format", "svg", str(empty)])
    assert exc.value.code == 2  # an unknown format is a usage error


def _st(pid: int, sid: str, parent: str | None, stage: str, s: float, e: float, **attrs: Any) -> SpanItem:
    """A stage span as the hooks send it: ``coldstart.<stage>`` with ``infersight.stage``."""
    return _span(pid, sid, parent, "coldstart." + stage, s, e, **{"infersight.stage": stage, **attrs})


def _rows(text: str) -> list[str]:
    """The stage column of a text waterfall's rows, indentation kept (the root's row left out)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("coldstart ")) + 1
    return [ln[:26].rstrip() for ln in lines[start:] if ln.startswith("  ") and not ln.startswith("  gap at")]


def _peft(pid: int = 7) -> list[SpanItem]:
    """The cold start of a PEFT LoRA loaded and merged (tests/support/workloads/library_stacks.py peft, its real
    spans' shape): the base model's build and read at the top, then the adapter's load (a stage rule's
    model_build) with its two file reads nested in it, the merge with an import in it, a warmup with a read."""
    root, adapter, merge, warm = "10" * 8, "11" * 8, "12" * 8, "13" * 8
    return [
        _span(pid, root, None, "coldstart", 0, 12, **{"infersight.coldstart.ended_by": "exit"}),
        _st(pid, "20" * 8, root, "runtime_init", 0, 0.2),
        _st(pid, "21" * 8, root, "framework_import", 0.2, 10),
        _st(pid, "22" * 8, root, "model_build", 10.028, 10.076,
              **{"infersight.model.class": "GPT2LMHeadModel", "infersight.model.meta": True}),
        _st(pid, "23" * 8, root, "weights_load", 10.239, 10.284),
        _st(pid, adapter, root, "model_build", 10.293, 10.414,
              **{"infersight.stage.rule": "peft.load_adapter"}),
        _st(pid, "24" * 8, adapter, "weights_load", 10.387, 10.390),
        _st(pid, "25" * 8, adapter, "weights_load", 10.403, 10.409),
        _st(pid, merge, root, "model_build", 10.415, 11.034,
              **{"infersight.stage.rule": "peft.merge_and_unload"}),
        _st(pid, "26" * 8, merge, "framework_import", 10.418, 10.424),
        _st(pid, warm, root, "warmup", 11.039, 11.366),
        _st(pid, "27" * 8, warm, "weights_load", 11.051, 11.367),
    ]


def test_text_rows_nest_under_their_parent_span_not_the_row_before(tmp_path: Path) -> None:
    """A PEFT adapter load nests its file reads in a model_build: they were drawn under the base model's
    weights_load (the row before them in start order, its own model_build grouped with the base's as
    ``model_build x3``). Each span's row now follows its parent's, one level in; leaf spans still share rows."""
    src = tmp_path / "peft.jsonl"
    src.write_text(traces_request(_peft()) + "\n")
    rc, out, err = show(src, "text")
    assert rc == 0, err
    assert _rows(out) == [
        "  runtime_init", "  framework_import", "  model_build", "  weights_load",
        "  model_build", "    weights_load x2",
        "  model_build", "    framework_import",
        "  warmup", "    weights_load",
    ], out
    adapter = next(ln for ln in out.splitlines() if ln.startswith("  model_build") and "peft.load_adapter" in ln)
    assert " 10.293 " in adapter, out  # the adapter's own row, its rule named
    # The report's rows (and --format json's) nest the same way.
    rc, js, _ = show(src, "json")
    (cs,) = json.loads(js)["coldstarts"]
    assert [("  " * s["depth"]) + s["stage"] for s in cs["stages"]] == [
        "  runtime_init", "  framework_import", "  model_build", "  weights_load",
        "  model_build", "    weights_load", "    weights_load",
        "  model_build", "    framework_import",
        "  warmup", "    weights_load",
    ]


def test_text_rows_of_a_parent_loop_are_each_drawn_once(tmp_path: Path) -> None:
    """Bad data: two stages that name each other as parent (no way up to the root) are still drawn, once."""
    root = "10" * 8
    spans = [_span(7, root, None, "coldstart", 0, 4), _st(7, "20" * 8, root, "framework_import", 0, 1),
             _st(7, "21" * 8, "22" * 8, "model_build", 1, 2),
             _st(7, "22" * 8, "21" * 8, "weights_load", 1.5, 1.8)]
    from infersight.exporters.waterfall import render_waterfall
    from infersight.telemetry import ColdStart

    assert _rows(render_waterfall(ColdStart(spans[0], spans[1:]))) == [
        "  framework_import", "  model_build", "    weights_load"]


def _supervisor(tmp_path: Path, **attrs: Any) -> Path:
    root, worker = "10" * 8, "30" * 8
    spans = [
        _span(7, root, None, "coldstart", 0, 1, **{"infersight.coldstart.ended_by": "ready",
                                                   "infersight.coldstart.ready_s": 1.0,
                                                   "infersight.ready.source": "listen", **attrs}),
        _st(7, "20" * 8, root, "runtime_init", 0, 0.3),
        _st(7, "21" * 8, root, "ready_wait", 0.3, 1.0),
        _span(8, worker, "21" * 8, "coldstart", 0.4, 2.0, **{"infersight.coldstart.ended_by": "exit"}),
        _st(8, "31" * 8, worker, "framework_import", 0.4, 2.0),
    ]
    src = tmp_path / ("sup%d.jsonl" % len(attrs))
    src.write_text(traces_request(spans) + "\n")
    return src


@pytest.mark.parametrize(("ready", "said"), [
    (0, "workers: 1 reported, none ever ready (each exited first: failed to boot, or stopped while loading)"),
    (1, "workers: 1 reported, 1 ever ready"),
], ids=["none", "one"])
def test_a_supervisors_workers_ready_is_shown(tmp_path: Path, ready: int, said: str) -> None:
    """A gunicorn master records how many of its workers were ever ready (``workers_ready``, hooks/_readiness.py):
    the waterfall printed no line for it. It says it under the readiness line, the report in its summary."""
    src = _supervisor(tmp_path, **{"infersight.coldstart.workers": 1, "infersight.coldstart.workers_ready": ready})
    rc, out, err = show(src, "text")
    assert rc == 0, err
    master = out.split("\n\n")[0]
    lines = master.splitlines()
    assert lines[lines.index("ready after 1.000 s (listen); ended by ready") + 1] == said, master
    assert "workers:" not in out.split("\n\n")[1]  # the worker is no supervisor
    rc, js, _ = show(src, "json")
    by_pid = {cs["pid"]: cs for cs in json.loads(js)["coldstarts"]}
    assert (by_pid[7]["workers_reported"], by_pid[7]["workers_ready"]) == (1, ready)
    assert (by_pid[8]["workers_reported"], by_pid[8]["workers_ready"]) == (None, None)
    page = tmp_path / "report.html"
    assert main(["report", str(src), "-o", str(page)]) == 0
    html = page.read_text()
    assert html.count("workers: ") == html.count(said) == 1


def test_a_supervisor_ended_by_its_workers_says_when_it_served(tmp_path: Path) -> None:
    """A gunicorn master is ready at its own listen, but serves nobody before a worker is ready: its root ends then
    (``ended_by=workers``). Its ``ready after`` stays its listen; the workers line says when it served."""
    src = _supervisor(tmp_path, **{"infersight.coldstart.workers": 2, "infersight.coldstart.workers_ready": 1,
                                   "infersight.coldstart.ready_s": 0.3, "infersight.coldstart.ended_by": "workers"})
    rc, out, err = show(src, "text")
    assert rc == 0, err
    lines = out.split("\n\n")[0].splitlines()
    at = lines.index("ready after 0.300 s (listen); ended by workers")
    assert lines[at + 1] == "workers: 2 reported, 1 ever ready; serving after 1.000 s", lines
    # its own readiness came last (its listen after its worker's): the readiness line says it already
    src = _supervisor(tmp_path, **{"infersight.coldstart.workers": 2, "infersight.coldstart.workers_ready": 1,
                                   "infersight.coldstart.ended_by": "workers"})
    rc, out, err = show(src, "text")
    assert rc == 0, err
    assert "workers: 2 reported, 1 ever ready\n" in out and "serving after" not in out, out


def test_no_workers_line_where_none_is_recorded(tmp_path: Path) -> None:
    src = _supervisor(tmp_path)
    rc, out, _ = show(src, "text")
    assert rc == 0 and "workers:" not in out
    src = _supervisor(tmp_path, **{"infersight.coldstart.workers": 1, "infersight.coldstart.workers_ready": "x"})
    rc, out, _ = show(src, "text")
    assert rc == 0 and "workers:" not in out  # junk is no count
