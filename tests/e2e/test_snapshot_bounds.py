"""Snapshot summaries: one definition on both sides, bounded work (issue 10, item 14).

Every snapshot here is SYNTHETIC (the layout of ``torch.cuda.memory._snapshot()``).
"""

from __future__ import annotations

import json
import pickle
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from infersight.hooks import _alloc
from infersight.rules import snapshot as rs
from infersight.rules.snapshot import UnsafePickleError, loads_snapshot, summarize

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "support" / "data" / "snapshot_vectors.json").read_text())


def hook_view(segments: list[dict[str, Any]]) -> dict[str, Any]:
    out = _alloc.snapshot_summary(segments)
    pools = out["pools"].values()
    return {
        "segments": out["segments"],
        "free_bytes": sum(p["free"] for p in pools),
        "largest_free_block": max((p["largest_free"] for p in pools), default=0),
        "inactive_split_bytes": out["inactive_split"],
        "top": out["top"],
    }


def rules_view(segments: list[dict[str, Any]]) -> dict[str, Any]:
    s = summarize({"segments": segments})
    return {
        "segments": s.segments,
        "free_bytes": s.free_bytes,
        "largest_free_block": s.largest_free_block,
        "inactive_split_bytes": s.inactive_split_bytes,
        "top": [a.size for a in s.top_allocations],
    }


@pytest.mark.parametrize("case", VECTORS, ids=[c["name"] for c in VECTORS])
def test_both_summaries_give_the_shared_vector(case: dict[str, Any]) -> None:
    assert hook_view(case["segments"]) == case["expect"]
    assert rules_view(case["segments"]) == case["expect"]


def repeated_reference_pickle(n_segments: int, n_blocks: int) -> bytes:
    """A small pickle that names n_segments x n_blocks blocks: one block dict, one list
    that references it n_blocks times, and n_segments references to one segment."""
    block = {"size": 2 << 20, "requested_size": 2 << 20, "address": 0, "state": "active_allocated",
             "frames": [{"filename": "m.py", "line": 1, "name": "f"}]}
    free = {"size": 1 << 20, "requested_size": 0, "address": 0, "state": "inactive", "frames": []}
    seg = {"total_size": 1 << 40, "segment_type": "large", "segment_pool_id": (0, 0),
           "blocks": [block, free] * (n_blocks // 2)}
    return pickle.dumps({"segments": [seg] * n_segments}, protocol=4)


def test_repeated_references_are_bounded_in_the_rules() -> None:
    data = repeated_reference_pickle(400_000, 200_000)  # 8e10 blocks if expanded
    assert len(data) < 2 << 20
    snap = loads_snapshot(data)
    s = summarize(snap)
    assert s.truncated
    assert s.blocks == rs.MAX_BLOCKS
    assert s.segments == 2  # 200,000 blocks, then the 62,144 left of the budget
    assert len(s.top_allocations) == 10
    assert s.inactive_split_bytes == s.free_bytes == (rs.MAX_BLOCKS // 2) * (1 << 20)


def test_summary_memory_does_not_grow_with_the_blocks_it_visits() -> None:
    """Only the top live blocks are kept: the peak is the same for 2,000 and 40,000 blocks."""
    snap = loads_snapshot(repeated_reference_pickle(10, 40_000))
    peaks = []
    for n in (2_000, 40_000):
        tracemalloc.start()
        s = summarize(snap, max_blocks=n)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert s.blocks == n and s.truncated
    assert peaks[1] < peaks[0] + (64 << 10), peaks  # 40k LiveAllocations would be ~5 MB


def test_many_referenced_segments_stop_at_the_segment_bound() -> None:
    snap = loads_snapshot(repeated_reference_pickle(1_000_000, 0))
    s = summarize(snap)
    assert s.truncated and s.segments == rs.MAX_SEGMENTS and s.blocks == 0
    s = summarize(snap, max_segments=10)
    assert s.truncated and s.segments == 10


def test_repeated_references_are_bounded_in_the_hook() -> None:
    snap = loads_snapshot(repeated_reference_pickle(50_000, 100_000))
    out = _alloc.snapshot_summary(snap["segments"])
    assert out["truncated"] is True
    assert out["segments"] == 1  # the first segment alone spends the block budget
    assert out["inactive_split"] == (_alloc.MAX_BLOCKS // 2) * (1 << 20)
    assert len(out["top"]) == _alloc.TOP_ALLOCS


def test_not_truncated_says_so() -> None:
    s = summarize({"segments": VECTORS[0]["segments"]})
    assert not s.truncated and s.blocks == 2
    assert "truncated" not in _alloc.snapshot_summary(VECTORS[0]["segments"])


class _Bomb:
    def __reduce__(self) -> tuple[Any, ...]:
        return (bytearray, (10**12,))


@pytest.mark.parametrize("protocol", [2, 4])
def test_bytearray_of_a_size_is_refused(protocol: int) -> None:
    data = pickle.dumps({"segments": [], "x": _Bomb()}, protocol=protocol)
    with pytest.raises(UnsafePickleError, match="bytearray"):
        loads_snapshot(data)


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_small_bytearray_data_still_loads(protocol: int) -> None:
    snap = loads_snapshot(pickle.dumps({"segments": [], "x": bytearray(b"abc")}, protocol=protocol))
    assert snap["x"] == bytearray(b"abc")


def test_classify_cli_says_truncated(tmp_path: Path) -> None:
    import subprocess
    import sys

    p = tmp_path / "snap.pickle"
    p.write_bytes(repeated_reference_pickle(100_000, 100_000))
    r = subprocess.run([sys.executable, "-m", "infersight", "classify", "--json", "--snapshot", str(p)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)["snapshot"]
    assert snap["truncated"] is True and snap["blocks"] == rs.MAX_BLOCKS
    r = subprocess.run([sys.executable, "-m", "infersight", "classify", "--snapshot", str(p)],
                       capture_output=True, text=True, timeout=120)
    assert "TRUNCATED: summarised the first 3 segments and 262144 blocks only" in r.stdout


def test_a_truncated_hook_summary_is_marked_on_the_oom_record() -> None:
    from infersight.agent.oom.kind import _snap_attrs

    out = _alloc.snapshot_summary(loads_snapshot(repeated_reference_pickle(10, 100_000))["segments"])
    attrs = _snap_attrs(out)
    assert attrs["infersight.oom.snapshot.truncated"] is True
    assert attrs["infersight.oom.snapshot.inactive_split_bytes"] == out["inactive_split"]
    assert "infersight.oom.snapshot.truncated" not in _snap_attrs(_alloc.snapshot_summary([]))
