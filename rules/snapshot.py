"""Summarise a ``torch.cuda.memory._dump_snapshot`` pickle, read with a restricted unpickler.

A snapshot file is untrusted input: ``pickle.load`` would run any callable it names. The
snapshot of ``_snapshot()`` is plain data (dicts, lists, tuples, str, int, float, bool,
None), so ``_SafeUnpickler`` allows only a handful of harmless container globals and refuses
every other global, and persistent ids, with ``UnsafePickleError``.

Layout read here (``torch.cuda.memory._snapshot`` docstring): ``{"segments": [Segment],
"device_traces": [...]}``; a Segment has ``address, total_size, stream, segment_type
("small"|"large"), segment_pool_id, allocated_size, active_size, blocks``; a Block has
``size, requested_size, address, state ("active_allocated"|"active_awaiting_free"|
"inactive"), frames``.

A pickle can reference one object many times (the memo): a 0.8 MB file can name a
million segments that are all the same list of a million blocks. The summary therefore
looks at no more than ``MAX_SEGMENTS`` segments and ``MAX_BLOCKS`` blocks in all, keeps
only the ``top`` largest live blocks, and says ``truncated`` when it stopped early.

``inactive_split`` is PyTorch's ``inactive_split_bytes``: a free block counts when it is
split, i.e. it has a neighbour in its segment (``Block::is_split()``: prev or next), so
every free block of a segment that holds more than one block. The hook's summary
(``infersight.hooks._alloc.snapshot_summary``) uses the same definition and bounds;
tests/support/data/snapshot_vectors.json is their shared test vector.
"""

from __future__ import annotations

import heapq
import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infersight.bytesize import torch_bytes
from infersight.rules.engine import RuleSet, Verdict, classify
from infersight.rules.rulefile import RulesError

__all__ = [
    "ALLOWED_GLOBALS",
    "LiveAllocation",
    "PoolSummary",
    "SnapshotError",
    "SnapshotSummary",
    "SnapshotVerdict",
    "UnsafePickleError",
    "load_snapshot",
    "loads_snapshot",
    "summarize",
    "verdict_for",
]

ALLOWED_GLOBALS = frozenset(
    {
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "bytearray"),
        ("collections", "OrderedDict"),
    }
)
SMALL_REQUEST = 1 << 20  # PyTorch serves requests <= 1 MiB from the small pool
DEFAULT_POOL = (0, 0)
MAX_FILE_BYTES = 4 << 30
MAX_SEGMENTS = 65536  # segments a summary looks at
MAX_BLOCKS = 1 << 18  # blocks a summary looks at, over all segments (~1 us each)
MAX_BYTEARRAY = 1 << 20  # a snapshot holds no bytearray; refuse bytearray(10**12)


class SnapshotError(RulesError, ValueError):
    """The file is not a readable memory snapshot."""


class UnsafePickleError(SnapshotError):
    """The pickle names a global outside the allow list."""


def _bytearray(*args: Any) -> bytearray:
    """``bytearray`` for protocols < 5, which pickle it as bytearray(str, encoding); a
    size argument (bytearray(10**12)) would allocate, so only data is accepted."""
    if not args or not isinstance(args[0], (str, bytes)) or len(args[0]) > MAX_BYTEARRAY:
        raise UnsafePickleError("refused bytearray(...) that is not small data")
    return bytearray(*args)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocols < 3 write the Python 2 name
            module = "builtins"
        if (module, name) == ("builtins", "bytearray"):
            return _bytearray
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        allowed = ", ".join(f"{m}.{n}" for m, n in sorted(ALLOWED_GLOBALS))
        raise UnsafePickleError(f"refused global {module}.{name}: a memory snapshot needs none beyond {allowed}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refused persistent id: a memory snapshot has none")


