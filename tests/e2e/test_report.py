"""``infersight report``: the page of a real launched workload, rendered by a real browser.

The cold start comes from ``infersight launch -- python examples/demo_serve.py`` (real). The
GPU side (memory, devices, OOM) is made by the agent's real handlers from FAKE device
readings (tests/support/report_data.py): there is no GPU here. Headless Chromium (Debian's package,
which scripts/check installs) loads the page from disk; its net log shows that the page
requested nothing, its DOM is checked row by row, and its screenshot must not be blank.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import report_data as rd

from infersight.agent.report.html import CSP
from infersight.agent.report.page import build, run_report
from infersight.agent.report.parse import parse_lines
from infersight.agent.report.views import waterfalls
from infersight.exporters.otlp_json import encode_lines, traces_request
from infersight.telemetry import LogItem, MetricItem, Resource, SpanItem

REPO = Path(__file__).resolve().parents[2]
INFERSIGHT = [sys.executable, "-m", "infersight"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/check installs it)")
QUIET = [  # keep Chromium's own background traffic out of the net log
    "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--disable-extensions", "--disable-features=SpellCheck,Translate,OptimizationHints,MediaRouter",
    "--host-resolver-rules=MAP * ~NOTFOUND",
]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INFERSIGHT, *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real cold start: the demo server under ``infersight launch``."""
    d = tmp_path_factory.mktemp("demo")
    out = d / "demo.otlp.jsonl"
    env = dict(os.environ, XDG_CACHE_HOME=str(d / "cache"), INFERSIGHT_MEASURE_STORAGE="0")
    p = subprocess.run([*INFERSIGHT, "launch", "--otlp-file", str(out), "--no-console", "--",
                        sys.executable, str(REPO / "examples" / "demo_serve.py"), "--hidden", "512",
                        "--weights-dir", str(d)], capture_output=True, text=True, timeout=180, env=env, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


@pytest.fixture(scope="module")
def gpu(demo: Path) -> Path:
    """FAKE-GPU telemetry from the agent's real code, timed just after the demo's cold start."""
    (root,) = [s for s in parse_lines(demo.read_text().splitlines(True)).spans if s.name == "coldstart"]
    return rd.write(demo.parent / "gpu.otlp.jsonl", rd.gpu_items(root.end_ns + 1_000_000_000))


def stage_spans(path: Path) -> list[SpanItem]:
    spans = parse_lines(path.read_text().splitlines(True)).spans
    return [s for s in spans if s.name.startswith("coldstart.")]


# -- the browser ------------------------------------------------------------------------------


def chromium(page: Path, *args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *QUIET, "--user-data-dir=%s" % profile, *args, page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120, check=False)


def page_requests(net_log: Path) -> list[str]:
    """URLs of requests the page itself started (initiator set); the browser's own requests
    carry no page origin."""
    d = json.loads(net_log.read_text())
    start = d["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [e["params"].get("url", "") for e in d["events"] if e["type"] == start
            and e.get("params", {}).get("initiator") not in (None, "not an origin")]


def render(page: Path, tmp: Path) -> tuple[str, list[str], list[str]]:
    """(the DOM after load, the URLs the page requested, its Content-Security-Policy violations)."""
    net = tmp / ("%s.netlog.json" % page.stem)
    p = chromium(page, "--log-net-log=%s" % net, "--enable-logging=stderr", "--v=0", "--dump-dom",
                 profile=tmp / ("prof-" + page.stem))
    assert p.returncode == 0 and "</html>" in p.stdout, p.stderr[-2000:]
    violations = [line for line in p.stderr.splitlines() if "Content Security Policy" in line]
    return p.stdout, page_requests(net), violations


def png_pixels(data: bytes) -> Any:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) with zlib: a (height, width, 3) array."""
    np = pytest.importorskip("numpy")
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h, ctype = 8, b"", 0, 0, 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 3 if ctype == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, w * bpp + 1)
    out = np.zeros((h, w * bpp), dtype=np.uint8)
    prev = np.zeros(w * bpp, dtype=np.int64)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int64)
        if f == 1:  # Sub: a running sum along each channel
            line = np.cumsum(line.reshape(w, bpp), axis=0).reshape(-1) % 256
        elif f == 2:  # Up
            line = (line + prev) % 256
        elif f in (3, 4):  # Average, Paeth: sequential along the row
            cur = [0] * (w * bpp)
            lp, pp = line.tolist(), prev.tolist()
            for i in range(w * bpp):
                a = cur[i - bpp] if i >= bpp else 0
                b, c = pp[i], (pp[i - bpp] if i >= bpp else 0)
                if f == 3:
                    pred = (a + b) // 2
                else:
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[i] = (lp[i] + pred) & 255
            line = np.array(cur, dtype=np.int64)
        out[y] = line
        prev = line
    return out.reshape(h, w, bpp)[:, :, :3]


class Dom(HTMLParser):
    """The elements of a dumped DOM, with their attributes and text, in document order."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[dict[str, Any]] = []
        self._open: list[dict[str, Any]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = {"tag": tag, "attrs": {k: v or "" for k, v in attrs}, "text": "", "children": []}
        if self._open:
            self._open[-1]["children"].append(el)
        self.elements.append(el)
        if tag not in ("meta", "br", "link", "img", "input"):  # HTML void elements; SVG ones get end tags
            self._open.append(el)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i]["tag"] == tag:
                del self._open[i:]
                break

    def handle_data(self, data: str) -> None:
        for el in self._open:
            el["text"] += data

    def find(self, tag: str | None = None, **attrs: str) -> list[dict[str, Any]]:
        out = []
        for el in self.elements:
            if tag is not None and el["tag"] != tag:
                continue
            ok = True
            for k, v in attrs.items():
                have = el["attrs"].get(k.replace("_", "-"))
                if have is None or (not set(v.split()) <= set(have.split()) if k == "class" else have != v):
                    ok = False
            if ok:
                out.append(el)
        return out

    def child(self, el: dict[str, Any], tag: str, cls: str) -> dict[str, Any] | None:
        for c in el["children"]:
            if c["tag"] == tag and cls in c["attrs"].get("class", "").split():
                return c
        return None


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def report(*inputs: Path, out: Path) -> Result:
    """``infersight report`` in-process (the CLI wiring has its own tests below): an exception
    here would fail the test, so a pass also means 'no traceback'."""
    o, e = io.StringIO(), io.StringIO()
    rc = run_report([str(p) for p in inputs], str(out), o, e)
    return Result(rc, o.getvalue(), e.getvalue())


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.slow
@needs_chromium
def test_real_workload_page_in_chromium(demo: Path, gpu: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    p = run_cli("report", str(demo), str(gpu), "-o", str(page))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(page)
    dom_text, requests, violations = render(page, tmp_path)
    assert requests == [], "the page requested %s" % requests
    assert violations == [], violations
    dom = Dom(dom_text)
    (csp,) = dom.find("meta", http_equiv="Content-Security-Policy")
    assert "default-src 'none'" in csp["attrs"]["content"]
    assert not dom.find("script") and not dom.find("link") and not dom.find("img")

    # One waterfall row per stage span, with its duration text, in both processes.
    for path in (demo, gpu):
        for s in stage_spans(path):
            (row,) = dom.find("g", data_span_id=s.span_id)
            assert "row" in row["attrs"]["class"]
            dur = dom.child(row, "text", "dur")
            assert dur is not None and dur["text"] == "%.3f s" % ((s.end_ns - s.start_ns) / 1e9)
            assert row["attrs"]["data-stage"] == (s.attributes.get("infersight.stage") or s.name[10:])
    roots = [s for path in (demo, gpu) for s in parse_lines(path.read_text().splitlines(True)).spans
             if s.name == "coldstart"]
    assert len(dom.find("g", **{"class": "row"})) == len(stage_spans(demo)) + len(stage_spans(gpu)) + len(roots)

    # Nested stage indented, unattributed span hatched with its top frames on hover.
    (gc,) = dom.find("g", data_span_id="17" * 8)  # the FAKE worker's graph_compile, inside warmup
    assert gc["attrs"]["data-depth"] == "2" and gc["attrs"]["data-stage"] == "graph_compile"
    (un,) = dom.find("g", data_span_id="18" * 8)  # its unattributed stretch
    assert "unattributed" in un["attrs"]["class"]
    assert "mylib.setup:build_index 61%" in un["text"]
    # the FAKE worker's root row's gap, too (the real demo has one as well when the machine is slow)
    gaps = [g for g in dom.find("rect", **{"class": "gap"}) if "sampled top frames: mylib." in g["text"]]
    assert len(gaps) == 1 and "json.decoder:raw_decode 22%" in gaps[0]["text"]
    # the FAKE worker's weights_load (the demo's own read may print "2.0 GiB/s" as its throughput)
    (wl,) = dom.find("g", data_span_id="14" * 8)
    assert wl["attrs"]["data-stage"] == "weights_load" and "2.0 GiB @" in wl["text"]
    assert "warm (page cache 100%)" in wl["text"]
    assert "x.unknown.attribute = kept as is" in wl["text"]  # unknown attributes on hover
    assert dom.find("g", **{"class": "mark ready"}) and dom.find("g", **{"class": "mark first-response"})
    (stage_oom,) = dom.find("g", **{"class": "stage-oom"})  # the OOM on the warmup row
    (warmup,) = dom.find("g", data_span_id=rd.WARMUP)
    assert stage_oom in warmup["children"] and "reservation_conflict" in stage_oom["text"]

    # Memory, devices and the OOM table, from the FAKE-GPU file.
    for sec in ("coldstart", "memory", "devices", "ooms"):
        assert dom.find("section", id=sec), sec
    mem = dom.find("div", data_device=rd.GPU[0])
    assert mem and {s["attrs"]["data-series"] for s in dom.find("g", **{"class": "series"})} >= {
        "allocated", "reserved", "NVML used (device)"}
    (oom_mark,) = [g for g in dom.find("g", **{"class": "oom-mark"}) if g is not stage_oom]
    assert "reservation_conflict" in oom_mark["text"] and "remedy:" in oom_mark["text"]
    assert dom.find("g", **{"class": "ev-mark"}), "the large allocation is marked"
    (slow,) = [r for r in dom.find("tr", **{"class": "device-row"}) if r["attrs"]["data-device"] == rd.GPU[1]]
    assert "slow" in slow["text"] and "thermal_throttling" in slow["text"] and "20.00" in slow["text"]
    tracks = {t["attrs"]["data-track"] for t in dom.find("g", **{"class": "track"})}
    assert {"throttle: hw_thermal_slowdown", "PCIe below max", "ECC", "events"} <= tracks
    (oom_row,) = dom.find("tr", **{"class": "oom-row"})
    assert "reservation_conflict" in oom_row["text"] and "4.0 GiB" in oom_row["text"]

    # The screenshot is not blank: many colours, large variance, and the bars' blue among them.
    shot = tmp_path / "shot.png"
    c = chromium(page, "--window-size=1280,1400", "--force-device-scale-factor=0.5", "--screenshot=%s" % shot,
                 profile=tmp_path / "prof-shot")
    assert c.returncode == 0 and shot.exists(), c.stderr[-2000:]
    px = png_pixels(shot.read_bytes())
    colours = {tuple(int(v) for v in p) for p in px.reshape(-1, 3)[::3]}
    assert len(colours) > 50, len(colours)
    assert float(px.std()) > 10.0
    blue = (abs(px[:, :, 0].astype(int) - 0x09) < 24) & (abs(px[:, :, 1].astype(int) - 0x69) < 24) & (
        abs(px[:, :, 2].astype(int) - 0xDA) < 24)
    assert int(blue.sum()) > 200, "no stage bars drawn"
    assert float(px.mean()) > 200, "light by default"

    # Dark mode follows the system (prefers-color-scheme), and stays readable: bright text on dark.
    dark = tmp_path / "dark.png"
    c = chromium(page, "--force-dark-mode", "--window-size=1280,800", "--force-device-scale-factor=0.5",
                 "--screenshot=%s" % dark, profile=tmp_path / "prof-dark")
    assert c.returncode == 0 and dark.exists(), c.stderr[-2000:]
    dpx = png_pixels(dark.read_bytes())
    assert float(dpx.mean()) < 60, "dark background"
    assert int((dpx.min(axis=2) > 200).sum()) > 500, "light text"
    assert page.stat().st_size < 1_500_000


@pytest.mark.slow
@needs_chromium
def test_sections_absent_without_their_data(demo: Path, tmp_path: Path) -> None:
    page = tmp_path / "cold.html"
    assert report(demo, out=page).returncode == 0
    dom = Dom(render(page, tmp_path)[0])  # (no script: the DOM is the file's, as the browser built it)
    assert dom.find("section", id="coldstart")
    for sec in ("memory", "devices", "ooms"):
        assert not dom.find("section", id=sec), sec


@pytest.mark.slow
@needs_chromium
def test_net_log_and_csp_checks_see_a_fetch(tmp_path: Path) -> None:
    """The controls for 'no request left the page': a page that fetches is caught by the net
    log, and under the report's CSP the same fetch is blocked and reported."""
    img = '<img src="http://example.invalid/x.png">'
    page = tmp_path / "fetching.html"
    page.write_text("<!doctype html><html><body>%s</body></html>" % img)
    _, requests, violations = render(page, tmp_path)
    assert requests == ["http://example.invalid/x.png"] and violations == []
    guarded = tmp_path / "guarded.html"
    guarded.write_text('<!doctype html><html><head><meta http-equiv="Content-Security-Policy" content="%s"></head>'
                       "<body>%s</body></html>" % (CSP, img))
    _, requests, violations = render(guarded, tmp_path)
    assert requests == [] and len(violations) == 1 and "example.invalid" in violations[0]


def test_default_output_name_and_size(demo: Path, tmp_path: Path) -> None:
    src = tmp_path / "run.otlp.jsonl"
    shutil.copy(demo, src)
    p = run_cli("report", src.name, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "run.html"
    html = (tmp_path / "run.html").read_text()
    assert 'id="coldstart"' in html and 'id="memory"' not in html
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", html), "nothing is fetched"
    assert len(html.encode()) < 1_500_000


# -- robustness: a sensible page or a clear error, never a traceback ---------------------------


def test_only_metrics(gpu: Path, tmp_path: Path) -> None:
    src = tmp_path / "metrics.jsonl"
    src.write_text("".join(line for line in gpu.read_text().splitlines(True) if '"resourceMetrics"' in line))
    p = report(src, out=tmp_path / "m.html")
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "m.html").read_text()
    assert 'id="memory"' in html and 'id="devices"' in html
    assert 'id="coldstart"' not in html and 'id="ooms"' not in html


def test_only_logs(gpu: Path, tmp_path: Path) -> None:
    src = tmp_path / "logs.jsonl"
    src.write_text("".join(line for line in gpu.read_text().splitlines(True) if '"resourceLogs"' in line))
    p = report(src, out=tmp_path / "l.html")
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "l.html").read_text()
    assert 'id="ooms"' in html and 'class="oom-row"' in html
    assert 'id="devices"' in html  # the slow verdict and the Xid are device logs
    assert 'id="coldstart"' not in html and 'id="memory"' not in html


