"""The waterfall's weights column for one row of ``weights_load`` spans (pure).

A row may hold one span or several siblings. It says the file bytes loaded, the throughput of
the reads that have one (a file-mapped load reads nothing yet and has none: ``mapped
(lazy)``; the copy or forward that really read it is ``deferred``), and whether the page cache
served the read (``warm (page cache)``) or the disk did (``cold``), from
``infersight.weights.page_cache_ratio`` when the read began. The storage-ceiling share is
shown only for a cold read: a warm one says nothing about the disk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from infersight.bytesize import human_bytes
from infersight.weights_files import COLD_BELOW, W, ceiling_share


def _num(a: Mapping[str, object], key: str) -> float | None:
    v = a.get(W + key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def weights_note(rows: Sequence[Mapping[str, object]]) -> str:
    """``rows``: the attributes of the spans in one waterfall row."""
    spans = [a for a in rows if _num(a, "bytes") is not None]
    if not spans:
        return ""
    loads = [a for a in spans if a.get(W + "api") != "deferred"]
    deferred = [a for a in spans if a.get(W + "api") == "deferred"]
    nbytes = sum(_num(a, "bytes") or 0.0 for a in (loads or deferred))  # a deferred read re-reads a load's file
    out = human_bytes(nbytes)
    rated = [a for a in spans if _num(a, "bytes_per_s")]
    if rated:
        rb = sum(_num(a, "bytes") or 0.0 for a in rated)
        seconds = sum((_num(a, "bytes") or 0.0) / (_num(a, "bytes_per_s") or 1.0) for a in rated)
        out += " @ %s/s" % human_bytes(rb / seconds if seconds > 0 else 0.0)
    elif any(a.get(W + "lazy") is True for a in spans):
        # at most the file: /proc/self/io counts the whole process ("273.8 MiB mapped; 275.6 MiB read from storage")
        fetched = min(sum(_num(a, "read_bytes") or 0.0 for a in spans), nbytes)
        # the loader may still have read ahead (safetensors does): say how much came from storage
        out += " mapped (lazy; %s read from storage)" % human_bytes(fetched) if fetched >= 2**20 else " mapped (lazy)"
    if deferred:
        out += " deferred" if not loads else " + deferred read"
    ratios = [r for r in (_num(a, "page_cache_ratio") for a in (loads or deferred)) if r is not None]
    if ratios:
        cold = [r < COLD_BELOW for r in ratios]
        out += " cold" if all(cold) else (" partly cold" if any(cold) else " warm (page cache)")
    ceilings = [c for c in (_num(a, "ceiling_ratio") for a in spans) if c is not None]
    if len(ceilings) == 1:
        out += " (%s of storage ceiling)" % ceiling_share(ceilings[0])
    return out
