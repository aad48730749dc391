"""One figure per weights file: what the storage served for it is at most the file, and a window in which the
process plainly read other files (``/proc/self/io`` counts the whole process) gives no rate to judge the loader by."""

from __future__ import annotations

from infersight.hooks import _contract
from infersight.telemetry import Resource, SpanItem
from infersight.weights_files import W, describe, summarize

MIB = 1 << 20


def _load(span_id: str, start_s: float, end_s: float, **attrs: object) -> SpanItem:
    a = {_contract.STAGE: _contract.WEIGHTS_LOAD, W + "path": "/m/small.safetensors", **attrs}
    return SpanItem(Resource.of({}), "0" * 32, span_id, "1" * 16, "coldstart.weights_load", int(start_s * 1e9),
                    int(end_s * 1e9), a, [], None)  # type: ignore[arg-type]


def test_a_file_read_while_the_process_read_other_files_gets_no_rate_and_never_more_than_its_size() -> None:
    """A 1 MiB file mapped lazily, read in a first forward that also read a 257 MiB file: it said "258.5 MiB from
    storage in 0.544 s, 1.8 MiB/s, cold, 0% of the storage ceiling" (a review)."""
    spans = [_load("a" * 16, 0.0, 0.01, **{W + "mapped_bytes": MIB, W + "lazy": True, W + "page_cache_ratio": 0.0,
                                           W + "read_bytes": 0}),
             _load("b" * 16, 1.0, 1.544, **{W + "api": "deferred", W + "read_bytes": 258 * MIB + MIB // 2})]
    (f,) = summarize(spans, lambda _p: 500.0 * MIB)
    assert f["read_bytes"] == MIB
    assert "bytes_per_s" not in f and "ceiling_ratio" not in f
    assert f["read_bytes_process"] == 258 * MIB + MIB // 2
    assert "258" not in describe(f)


def test_a_cold_file_read_alone_keeps_its_rate_and_ceiling_ratio() -> None:
    spans = [_load("a" * 16, 0.0, 0.5, **{W + "bytes": 100 * MIB, W + "page_cache_ratio": 0.0,
                                          W + "read_bytes": 101 * MIB})]  # a little more: the process's own reads
    (f,) = summarize(spans, lambda _p: 400.0 * MIB)
    assert f["read_bytes"] == 100 * MIB
    assert f["bytes_per_s"] == 200.0 * MIB and f["ceiling_ratio"] == 0.5
