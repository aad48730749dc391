"""Pure and small pieces of the cold-start feature: waterfall, show, storage ceiling,
the inactive API, the bootstrap's footprint, Python 3.9-3.13 syntax of the hooks."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from infersight.agent.coldstart import storage_ceiling
from infersight.agent.commands.show import show_file
from infersight.exporters.waterfall import render_waterfall
from infersight.telemetry import ColdStart, Resource, SpanItem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOOK_FILES = sorted(
    glob.glob(os.path.join(ROOT, "hooks", "*.py")) + glob.glob(os.path.join(ROOT, "hooks", "bootstrap", "*.py"))
)
RES = Resource.of({"service.name": "svc", "process.pid": 7})
T, R = "a" * 32, "b" * 16


def span(name: str, sid: str, parent: str, s: float, e: float, **attrs: object) -> SpanItem:
    a = {"infersight.stage": name.split(".", 1)[-1], **attrs}
    return SpanItem(RES, T, sid, parent, name, int(s * 1e9), int(e * 1e9), a)  # type: ignore[arg-type]


def sample() -> ColdStart:
    root = SpanItem(RES, T, R, None, "coldstart", 0, 10 * 10**9,
                    {"faas.coldstart": True, "infersight.coldstart.unattributed_s": 1.0,
                     "infersight.coldstart.ready_s": 9.0, "infersight.ready.source": "listen",
                     "infersight.coldstart.ended_by": "first_request"})
    stages = [
        span("coldstart.framework_import", "1" * 16, R, 0.5, 3.0),
        span("coldstart.weights_load", "2" * 16, R, 3.0, 5.0, **{
            "infersight.weights.bytes": 2 * 2**30, "infersight.weights.bytes_per_s": 2**30,
            "infersight.weights.ceiling_ratio": 0.25}),
        span("coldstart.warmup", "3" * 16, R, 5.0, 8.0),
        span("coldstart.graph_compile", "4" * 16, "3" * 16, 5.1, 7.0),
        span("coldstart.tokenizer", "5" * 16, R, 8.0, 8.5, **{"infersight.stage.custom": True}),
        span("coldstart.first_request", "6" * 16, R, 9.0, 10.0, **{"infersight.first_request.ttfb_s": 1.0}),
    ]
    return ColdStart(root, stages)


def test_waterfall_columns_and_summary() -> None:
    text = render_waterfall(sample())
    lines = text.splitlines()
    assert lines[0].startswith("infersight cold start: svc (pid 7) 10.000 s")
    assert lines[1].split()[:4] == ["stage", "start", "s", "dur"]
    wl = next(line for line in lines if "weights_load" in line)
    assert "2.0 GiB @ 1.0 GiB/s (25% of storage ceiling)" in wl
    assert "    graph_compile" in text  # nested under warmup: indented
    assert "tokenizer*" in text
    assert "unattributed: 1.000 s (10.0% of the cold start)" in text
    assert "biggest stages: warmup 3.000 s, framework_import 2.500 s, weights_load 2.000 s" in text
    assert "ready after 9.000 s (listen); ended by first_request" in text
    assert "first byte 1.000 s" in text


@pytest.mark.parametrize(("ended_by", "line"), [
    ("producer_lost", "never ready: the process was killed (or lost) before any readiness signal"),
    ("exit", "never ready: the process exited before any readiness signal"),
    ("workers", "ended by workers"),
])
def test_a_cold_start_without_readiness_says_how_it_ended(ended_by: str, line: str) -> None:
    """A process killed or exited before readiness: its waterfall says it was never ready, instead of
    an ordinary-looking total with no word of readiness."""
    cs = sample()
    attrs = {k: v for k, v in cs.root.attributes.items() if k not in ("infersight.coldstart.ready_s",
                                                                         "infersight.ready.source")}
    attrs["infersight.coldstart.ended_by"] = ended_by
    text = render_waterfall(ColdStart(replace(cs.root, attributes=attrs), cs.stages))
    assert line in text.splitlines()
    assert "ready after" not in text


def test_show_reads_back_the_file_exporter_output(tmp_path) -> None:
    from infersight.exporters.otlp_json import traces_request

    cs = sample()
    path = tmp_path / "f.jsonl"
    path.write_text(traces_request([cs.root, *cs.stages]) + "\n")
    out = tmp_path / "o.txt"
    with open(out, "w") as f:
        assert show_file(str(path), f) == 0
    assert out.read_text().strip() == render_waterfall(cs).strip()


def test_show_without_coldstart(tmp_path) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    with open(tmp_path / "o", "w") as f:
        assert show_file(str(p), f) == 1
    with open(tmp_path / "o", "w") as f:
        assert show_file(str(tmp_path / "missing"), f) == 2


def test_storage_ceiling_measure_cache_and_lookup(tmp_path) -> None:
    cache = str(tmp_path / "cache.json")
    data = tmp_path / "w.bin"
    data.write_bytes(os.urandom(4 << 20))
    m = storage_ceiling.measure_file(str(data), max_bytes=8 << 20)
    assert m.nbytes == 4 << 20 and m.seconds > 0 and m.method in ("direct", "buffered")
    assert storage_ceiling.ensure_for_file(str(data), min_bytes=64 << 20, cache=cache) is None  # too small
    entry = storage_ceiling.ensure_for_file(str(data), min_bytes=1 << 20, cache=cache)
    assert entry is not None and entry["device"] == storage_ceiling.device_key(str(data))
    assert storage_ceiling.lookup(str(data), cache)["bytes_per_s"] == pytest.approx(entry["bytes_per_s"])
    smaller = storage_ceiling.Measurement(1, 1.0, "direct")
    assert storage_ceiling.record(str(data), smaller, cache)["sample_bytes"] == 4 << 20  # larger sample kept


def test_doctor_quotes_the_cached_storage_ceiling(tmp_path, monkeypatch) -> None:
    from infersight.agent.commands.doctor import OK, check_storage_ceiling

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    storage_ceiling.record(str(tmp_path), storage_ceiling.Measurement(3 << 30, 2.0, "direct"))
    check = check_storage_ceiling()
    assert check.status == OK
    assert "reads 1.5 GiB/s sequentially (direct read" in check.detail


def test_hooks_ratio_from_cache(tmp_path, monkeypatch) -> None:
    from infersight.hooks import _coldstart

    data = tmp_path / "w.bin"
    data.write_bytes(b"x" * 4096)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    storage_ceiling.record(str(data), storage_ceiling.Measurement(1000, 1.0, "direct"))
    monkeypatch.setattr(_coldstart.state(), "ceilings", None)
    a = _coldstart.weights_attrs(str(data), 500, 1.0)
    assert a["infersight.weights.bytes_per_s"] == 500
    assert a["infersight.weights.ceiling_ratio"] == pytest.approx(0.5)


def test_api_is_a_noop_when_inactive() -> None:
    code = (
        "from infersight import hooks\n"
        "import sys\n"
        "with hooks.stage('x'):\n"
        "    pass\n"
        "@hooks.stage('y')\n"
        "def f(): return 3\n"
        "assert f() == 3\n"
        "hooks.mark_ready(); hooks.first_response()\n"
        "assert not hooks.active()\n"
        "assert 'torch' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT")}
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_bootstrap_imports_no_framework(tmp_path) -> None:
    """The bootstrap activates without torch; torch stays unimported until the user imports it."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.path.join(ROOT, "hooks", "bootstrap"),
                "INFERSIGHT_SOCKET": str(tmp_path / "none.sock"), "INFERSIGHT_SPOOL_DIR": str(tmp_path / "spool"),
                "INFERSIGHT_EXIT_FLUSH_S": "0"})
    code = ("import sys\nfrom infersight.hooks import _coldstart\n"
            "assert _coldstart.state().installed and _coldstart.state().collecting\n"
            "assert not [m for m in ('torch', 'safetensors', 'numpy') if m in sys.modules]\n"
            "assert any(type(f).__name__ == 'Finder' for f in sys.meta_path)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


@pytest.mark.parametrize("version", ["3.9", "3.10", "3.12", "3.13"])
def test_hooks_compile_on_every_supported_python(version: str) -> None:
    found = glob.glob(os.path.expanduser("~/.pyenv/versions/%s*/bin/python" % version))
    if not found:
        pytest.skip("no python %s here" % version)
    code = "import ast,sys\nfor p in sys.argv[1:]:\n    compile(open(p).read(), p, 'exec')\n"
    subprocess.run([found[0], "-c", code, *HOOK_FILES], check=True, timeout=60)


def test_bootstrap_runs_on_python39(tmp_path) -> None:
    found = glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python"))
    if not found:
        pytest.skip("no python 3.9 here")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
           "PYTHONPATH": os.path.join(ROOT, "hooks", "bootstrap"),
           "INFERSIGHT_SOCKET": str(tmp_path / "none.sock"), "INFERSIGHT_SPOOL_DIR": str(tmp_path / "spool"),
           "INFERSIGHT_EXIT_FLUSH_S": "0"}
    code = ("from infersight import hooks\nfrom infersight.hooks import _coldstart\n"
            "import socket\nassert _coldstart.state().collecting\n"
            "with hooks.stage('s'):\n    pass\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); s.close()\n"
            "assert _coldstart.state().ready_source == 'listen'\n"
            "hooks.first_response()\nassert not _coldstart.state().collecting\n"
            "assert 'listen' not in socket.socket.__dict__\n")
    p = subprocess.run([found[0], "-c", code], env=env, timeout=60, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "hooks disabled" not in p.stderr


def test_show_and_the_report_name_the_same_biggest_stages() -> None:
    """A stage run twice at the top level (two imports around a model build) is one entry of its added time in
    ``show`` and, since this test, in the report and ``show --format json``: they ranked single spans."""
    from infersight.agent.report.views import waterfalls

    cs = sample()
    again = span("coldstart.framework_import", "7" * 16, R, 8.5, 9.0)
    cs = ColdStart(cs.root, [*cs.stages, again])
    assert "biggest stages: framework_import 3.000 s, warmup 3.000 s, weights_load 2.000 s" in render_waterfall(cs)
    (family,) = waterfalls([cs.root, *cs.stages])
    assert family.processes[0].summary.biggest == [("framework_import", 3.0), ("warmup", 3.0), ("weights_load", 2.0)]


def test_the_wait_for_traffic_runs_to_the_first_request_past_a_later_stage() -> None:
    """Ray Serve's proxy imports uvicorn on a task after readiness: the wait row took that import's start for the
    first request's (0.001 s shown for an 11.4 s wait: a review). It runs from readiness to the first request."""
    root = SpanItem(RES, T, R, None, "coldstart", 0, 1 * 10**9,
                    {"faas.coldstart": True, "infersight.coldstart.ready_s": 1.0, "infersight.ready.source": "listen",
                     "infersight.coldstart.ended_by": "ready"})
    stages = [
        span("coldstart.framework_import", "1" * 16, R, 0.1, 0.9),
        span("coldstart.server_start", "2" * 16, R, 0.9, 1.0, **{"infersight.stage.custom": True}),
        span("coldstart.framework_import", "3" * 16, "2" * 16, 1.5, 1.6),  # the task's lazy import, after ready
        span("coldstart.first_request", "4" * 16, R, 4.0, 4.2),
    ]
    text = render_waterfall(ColdStart(root, stages))
    wait_row = next(x for x in text.splitlines() if "(waiting for traffic)" in x)
    assert wait_row.split()[4] == "3.000", wait_row  # (name, start, duration)
