"""Weights spans say what was really read, when, and whether the page cache served it.

Fast part: the kernel probes (mincore page-cache ratio, pagemap, /proc/self/maps), the pure
attribute rules, the waterfall column and launch's storage-ceiling note.

Slow part: every loading style (safetensors load_file / safe_open with and without ``with`` /
get_slice, torch.load with and without mmap, torch.jit.load, transformers 5 from_pretrained of
a BERT and a GPT-2 built from configs, plus the deferred reads) run under ``infersight launch``
with no infersight call, on files evicted from the page cache and on files read just before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, LaunchRun, launch, stage_name  # noqa: E402

from infersight.agent.coldstart import storage_ceiling  # noqa: E402
from infersight.exporters.weights_note import weights_note  # noqa: E402
from infersight.hooks import _pagestate, _state, _weights  # noqa: E402

W = "infersight.weights."


def write(path: str, nbytes: int) -> str:
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * (nbytes >> 20))
        f.flush()
        os.fsync(f.fileno())  # dirty pages are not dropped by DONTNEED
    return path


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_all(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


# -- probes --------------------------------------------------------------------------------


def test_page_cache_ratio_follows_eviction_and_reads(tmp_path, monkeypatch) -> None:
    p = write(str(tmp_path / "w.bin"), 16 << 20)
    evict(p)
    assert _pagestate.page_cache_ratio([p]) < 0.5
    read_all(p)
    assert _pagestate.page_cache_ratio([p]) >= 0.9
    evict(p)
    with open(p, "rb") as f:  # the first half only, without readahead past it
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        f.read(8 << 20)
    half = _pagestate.page_cache_ratio([p])
    assert half is not None and 0.3 < half < 0.9
    monkeypatch.setattr(_pagestate, "SAMPLE_PAGES", 1024)  # a huge file: sampled windows, same answer
    sampled = _pagestate.page_cache_ratio([p])
    assert sampled is not None and abs(sampled - half) < 0.2
    assert _pagestate.page_cache_ratio([str(tmp_path / "missing")]) is None
    assert _pagestate.page_cache_ratio([write(str(tmp_path / "empty"), 0)]) is None


def test_pagemap_sees_pages_faulted_in_through_a_file_mapping(tmp_path) -> None:
    p = write(str(tmp_path / "m.bin"), 8 << 20)
    read_all(p)
    with open(p, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private, like safetensors' and torch's
    view = (ctypes.c_char * len(mm)).from_buffer(mm)
    try:
        addr = ctypes.addressof(view)
        key = _pagestate.file_key(p)
        assert any(lo <= addr < hi for lo, hi in _pagestate.file_mappings(key))
        assert _pagestate.file_mappings(_pagestate.file_key(__file__)) == []
        chunk = [(addr, len(mm))]
        before = _pagestate.present_bytes(chunk)
        assert before is not None and before < len(mm)
        for off in range(0, len(mm), mmap.PAGESIZE):  # touch every page: all are present now
            view[off]
        assert _pagestate.present_bytes(chunk) == len(mm)
    finally:
        del view
        mm.close()
    assert _pagestate.present_bytes([]) == 0


def test_kernel_counters_move_on_a_cold_read(tmp_path) -> None:
    p = write(str(tmp_path / "c.bin"), 16 << 20)
    evict(p)
    r0 = _pagestate.read_bytes()
    assert r0 is not None and _pagestate.major_faults() is not None
    read_all(p)
    assert _pagestate.read_bytes() - r0 >= 8 << 20


# -- the attribute rules -------------------------------------------------------------------


def test_lazy_reads_have_no_throughput_and_the_ceiling_is_for_cold_reads_only() -> None:
    lazy = _weights.read_attrs("safetensors.torch.load_file", "/w", 100, None, True, 0.0, 0, 0, ceiling=50.0)
    assert lazy[W + "lazy"] is True and W + "bytes_per_s" not in lazy and W + "ceiling_ratio" not in lazy
    cold = _weights.read_attrs("torch.load", "/w", 100, 2.0, False, 0.1, 100, 3, ceiling=100.0)
    assert cold[W + "bytes_per_s"] == 50.0 and cold[W + "ceiling_ratio"] == 0.5
    assert cold[W + "read_bytes"] == 100 and cold[W + "major_faults"] == 3
    warm = _weights.read_attrs("torch.load", "/w", 100, 2.0, False, 0.95, 0, 0, ceiling=100.0)
    assert warm[W + "bytes_per_s"] == 50.0 and W + "ceiling_ratio" not in warm
    unknown = _weights.read_attrs("torch.load", "", 100, 2.0, False, None, None, None, ceiling=100.0)
    assert W + "ceiling_ratio" not in unknown and W + "page_cache_ratio" not in unknown
    assert W + "read_bytes" not in unknown and W + "path" not in unknown


def test_waterfall_says_warm_or_cold() -> None:
    def note(*spans: dict[str, object]) -> str:
        return weights_note(list(spans))

    assert note({W + "bytes": 2**20, W + "bytes_per_s": 2**30, W + "page_cache_ratio": 1.0}) == (
        "1.0 MiB @ 1.0 GiB/s warm (page cache)")
    assert note({W + "bytes": 2**20, W + "bytes_per_s": 2**20, W + "page_cache_ratio": 0.0,
                 W + "ceiling_ratio": 0.5}) == "1.0 MiB @ 1.0 MiB/s cold (50% of storage ceiling)"
    lazy = {W + "bytes": 2**20, W + "lazy": True, W + "page_cache_ratio": 0.2, W + "api": "torch.load"}
    assert note(lazy) == "1.0 MiB mapped (lazy) cold"
    copy = {W + "bytes": 2**20, W + "bytes_per_s": 2**30, W + "api": "deferred", W + "page_cache_ratio": 0.7}
    assert note(copy) == "1.0 MiB @ 1.0 GiB/s deferred warm (page cache)"
    # one row for a mapped load and the copy that read it: the file counts once, the rate is the copy's
    assert note(lazy, copy) == "1.0 MiB @ 1.0 GiB/s + deferred read cold"
    ahead = dict(lazy, **{W + "read_bytes": 2**20})  # the loader read the file ahead while mapping it
    assert note(ahead) == "1.0 MiB mapped (lazy; 1.0 MiB read from storage) cold"
    warm = dict(lazy, **{W + "page_cache_ratio": 1.0})
    assert note(lazy, warm) == "2.0 MiB mapped (lazy) partly cold"
    two = [{W + "bytes": 2**20, W + "bytes_per_s": 2**20}, {W + "bytes": 3 * 2**20, W + "bytes_per_s": 3 * 2**20}]
    assert weights_note(two) == "4.0 MiB @ 2.0 MiB/s"  # 4 MiB in 2 s: time-weighted
    assert note({}) == "" and note({W + "bytes": True}) == ""
    old = {W + "bytes": 2 * 2**30, W + "bytes_per_s": 2**30, W + "ceiling_ratio": 0.25}  # older hooks
    assert note(old) == "2.0 GiB @ 1.0 GiB/s (25% of storage ceiling)"


def test_launch_compares_only_cold_files_with_the_storage_ceiling() -> None:
    def event(path: str, rate: float, ratio: float | None) -> dict[str, object]:
        attrs = [{"key": "path", "value": {"stringValue": path}},
                 {"key": "bytes_per_s", "value": {"doubleValue": rate}}]
        if ratio is not None:
            attrs.append({"key": "page_cache_ratio", "value": {"doubleValue": ratio}})
        return {"name": "weights_file", "attributes": attrs}

    req = {"resourceSpans": [{"scopeSpans": [{"spans": [{"events": [
        event("/cold", 1e8, 0.0), event("/warm", 5e9, 1.0), event("/unsaid", 1e8, None)]}]}]}]}
    assert storage_ceiling.cold_files(req) == {"/cold": 1e8}


def test_a_move_to_a_device_says_it_read_the_mapped_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What weights_to_device gains when the weights still map their file (the move is the read).
    No GPU here: the move is stood in for by replacing the parameters with copies."""
    torch = pytest.importorskip("torch")
    p = str(tmp_path / "m.pt")
    torch.save({"weight": torch.randn(512, 512), "bias": torch.randn(512)}, p)
    sd = torch.load(p, mmap=True, weights_only=True)
    monkeypatch.setattr(_state, "current", _state.HookState())  # the mapped files are forgotten with it
    _state.current.weights.module = torch
    try:
        assert _weights._register([p], list(sd.values()))
        with torch.device("meta"):
            m = torch.nn.Linear(512, 512)
        m.load_state_dict(sd, assign=True)
        token = _weights.move_begin(m)
        assert token is not None and token[1] == (512 * 512 + 512) * 4
        assert _weights.move_attrs(token, m, 0.5, True) == {}  # still mapped: nothing read
        m.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
        a = _weights.move_attrs(token, m, 0.5, True)
        assert a[W + "deferred_read"] is True and a[W + "path"] == p and a[W + "mapped_bytes"] == token[1]
        assert 0.0 <= a[W + "page_cache_ratio"] <= 1.0
        assert W + "bytes_per_s" not in a and W + "bytes" not in a  # the move's own figures stay
        assert _weights.move_begin(m) is None
    finally:
        _weights._forget()


