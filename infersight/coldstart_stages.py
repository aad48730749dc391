"""Reading a finished cold start (a :class:`~infersight.telemetry.ColdStart`) by stage (pure).

The stage a span stands for, the seconds each stage took within the root, what ended the
cold start, and the interval union these rest on. The daemon's cold-start metrics, the MQTT
payloads and the console waterfall all read cold starts this one way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from infersight.hooks import _contract
from infersight.telemetry import AttrValue, ColdStart, SpanItem

# The names the hooks set, as their contract defines them.
STAGE = _contract.STAGE
ENDED_BY = _contract.ENDED_BY
UNATTRIBUTED = _contract.UNATTRIBUTED
FIRST_REQUEST = _contract.FIRST_REQUEST
TOP = _contract.UNATTRIBUTED_TOP
SAMPLES = _contract.UNATTRIBUTED_SAMPLES
MIN_TOP_SAMPLES = _contract.MIN_GAP_SAMPLES
TOTAL = "total"
WORKERS = _contract.WORKERS  # a supervisor's workers that reported, and of those the ones ever ready
WORKERS_READY = _contract.WORKERS_READY


def union_ns(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Length of the union of intervals clipped to [lo, hi]."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total


def as_number(v: AttrValue | None) -> float | None:
    """A numeric attribute as a float; None for anything else (booleans included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def stage_name(s: SpanItem) -> str | None:
    """``infersight.stage``, else the name after ``coldstart.``; None for other spans."""
    v = s.attributes.get(STAGE)
    if isinstance(v, str) and v:
        return v
    if s.name.startswith("coldstart.") and len(s.name) > len("coldstart."):
        return s.name[len("coldstart."):]
    return None


def stage_durations(cs: ColdStart) -> dict[str, float]:
    """Seconds per stage of one cold start, plus ``unattributed`` and ``total``.

    A stage's value is the time within the root during which at least one of its spans was
    open: spans of one stage that nest or run in parallel (two shard loads on two threads)
    count once; sequential ones add up. Different stages may nest (``graph_compile`` inside
    ``warmup``), so stage values can sum to more than ``total``. ``unattributed`` is the
    root's ``infersight.coldstart.unattributed_s`` (the sampler's ``coldstart.unattributed``
    spans explain that time and are not counted again).

    A root that ended at readiness is followed by the wait for traffic, in no stage, and by
    ``first_request``, measured from the request's arrival: the stages' window runs to its end
    (what nests in it counts too), ``total`` is the root's.
    """
    root = cs.root
    spans: dict[str, list[tuple[int, int]]] = {}
    for s in cs.stages:
        name = stage_name(s)
        if name is not None and name not in (UNATTRIBUTED, TOTAL):
            spans.setdefault(name, []).append((s.start_ns, s.end_ns))
    hi = root.end_ns
    if root.attributes.get(ENDED_BY) == _contract.ENDED_BY_READY:
        hi = max([hi, *(e for _s, e in spans.get(FIRST_REQUEST, ()))])
    out = {name: union_ns(iv, root.start_ns, hi) / 1e9 for name, iv in sorted(spans.items())}
    un = as_number(root.attributes.get(_contract.UNATTRIBUTED_S))
    if un is None:
        covered = union_ns([iv for ivs in spans.values() for iv in ivs], root.start_ns, root.end_ns)
        un = (root.end_ns - root.start_ns - covered) / 1e9
    out[UNATTRIBUTED] = max(0.0, un)
    out[TOTAL] = (root.end_ns - root.start_ns) / 1e9
    return out


def biggest_stages(root: SpanItem, stages: Sequence[SpanItem], n: int = 3) -> list[tuple[str, int]]:
    """The ``n`` stages that took longest (ns), each its top-level spans' time added up (a stage run twice is one
    entry); not the gaps, nor what started after the root's end (a first request after readiness), nor the part
    of a span after it (an import still running when ``--ready-url`` answered), as the waterfall draws them."""
    per_stage: dict[str, int] = {}
    for s in stages:
        name = stage_name(s) or s.name  # (a span of another name under the root: by that name, as drawn)
        if s.parent_span_id == root.span_id and name != UNATTRIBUTED and s.start_ns < root.end_ns:
            per_stage[name] = per_stage.get(name, 0) + min(s.end_ns, root.end_ns) - s.start_ns
    return sorted(per_stage.items(), key=lambda kv: -kv[1])[:n]


def started_in_note(spans: Iterable[SpanItem]) -> str:
    """``started in model_build`` for stages an asyncio task opened after the stage that made the task had ended
    (``infersight.stage.started_in``, set by the agent's assembly); "" for any other."""
    came = sorted({v for s in spans if isinstance(v := s.attributes.get(_contract.STAGE_STARTED_IN), str) and v})
    return "started in " + ", ".join(came[:2]) if came else ""


def ended_by(cs: ColdStart) -> str:
    """The root's ``infersight.coldstart.ended_by``; for a launcher-only root, what ended it."""
    v = cs.root.attributes.get(ENDED_BY)
    if isinstance(v, str) and v:
        return v[:64]
    names = {stage_name(s) for s in cs.stages}
    if cs.root.attributes.get("infersight.coldstart.source") == "launcher":
        if _contract.READY_WAIT in names:
            return _contract.ENDED_BY_READY
        return _contract.ENDED_BY_FIRST_REQUEST if FIRST_REQUEST in names else _contract.ENDED_BY_EXIT
    return "unknown"


def gap_frames(attributes: dict[str, AttrValue]) -> tuple[list[str], str]:
    """The sampler's top frames of an ``unattributed`` span that may be shown, and what to say
    instead when none may: with fewer than ``MIN_TOP_SAMPLES`` samples (hooks that predate the
    minimum still sent a top for one sample) no frame is named."""
    top = attributes.get(TOP)
    frames = [str(f) for f in top] if isinstance(top, list) else ([top] if isinstance(top, str) and top else [])
    n = as_number(attributes.get(SAMPLES))
    if n is not None and n < MIN_TOP_SAMPLES:
        return [], "%d sample%s: too few to name a frame" % (n, "" if n == 1 else "s")
    if not frames:
        return [], "no samples" if n is None or n == 0 else "%d samples, no frame named" % n
    return frames, ""


def is_named(s: SpanItem) -> bool:
    """A stage that counts as covered: any but ``unattributed`` (a gap the sampler explains)."""
    return stage_name(s) not in (None, UNATTRIBUTED)


def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The same time as disjoint intervals, in order."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        elif e > s:
            out.append((s, e))
    return out


def named_intervals(spans: list[SpanItem]) -> list[tuple[int, int]]:
    """The disjoint intervals the named stages among ``spans`` cover, in order."""
    return merge([(s.start_ns, s.end_ns) for s in spans if is_named(s)])


def covered_ns(spans: list[SpanItem], root: SpanItem, more: Sequence[tuple[int, int]] = ()) -> int:
    """Time within ``root`` covered by the named stages among ``spans`` and the intervals ``more``."""
    return union_ns([*((s.start_ns, s.end_ns) for s in spans if is_named(s)), *more], root.start_ns, root.end_ns)


def coverage(cs: ColdStart) -> float:
    """The process's own figure: share of its root covered by its own named stages."""
    total = cs.root.end_ns - cs.root.start_ns
    return 1.0 if total <= 0 else covered_ns(cs.stages, cs.root) / total


def tree_coverage(cs: ColdStart) -> float:
    """The process tree's figure: its own named stages and its workers' (never a worker's
    whole lifetime: the time a worker spent in no stage is not covered for its supervisor)."""
    total = cs.root.end_ns - cs.root.start_ns
    return 1.0 if total <= 0 else covered_ns(cs.stages, cs.root, cs.worker_covered) / total


def workers_counts(root: SpanItem) -> tuple[int | None, int | None]:
    """A supervisor's workers that reported to it, and of those the ones ever ready (None: not recorded,
    or no count: a worker SIGKILLed before it could report is in neither)."""
    return _count(root.attributes.get(WORKERS)), _count(root.attributes.get(WORKERS_READY))


def workers_ready(root: SpanItem) -> str:
    """What a supervisor's root says of its workers' readiness, as ``show`` and ``report`` print it
    (``workers: 2 reported, 1 ever ready``); "" where it says nothing (no worker reported, or a process
    that is no supervisor). A root ended by its workers ended when it served through one (its first ready
    worker, or its own listen if that came later): its own ``ready after`` is its listen, so that time is
    said here (``serving after 2.300 s``)."""
    reported, ready = workers_counts(root)
    if ready is None:
        return ""
    text = ("%d ever ready" % ready if ready
            else "none ever ready (each exited first: failed to boot, or stopped while loading)")
    text = "workers: %s" % (text if reported is None else "%d reported, %s" % (reported, text))
    serving = (root.end_ns - root.start_ns) / 1e9
    own = as_number(root.attributes.get(_contract.READY_S))
    if (ready and root.attributes.get(ENDED_BY) == _contract.ENDED_BY_WORKERS and serving >= 0
            and (own is None or abs(serving - own) >= 0.0005)):  # (not when its own readiness says it already)
        text += "; serving after %.3f s" % serving
    return text


def _count(v: AttrValue | None) -> int | None:
    return v if type(v) is int and 0 <= v < 1 << 31 else None
