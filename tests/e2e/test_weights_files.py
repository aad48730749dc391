"""One ``weights_file`` summary per weights file on the cold-start root, lazy loads included.

Pure part: how a file's spans add up (nested reads once, a warm forward no reading time, the
storage's bytes for a cold file, never the mapped bytes over a time they were not read).

Real part: transformers 5 + safetensors (a small BERT built from its config, random weights,
``save_pretrained``) loaded under ``infersight launch`` cold (``--evict``) and warm, on a fresh
storage-ceiling cache: the first cold run already has a ceiling (the agent measures the state
directory's device at start), every figure stays below this machine's memcpy bandwidth (a
physical bound, not a speed test), and the waterfall, ``show``, the report and the histogram
show the summaries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import wait_for

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import INFERSIGHT, LaunchRun, launch  # noqa: E402

from infersight import weights_files  # noqa: E402
from infersight.agent.coldstart.metrics import ColdStartMetrics, weights_throughput  # noqa: E402
from infersight.telemetry import ColdStart, Resource, SpanEvent, SpanItem  # noqa: E402

W = "infersight.weights."
MB = 1 << 20
ROOT = "r" * 16


def _span(sid: str, start: float, end: float, parent: str = ROOT, **a: object) -> SpanItem:
    attrs = {"infersight.stage": "weights_load", **{W + k: v for k, v in a.items()}}
    return SpanItem(Resource.of({"service.name": "s"}), "a" * 32, sid, parent, "coldstart.weights_load",
                    int(start * 1e9), int(end * 1e9), attrs)  # type: ignore[arg-type]


def _root(end: float = 10.0) -> SpanItem:
    return SpanItem(Resource.of({"service.name": "s"}), "a" * 32, ROOT, None, "coldstart", 0, int(end * 1e9), {})


def test_the_agent_calls_a_read_cold_where_the_hooks_do() -> None:
    from infersight.hooks import _weights

    assert weights_files.COLD_BELOW == _weights.COLD_BELOW


def test_lazy_load_and_its_deferred_copy_are_one_cold_file() -> None:
    """A lazy load (1 s, 40 MiB from storage) and the copy nested in it that read the rest
    (1 s, its own /proc/self/io delta inside the outer one): 100 MiB, 2 s, counted once."""
    spans = [
        _span("1" * 16, 0.0, 2.0, path="/m.st", api="safetensors.safe_open", lazy=True, bytes=100 * MB,
              read_bytes=100 * MB, page_cache_ratio=0.0),
        _span("2" * 16, 1.0, 2.0, parent="1" * 16, path="/m.st", api="deferred", bytes=100 * MB,
              mapped_bytes=100 * MB, bytes_per_s=100 * MB, read_bytes=60 * MB, page_cache_ratio=0.4),
    ]
    (f,) = weights_files.summarize(spans, lambda _p: 200.0 * MB)
    assert f["path"] == "/m.st" and f["bytes"] == 100 * MB
    assert f["read_bytes"] == 100 * MB, "the nested copy's fetch is inside the outer span's"
    assert f["read_s"] == 2.0
    assert f["bytes_per_s"] == 50.0 * MB  # what the storage served over the reading time
    assert f["page_cache_ratio"] == 0.0 and f["ceiling_ratio"] == 0.25


def test_warm_forward_counts_what_it_faulted_in_never_the_mapped_bytes() -> None:
    """Warm: a lazy load (0.1 s, mapped only) and a first forward (3 s with its compute) that
    faulted 80 of the 100 mapped MiB in: 80 MiB over 3.1 s, a floor of the rate."""
    spans = [
        _span("1" * 16, 0.0, 0.1, path="/m.st", api="transformers.from_pretrained", lazy=True, bytes=100 * MB,
              read_bytes=0, page_cache_ratio=1.0),
        _span("2" * 16, 1.0, 4.0, path="/m.st", api="deferred", deferred_by="forward", bytes=80 * MB,
              mapped_bytes=100 * MB, read_bytes=0, page_cache_ratio=1.0),
    ]
    (f,) = weights_files.summarize(spans, lambda _p: 1.0)
    assert f["read_s"] == pytest.approx(3.1) and f["counted_bytes"] == 80 * MB
    assert f["bytes_per_s"] == pytest.approx(80 * MB / 3.1)
    assert "ceiling_ratio" not in f, "a warm file says nothing about the disk"
    lazy_only = weights_files.summarize(spans[:1])[0]
    assert "bytes_per_s" not in lazy_only, "mapped bytes were not read: no figure from them"


def test_cold_storage_bytes_are_capped_at_the_file() -> None:
    """/proc/self/io counts the whole process: a parallel read of another file must not make
    this one faster than its own size over its own time."""
    spans = [_span("1" * 16, 0.0, 1.0, path="/a", api="torch.load", lazy=False, bytes=10 * MB,
                   bytes_per_s=10 * MB, read_bytes=50 * MB, page_cache_ratio=0.0,
                   storage_ceiling_bytes_per_s=20.0 * MB)]
    (f,) = weights_files.summarize(spans)
    assert f["bytes_per_s"] == 10 * MB and f["ceiling_ratio"] == 0.5


def test_summaries_feed_the_histogram_and_the_waterfall() -> None:
    from infersight.exporters.waterfall import render_waterfall

    spans = [_span("1" * 16, 0.0, 2.0, path="/w/model.safetensors", api="transformers.from_pretrained", lazy=True,
                   bytes=100 * MB, read_bytes=100 * MB, page_cache_ratio=0.0)]
    cs = ColdStart(_root(), spans)
    assert weights_throughput(cs) is None, "a lazy span alone has no throughput"
    cs.root.events.extend(SpanEvent(weights_files.EVENT, cs.root.end_ns, a) for a in weights_files.summarize(spans))
    assert weights_throughput(cs) == ("cold", 50.0 * MB)
    text = render_waterfall(cs, ceiling_of=lambda _p: 100.0 * MB)
    assert "weights file model.safetensors 100.0 MiB: 100.0 MiB from storage in 2.000 s, 50.0 MiB/s, cold, " \
           "50% of the storage ceiling" in text
    items = ColdStartMetrics().observe(cs, cs.root.end_ns)
    hist = next(i for i in items if i.name == "infersight.coldstart.weights.throughput")
    assert [p.attributes for p in hist.points] == [{"infersight.weights.cache": "cold"}]


# -- real transformers + safetensors --------------------------------------------------------

MAKE = r"""
import os, sys
from transformers import BertConfig, BertModel
BertModel(BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                     vocab_size=8000)).save_pretrained(sys.argv[1])
os._exit(0)  # written and closed: skip the teardown of torch and transformers (about a second)
"""

LOAD = r"""
import json, sys, torch
from transformers import BertModel
sys.path.insert(0, sys.argv[2])
from weights_styles import memcpy_bytes_per_s
model = BertModel.from_pretrained(sys.argv[1])
with torch.no_grad():
    model(torch.ones(1, 16, dtype=torch.long))