def test_truncated_last_line(demo: Path, tmp_path: Path) -> None:
    text = demo.read_text()
    src = tmp_path / "cut.jsonl"
    src.write_text(text + text.splitlines(True)[0][:57])  # a writer killed mid-line
    p = report(src, out=tmp_path / "c.html")
    assert p.returncode == 0, p.stderr
    assert "cut.jsonl:%d: not JSON (no newline: cut short?)" % (len(text.splitlines()) + 1) in p.stderr
    html = (tmp_path / "c.html").read_text()
    assert 'id="coldstart"' in html and "1 line(s) or record(s) skipped" in html


def test_two_cold_starts_of_different_services(demo: Path, gpu: Path, tmp_path: Path) -> None:
    p = report(demo, gpu, out=tmp_path / "two.html")
    assert p.returncode == 0
    html = (tmp_path / "two.html").read_text()
    families = html.split('<div class="family">')[1:]
    assert len(families) >= 2  # one per cold start, whatever helpers the demo grows
    fake = [f for f in families if "fake-gpu-worker (pid %d)" % rd.FAKE_PID in f]
    demo_fam = [f for f in families if "demo_serve.py" in f]
    assert len(fake) == 1 and len(demo_fam) == 1 and fake != demo_fam


@pytest.mark.parametrize("content", ["", "\n\n", "hello world\n", '{"not": "otlp"}\n', "\x00\xff garbage"])
def test_no_otlp_data_is_a_clear_error(tmp_path: Path, content: str) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content.encode("utf-8", "surrogatepass") if content != "\x00\xff garbage" else b"\x00\xff garbage")
    p = report(src, out=tmp_path / "x.html")
    assert p.returncode == 2
    assert "infersight report: no OTLP records in" in p.stderr
    assert not (tmp_path / "x.html").exists()
    assert "the page lists them" not in p.stderr, "no page was written"


