"""Inline SVG for the report (pure): waterfalls, line charts and event tracks.

Every chart is a fixed-width ``viewBox`` scaled to the page, styled by classes that the page's
CSS colours for light, dark and print. Hover text is an SVG ``<title>``: no script runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape

from infersight.agent.report.gpu import DeviceTimeline, MemoryChart
from infersight.agent.report.views import Family, Oom, ProcessWaterfall, weights_note
from infersight.bytesize import human_bytes
from infersight.coldstart_stages import gap_frames, started_in_note
from infersight.hooks import _contract
from infersight.sanitize import clean_text
from infersight.telemetry import AttrValue, SpanItem

W = 1200
NAME_X, BAR_X0, BAR_X1 = 6, 230, 760
DUR_X, SHARE_X, INFO_X = 835, 890, 905
ROW_H, AXIS_H = 20, 22
MAX_POINTS = 1500  # per series; denser series keep each bucket's maximum
MAX_TITLE = 2000
MAX_ROWS = 400  # per process: a real cold start has tens of stages; the page must stay small
MAX_TICKS = 40  # an axis never draws more (a value of 1e308 must not draw for ever)


def esc(v: object) -> str:
    """HTML text: escaped, and no control character (a raw NUL or ESC from a file name or a
    record is shown as U+FFFD, never written into the page)."""
    return escape(clean_text(str(v), 1 << 30), quote=True)


def fmt_attr(v: AttrValue) -> str:
    if isinstance(v, float):
        return "%.6g" % v
    if isinstance(v, list):
        return ", ".join(str(x) for x in v)
    return str(v)


def span_title(s: SpanItem, extra: Sequence[str] = ()) -> str:
    """The hover text: name, timing and every attribute (known or not)."""
    lines = ["%s  %.3f s" % (s.name, (s.end_ns - s.start_ns) / 1e9), *extra]
    lines += ["%s = %s" % (k, fmt_attr(v)) for k, v in sorted(s.attributes.items())]
    if s.error:
        lines.append("error: %s" % s.error)
    for e in s.events[:20]:
        lines.append("event %s @ +%.3f s" % (e.name, (e.time_ns - s.start_ns) / 1e9))
    text = "\n".join(lines)
    return text if len(text) <= MAX_TITLE else text[:MAX_TITLE] + "..."


def nice_step(span: float, target: int = 8) -> float:
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return float(m * mag)
    return float(10 * mag)


def fmt_s(x: float, step: float) -> str:
    digits = max(0, min(6, -math.floor(math.log10(step)))) if step > 0 else 0
    return "%.*f s" % (digits, x)


class Scale:
    """Nanoseconds -> x between x0 and x1."""

    def __init__(self, t0: int, t1: int, x0: float, x1: float) -> None:
        if t1 - t0 < 1_000_000:  # one instant (a single sample): show a second around it
            t0, t1 = t0 - 500_000_000, t1 + 500_000_000
        self.t0, self.t1, self.x0, self.x1 = t0, t1, x0, x1

    def __call__(self, t: int) -> float:
        return self.x0 + (self.x1 - self.x0) * (t - self.t0) / (self.t1 - self.t0)


def _time_axis(sc: Scale, y: float, height: float, origin_ns: int) -> list[str]:
    """Tick lines over ``height`` and labels in seconds since ``origin_ns``."""
    a, b = (sc.t0 - origin_ns) / 1e9, (sc.t1 - origin_ns) / 1e9
    step = nice_step(b - a)
    out = ['<g class="axis">']
    k = math.ceil(a / step - 1e-9)
    for _ in range(MAX_TICKS):
        if k * step > b + 1e-9:
            break
        t = k * step
        x = sc(origin_ns + int(t * 1e9))
        out.append('<line class="grid" x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f"/>' % (x, y, x, y + height))
        out.append('<text class="tick" x="%.1f" y="%.1f" text-anchor="middle">%s</text>' % (x, y - 6, fmt_s(t, step)))
        k += 1
    out.append("</g>")
    return out


# -- waterfall ----------------------------------------------------------------------------


def waterfall_svg(wf: ProcessWaterfall, fam: Family, uid: str) -> str:
    rows = wf.rows[:MAX_ROWS]
    height = AXIS_H + ROW_H * len(rows) + 8 + 12 * max(len(wf.marks), 1)
    sc = Scale(fam.t0_ns, fam.t1_ns, BAR_X0, BAR_X1)
    total = max(wf.root.end_ns - wf.root.start_ns, 1)
    at_ready = wf.root.attributes.get(_contract.ENDED_BY) == "ready"
    indent = 12 * wf.depth
    out = [
        '<svg class="chart wf" viewBox="0 0 %d %d" width="100%%" role="img" aria-label="%s" '
        'xmlns="http://www.w3.org/2000/svg">' % (W, height, esc("cold-start waterfall of pid %s" % (
            wf.root.resource.get("process.pid") or "?"))),
        '<defs><pattern id="hatch-%s" class="hatch" patternUnits="userSpaceOnUse" width="6" height="6" '
        'patternTransform="rotate(45)"><rect class="hatch-bg" width="6" height="6"/>'
        '<line class="hatch-line" x1="0" y1="0" x2="0" y2="6"/></pattern></defs>' % uid,
        '<text class="colhead" x="%d" y="14">stage</text>' % NAME_X,
        '<text class="colhead" x="%d" y="14" text-anchor="end">duration</text>' % DUR_X,
        '<text class="colhead" x="%d" y="14" text-anchor="end">share</text>' % SHARE_X,
        '<text class="colhead" x="%d" y="14">weights / notes</text>' % INFO_X,
    ]
    out += _time_axis(sc, AXIS_H, ROW_H * len(rows), fam.t0_ns)
    for i, row in enumerate(rows):
        s = row.span
        y = AXIS_H + i * ROW_H
        x0, x1 = sc(s.start_ns), sc(s.end_ns)
        dur = (s.end_ns - s.start_ns) / 1e9
        info = weights_note(s)
        extra: list[str] = []
        if row.kind == "unattributed":
            frames, instead = gap_frames(s.attributes)
            info = "top: " + ", ".join(frames[:3]) if frames else "no stage covers this (%s)" % instead
            extra = ["sampled top frames:", *("  %s" % f for f in frames)] if frames else [instead]
        elif row.kind == "custom":
            info = info or "custom stage"
        elif row.kind == "root":
            info = "%s%s" % (wf.root.resource.get("service.name") or "", " (helper)" if wf.helper else "")
        if row.kind != "root":  # a task's stage, after the stage that made it
            info = "; ".join(x for x in (info, started_in_note([s])) if x)
        after = at_ready and row.kind != "root" and s.start_ns >= wf.root.end_ns  # the wait for traffic is before it
        if after and row.depth == 1:
            info = "after %.3f s waiting for traffic (in no total)%s" % (
                (s.start_ns - wf.root.end_ns) / 1e9, "; " + info if info else "")
        out.append('<g class="row %s" data-stage="%s" data-span-id="%s" data-depth="%d">' % (
            row.kind, esc(row.label), esc(s.span_id), row.depth))
        out.append("<title>%s</title>" % esc(span_title(s, extra)))
        out.append('<rect class="rowbg" x="0" y="%d" width="%d" height="%d"/>' % (y, W, ROW_H))
        out.append('<text class="name" x="%d" y="%d">%s</text>' % (
            NAME_X + indent + 12 * row.depth, y + 14, esc(row.label + ("*" if row.kind == "custom" else ""))))
        fill = ' style="fill:url(#hatch-%s)"' % uid if row.kind == "unattributed" else ""  # beats the CSS fill
        out.append('<rect class="bar" x="%.1f" y="%d" width="%.1f" height="%d" rx="2"%s/>' % (
            x0, y + 4, max(x1 - x0, 1.5), ROW_H - 8, fill))
        out.append('<text class="dur" x="%d" y="%d" text-anchor="end">%.3f s</text>' % (DUR_X, y + 14, dur))
        out.append('<text class="share" x="%d" y="%d" text-anchor="end">%s</text>' % (
            SHARE_X, y + 14, "-" if after else "%.1f%%" % (100.0 * (s.end_ns - s.start_ns) / total)))
        if info:
            out.append('<text class="info" x="%d" y="%d">%s</text>' % (
                INFO_X, y + 14, esc(info if len(info) <= 48 else info[:47] + "…")))
        for e in s.events:  # an OOM inside this stage: the verdict on hover
            if e.name == "infersight.oom":
                ea = e.attributes
                out.append('<g class="oom-mark stage-oom"><title>%s</title><path d="M%.1f %d l5 6 l-5 6 l-5 -6 z"/>'
                           "</g>" % (esc("OOM: %s (rule %s)\n%s" % (
                               ea.get("infersight.oom.class"), ea.get("infersight.oom.rule"),
                               ea.get("infersight.oom.remedy"))), sc(e.time_ns), y + 4))
        out.append("</g>")
    y_root = AXIS_H
    sampled = [r.span for r in rows if r.kind == "unattributed"]
    for a, b in wf.gaps:
        text = "unattributed %.3f s (+%.3f s to +%.3f s): no stage covers it" % (
            (b - a) / 1e9, (a - wf.root.start_ns) / 1e9, (b - wf.root.start_ns) / 1e9)
        for u in sampled:  # the stack sampler's view of this stretch, where it ran
            if u.start_ns < b and u.end_ns > a:
                frames, instead = gap_frames(u.attributes)
                text += "\nsampled top frames: %s" % (", ".join(frames) or instead)
        out.append('<rect class="gap" x="%.1f" y="%d" width="%.1f" height="%d" fill="url(#hatch-%s)">'
                   "<title>%s</title></rect>" % (sc(a), y_root + 3, max(sc(b) - sc(a), 1.0), ROW_H - 6, uid, esc(text)))
    bottom = AXIS_H + ROW_H * len(rows)
    for i, m in enumerate(wf.marks):  # labels on their own lines: marks are often close together
        x = sc(m.t_ns)
        cls = m.label.replace(" ", "-")
        anchor = "end" if x > BAR_X1 - 80 else "start"
        out.append('<g class="mark %s"><title>%s</title><line x1="%.1f" y1="%d" x2="%.1f" y2="%d"/>'
                   '<text x="%.1f" y="%d" text-anchor="%s">%s</text></g>' % (
                       esc(cls), esc(m.title), x, AXIS_H, x, bottom + 4 + 12 * i, x + (-3 if anchor == "end" else 3),
                       bottom + 13 + 12 * i, anchor, esc(m.label)))
    out.append("</svg>")
    return "".join(out)


# -- time series --------------------------------------------------------------------------


def decimate(points: list[tuple[int, float]], limit: int = MAX_POINTS) -> list[tuple[int, float]]:
    """At most ``limit`` points; each dropped run keeps its maximum (peaks are what matter)."""
    if len(points) <= limit:
        return points
    k = math.ceil(len(points) / limit)
    return [max(points[i:i + k], key=lambda p: p[1]) for i in range(0, len(points), k)]


PLOT_X0, PLOT_X1 = 80, 1180


def memory_svg(c: MemoryChart, t0: int, t1: int, origin_ns: int) -> str:
    height, top, bottom = 250, 24, 210
    values = [v for s in c.series for _, v in s.points] + ([c.limit] if c.limit is not None else [])
    values += [n for o in c.ooms for n in (o.numbers.get("T"),) if n is not None and c.limit is None]
    vmax = max([*(v for v in values if math.isfinite(v)), 1.0])
    unit = 1024.0 ** min(4, max(0, int(math.log(vmax, 1024))))  # steps of whole MiB/GiB, not of 10^9
    step = nice_step(vmax / unit, 5) * unit
    vtop = math.ceil(vmax / step) * step
    if not math.isfinite(vtop):  # near the largest float: the top tick is the maximum itself
        vtop = step = vmax

    def y(v: float) -> float:
        return bottom - (bottom - top) * (v / vtop)

    sc = Scale(t0, t1, PLOT_X0, PLOT_X1)
    out = ['<svg class="chart mem" viewBox="0 0 %d %d" width="100%%" role="img" aria-label="%s" '
           'xmlns="http://www.w3.org/2000/svg">' % (W, height, esc("memory of " + c.title))]
    out += _time_axis(sc, top, bottom - top, origin_ns)
    for k in range(MAX_TICKS):
        if k * step > vtop * (1 + 1e-9):
            break
        yy = y(k * step)
        out.append('<line class="grid" x1="%d" y1="%.1f" x2="%d" y2="%.1f"/>' % (PLOT_X0, yy, PLOT_X1, yy))
        out.append('<text class="tick" x="%d" y="%.1f" text-anchor="end">%s</text>' % (
            PLOT_X0 - 6, yy + 4, esc(human_bytes(k * step))))
    if c.limit is not None:
        out.append('<g class="limit"><title>device memory %s</title><line x1="%d" y1="%.1f" x2="%d" y2="%.1f"/>'
                   '</g>' % (esc(human_bytes(c.limit)), PLOT_X0, y(c.limit), PLOT_X1, y(c.limit)))
    for i, s in enumerate(c.series):
        pts = decimate(s.points)
        if not pts:
            continue
        path: list[str] = []
        for j, (t, v) in enumerate(pts):  # a step line: a gauge holds its value until the next sample
            if j:
                path.append("%.1f,%.1f" % (sc(t), y(pts[j - 1][1])))
            path.append("%.1f,%.1f" % (sc(t), y(v)))
        peak = max(v for _, v in s.points)
        out.append('<g class="series %s s%d" data-series="%s"><title>%s: %d points, peak %s</title>'
                   '<polyline points="%s"/></g>' % (
                       esc(s.role), i, esc(s.label), esc(s.label), len(s.points), esc(human_bytes(peak)),
                       " ".join(path)))
    for n, o in enumerate(c.ooms, 1):
        x = sc(o.log.time_ns)
        out.append('<g class="oom-mark"><title>%s</title><line x1="%.1f" y1="%d" x2="%.1f" y2="%d"/>'
                   '<text x="%.1f" y="%d" text-anchor="end">OOM %d</text></g>' % (
                       esc(oom_title(o)), x, top, x, bottom, x - 4, top + 12, n))
    for e in c.events:
        x = sc(e.t_ns)
        out.append('<g class="ev-mark"><title>%s</title><path d="M%.1f %d l5 9 h-10 z"/></g>' % (
            esc(e.title), x, bottom + 2))
    out.append('<text class="axis-label" x="%d" y="%d" text-anchor="end">seconds since start of report</text>' % (
        PLOT_X1, height - 8))
    out.append("</svg>")
    return "".join(out)


def oom_title(o: Oom) -> str:
    nums = ", ".join("%s=%s" % (k, human_bytes(v)) for k, v in o.numbers.items() if v is not None)
    lines = ["OOM on %s: %s (rule %s)" % (o.device or o.hw_id or "?", o.cls, o.rule), nums, "remedy: " + o.remedy]
    if o.note:
        lines.append("note: " + o.note)
    return "\n".join(x for x in lines if x)


def tracks_svg(d: DeviceTimeline, t0: int, t1: int, origin_ns: int) -> str:
    n = max(len(d.tracks), 1)
    top = 24
    height = top + 22 * n + 16
    sc = Scale(t0, t1, PLOT_X0 + 120, PLOT_X1)
    out = ['<svg class="chart dev" viewBox="0 0 %d %d" width="100%%" role="img" aria-label="%s" '
           'xmlns="http://www.w3.org/2000/svg">' % (W, height, esc("device events of " + d.title))]
    out += _time_axis(sc, top, 22 * n, origin_ns)
    for i, tr in enumerate(d.tracks):
        y = top + 22 * i
        out.append('<g class="track" data-track="%s"><text class="name" x="%d" y="%d">%s</text>' % (
            esc(tr.label), NAME_X, y + 15, esc(tr.label[:30])))
        for iv in tr.intervals:
            out.append('<rect class="iv" x="%.1f" y="%d" width="%.1f" height="14"><title>%s</title></rect>' % (
                sc(iv.start_ns), y + 4, max(sc(iv.end_ns) - sc(iv.start_ns), 2.0), esc("%s (%.3f s)" % (
                    iv.title, (iv.end_ns - iv.start_ns) / 1e9))))
        for e in tr.events:
            x = sc(e.t_ns)
            out.append('<g class="ev"><title>%s</title><path d="M%.1f %d l6 7 l-6 7 l-6 -7 z"/></g>' % (
                esc(e.title), x, y + 4))
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def legend(items: Sequence[tuple[str, str]], swatch: Callable[[str], str] = lambda c: c) -> str:
    return '<p class="legend">%s</p>' % " ".join(
        '<span class="key %s"><i></i>%s</span>' % (esc(swatch(cls)), esc(label)) for cls, label in items)