json.dump({"memcpy_bytes_per_s": memcpy_bytes_per_s()}, open(sys.argv[3], "w"))
"""


def _root_of(run: LaunchRun) -> SpanItem:
    (root,) = [r for r in run.roots() if r.attributes.get("infersight.process.role") != "helper"]
    return root


@pytest.fixture(scope="module")
def bert_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, LaunchRun], str]:
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    base = tmp_path_factory.mktemp("wfiles")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    model = str(base / "bert")
    subprocess.run([sys.executable, "-c", MAKE, model], check=True, env={**os.environ, **env}, timeout=300,
                   capture_output=True)
    script = base / "load.py"
    script.write_text(LOAD)
    # A fresh ceiling cache, the agent's state directory on the model's device, measuring on.
    shared = {**env, "XDG_CACHE_HOME": str(base / "cache"), "INFERSIGHT_STATE_DIR": str(base / "state"),
              "INFERSIGHT_MEASURE_STORAGE": "1"}
    runs = {}
    for state in ("cold", "warm"):
        tmp = base / state
        tmp.mkdir()
        flags = ("--evict", model) if state == "cold" else ()
        runs[state] = launch(str(tmp), [sys.executable, str(script), model,
                                        os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads")],
                             *flags, env=shared, timeout=600)
        assert runs[state].rc == 0, runs[state].output
    return model, runs, str(base)


def _files(run: LaunchRun) -> list[dict]:  # type: ignore[type-arg]
    return [e.attributes for e in _root_of(run).events if e.name == weights_files.EVENT]


@pytest.mark.slow
@pytest.mark.torch
def test_each_weights_file_has_one_summary_cold_and_warm(bert_runs) -> None:  # type: ignore[no-untyped-def]
    model, runs, _base = bert_runs
    st = os.path.join(model, "model.safetensors")
    for state, run in runs.items():
        files = _files(run)
        assert [f["path"] for f in files] == [st], (state, files)
        (f,) = files
        assert f["bytes"] == os.path.getsize(st)
        assert f["read_s"] > 0
        bound = float(run.result["memcpy_bytes_per_s"])
        assert 0 < float(f["bytes_per_s"]) <= bound, (state, f, bound)  # a physical bound, not a speed
        if state == "cold":
            assert f["page_cache_ratio"] < 0.5 and f["read_bytes"] > 0
        else:
            assert f["page_cache_ratio"] >= 0.5 and "ceiling_ratio" not in f
        assert "weights file model.safetensors" in run.output  # the launch waterfall


@pytest.mark.slow
@pytest.mark.torch
def test_first_cold_run_knows_the_ceiling(bert_runs) -> None:  # type: ignore[no-untyped-def]
    """The agent measured the state directory's device at start (the model's device too): the
    first cold run's summary has a ceiling ratio, in the span event or, when the measurement
    ended after the root, from the cache in ``show`` and ``report``."""
    model, runs, base = bert_runs
    cache = os.path.join(base, "cache", "infersight", "storage_ceiling.json")
    dev = os.stat(model).st_dev
    key = "%d:%d" % (os.major(dev), os.minor(dev))
    def measured() -> bool:
        if not os.path.exists(cache):
            return False
        with open(cache, encoding="utf-8") as f:
            return key in json.load(f)["devices"]

    assert wait_for(measured, 120)
    out = os.path.join(base, "cold", "out.otlp.jsonl")
    show = subprocess.run([*INFERSIGHT, "show", out], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "XDG_CACHE_HOME": os.path.join(base, "cache")})
    assert show.returncode == 0, show.stderr
    line = next(x for x in show.stdout.splitlines() if x.startswith("weights file model.safetensors"))
    assert ", cold, " in line and "% of the storage ceiling" in line, line
    js = subprocess.run([*INFERSIGHT, "show", "--format", "json", out], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "XDG_CACHE_HOME": os.path.join(base, "cache")})
    (f,) = [f for cs in json.loads(js.stdout)["coldstarts"] for f in cs["weights_files"]]
    assert f["ceiling_ratio"] > 0
    html = os.path.join(base, "cold.html")
    rep = subprocess.run([*INFERSIGHT, "report", out, "-o", html], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XDG_CACHE_HOME": os.path.join(base, "cache")})
    assert rep.returncode == 0, rep.stderr
    with open(html, encoding="utf-8") as fh:
        page = fh.read()
    assert "weights file model.safetensors" in page and "% of the storage ceiling" in page


@pytest.mark.slow
@pytest.mark.torch
def test_lazy_loads_reach_the_throughput_histogram(bert_runs) -> None:  # type: ignore[no-untyped-def]
    from conftest import read_otlp_lines

    _model, runs, base = bert_runs
    from pathlib import Path

    lines = read_otlp_lines(Path(base, "cold", "out.otlp.jsonl"))
    hist = [m for req in lines for rm in req.get("resourceMetrics", []) for sm in rm["scopeMetrics"]
            for m in sm["metrics"] if m["name"] == "infersight.coldstart.weights.throughput"]
    assert hist, "transformers + safetensors (a lazy load) feeds the weights histogram"
    points = hist[-1]["histogram"]["dataPoints"]
    assert [a["value"]["stringValue"] for p in points for a in p["attributes"]] == ["cold"]