# -- every loading style under launch --------------------------------------------------------

STYLES = ("st_assign", "st_copy", "st_half", "pt", "ptmm", "sow", "soe", "jit", "bert", "gpt2")
LAZY = {"st_assign", "st_copy", "st_half", "ptmm", "sow", "soe", "bert", "gpt2"}
COPIED = ("st_copy", "ptmm", "sow", "soe", "soe_stage")  # read by a load_state_dict copy
FORWARD = ("st_assign", "bert", "gpt2")  # read by the first forward (assign=True, transformers)


@pytest.fixture(scope="module")
def styles(tmp_path_factory: pytest.TempPathFactory) -> tuple[LaunchRun, dict[str, str]]:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    pytest.importorskip("transformers")
    tmp = str(tmp_path_factory.mktemp("weights"))
    d = os.path.join(tmp, "files")
    os.makedirs(d)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    workload = os.path.join(HERE, "weights_styles.py")
    subprocess.run([sys.executable, workload, "prepare", d], check=True, env=env, timeout=600,
                   capture_output=True)
    for root, _, names in os.walk(d):
        for name in names:
            p = os.path.join(root, name)
            if "_cold" in p:
                evict(p)
            else:
                evict(p)  # written by this test: make sure "warm" means "read first"
                read_all(p)
    # a storage ceiling cached for this disk: cold reads are compared with it, warm ones never
    storage_ceiling.record(d, storage_ceiling.Measurement(1 << 30, 1.0, "direct"),
                           os.path.join(tmp, "cache", "infersight", "storage_ceiling.json"))
    keep = {k: env[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "PYTHONWARNINGS",
                                "HF_HUB_DISABLE_PROGRESS_BARS")}
    run = launch(tmp, [sys.executable, workload, "run", d], env=keep, timeout=600)
    assert run.rc == 0, run.output
    return run, run.result["files"]