def loads_snapshot(data: bytes) -> dict[str, Any]:
    """Unpickle snapshot bytes with the restricted unpickler and check the top level."""
    try:
        obj = _SafeUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except Exception as exc:  # any malformed pickle: EOFError, UnpicklingError, ...
        raise SnapshotError(f"not a readable pickle: {exc}") from exc
    if isinstance(obj, list):  # very old torch pickled the segment list alone
        obj = {"segments": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        raise SnapshotError("not a memory snapshot: no 'segments' list at the top level")
    return obj


def load_snapshot(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> dict[str, Any]:
    """Read and safely unpickle a ``_dump_snapshot`` file."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > max_bytes:
            raise SnapshotError(f"{p}: {size} bytes is over the {max_bytes}-byte limit")
        data = p.read_bytes()
    except OSError as exc:
        raise SnapshotError(f"{p}: {exc.strerror or exc}") from exc
    return loads_snapshot(data)


@dataclass(frozen=True, slots=True)
class PoolSummary:
    """One allocator pool: segment type ("large"/"small") and pool id ((0, 0) = default)."""

    segment_type: str
    pool_id: tuple[int, ...]
    segments: int
    reserved_bytes: int
    allocated_bytes: int
    free_bytes: int  # inactive blocks
    largest_free_block: int
    inactive_split_bytes: int  # inactive blocks inside segments that are split

    @property
    def fragmentation_ratio(self) -> float:
        return _ratio(self.largest_free_block, self.free_bytes)

    @property
    def name(self) -> str:
        pool = "" if self.pool_id == DEFAULT_POOL else f" pool {self.pool_id}"
        return f"{self.segment_type}{pool}"


@dataclass(frozen=True, slots=True)
class LiveAllocation:
    size: int
    requested_size: int
    address: int
    segment_type: str
    frame: str | None  # innermost recorded frame, when history was on


@dataclass(frozen=True, slots=True)
class SnapshotSummary:
    segments: int
    reserved_bytes: int
    allocated_bytes: int
    active_bytes: int  # allocated plus awaiting free on another stream
    free_bytes: int
    largest_free_block: int
    inactive_split_bytes: int
    fragmentation_ratio: float  # 1 - largest free block / total free (0 when nothing free)
    expandable_segments: bool
    pools: tuple[PoolSummary, ...]
    top_allocations: tuple[LiveAllocation, ...]
    blocks: int = 0  # blocks looked at
    truncated: bool = False  # stopped at MAX_SEGMENTS / MAX_BLOCKS: the sums are partial

    def pool(self, segment_type: str, pool_id: tuple[int, ...] = DEFAULT_POOL) -> PoolSummary:
        for p in self.pools:
            if p.segment_type == segment_type and p.pool_id == pool_id:
                return p
        return PoolSummary(segment_type, pool_id, 0, 0, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class SnapshotVerdict:
    request_bytes: int
    pool: str
    largest_free_block: int
    free_bytes: int
    outcome: str  # "fits" | "fragmentation" | "needs_new_segment"
    explanation: str
    # the rule engine on R, A, P from the snapshot (T and F are not in it); None when a cached block serves the
    # request: no OOM to classify (the rubric, on those numbers alone, would call it fragmentation: C >= R)
    rubric: Verdict | None


def _ratio(largest: int, total: int) -> float:
    return 0.0 if total <= 0 else 1.0 - largest / total


def _int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _frame(block: Mapping[str, Any]) -> str | None:
    frames = block.get("frames")
    if not isinstance(frames, list) or not frames or not isinstance(frames[0], dict):
        return None
    f = frames[0]
    return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"


def summarize(
    snapshot: Mapping[str, Any],
    top: int = 10,
    *,
    max_segments: int = MAX_SEGMENTS,
    max_blocks: int = MAX_BLOCKS,
) -> SnapshotSummary:
    """Segment count, per-pool largest free block, inactive-split bytes, fragmentation.

    Looks at ``max_segments`` segments and ``max_blocks`` blocks at most (``truncated``
    says it stopped there), so the work is bounded whatever the pickle references."""
    segs = snapshot.get("segments")
    if not isinstance(segs, list):
        raise SnapshotError("not a memory snapshot: no 'segments' list")
    acc: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    live: list[tuple[int, int, Mapping[str, Any], str]] = []  # min-heap of the top blocks
    active = 0
    expandable = False
    nblk = seq = 0
    truncated = len(segs) > max_segments
    for seg in segs[:max_segments]:
        if nblk >= max_blocks:
            truncated = True
            break
        if not isinstance(seg, dict):
            raise SnapshotError("segment is not a mapping")
        total = _int(seg.get("total_size"))
        stype = seg.get("segment_type")
        if stype not in ("large", "small"):
            stype = "small" if total <= 2 << 20 else "large"
        raw_pool = seg.get("segment_pool_id", DEFAULT_POOL)
        pool_id = tuple(_int(x) for x in raw_pool[:4]) if isinstance(raw_pool, tuple | list) else ()
        expandable = expandable or bool(seg.get("is_expandable", False))
        blocks = seg.get("blocks")
        blocks = blocks if isinstance(blocks, list) else []
        row = acc.setdefault((stype, pool_id), [0, 0, 0, 0, 0, 0])
        row[0] += 1
        row[1] += total
        split = len(blocks) > 1  # PyTorch's Block::is_split(): it has a neighbour
        if len(blocks) > max_blocks - nblk:
            truncated = True
            blocks = blocks[: max_blocks - nblk]
        nblk += len(blocks)
        for b in blocks:
            if not isinstance(b, dict):
                raise SnapshotError("block is not a mapping")
            size = _int(b.get("size"))
            state = b.get("state")
            if state == "inactive":
                row[3] += size
                row[4] = max(row[4], size)
                if split:
                    row[5] += size
            else:
                active += size
                if state == "active_allocated":
                    row[2] += size
                    seq += 1  # a unique tie-break: the heap never compares the dicts
                    entry = (size, -seq, b, stype)
                    if len(live) < top:
                        heapq.heappush(live, entry)
                    elif top > 0 and size > live[0][0]:
                        heapq.heapreplace(live, entry)
    pools = tuple(
        PoolSummary(st, pid, *row) for (st, pid), row in sorted(acc.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    )
    free = sum(p.free_bytes for p in pools)
    largest = max((p.largest_free_block for p in pools), default=0)
    tops = [
        LiveAllocation(size, _int(b.get("requested_size")) or size, _int(b.get("address")), st, _frame(b))
        for size, _, b, st in sorted(live, key=lambda e: (-e[0], -e[1]))
    ]
    return SnapshotSummary(
        segments=sum(p.segments for p in pools),
        reserved_bytes=sum(p.reserved_bytes for p in pools),
        allocated_bytes=sum(p.allocated_bytes for p in pools),
        active_bytes=active,
        free_bytes=free,
        largest_free_block=largest,
        inactive_split_bytes=sum(p.inactive_split_bytes for p in pools),
        fragmentation_ratio=_ratio(largest, free),
        expandable_segments=expandable,
        pools=pools,
        top_allocations=tuple(tops),
        blocks=nblk,
        truncated=truncated,
    )


def verdict_for(summary: SnapshotSummary, request: int, rules: RuleSet | None = None) -> SnapshotVerdict:
    """Could the cache serve ``request`` bytes, and if not, why (default pool only)?"""
    stype = "small" if request <= SMALL_REQUEST else "large"
    pool = summary.pool(stype)
    if pool.largest_free_block >= request:
        outcome = "fits"
        text = (
            f"a free {torch_bytes(pool.largest_free_block)} block in the {stype} pool "
            f"can serve {torch_bytes(request)} without a new segment"
        )
    elif pool.free_bytes >= request:
        outcome = "fragmentation"
        text = (
            f"the {stype} pool has {torch_bytes(pool.free_bytes)} free but its largest block "
            f"is {torch_bytes(pool.largest_free_block)}: enough bytes, not in one block"
        )
    else:
        outcome = "needs_new_segment"
        text = (
            f"the {stype} pool has only {torch_bytes(pool.free_bytes)} free; the allocator "
            "must get a new segment from the device (device free memory decides)"
        )
    numbers = {"R": request, "A": summary.allocated_bytes, "P": summary.reserved_bytes}
    return SnapshotVerdict(
        request_bytes=request,
        pool=pool.name,
        largest_free_block=pool.largest_free_block,
        free_bytes=pool.free_bytes,
        outcome=outcome,
        explanation=text,
        rubric=None if outcome == "fits" else classify(numbers, rules),
    )