def test_unreadable_input_and_unwritable_output(demo: Path, tmp_path: Path) -> None:
    p = report(tmp_path / "missing.jsonl", out=tmp_path / "x.html")
    assert p.returncode == 2 and "cannot read" in p.stderr and "missing.jsonl" in p.stderr
    p = report(tmp_path, out=tmp_path / "x.html")  # a directory
    assert p.returncode == 2 and "cannot read" in p.stderr
    p = report(demo, out=tmp_path / "no" / "such" / "dir" / "x.html")
    assert p.returncode == 2 and "cannot write" in p.stderr
    p2 = run_cli("report", str(tmp_path / "missing.jsonl"))
    assert p2.returncode == 2 and "infersight report: cannot read" in p2.stderr and "Traceback" not in p2.stderr


def test_agent_health_only_gives_a_page_that_says_so(demo: Path, tmp_path: Path) -> None:
    src = tmp_path / "health.jsonl"
    src.write_text("".join(line for line in demo.read_text().splitlines(True) if '"resourceMetrics"' in line))
    p = report(src, out=tmp_path / "h.html")
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "h.html").read_text()
    assert 'id="empty"' in html and "<section" in html and 'id="coldstart"' not in html


def test_bad_records_are_skipped_and_counted() -> None:
    good = traces_request([SpanItem(Resource.of({"process.pid": 1}), "ab" * 16, "cd" * 8, None, "coldstart", 10, 20)])
    bad_span = json.loads(good)
    bad_span["resourceSpans"][0]["scopeSpans"][0]["spans"].append({"name": "x", "startTimeUnixNano": "zz"})
    weird = {"resourceLogs": [{"resource": {}, "scopeLogs": [{"logRecords": [
        {"timeUnixNano": "5", "body": {"kvlistValue": {"values": [{"key": "a", "value": {"intValue": "1"}}]}},
         "attributes": [{"key": "k", "value": {"bytesValue": "AAE="}}]}]}]}]}
    t = parse_lines([json.dumps(bad_span) + "\n", json.dumps(weird) + "\n", "[1, 2]\n"], "f")
    assert [s.span_id for s in t.spans] == ["cd" * 8]
    assert len(t.logs) == 1 and t.logs[0].body == '{"a": 1}'
    assert len(t.skipped) == 2 and "span skipped" in t.skipped[0] and "not an OTLP export request" in t.skipped[1]


