"""The report page (pure): a Report view -> one self-contained HTML document.

Everything is inline: styles, SVG charts; no script, no font, no image is fetched, and a
Content-Security-Policy of ``default-src 'none'`` makes sure of it. A section is written only
when its data is in the files.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from infersight import __version__
from infersight.agent.report.gpu import Devices, MemoryChart, Series
from infersight.agent.report.scan import ColdStartRow
from infersight.agent.report.svg import MAX_ROWS, esc, legend, memory_svg, oom_title, tracks_svg, waterfall_svg
from infersight.agent.report.views import Family, Oom, process_label
from infersight.bytesize import human_bytes
from infersight.weights_files import describe

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"


CSS = """
:root{--bg:#fff;--fg:#1f2328;--muted:#59636e;--grid:#d1d9e0;--rowbg:#f6f8fa;--bar:#0969da;--nested:#54aeff;
--root:#8c959f;--custom:#8250df;--un:#9a6700;--unbg:#fff8c5;--ready:#1a7f37;--resp:#bf3989;--probe:#0550ae;
--oom:#cf222e;--alloc:#0969da;--resv:#8250df;--nvml:#1a7f37;--nvproc:#9a6700;--iv:#d4a72c;--ev:#cf222e;
color-scheme:light dark}
@media screen and (prefers-color-scheme:dark){:root{--bg:#0d1117;--fg:#e6edf3;--muted:#9198a1;--grid:#30363d;
--rowbg:#151b23;--bar:#4493f8;--nested:#80ccff;--root:#656c76;--custom:#ab7df8;--un:#d29922;--unbg:#3b2e00;
--ready:#3fb950;--resp:#f778ba;--probe:#79c0ff;--oom:#f85149;--alloc:#4493f8;--resv:#ab7df8;--nvml:#3fb950;
--nvproc:#d29922;--iv:#bb8009;--ev:#f85149}}
@media print{:root{--fg:#000;--muted:#444;--grid:#ccc;--rowbg:#fff}
body{margin:0;font-size:9pt;max-width:none}nav{display:none}.proc,.chartbox,tr{break-inside:avoid}
h2,h3{break-after:avoid}svg.chart{max-width:100%}}
body{background:var(--bg);color:var(--fg);font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,
"Helvetica Neue",Arial,sans-serif;margin:24px auto;max-width:1240px;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;border-bottom:1px solid var(--grid);padding-bottom:4px;
margin-top:28px}h3{font-size:15px;margin:18px 0 2px}.muted,.meta{color:var(--muted)}
nav a{margin-right:12px;color:var(--bar)}code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}
.summary{margin:2px 0 6px}.tag{font-size:11px;border:1px solid var(--grid);border-radius:10px;padding:0 6px;
margin-left:6px;color:var(--muted)}
svg.chart{display:block;width:100%;height:auto;font:11px system-ui,-apple-system,"Segoe UI",Roboto,Arial,
sans-serif}
svg text{fill:var(--fg)}svg .tick,svg .colhead,svg .axis-label{fill:var(--muted)}
svg .grid{stroke:var(--grid);stroke-width:1}
svg .rowbg{fill:transparent}svg .row:hover .rowbg{fill:var(--rowbg)}
svg .bar{fill:var(--bar)}svg .row.root .bar{fill:var(--root);opacity:.45}
svg .row.custom .bar{fill:var(--custom)}svg .row[data-depth="2"] .bar,svg .row[data-depth="3"] .bar,
svg .row[data-depth="4"] .bar{fill:var(--nested)}
svg .hatch-bg{fill:var(--unbg)}svg .hatch-line{stroke:var(--un);stroke-width:2}
svg .row.unattributed .bar,svg .gap{stroke:var(--un);stroke-width:1}
svg .dur,svg .share{font-variant-numeric:tabular-nums}svg .info{fill:var(--muted)}
svg .mark line{stroke-width:1.5;stroke-dasharray:4 3}svg .mark text{font-size:10px;font-weight:600}
svg .mark.ready line{stroke:var(--ready)}svg .mark.ready text{fill:var(--ready)}
svg .mark.first-response line{stroke:var(--resp)}svg .mark.first-response text{fill:var(--resp)}
svg .mark.probe line{stroke:var(--probe)}svg .mark.probe text{fill:var(--probe)}
svg .series polyline{fill:none;stroke-width:2}svg .series.allocated polyline{stroke:var(--alloc)}
svg .series.reserved polyline{stroke:var(--resv);stroke-dasharray:6 3}svg .series.nvml polyline{stroke:var(--nvml)}
svg .series.nvml_proc polyline{stroke:var(--nvproc);stroke-dasharray:2 2}
svg .limit line{stroke:var(--muted);stroke-dasharray:8 4}
svg .oom-mark line{stroke:var(--oom);stroke-width:2}
svg .oom-mark path{fill:var(--oom)}svg .oom-mark text{fill:var(--oom);font-weight:700}
svg .ev-mark path{fill:var(--iv)}svg .iv{fill:var(--iv);opacity:.8}svg .ev path{fill:var(--ev)}
.legend{margin:0 0 4px;font-size:12px}.legend .key{margin-right:14px;white-space:nowrap}
.legend i{display:inline-block;width:18px;height:3px;vertical-align:middle;margin-right:5px;background:var(--fg)}
.legend .allocated i{background:var(--alloc)}.legend .reserved i{background:var(--resv)}
.legend .nvml i{background:var(--nvml)}.legend .nvml_proc i{background:var(--nvproc)}
.legend .oom i{background:var(--oom)}.legend .alloc-ev i{background:var(--iv)}
.legend .ready i{background:var(--ready)}.legend .first-response i{background:var(--resp)}
.legend .unattributed i{background:var(--un)}.legend .bar i{background:var(--bar)}
table{border-collapse:collapse;width:100%;font-size:13px;margin:6px 0}
th,td{border-bottom:1px solid var(--grid);padding:4px 6px;text-align:left;vertical-align:top}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.verdict-slow{color:var(--oom);font-weight:600}.cls{font-weight:600}
footer{margin-top:28px;color:var(--muted);font-size:12px}
"""


# The page's bounds: past them it summarises instead of drawing everything (30k cold starts
# made a 168 MB page). Stated on the page and in docs/report.md.
MAX_WATERFALLS = 50  # cold starts drawn: the slowest ones
MAX_LISTED = 200  # cold starts listed in the table of the slowest; "M more" for the rest
MAX_OOM_ROWS = 200  # OOMs in the table, the first ones in time; "M more" for the rest
MAX_MEMORY_CHARTS = 32  # devices with a memory chart, the highest peaks first
MAX_SERIES = 16  # lines in one memory chart, the highest peaks first


@dataclass(slots=True)
class Report:
    """Everything the page shows; an empty list is a section left out."""

    families: list[Family]  # the cold starts drawn (all of them up to MAX_WATERFALLS), oldest first
    memory: list[MemoryChart]
    devices: Devices
    ooms: list[Oom]  # the first ones in time (MAX_OOM_ROWS, and those marked on each chart)
    t0_ns: int  # the earliest record: times on the page are seconds since this
    t1_ns: int
    counts: dict[str, int]
    skipped: list[str]  # the first scan.MAX_SKIPPED notes
    slowest: list[ColdStartRow] = field(default_factory=list)  # slowest first, up to MAX_LISTED
    coldstart_count: int = 0  # every cold start (family) in the files
    oom_count: int = 0  # every OOM in the files
    skipped_count: int = 0  # every line or record skipped


def _fmt_s(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else "%.*f s" % (digits, v)


def _slowest_table(r: Report) -> str:
    """The bound's summary: the slowest cold starts in numbers, and how many more there are."""
    rows = "".join(
        '<tr class="slow-row"><td class="num">%d</td><td>%s</td><td class="num">%.3f s</td>'
        '<td class="num">%.3f s</td><td class="num">%s</td><td class="num">%d</td></tr>' % (
            n, esc(f.top.label), (f.t0_ns - r.t0_ns) / 1e9, f.top.total_s, esc(_fmt_s(f.top.ready_s)), f.processes)
        for n, f in enumerate(r.slowest[:MAX_LISTED], 1))
    more = r.coldstart_count - MAX_LISTED
    return ('<p class="bound">%d cold starts: this page draws the %d slowest and lists the %d slowest below '
            "(bounds of the page; <code>infersight show --format json</code> has them all).</p>"
            '<table class="slowest"><tr><th class="num">#</th><th>process</th><th class="num">start</th>'
            '<th class="num">total</th><th class="num">ready</th><th class="num">processes</th></tr>%s</table>%s' % (
                r.coldstart_count, MAX_WATERFALLS, min(MAX_LISTED, r.coldstart_count), rows,
                '<p class="more">%d more cold starts not listed.</p>' % more if more > 0 else ""))


def _coldstart(r: Report) -> str:
    out = ['<section id="coldstart"><h2>Cold start</h2>',
           legend([("bar", "stage"), ("unattributed", "unattributed (no stage)"), ("ready", "ready"),
                   ("first-response", "first response")]),
           '<p class="muted">Bars share one time axis per cold start; nested stages are indented, and processes '
           "started under another nest below it. Hover a bar for its attributes.</p>"]
    if r.coldstart_count > MAX_WATERFALLS:
        out.append(_slowest_table(r))
    families = r.families[:MAX_WATERFALLS]  # page.build_from draws the slowest ones, oldest first
    uid = 0
    for fam in families:
        out.append('<div class="family">')
        for wf in fam.processes:
            uid += 1
            sm = wf.summary
            pid = wf.root.resource.get("process.pid")
            parts = ["total %.3f s" % sm.total_s]
            if sm.ready_s is not None:
                parts.append("ready after %.3f s" % sm.ready_s)
            if sm.workers:
                parts.append(sm.workers)
            if sm.biggest:
                parts.append("biggest: " + ", ".join("%s %.3f s" % (n, d) for n, d in sm.biggest))
            parts.append("unattributed %.3f s (%.1f%%)" % (sm.unattributed_s, 100 * sm.unattributed_share))
            tags = ('<span class="tag">helper</span>' if wf.helper else "") + (
                '<span class="tag">%s</span>' % esc(wf.parent) if wf.parent else "")
            out.append('<div class="proc" data-pid="%s" data-depth="%d">' % (esc(pid if pid is not None else ""),
                                                                            wf.depth))
            out.append('<h3 style="margin-left:%dpx">%s%s</h3>' % (16 * wf.depth, esc(process_label(wf.root)), tags))
            cmd = wf.root.resource.get("process.command") or wf.root.resource.get("process.executable.name")
            out.append('<p class="summary" style="margin-left:%dpx">%s%s</p>' % (
                16 * wf.depth, esc(" · ".join(parts)), (' <span class="muted">(%s)</span>' % esc(cmd)) if cmd else ""))
            out.append(waterfall_svg(wf, fam, "w%d" % uid))
            if wf.foreign:
                out.append('<p class="muted foreign" style="margin-left:%dpx">%d span%s of another user\'s process '
                           "claimed this trace; left out.</p>" % (16 * wf.depth, wf.foreign,
                                                                  "" if wf.foreign == 1 else "s"))
            if sm.weights_files:
                out.append('<ul class="weights" style="margin-left:%dpx">%s</ul>' % (16 * wf.depth, "".join(
                    "<li>weights file %s</li>" % esc(describe(f)) for f in sm.weights_files)))
            if len(wf.rows) > MAX_ROWS:
                out.append('<p class="muted">%d more stages not drawn; <code>infersight show --format json</code> '
                           "lists them all.</p>" % (len(wf.rows) - MAX_ROWS))
            out.append("</div>")
        out.append("</div>")
    out.append("</section>")
    return "".join(out)


def _memory(r: Report) -> str:
    out = ['<section id="memory"><h2>Memory</h2>']
    spans = [c.span_ns() for c in r.memory]
    t0, t1 = min(a for a, _ in spans), max(b for _, b in spans)
    charts = r.memory
    if len(charts) > MAX_MEMORY_CHARTS:
        keep = {id(c) for c in sorted(charts, key=_peak, reverse=True)[:MAX_MEMORY_CHARTS]}
        out.append('<p class="bound">%d devices: the %d with the highest peaks are drawn, %d more are not '
                   "(a bound of the page).</p>" % (len(charts), MAX_MEMORY_CHARTS, len(charts) - MAX_MEMORY_CHARTS))
        charts = [c for c in charts if id(c) in keep]
    for chart in charts:
        c = chart
        if len(c.series) > MAX_SERIES:
            n = len(c.series)
            c = dataclasses.replace(c, series=sorted(c.series, key=_series_peak, reverse=True)[:MAX_SERIES])
            out.append('<p class="bound">%s: %d lines, the %d with the highest peaks are drawn (a bound of the '
                       "page).</p>" % (esc(c.title), n, MAX_SERIES))
        if len(c.ooms) > MAX_OOM_ROWS or len(c.events) > MAX_OOM_ROWS:  # marks: as many as the OOM table
            c = dataclasses.replace(c, ooms=c.ooms[:MAX_OOM_ROWS], events=c.events[:MAX_OOM_ROWS])
        items = [(s.role, s.label) for s in c.series]
        if c.ooms:
            items.append(("oom", "OOM"))
        if c.events:
            items.append(("alloc-ev", "large allocation / retry"))
        out.append('<div class="chartbox" data-device="%s"><h3>%s</h3>' % (esc(c.key), esc(c.title)))
        out.append(legend(items))
        out.append(memory_svg(c, t0, t1, r.t0_ns))
        if c.events:
            big = sorted(c.events, key=lambda e: e.t_ns)[:50]
            out.append('<table class="allocs"><tr><th class="num">time</th><th>event</th></tr>%s</table>' % "".join(
                '<tr><td class="num">%.3f s</td><td>%s</td></tr>' % ((e.t_ns - r.t0_ns) / 1e9, esc(e.title))
                for e in big))
        out.append("</div>")
    out.append("</section>")
    return "".join(out)


def _series_peak(s: Series) -> float:
    return max((v for _, v in s.points), default=0.0)


def _peak(c: MemoryChart) -> float:
    return max((_series_peak(s) for s in c.series), default=0.0)


def _devices(r: Report) -> str:
    d = r.devices
    out = ['<section id="devices"><h2>Devices</h2>']
    if d.rows:
        out.append('<table class="device-table"><tr><th>device</th><th>model</th><th>class</th>'
                   '<th class="num">requests</th><th class="num">P50</th><th class="num">P99</th>'
                   '<th class="num">coefficient vs peers</th><th>verdict</th><th>cause</th></tr>')
        users = len({row.user for row in d.rows}) > 1  # several users' series: say whose each row is
        for row in d.rows:
            src = " (from histogram buckets)" if row.source == "histogram" else ""
            model = esc(row.model) + ("<br><small>uid %s</small>" % esc(row.user or "?") if users else "")
            out.append(
                '<tr class="device-row" data-device="%s"><td>%s<br><code>%s</code></td><td>%s</td><td>%s</td>'
                '<td class="num">%s</td><td class="num" title="%s">%s</td><td class="num" title="%s">%s</td>'
                '<td class="num">%s</td><td class="verdict-%s" title="%s">%s</td><td>%s</td></tr>' % (
                    esc(row.device), esc(row.name), esc(row.device), model, esc(row.request_class),
                    row.count if row.count is not None else "-", esc(src), _fmt_s(row.p50_s, 4), esc(src),
                    _fmt_s(row.p99_s, 4), "-" if row.coefficient is None else "%.2f" % row.coefficient,
                    esc(row.verdict), esc(row.detail), esc(row.verdict or "-"), esc(row.cause or "-")))
        out.append("</table>")
    t0 = min((tl.t0_ns for tl in d.timelines), default=r.t0_ns)
    t1 = max((tl.t1_ns for tl in d.timelines), default=r.t1_ns)
    for tl in d.timelines:
        out.append('<div class="chartbox" data-device="%s"><h3>%s</h3>' % (esc(tl.key), esc(tl.title)))
        if tl.tracks:
            out.append(tracks_svg(tl, t0, t1, r.t0_ns))
        else:
            out.append('<p class="muted">No throttling, PCIe, ECC or device events recorded.</p>')
        out.append("</div>")
    out.append("</section>")
    return "".join(out)


def _ooms(r: Report) -> str:
    out = ['<section id="ooms"><h2>OOMs</h2><table class="oom-table"><tr><th class="num">#</th>'
           '<th class="num">time</th><th>process</th><th>device</th><th>class</th><th>rule</th>',
           "".join('<th class="num">%s</th>' % k for k in ("R", "T", "F", "A", "P", "U", "O", "L")),
           "<th>remedy</th></tr>"]
    for n, o in enumerate(r.ooms[:MAX_OOM_ROWS], 1):
        out.append(_oom_row(n, o, r.t0_ns))
    if r.oom_count > MAX_OOM_ROWS:
        out.append('<tr class="more"><td colspan="15">%d more OOMs not listed (the page lists the first %d).</td>'
                   "</tr>" % (r.oom_count - MAX_OOM_ROWS, MAX_OOM_ROWS))
    out.append('</table><p class="muted">R requested, T device total, F free, A allocated, P reserved by PyTorch, '
               "U this process's use, O other processes, L the per-process cap.</p></section>")
    return "".join(out)


def _oom_row(n: int, o: Oom, t0: int) -> str:
    nums = "".join('<td class="num">%s</td>' % (esc(human_bytes(v)) if v is not None else "-")
                   for v in o.numbers.values())
    remedy = esc(o.remedy) + ('<br><span class="muted">%s</span>' % esc(o.note) if o.note else "")
    return ('<tr class="oom-row" title="%s"><td class="num">%d</td><td class="num">%.3f s</td><td>%s</td>'
            '<td>%s</td><td class="cls">%s</td><td><code>%s</code></td>%s<td>%s</td></tr>' % (
                esc(oom_title(o)), n, (o.log.time_ns - t0) / 1e9, esc(process_label(o.log)),
                esc(o.device or o.hw_id or "-"), esc(o.cls), esc(o.rule), nums, remedy))


def _utc(t_ns: int) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t_ns / 1e9)) if t_ns else "-"
    except (OverflowError, ValueError, OSError):
        return "%d ns" % t_ns