@pytest.fixture(scope="module")
def memcpy_here() -> float:
    """This machine's memcpy bandwidth measured in the test process (best of many copies), once
    for the module: each bound below is the best of it and the workload's own measurement."""
    from weights_styles import memcpy_bytes_per_s

    return memcpy_bytes_per_s()


def weights(run: LaunchRun) -> list:
    root = run.root_of(run.result["pid"])
    return [s for s in run.stages(root) if stage_name(s) == "weights_load"]


def of(run: LaunchRun, path: str, deferred: bool = False) -> list:
    return [s for s in weights(run) if s.attributes.get(W + "path") == path
            and (s.attributes.get(W + "api") == "deferred") is deferred]


@pytest.mark.slow
@pytest.mark.torch
def test_every_throughput_is_below_memcpy_bandwidth(styles, memcpy_here: float) -> None:
    run, _ = styles
    # the best of a measurement here and one in the workload process, right after its loads
    bound = max(memcpy_here, float(run.result["memcpy_bytes_per_s"]))
    rated = [s for s in weights(run) if W + "bytes_per_s" in s.attributes]
    assert len(rated) >= 12  # eager loads and load_state_dict copies, cold and warm
    for s in rated:
        rate = float(s.attributes[W + "bytes_per_s"])
        assert 0 < rate <= bound, "%s: %.0f MB/s above memcpy %.0f MB/s" % (
            s.attributes.get(W + "path"), rate / 1e6, bound / 1e6)
    print("memcpy %.0f MB/s; fastest weights read %.0f MB/s" % (
        bound / 1e6, max(float(s.attributes[W + "bytes_per_s"]) for s in rated) / 1e6))


@pytest.mark.slow
@pytest.mark.torch
def test_every_file_has_one_summary_below_memcpy(styles, memcpy_here: float) -> None:
    """Each file read (eager, lazy, deferred, cold and warm) has one ``weights_file`` event on
    the root, and no effective figure is above this machine's memcpy bandwidth."""
    run, files = styles
    bound = max(memcpy_here, float(run.result["memcpy_bytes_per_s"]))
    root = run.root_of(run.result["pid"])
    summaries = [e.attributes for e in root.events if e.name == "weights_file"]
    paths = [f["path"] for f in summaries]
    assert len(paths) == len(set(paths)), "one summary per file"
    read = {s.attributes[W + "path"] for s in weights(run)}
    assert set(paths) == read
    for style in STYLES:
        for state in ("cold", "warm"):
            (f,) = [f for f in summaries if f["path"] == files["%s_%s" % (style, state)]]
            assert f["read_s"] > 0, (style, state, f)
            assert (f["page_cache_ratio"] < 0.5) is (state == "cold"), (style, state, f)
            rate = f.get("bytes_per_s")
            assert rate is None or 0 < float(rate) <= bound, (style, state, f, bound)
            if style in ("pt", "jit") or style in COPIED:
                assert rate, (style, state, f)  # a read that took the bytes has a figure