# -- cold-start structure -----------------------------------------------------------------------


def _span(pid: int, trace: str, sid: str, parent: str | None, name: str, s: float, e: float,
          **attrs: Any) -> SpanItem:
    res = Resource.of({"service.name": "svc-%d" % pid, "process.pid": pid})
    return SpanItem(res, trace, sid, parent, name, int(s * 1e9), int(e * 1e9), dict(attrs))


def test_child_processes_nest_under_their_parents_stage(tmp_path: Path) -> None:
    tr = "ab" * 16
    spans = [
        _span(10, tr, "01" * 8, None, "coldstart", 100.0, 110.0),
        _span(10, tr, "02" * 8, "01" * 8, "coldstart.warmup", 101.0, 109.0, **{"infersight.stage": "warmup"}),
        _span(11, tr, "03" * 8, "02" * 8, "coldstart", 102.0, 108.0),  # a worker, started during warmup
        _span(11, tr, "04" * 8, "03" * 8, "coldstart.weights_load", 103.0, 104.0,
              **{"infersight.stage": "weights_load"}),
        _span(12, tr, "05" * 8, "04" * 8, "coldstart", 103.5, 103.9, **{"infersight.process.role": "helper"}),
        _span(20, "cd" * 16, "06" * 8, None, "coldstart", 200.0, 201.0),  # another service
    ]
    fams = waterfalls(spans)
    assert [[(w.root.resource.get("process.pid"), w.depth) for w in f.processes] for f in fams] == [
        [(10, 0), (11, 1), (12, 2)], [(20, 0)]]
    assert fams[0].processes[1].parent == "started by pid 10 during warmup"
    assert fams[0].processes[2].helper
    src = tmp_path / "tree.jsonl"
    src.write_text(traces_request(spans) + "\n")
    assert report(src, out=tmp_path / "t.html").returncode == 0
    html = (tmp_path / "t.html").read_text()
    assert html.count('class="proc"') == 4 and 'data-depth="2"' in html and ">helper<" in html
    assert "started by pid 10 during warmup" in html


