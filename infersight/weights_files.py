"""One figure per weights file of a cold start, over all the spans that read it (pure).

A file's bytes may be read by several spans: an eager load reads them all inside the call; a
lazy (file-mapped) load reads what the loader touches, and a later ``load_state_dict`` copy,
conversion or first forward reads the rest (``api="deferred"``). No single span has the
file's figure, so the cold-start root carries one span event ``weights_file`` per file:

- ``path``, ``bytes`` (the file's size, as the load span says; a checkpoint directory when one
  load read several shards);
- ``read_bytes``: what the storage layer fetched during its spans (``/proc/self/io``, summed
  over the outermost ones: a copy nested in a ``with safe_open`` block counts once), at most the
  file's size: ``/proc/self/io`` counts the whole process. Where a lazily loaded file was read in
  later work (a first forward) during which the process read more than 1.5x the file, the rate
  and the ceiling ratio are left out and ``read_bytes_process`` says what the process read (an
  eager load read the whole file inside its span: its size over that time stands);
- ``read_s``: the time its spans took, their union: eager loads, lazy loads (the loader
  touches tensors as it builds the model) and deferred reads (copies, conversions, first
  forwards: a forward's time includes its compute, so the figure is a floor of the rate);
- ``bytes_per_s``, the effective rate: for a cold file (``page_cache_ratio`` < 0.5 when its
  first read began), the bytes the storage served over ``read_s``; for a warm one, the bytes its
  reads really took (an eager load's file, a copy's tensors, the pages a forward faulted in)
  over ``read_s``; ``counted_bytes`` says which. Never the mapped bytes over a time in which
  they were not all read (a forward touches 48-88% of a model's file);
- ``page_cache_ratio`` of the first read, and ``ceiling_ratio`` (to the storage ceiling of
  the file's device) when cold and a ceiling is known.

The agent adds the events when the root closes; ``show`` and ``report`` read them, compute a
missing ceiling ratio from the cached ceiling, and summarise spans of files written before
the events existed the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from infersight.bytesize import human_bytes
from infersight.hooks import _contract
from infersight.telemetry import AttrValue, ColdStart, SpanEvent, SpanItem

EVENT = "weights_file"
W = _contract.WEIGHTS
COLD_BELOW = _contract.COLD_BELOW
RESIDENT = 0.99  # a read that began with this share of the file in the page cache fetched (next to) nothing of it
RAISES_CEILING = 64 << 20  # a cold read of this many bytes says the disk's bandwidth (= storage_ceiling.MIN_SAMPLE)

CeilingOf = Callable[[str], "float | None"]  # a file's storage ceiling (bytes/s), if known


def _num(a: Mapping[str, AttrValue], key: str) -> float | None:
    v = a.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _union_s(intervals: list[tuple[int, int]]) -> float:
    total, cur_s, cur_e = 0, -1, -1
    for s, e in sorted(intervals):
        if s > cur_e:
            total += max(0, cur_e - cur_s)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    total += max(0, cur_e - cur_s)
    return total / 1e9


def _is_weights(s: SpanItem) -> bool:
    return s.attributes.get(_contract.STAGE) == _contract.WEIGHTS_LOAD and isinstance(s.attributes.get(W + "path"), str)


def summarize(stages: Iterable[SpanItem], ceiling_of: CeilingOf | None = None) -> list[dict[str, AttrValue]]:
    """The ``weights_file`` attributes of each file the stages read, in the order first read."""
    by_path: dict[str, list[SpanItem]] = {}
    for s in sorted((s for s in stages if _is_weights(s)), key=lambda s: s.start_ns):
        by_path.setdefault(str(s.attributes[W + "path"]), []).append(s)
    return [_summary(path, spans, ceiling_of) for path, spans in by_path.items()]


def _summary(path: str, spans: list[SpanItem], ceiling_of: CeilingOf | None) -> dict[str, AttrValue]:
    ids = {s.span_id for s in spans}
    outer = [s for s in spans if s.parent_span_id not in ids]  # a read nested in another of this file counts once
    loads = [s for s in spans if s.attributes.get(W + "api") != "deferred"]
    size = max((_num(s.attributes, W + "bytes") or 0.0 for s in loads), default=0.0) or max(
        (_num(s.attributes, W + "mapped_bytes") or _num(s.attributes, W + "bytes") or 0.0 for s in spans),
        default=0.0)
    read_s = _union_s([(s.start_ns, s.end_ns) for s in spans])
    fetched = [v for v in (_num(s.attributes, W + "read_bytes") for s in outer) if v is not None]
    ratio = next((r for r in (_num(s.attributes, W + "page_cache_ratio") for s in spans) if r is not None), None)
    out: dict[str, AttrValue] = {"path": path, "bytes": int(size), "read_s": round(read_s, 6)}
    if fetched:
        # /proc/self/io counts the whole process: what it read of other files (a lazy import, a
        # library's pages faulted in during a first forward) is not this file's
        out["read_bytes"] = int(min(sum(fetched), size) if size else sum(fetched))
    if ratio is not None:
        out["page_cache_ratio"] = ratio
    cold = ratio is not None and ratio < COLD_BELOW
    if cold:  # what the storage served (at most the file: read_bytes counts the whole process)
        nbytes = min(sum(fetched), size) if fetched else 0.0
    else:  # what the reads took: a lazy load's bytes are only mapped, read by the spans after it
        nbytes = min(sum(_num(s.attributes, W + "bytes") or 0.0 for s in outer
                         if s.attributes.get(W + "lazy") is not True), size)
    rate_s = read_s
    if cold:  # the storage's bytes over the reads that fetched them: a later read that found the file resident
        # (a lazy load_file fetched 7.5 MiB in 8 ms, then load_state_dict copied it from memory for 235 ms) is not
        # storage time (it made a 940 MiB/s read 31 MiB/s, "9% of the storage ceiling")
        fetching = [(s.start_ns, s.end_ns) for s in spans
                    if (_num(s.attributes, W + "page_cache_ratio") or 0.0) < RESIDENT]
        rate_s = _union_s(fetching) if fetching else read_s
        if rate_s < read_s:
            out["fetch_s"] = round(rate_s, 6)
    if nbytes > 0 and rate_s > 0:
        out["counted_bytes"] = int(nbytes)
        out["bytes_per_s"] = nbytes / rate_s
    eager = all(s.attributes.get(W + "api") != "deferred" and s.attributes.get(W + "lazy") is not True for s in spans)
    if cold and not eager and fetched and size and sum(fetched) > 1.5 * size:
        # a lazy file read in later work (a first forward) that mostly read other files: no rate to judge the
        # loader by (an eager load read the whole file inside its span: its size over that time stands)
        out["read_bytes_process"] = int(sum(fetched))
        out.pop("bytes_per_s", None)
        out.pop("counted_bytes", None)
    elif cold:
        ceiling = next((c for c in (_num(s.attributes, W + "storage_ceiling_bytes_per_s") for s in spans)
                        if c), None)
        add_ceiling(out, ceiling if ceiling else (ceiling_of(path) if ceiling_of is not None else None))
    return out


def ceiling_share(ratio: float) -> str:
    """A cold read's share of its device's storage ceiling, as printed: above 100% the ceiling was measured low."""
    return "%.0f%%" % (100 * ratio) if ratio <= 1.0 else "above 100%"


def add_ceiling(summary: dict[str, AttrValue], ceiling: float | None) -> None:
    """Add ``ceiling_ratio`` to a cold file's summary that has a throughput, if it lacks one. A cold read of at
    least ``RAISES_CEILING`` bytes faster than the ceiling proves the ceiling low (measured while the disk was busy:
    a review saw 271-507% of it on every read): the ceiling is then that read's rate, ratio 1, and
    ``ceiling_raised_from`` says so (the agent keeps the new figure, ``storage_ceiling.raise_to``). A smaller read
    keeps its ratio, printed "above 100%"."""
    rate = _num(summary, "bytes_per_s")
    ratio = _num(summary, "page_cache_ratio")
    if "ceiling_ratio" in summary or not ceiling or rate is None or ratio is None or ratio >= COLD_BELOW:
        return
    counted = _num(summary, "counted_bytes") or 0.0
    if rate > ceiling and counted >= RAISES_CEILING:  # a smaller read says more about readahead than the disk
        summary["ceiling_raised_from"] = ceiling
        ceiling = rate
    summary["storage_ceiling_bytes_per_s"] = ceiling
    summary["ceiling_ratio"] = rate / ceiling


def events(cs: ColdStart) -> list[SpanEvent]:
    return [e for e in cs.root.events if e.name == EVENT]


def files_of(cs: ColdStart, ceiling_of: CeilingOf | None = None) -> list[dict[str, AttrValue]]:
    """The root's ``weights_file`` summaries (a copy, a missing ceiling ratio added from
    ``ceiling_of``); for a root without them (an older file), computed from its stages."""
    found = [dict(e.attributes) for e in events(cs)]
    if not found:
        return summarize(cs.stages, ceiling_of)
    for f in found:
        path = f.get("path")
        if ceiling_of is not None and isinstance(path, str):
            add_ceiling(f, ceiling_of(path))
    return found


def describe(f: Mapping[str, AttrValue]) -> str:
    """``model.safetensors 512.0 MiB: 480.0 MiB from storage in 0.610 s, 787.0 MiB/s, cold, 41% of
    the storage ceiling``."""
    path = str(f.get("path") or "?")
    name = path.rstrip("/").rsplit("/", 1)[-1] or path
    parts = ["%s %s" % (name, human_bytes(_num(f, "bytes") or 0.0))]
    read_b, read_s, rate = _num(f, "read_bytes"), _num(f, "read_s"), _num(f, "bytes_per_s")
    ratio = _num(f, "page_cache_ratio")
    cold = ratio is not None and ratio < COLD_BELOW
    counted = _num(f, "counted_bytes")
    reading = "%s from storage" % human_bytes(read_b) if cold and read_b else (
        "%s read" % human_bytes(counted) if counted else "read")
    fetch_s = _num(f, "fetch_s")
    parts.append("%s in %.3f s" % (reading, fetch_s if cold and read_b and fetch_s is not None else read_s or 0.0))
    if rate:
        parts.append("%s/s" % human_bytes(rate))
    if ratio is not None:
        parts.append("cold" if cold else "warm (page cache %.0f%%)" % (100 * ratio))
    c = _num(f, "ceiling_ratio")
    raised = _num(f, "ceiling_raised_from")
    if raised is not None:
        parts.append("faster than the storage ceiling measured before (%s/s): the ceiling now" % human_bytes(raised))
    elif c is not None:
        parts.append("%s of the storage ceiling" % ceiling_share(c))
    return parts[0] + ": " + ", ".join(parts[1:])