@pytest.mark.slow
@pytest.mark.torch
def test_page_cache_ratio_and_ceiling_follow_eviction(styles) -> None:
    run, files = styles
    for state in ("cold", "warm"):  # a bare safe_open closed after another stage began: no load span
        assert of(run, files["soe_stage_" + state]) == []
    for style in STYLES:
        for state in ("cold", "warm"):
            spans = of(run, files["%s_%s" % (style, state)])
            assert len(spans) == 1, (style, state, spans)  # one load span per file
            a = spans[0].attributes
            ratio = float(a[W + "page_cache_ratio"])
            if state == "cold":
                assert ratio < 0.5, (style, ratio)
                assert ("infersight.weights.ceiling_ratio" in a) is (W + "bytes_per_s" in a)
            else:
                assert ratio >= 0.9, (style, ratio)
                assert W + "ceiling_ratio" not in a
    cold_eager = of(run, files["pt_cold"])[0].attributes
    assert int(cold_eager[W + "read_bytes"]) >= int(cold_eager[W + "bytes"]) // 2  # the disk really served it
    assert int(of(run, files["pt_warm"])[0].attributes[W + "read_bytes"]) < 1 << 20
    out = run.output
    assert "warm (page cache)" in out and " cold" in out


@pytest.mark.slow
@pytest.mark.torch
def test_an_eager_load_has_one_rate_on_its_span_and_on_its_file(styles) -> None:
    """An eager load's span is the call: its rate is its bytes over the span's own time, and the file's summary
    says the same. The span used to end after the hooks' bookkeeping (the /proc reads, the storage ceiling's
    lookup), which the rate did not count: a small warm file read at 165 MiB/s on its row was 152 MiB/s on
    its summary line."""
    run, files = styles
    root = run.root_of(run.result["pid"])
    summaries = {e.attributes["path"]: e.attributes for e in root.events if e.name == "weights_file"}
    for style in ("pt", "jit"):
        path = files[style + "_warm"]
        (span,) = of(run, path)
        rate = float(span.attributes[W + "bytes_per_s"])
        own = int(span.attributes[W + "bytes"]) / ((span.end_ns - span.start_ns) / 1e9)
        assert abs(own / rate - 1) < 0.02, (style, own, rate)
        assert abs(float(summaries[path]["bytes_per_s"]) / rate - 1) < 0.02, (style, summaries[path], rate)


@pytest.mark.slow
@pytest.mark.torch
def test_mapped_loads_are_lazy_and_eager_ones_rated(styles) -> None:
    run, files = styles
    for style in STYLES:
        for state in ("cold", "warm"):
            path = files["%s_%s" % (style, state)]
            a = of(run, path)[0].attributes
            assert a[W + "lazy"] is (style in LAZY), (style, a)
            assert (W + "bytes_per_s" in a) is (style not in LAZY), (style, a)
            if style in ("pt", "jit", "st_assign", "st_copy", "st_half", "ptmm", "bert", "gpt2"):
                assert a[W + "bytes"] == os.path.getsize(path)  # whole-file loads
            else:
                assert 0.95 * os.path.getsize(path) < a[W + "bytes"] <= os.path.getsize(path)  # the tensors taken
    apis = {style: of(run, files[style + "_cold"])[0].attributes[W + "api"] for style in STYLES}
    assert apis == {"st_assign": "safetensors.torch.load_file", "st_copy": "safetensors.torch.load_file",
                    "st_half": "safetensors.torch.load_file",
                    "pt": "torch.load", "ptmm": "torch.load", "sow": "safetensors.safe_open",
                    "soe": "safetensors.safe_open", "jit": "torch.jit.load",
                    "bert": "transformers.from_pretrained", "gpt2": "transformers.from_pretrained"}


@pytest.mark.slow
@pytest.mark.torch
def test_header_and_meta_reads_are_not_weights_spans(styles) -> None:
    run, files = styles
    assert of(run, files["header_st"]) == [] and of(run, files["header_pt"]) == []
    for state in ("cold", "warm"):  # transformers read each header onto the meta device first: no span
        for model in ("bert", "gpt2"):
            assert [s.attributes[W + "api"] for s in of(run, files["%s_%s" % (model, state)])] == [
                "transformers.from_pretrained"]


