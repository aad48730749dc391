"""A bounded on-disk FIFO of item batches, for exporters whose peer is away.

Segment files ``<n>.seg`` hold records: 8-byte header (payload length, item count)
then JSON of the batch. The read position survives restarts in ``pos``. When the
spool is full, the oldest segment is deleted and its items are counted as dropped.

One uid (``process.user.id`` of an item's resource; the agent's own items have none) holds at
most ``UID_SHARE`` of the spool while another uid holds items in it: past it, that uid's new items
are dropped at the door (counted in ``over_uid_share_items``), so that another user's flood while a
peer is away cannot push your queued records out. A uid alone in the spool (a single-tenant host)
may fill it; another uid's first records then push out the oldest as a full spool does, and from
then on the first uid is held to its share. Records an earlier agent spooled count for their uids
(read once at start: each record's size shared among its items' uids, no item decoded).

Every file is opened relative to a descriptor of the spool's directory, never through a
link: under ``agent.state_dir`` (the daemon) that descriptor comes from
:func:`infersight.statefiles.open_state_dir`, which checks that only the agent can write there.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import struct
from collections.abc import Sequence
from typing import Any, BinaryIO

from infersight.agent.daemon.itemcodec import from_dict, to_dict
from infersight.agent.errors import AgentError
from infersight.exporters.base import OWNER_ATTR, item_owner
from infersight.statefiles import DIR_FLAGS, open_state_dir
from infersight.telemetry import Item

REC = struct.Struct("!II")
UID_SHARE = 0.25  # of max_bytes, per uid (as the agent's other per-user budgets: a quarter)


def _dict_owner(d: dict[str, Any]) -> int | None:
    """The producer uid of an encoded item (``item_owner`` of what ``from_dict`` would make), without decoding it."""
    root = d.get("root")
    res = d.get("r") if "r" in d else (root.get("r") if isinstance(root, dict) else None)
    if isinstance(res, list):
        for kv in res:
            if isinstance(kv, list) and len(kv) == 2 and kv[0] == OWNER_ATTR:
                return kv[1] if type(kv[1]) is int else None
    return None


def _record_owners(payload: bytes) -> dict[int, int]:
    """The bytes of each uid in a record an earlier agent wrote (its size shared by item count: no item is
    decoded); a corrupt record counts for nobody (``peek_many`` skips it)."""
    try:
        items = json.loads(payload)
    except (ValueError, RecursionError):  # corrupt (a nesting too deep for the decoder too): counted by peek_many
        return {}
    if not isinstance(items, list) or not items:
        return {}
    counts: collections.Counter[int] = collections.Counter()
    for d in items:
        uid = _dict_owner(d) if isinstance(d, dict) else None
        if uid is not None:
            counts[uid] += 1
    return {uid: len(payload) * n // len(items) for uid, n in counts.items()}


class SpoolInUseError(AgentError, OSError):
    """Another agent holds this spool directory."""
SEGMENT_BYTES = 4 << 20


class DiskSpool:
    """``directory``: the spool's own directory; with ``state_dir``, a path relative to it."""

    def __init__(self, directory: str, max_bytes: int = 256 << 20, state_dir: str | None = None) -> None:
        self.dir = os.path.join(state_dir, directory) if state_dir else directory
        self.max_bytes = max_bytes
        self.segment_bytes = max(4096, min(SEGMENT_BYTES, max_bytes // 4))
        if state_dir:
            self.dfd = open_state_dir(state_dir, directory)
        else:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self.dfd = os.open(directory, DIR_FLAGS)
        try:  # one agent per spool: two writing one would corrupt it
            fcntl.flock(self.dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.dfd)
            raise SpoolInUseError("%s is in use by another agent (two agents share one state directory?)"
                                  % self.dir) from None
        self.segments: list[int] = sorted(
            int(n[:-4]) for n in os.listdir(self.dfd) if n.endswith(".seg") and n[:-4].isdigit()
        )
        self.read_pos = self._load_pos()
        self.dropped_items = 0
        self.spooled_items = 0
        self.corrupt_records = 0
        self.over_uid_share_items = 0  # items not spooled: their uid held its share of the spool
        scanned = {seg: self._scan(seg) for seg in self.segments}
        self._counts = {seg: items for seg, (items, _records, _uids) in scanned.items()}
        # per segment, per record: the bytes of each uid in it (FIFO, as records are read; an earlier agent's
        # records as ``_scan`` read them)
        self._record_uids: dict[int, collections.deque[dict[int, int]]] = {
            seg: uids for seg, (_items, records, uids) in scanned.items() if records}
        self._uid_bytes: collections.Counter[int] = collections.Counter()
        for q in self._record_uids.values():
            for by_uid in q:
                self._uid_bytes.update(by_uid)

    @staticmethod
    def _seg_name(seg: int) -> str:
        return "%012d.seg" % seg

    def _open(self, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.dfd)

    def _reader(self, seg: int) -> BinaryIO:
        return os.fdopen(self._open(self._seg_name(seg)), "rb")

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.dfd)
        except OSError:
            pass

    def close(self) -> None:
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1

    def _load_pos(self) -> int:
        """The read offset in the first segment. Saved as "SEGMENT OFFSET": a position saved
        for a segment that is gone (a save failed on a full disk) is not applied to the next."""
        try:
            with os.fdopen(self._open("pos"), "r") as f:
                parts = f.read().split()
            if len(parts) == 1:  # the older format: an offset alone
                return int(parts[0])
            seg, pos = int(parts[0]), int(parts[1])
        except (OSError, ValueError, IndexError):
            return 0
        return pos if self.segments and seg == self.segments[0] else 0

    def _save_pos(self) -> None:
        """Raises OSError (a full disk); the position in memory is right regardless."""
        self._unlink("pos.tmp")  # O_EXCL below: never write through what is at that name
        with os.fdopen(self._open("pos.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as f:
            f.write("%d %d" % (self.segments[0] if self.segments else 0, self.read_pos))
        os.replace("pos.tmp", "pos", src_dir_fd=self.dfd, dst_dir_fd=self.dfd)

    def _scan(self, seg: int) -> tuple[int, int, collections.deque[dict[int, int]]]:
        """Items and records left in a segment (from the read position for the first one), and per record the
        bytes of each uid in it (as ``append`` counts them: an earlier agent's records count for their uids)."""
        n = records = 0
        uids: collections.deque[dict[int, int]] = collections.deque()
        try:
            with self._reader(seg) as f:
                if self.segments and seg == self.segments[0]:
                    f.seek(self.read_pos)
                while True:
                    start = f.tell()
                    hdr = f.read(REC.size)
                    if not hdr:
                        break
                    size, count = REC.unpack(hdr) if len(hdr) == REC.size else (0, 0)
                    payload = f.read(size)
                    if len(hdr) < REC.size or len(payload) < size:
                        # a record torn by a crash mid-write: cut it off, as ``append`` does when a write fails,
                        # else the reader skips past the end of the file and every record written after it is lost
                        fd = self._open(self._seg_name(seg), os.O_WRONLY)
                        try:
                            os.ftruncate(fd, start)
                        finally:
                            os.close(fd)
                        self.corrupt_records += 1
                        self.dropped_items += count
                        break
                    uids.append(_record_owners(payload))
                    n += count
                    records += 1
        except OSError:
            pass
        return n, records, uids

    @property
    def items(self) -> int:
        return sum(self._counts.values())

    def size_bytes(self) -> int:
        total = 0
        for seg in self.segments:
            total += self._seg_size(seg)
        return total

    def __bool__(self) -> bool:
        return bool(self.segments) and self.items > 0

    def _seg_size(self, seg: int) -> int:
        try:
            return os.stat(self._seg_name(seg), dir_fd=self.dfd, follow_symlinks=False).st_size
        except FileNotFoundError:  # not created yet (its first write failed)
            return 0

    def head(self) -> tuple[int, int] | None:
        """Where the oldest unread record is: (segment, offset)."""
        return (self.segments[0], self.read_pos) if self.segments else None

    def append(self, batch: Sequence[Item]) -> int:
        """Write a batch, less the items of a uid past its share (counted): how many were left out. Raises
        OSError when the disk refuses (the caller counts it).

        A write that fails half way (a full disk) is cut back off, so the segment never
        keeps a torn record that would hide every record after it."""
        share = int(self.max_bytes * UID_SHARE)
        holders = {u for u, n in self._uid_bytes.items() if n > 0}
        parts: list[bytes] = []
        kept: list[Item] = []
        by_uid: dict[int, int] = {}
        for it in batch:
            part = json.dumps(to_dict(it), separators=(",", ":")).encode()
            uid = item_owner(it)
            if uid is not None:
                # no other uid's items held: the whole spool; else a quarter
                alone = holders <= {uid} and by_uid.keys() <= {uid}
                if not alone and self._uid_bytes[uid] + by_uid.get(uid, 0) + len(part) > share:
                    self.over_uid_share_items += 1
                    continue
                by_uid[uid] = by_uid.get(uid, 0) + len(part)
            parts.append(part)
            kept.append(it)
        left_out = len(batch) - len(kept)
        if not kept:
            self.dropped_items += left_out
            return left_out
        batch = kept
        payload = b"[" + b",".join(parts) + b"]"
        if not self.segments or self._seg_size(self.segments[-1]) > self.segment_bytes:
            nxt = (self.segments[-1] + 1) if self.segments else 1
            self.segments.append(nxt)
            self._counts[nxt] = 0
        seg = self.segments[-1]
        data = REC.pack(len(payload), len(batch)) + payload
        fd = self._open(self._seg_name(seg), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
        self._counts[seg] += len(batch)
        self.spooled_items += len(batch)
        self.dropped_items += left_out  # (only once written: a write that fails is the caller's to count, whole)
        self._record_uids.setdefault(seg, collections.deque()).append(by_uid)
        self._uid_bytes.update(by_uid)
        while self.size_bytes() > self.max_bytes and len(self.segments) > 1:
            self._drop_oldest()
        return left_out

    def held_by_uid(self) -> dict[int, int]:
        """Bytes of each uid's items in the spool (those spooled since this agent started)."""
        return {uid: n for uid, n in self._uid_bytes.items() if n > 0}

    def _forget_records(self, seg: int, records: int | None) -> None:
        """``records`` of segment ``seg``'s oldest records (None: all of them) are gone: their uids' bytes too."""
        q = self._record_uids.get(seg)
        if q is None:
            return
        n = len(q) if records is None else min(records, len(q))
        for _ in range(n):
            self._uid_bytes.subtract(q.popleft())
        if not q or records is None:
            self._record_uids.pop(seg, None)

    def _drop_oldest(self) -> None:
        seg = self.segments.pop(0)
        self._forget_records(seg, None)
        self.dropped_items += self._counts.pop(seg, 0)
        self._unlink(self._seg_name(seg))
        self.read_pos = 0
        self._save_pos()

    def peek_many(self, max_items: int) -> tuple[list[Item], int]:
        """The oldest records of the first segment, up to ``max_items`` items (at least one
        record): (items, records). Skips and counts corrupt records."""
        out: list[Item] = []
        records = 0
        while self.segments and records == 0:
            seg = self.segments[0]
            try:
                with self._reader(seg) as f:
                    f.seek(self.read_pos)
                    while records == 0 or len(out) < max_items:
                        hdr = f.read(REC.size)
                        if len(hdr) < REC.size:
                            break
                        size, count = REC.unpack(hdr)
                        if records and len(out) + count > max_items:
                            break
                        payload = f.read(size)
                        try:
                            out.extend(from_dict(d) for d in json.loads(payload))
                        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                            if records:
                                break  # return what we have; the bad one is next
                            self.corrupt_records += 1
                            self.dropped_items += count
                            self._forget_records(seg, 1)
                            self._advance(REC.size + size, count)
                            f.seek(self.read_pos)
                            continue
                        records += 1
            except OSError:
                pass
            if records == 0:
                if len(self.segments) == 1:
                    break  # fully read; the writer keeps appending here
                self._retire_first()
        return out, records

    def pop_many(self, records: int) -> None:
        """Forget ``records`` records that ``peek_many`` returned (after they were exported)."""
        seg = self.segments[0]
        nbytes = count = 0
        with self._reader(seg) as f:
            f.seek(self.read_pos)
            for _ in range(records):
                size, n = REC.unpack(f.read(REC.size))
                f.seek(size, os.SEEK_CUR)
                nbytes += REC.size + size
                count += n
        self._forget_records(seg, records)
        self._advance(nbytes, count)
        if self._counts.get(seg, 0) == 0 and self.read_pos >= self._seg_size(seg):
            self._retire_first()

    def _advance(self, nbytes: int, count: int) -> None:
        self.read_pos += nbytes
        seg = self.segments[0]
        self._counts[seg] = max(0, self._counts.get(seg, 0) - count)
        self._save_pos()

    def _retire_first(self) -> None:
        seg = self.segments.pop(0)
        self._forget_records(seg, None)
        self._counts.pop(seg, None)
        self._unlink(self._seg_name(seg))
        self.read_pos = 0
        self._save_pos()

