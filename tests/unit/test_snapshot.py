"""Snapshot summaries and the restricted unpickler.

Every snapshot here is SYNTHETIC: built in this file with the structure that
``torch.cuda.memory._snapshot()`` returns (segments with address, total_size, stream,
segment_type, segment_pool_id, allocated_size, active_size and blocks with size,
requested_size, address, state, frames). No GPU produced them.
"""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from infersight.rules.snapshot import (
    SnapshotError,
    UnsafePickleError,
    load_snapshot,
    loads_snapshot,
    summarize,
    verdict_for,
)

MIB = 1 << 20
GIB = 1 << 30


def _segment(
    address: int,
    blocks: list[tuple[int, str]],
    segment_type: str = "large",
    pool: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    """SYNTHETIC segment: ``blocks`` are (size, state) laid out from ``address``."""
    out = []
    addr = address
    for size, state in blocks:
        frames = [{"filename": "model.py", "line": 42, "name": "forward"}] if state != "inactive" else []
        out.append(
            {
                "size": size,
                "requested_size": size - 512 if size > 512 else size,
                "address": addr,
                "state": state,
                "frames": frames,
            }
        )
        addr += size
    total = sum(s for s, _ in blocks)
    return {
        "device": 0,
        "address": address,
        "total_size": total,
        "stream": 0,
        "segment_type": segment_type,
        "segment_pool_id": pool,
        "allocated_size": sum(s for s, st in blocks if st == "active_allocated"),
        "active_size": sum(s for s, st in blocks if st != "inactive"),
        "requested_size": total,
        "is_expandable": False,
        "blocks": out,
    }


def synthetic_fragmented() -> dict[str, Any]:
    """SYNTHETIC: 3 large segments of 64 MiB with 20 MiB holes, one small segment, and a
    CUDA-graph private pool. Large default pool: 60 MiB free, largest hole 20 MiB."""
    segs = [
        _segment(1 << 32, [(44 * MIB, "active_allocated"), (20 * MIB, "inactive")]),
        _segment(2 << 32, [(20 * MIB, "inactive"), (44 * MIB, "active_allocated")]),
        _segment(3 << 32, [(22 * MIB, "active_allocated"), (20 * MIB, "inactive"), (22 * MIB, "active_awaiting_free")]),
        _segment(4 << 32, [(512 * 1024, "active_allocated"), (1536 * 1024, "inactive")], "small"),
        _segment(5 << 32, [(8 * MIB, "inactive")], "large", pool=(1, 0)),
    ]
    return {"segments": segs, "device_traces": [[]], "allocator_settings": {"expandable_segments": False}}


def test_summary_of_a_fragmented_cache() -> None:
    s = summarize(synthetic_fragmented())
    assert s.segments == 5
    assert s.reserved_bytes == 3 * 64 * MIB + 2 * MIB + 8 * MIB
    assert s.allocated_bytes == (44 + 44 + 22) * MIB + 512 * 1024
    assert s.active_bytes == s.allocated_bytes + 22 * MIB
    large = s.pool("large")
    assert (large.segments, large.free_bytes, large.largest_free_block) == (3, 60 * MIB, 20 * MIB)
    assert large.inactive_split_bytes == 60 * MIB
    assert large.fragmentation_ratio == pytest.approx(1 - 20 / 60)
    small = s.pool("small")
    assert small.largest_free_block == 1536 * 1024
    graph = s.pool("large", (1, 0))
    assert graph.largest_free_block == 8 * MIB
    assert graph.inactive_split_bytes == 0
    assert graph.name == "large pool (1, 0)"
    assert s.free_bytes == 60 * MIB + 1536 * 1024 + 8 * MIB
    assert s.largest_free_block == 20 * MIB
    assert s.fragmentation_ratio == pytest.approx(1 - (20 * MIB) / s.free_bytes)
    assert [a.size for a in s.top_allocations[:2]] == [44 * MIB, 44 * MIB]
    assert s.top_allocations[0].frame == "model.py:42 forward"


def test_verdicts_for_request_sizes() -> None:
    s = summarize(synthetic_fragmented())
    v = verdict_for(s, 16 * MIB)
    assert (v.outcome, v.pool) == ("fits", "large")
    assert v.rubric is None  # no OOM to classify (it said "fits", then "rubric fragmentation": a review)
    v = verdict_for(s, 50 * MIB)
    assert v.outcome == "fragmentation"
    assert v.largest_free_block == 20 * MIB
    assert "not in one block" in v.explanation
    assert v.rubric is not None and v.rubric.cls == "fragmentation"  # C = P - A covers 50 MiB
    v = verdict_for(s, 1 * GIB)
    assert v.outcome == "needs_new_segment"
    assert v.rubric is not None and v.rubric.cls == "unknown"
    assert "F" in v.rubric.missing
    v = verdict_for(s, 1024 * 1024)
    assert (v.outcome, v.pool) == ("fits", "small")


def test_empty_and_unfragmented() -> None:
    s = summarize({"segments": []})
    assert (s.segments, s.free_bytes, s.fragmentation_ratio) == (0, 0, 0.0)
    one = summarize({"segments": [_segment(0, [(32 * MIB, "inactive")])]})
    assert one.fragmentation_ratio == 0.0
    assert one.inactive_split_bytes == 0


@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
def test_load_round_trip(tmp_path: Path, protocol: int) -> None:
    snap = synthetic_fragmented()
    snap["segments"][0]["tags"] = {"a", "b"}  # a set needs builtins.set at protocol 2
    snap["meta"] = collections.OrderedDict(x=1)
    p = tmp_path / "snap.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=protocol))
    loaded = load_snapshot(p)
    assert summarize(loaded) == summarize(snap)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _EvilEval:
    def __reduce__(self) -> tuple[Any, ...]:
        return (eval, ("1+1",))


def test_unpickler_refuses_os_system(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps({"segments": [], "x": _Evil(marker)})
    with pytest.raises(UnsafePickleError, match=r"refused global (posix|os|nt)\.system"):
        loads_snapshot(data)
    assert not marker.exists()


@pytest.mark.parametrize("obj", [_EvilEval(), Path("/etc/passwd")])
def test_unpickler_refuses_other_globals(obj: object) -> None:
    with pytest.raises(UnsafePickleError, match="refused global"):
        loads_snapshot(pickle.dumps({"segments": [obj]}))


def test_unpickler_refuses_persistent_ids() -> None:
    import io

    class P(pickle.Pickler):
        def persistent_id(self, obj: object) -> str | None:
            return "x" if obj == "ref" else None

    buf = io.BytesIO()
    P(buf).dump({"segments": ["ref"]})
    with pytest.raises(UnsafePickleError, match="persistent"):
        loads_snapshot(buf.getvalue())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a pickle", "not a readable pickle"),
        (b"", "not a readable pickle"),
        (pickle.dumps({"no": "segments"}), "no 'segments'"),
        (pickle.dumps(42), "no 'segments'"),
    ],
)
def test_malformed_snapshots(data: bytes, message: str) -> None:
    with pytest.raises(SnapshotError, match=message):
        loads_snapshot(data)


def test_missing_file_and_size_limit(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError):
        load_snapshot(tmp_path / "absent.pickle")
    p = tmp_path / "big.pickle"
    p.write_bytes(pickle.dumps(synthetic_fragmented()))
    with pytest.raises(SnapshotError, match="limit"):
        load_snapshot(p, max_bytes=10)


def test_old_list_form_and_missing_segment_type() -> None:
    seg = _segment(0, [(1 * MIB, "active_allocated"), (1 * MIB, "inactive")])
    del seg["segment_type"], seg["segment_pool_id"]
    s = summarize(loads_snapshot(pickle.dumps([seg])))
    assert s.pools[0].segment_type == "small"  # a 2 MiB segment