def render(r: Report, sources: list[str]) -> str:
    sections: list[tuple[str, str, str]] = []
    if r.families:
        sections.append(("coldstart", "Cold start", _coldstart(r)))
    if r.memory:
        sections.append(("memory", "Memory", _memory(r)))
    if r.devices.rows or r.devices.timelines:
        sections.append(("devices", "Devices", _devices(r)))
    if r.ooms:
        sections.append(("ooms", "OOMs", _ooms(r)))
    start = _utc(r.t0_ns)
    head = ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            '<meta http-equiv="Content-Security-Policy" content="%s">'
            '<meta name="viewport" content="width=device-width,initial-scale=1">'
            '<meta name="generator" content="infersight %s"><title>infersight report: %s</title>'
            "<style>%s</style></head><body>" % (esc(CSP), esc(__version__), esc(", ".join(sources)), CSS))
    body = ['<header><h1>infersight report</h1><p class="meta">%s · starts %s · %s</p>' % (
        esc(", ".join(sources)), esc(start), esc(", ".join("%d %s" % (v, k) for k, v in r.counts.items())))]
    if sections:
        body.append("<nav>%s</nav>" % "".join('<a href="#%s">%s</a>' % (i, t) for i, t, _ in sections))
    body.append("</header>")
    body += [html for _, _, html in sections]
    if not sections:
        body.append('<section id="empty"><h2>Nothing to draw</h2><p>These files hold no cold start, memory, '
                    "device or OOM data (only the agent's own telemetry, or records of other kinds).</p></section>")
    foot = ['<footer><p>Written by infersight %s. Times are seconds since %s.</p>' % (esc(__version__), esc(start))]
    if r.skipped:
        foot.append('<p class="skipped">%d line(s) or record(s) skipped:</p><ul>%s</ul>' % (
            r.skipped_count, "".join("<li><code>%s</code></li>" % esc(s[:300]) for s in r.skipped[:20])))
    foot.append("</footer>")
    return head + "".join(body) + "".join(foot) + "</body></html>\n"