def test_a_parent_cycle_in_bad_data_does_not_hang() -> None:
    tr = "ab" * 16
    spans = [_span(1, tr, "01" * 8, "02" * 8, "coldstart", 1, 2), _span(2, tr, "02" * 8, "01" * 8, "coldstart", 1, 2)]
    fams = waterfalls(spans)
    assert sum(len(f.processes) for f in fams) == 2


def test_memory_and_oom_from_real_handlers_map_to_one_device() -> None:
    items = rd.gpu_items(time.time_ns())
    lines = encode_lines(items)
    r = build(parse_lines([line + "\n" for line in lines]))
    (chart,) = [c for c in r.memory if c.key == rd.GPU[0]]
    roles = {s.role for s in chart.series}
    assert roles == {"allocated", "reserved", "nvml"}
    assert chart.limit == 80 * rd.GIB
    assert [o.cls for o in chart.ooms] == ["reservation_conflict"]
    assert max(v for s in chart.series if s.role == "allocated" for _, v in s.points) == 18 * rd.GIB
    assert len(r.ooms) == 1 and r.ooms[0].numbers["R"] == 4 * rd.GIB
    assert sum(isinstance(i, LogItem) for i in items) == 3 and any(isinstance(i, MetricItem) for i in items)


def test_chrome_trace_of_the_real_workload(demo: Path) -> None:
    """``infersight show --format chrome-trace`` on the launched demo: what Perfetto opens."""
    p = run_cli("show", "--format", "chrome-trace", str(demo))
    assert p.returncode == 0, p.stderr
    trace = json.loads(p.stdout)
    spans = parse_lines(demo.read_text().splitlines(True)).spans
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["args"]["span_id"] for e in xs) == sorted(s.span_id for s in spans)
    for s in spans:
        (e,) = [e for e in xs if e["args"]["span_id"] == s.span_id]
        assert abs(e["dur"] * 1000 - (s.end_ns - s.start_ns)) < 1
        assert e["pid"] == s.resource.get("process.pid")
    (root,) = [s for s in spans if s.name == "coldstart"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names[root.resource.get("process.pid")].endswith("(pid %s)" % root.resource.get("process.pid"))
    marks = {e["name"] for e in trace["traceEvents"] if e["ph"] == "i"}
    assert {"ready", "first response"} <= marks


def test_output_never_overwrites_an_input(demo: Path, tmp_path: Path) -> None:
    src = tmp_path / "keep.otlp.jsonl"
    shutil.copy(demo, src)
    before = src.read_bytes()
    p = report(src, out=src)
    assert p.returncode == 2 and "is an input" in p.stderr
    assert src.read_bytes() == before


def test_a_link_planted_at_the_temporary_name_is_never_followed(demo: Path, tmp_path: Path) -> None:
    """The page was written to "<page>.tmp-<pid>" opened without O_EXCL: a link planted there for the coming
    pids (another user, in a shared directory) made the report overwrite the link's target, a file of the
    user who ran it."""
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    page = tmp_path / "r.html"
    os.symlink(victim, "%s.tmp-%d" % (page, os.getpid()))  # the name the old code would open
    p = report(demo, out=page)
    assert p.returncode == 0, p.stderr
    assert victim.read_text() == "keep me"
    assert "<html" in page.read_text() and not page.is_symlink()
    assert oct(page.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert sorted(x.name for x in tmp_path.iterdir() if ".tmp-" in x.name) == ["r.html.tmp-%d" % os.getpid()]


def test_a_report_that_writes_no_page_does_not_say_the_page_lists_its_skips(tmp_path: Path) -> None:
    src = tmp_path / "garbage.jsonl"
    src.write_text("not json\n")
    p = report(src, out=tmp_path / "x.html")
    assert p.returncode == 2 and "skipped in all" in p.stderr and "the page" not in p.stderr
    assert not (tmp_path / "x.html").exists()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_flood_of_stages_keeps_the_page_small(tmp_path: Path) -> None:
    tr = "ab" * 16
    spans = [_span(1, tr, "%016x" % 1, None, "coldstart", 0, 3000)] + [
        _span(1, tr, "%016x" % (i + 2), "%016x" % 1, "coldstart.step", i, i + 0.5, **{"infersight.stage": "step",
                                                                                    "infersight.stage.custom": True})
        for i in range(3000)]
    src = tmp_path / "flood.jsonl"
    src.write_text(traces_request(spans) + "\n")
    p = report(src, out=tmp_path / "f.html")
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "f.html").read_text()
    assert "2601 more stages not drawn" in html  # 3000 stages + the root, 400 rows drawn
    assert len(html.encode()) < 1_500_000
