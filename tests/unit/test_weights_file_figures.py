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


def test_a_deferred_read_that_found_the_file_resident_is_not_storage_time() -> None:
    """A lazy load_file fetched a 7.5 MiB adapter in 8 ms; load_state_dict then copied it from the page cache for
    235 ms: the file said "from storage in 0.243 s, 31.0 MiB/s, cold, 9% of the storage ceiling" (a review
    measured the disk at 1.2 GB/s)."""
    size = 7874448
    spans = [_load("a" * 16, 0.0, 0.008, **{W + "api": "safetensors.torch.load_file", W + "bytes": size,
                                            W + "lazy": True, W + "page_cache_ratio": 0.0,
                                            W + "read_bytes": 7876608}),
             _load("b" * 16, 0.032, 0.267, **{W + "api": "deferred", W + "bytes": 7864320, W + "read_bytes": 0,
                                              W + "page_cache_ratio": 1.0, W + "deferred_by": "load_state_dict"})]
    (f,) = summarize(spans, lambda _p: 1200.0 * MIB)
    assert f["bytes_per_s"] == size / 0.008
    assert f["read_s"] == 0.243 and f["fetch_s"] == 0.008
    assert "in 0.008 s" in describe(f), describe(f)


def test_a_cold_read_faster_than_the_ceiling_raises_it() -> None:
    """A ceiling measured while the disk was busy (363 MiB/s) and cold reads at 1.1-2.2 GiB/s: every read said
    271-507% of the storage ceiling (a review). The read's rate is the ceiling then, said so."""
    spans = [_load("a" * 16, 0.0, 0.25, **{W + "bytes": 512 * MIB, W + "page_cache_ratio": 0.0,
                                           W + "read_bytes": 512 * MIB})]
    (f,) = summarize(spans, lambda _p: 363.0 * MIB)
    assert f["bytes_per_s"] == 2048.0 * MIB
    assert f["ceiling_ratio"] == 1.0 and f["storage_ceiling_bytes_per_s"] == 2048.0 * MIB
    assert f["ceiling_raised_from"] == 363.0 * MIB
    line = describe(f)
    assert "faster than the storage ceiling measured before (363.0 MiB/s)" in line and "%" not in line, line


def test_the_agent_keeps_a_raised_ceiling(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from infersight.agent.coldstart import storage_ceiling as sc

    cache = str(tmp_path / "ceiling.json")
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"\0" * 4096)
    sc.record(str(weights), sc.Measurement(64 << 20, 64 / 363, "direct"), cache)
    assert not sc.raise_to(str(weights), 300.0 * MIB, 512 * MIB, cache)  # slower: kept
    assert not sc.raise_to(str(weights), 2048.0 * MIB, 8 * MIB, cache)  # a small read says little
    assert sc.raise_to(str(weights), 2048.0 * MIB, 512 * MIB, cache)
    assert sc.ceiling_of(str(weights), cache) == 2048.0 * MIB
    assert sc.lookup(str(weights), cache)["method"] == "cold read"  # type: ignore[index]


def test_a_lazy_rows_storage_bytes_are_at_most_the_file() -> None:
    """'273.8 MiB mapped (lazy; 275.6 MiB read from storage)': /proc/self/io counts the whole process."""
    from infersight.exporters.weights_note import weights_note

    note = weights_note([{W + "bytes": 273 * MIB, W + "lazy": True, W + "read_bytes": 275 * MIB,
                          W + "page_cache_ratio": 0.0}])
    assert "273.0 MiB mapped (lazy; 273.0 MiB read from storage)" in note, note
    assert "above 100%" in weights_note([{W + "bytes": MIB, W + "bytes_per_s": 2e9, W + "ceiling_ratio": 3.2}])


def test_a_small_cold_read_faster_than_the_ceiling_keeps_it() -> None:
    """20.6 MiB at 345.6 MiB/s against a 149.3 MiB/s ceiling: readahead, not the disk's bandwidth."""
    spans = [_load("a" * 16, 0.0, 0.06, **{W + "bytes": 20 * MIB, W + "page_cache_ratio": 0.0,
                                           W + "read_bytes": 20 * MIB})]
    (f,) = summarize(spans, lambda _p: 150.0 * MIB)
    assert "ceiling_raised_from" not in f and f["storage_ceiling_bytes_per_s"] == 150.0 * MIB
    assert "above 100% of the storage ceiling" in describe(f), describe(f)