@pytest.mark.slow
@pytest.mark.torch
def test_deferred_reads_are_spanned(styles) -> None:
    run, files = styles
    for state in ("cold", "warm"):
        for style in COPIED:
            path = files["%s_%s" % (style, state)]
            spans = of(run, path, deferred=True)
            assert [s.attributes[W + "deferred_by"] for s in spans] == ["load_state_dict"], (style, state)
            a = spans[0].attributes
            assert a[W + "bytes"] == a[W + "mapped_bytes"] > 0.95 * os.path.getsize(path)
            assert a[W + "bytes_per_s"] > 0 and a[W + "lazy"] is False
        # .float() on float32 mapped weights read nothing; .half() read them all
        spans = of(run, files["st_half_" + state], deferred=True)
        assert [s.attributes[W + "deferred_by"] for s in spans] == ["convert"], state
        assert spans[0].attributes[W + "bytes"] == spans[0].attributes[W + "mapped_bytes"]
        assert spans[0].attributes[W + "bytes_per_s"] > 0
    forwards = 0
    for style in FORWARD:  # evicted files: the forward faults pages in that nothing touched before
        spans = of(run, files[style + "_cold"], deferred=True)
        if not spans:
            # Readahead after the lazy load can bring every page in before the forward (this VM
            # reads ahead 8 MiB, and transformers touches tensors while it loads): then the
            # forward read nothing and has no span; the lazy load span still began cold.
            loads = of(run, files[style + "_cold"])
            assert loads and loads[0].attributes[W + "lazy"] is True, style
            assert loads[0].attributes[W + "page_cache_ratio"] < 0.5, style
            continue
        forwards += 1
        assert [s.attributes[W + "deferred_by"] for s in spans] == ["forward"], style
        a = spans[0].attributes
        assert 0 < a[W + "bytes"] <= a[W + "mapped_bytes"]
    assert forwards >= 1  # at least one first forward was the read


@pytest.mark.slow
@pytest.mark.torch
def test_failed_loads_raise_the_users_own_errors(styles) -> None:
    from weights_styles import failed_loads

    run, files = styles
    d = os.path.dirname(files["header_pt"])
    assert run.result["errors"] == failed_loads(d)  # the same errors here, without the hooks
    assert "no error" not in run.result["errors"]
    assert "hooks disabled" not in run.output


@pytest.mark.slow
@pytest.mark.torch
def test_weights_spans_nest_cleanly(styles) -> None:
    run, _ = styles
    root = run.root_of(run.result["pid"])
    stages = run.stages(root)
    by_id = {s.span_id: s for s in stages}

    def ancestors(s: object) -> set[str]:
        out, cur = set(), s
        while getattr(cur, "parent_span_id", None) in by_id:
            cur = by_id[cur.parent_span_id]  # type: ignore[attr-defined]
            out.add(cur.span_id)
        return out

    mine = weights(run)
    assert mine
    for w in mine:  # inside the root and their parent; overlap only where one nests in the other
        assert w.trace_id == root.trace_id and root.start_ns <= w.start_ns <= w.end_ns <= root.end_ns
        parent = by_id.get(w.parent_span_id or "")
        assert w.parent_span_id == root.span_id or (
            parent is not None and parent.start_ns <= w.start_ns and w.end_ns <= parent.end_ns)
        for s in stages:
            if s is not w and min(s.end_ns, w.end_ns) > max(s.start_ns, w.start_ns):
                assert s.span_id in ancestors(w) or w.span_id in ancestors(s), (w.name, s.name)
        if w.attributes.get(W + "deferred_by") == "forward":  # inside the forward it reads in
            assert stage_name(by_id[w.parent_span_id]) in ("warmup", "first_request")


FAULTY = """
import json, sys
import torch
from infersight.hooks import _weights

def boom(*args, **kwargs):
    raise RuntimeError("injected fault")

_weights.mappings_of = boom  # every lookup of a file mapping now fails inside the hooks
torch.save({"weight": torch.ones(256, 256)}, sys.argv[1])
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
model = torch.nn.Linear(256, 256, bias=False)
model.load_state_dict(sd)
json.dump({"sum": float(model.weight.sum())}, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
@pytest.mark.torch
def test_an_internal_fault_never_reaches_the_user(tmp_path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    run = launch(str(tmp_path), [sys.executable, str(script), str(tmp_path / "w.pt")], timeout=300)
    assert run.rc == 0, run.output
    assert run.result == {"sum": 256.0 * 256.0}  # the load and the copy worked
    assert "hooks disabled after an internal error" in run.output and "injected fault" in run.output
