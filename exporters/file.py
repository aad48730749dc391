"""OTLP JSON lines file, as the Collector's file exporter writes it, with size rotation."""

from __future__ import annotations

import logging
import os
import stat
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from infersight.exporters.base import ExportError, item_owner
from infersight.exporters.otlp_json import encode_lines
from infersight.statefiles import OWN_FILES, check_own_file, open_state_dir, open_state_file
from infersight.telemetry import Item

log = logging.getLogger("infersight.exporters.file")
INLINE_BYTES = 64 << 10  # smaller writes stay on the event loop
INLINE_ITEMS = 256  # larger batches are encoded in the worker thread too
UID_SHARE = 4  # one uid over a quarter of what the file and its rotations keep may not push out another's


class _Part(NamedTuple):
    """One producer uid's records of a batch, encoded (uid None: the agent's own)."""

    uid: int | None
    data: bytes
    lines: int
    items: int


def encode_parts(batch: Sequence[Item]) -> list[_Part]:
    """``batch`` encoded in one part per producer uid, in the order the uids first come: the file keeps
    each uid's share apart (``FileExporter._may_rotate``)."""
    groups: dict[int | None, list[Item]] = {}
    for it in batch:
        groups.setdefault(item_owner(it), []).append(it)
    parts = []
    for uid, items in groups.items():
        lines = encode_lines(items)
        if lines:
            parts.append(_Part(uid, ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace"), len(lines),
                               len(items)))
    return parts


PRIVATE_MASK = 0o077  # a file in the agent's state directory: no group or other bits

def current_umask() -> int | None:
    """This process's umask, read without changing it (``os.umask`` sets it, racing other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


OWNER_MARK = b'{"key":"process.user.id","value":{"intValue":"'  # a line's first: its resource's (keys are escaped)
OWNER_LOOK = 1 << 16  # how far into a line its owner is looked for (a resource's attributes come first)
READ_CHUNK = 8 << 20


def read_owners(fd: int) -> dict[int, int]:
    """The bytes of each uid's lines in the file open on ``fd`` (every line is one producer uid's records, or
    the agent's own, which count for nobody): 0.23 s for 256 MiB of 6.5 KiB lines, read once at start."""
    out: dict[int, int] = {}
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # /dev/full, a pipe: nothing an earlier run kept (and reads without end)
        return out
    rest, off = b"", 0
    while True:
        chunk = os.pread(fd, min(READ_CHUNK, st.st_size - off), off) if off < st.st_size else b""
        if not chunk:
            return out
        off += len(chunk)
        buf, start = rest + chunk, 0
        while (nl := buf.find(b"\n", start)) >= 0:
            i = buf.find(OWNER_MARK, start, min(nl, start + OWNER_LOOK))
            if i >= 0:
                j = i + len(OWNER_MARK)
                k = buf.find(b'"', j, j + 12)
                if k > j and buf[j:k].isdigit():
                    uid = int(buf[j:k])
                    out[uid] = out.get(uid, 0) + nl + 1 - start
            start = nl + 1
        rest = buf[start:]


def _path_owners(path: str) -> dict[int, int] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return read_owners(fd)
    finally:
        os.close(fd)


def _narrow_to_umask(fd: int, mask: int) -> None:
    """A file of the agent's state directory made before a stricter umask (an upgrade from
    UMask=0027 to 0077 left the default OTLP file group-readable by every model server's uid)
    loses the bits the umask ``mask`` now denies; a file the umask allows is left as it is."""
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & mask:
            os.fchmod(fd, mode & ~mask)
    except OSError:
        pass


class FileExporter:
    """Appends one ``Export*ServiceRequest`` per line; rotates to ``PATH.1`` ... ``PATH.N``.

    Durability: a batch counts as exported (and its producer is acked) once ``write(2)``
    put it in the kernel's page cache, so it survives the agent crashing; ``fsync`` runs
    only on :meth:`force_flush` and :meth:`shutdown`, so a power loss can cost what was
    written since. Small batches (at most ``INLINE_ITEMS`` items, encoding to under
    ``inline_bytes``) are encoded and written on the event loop: a page-cache write of a
    few KiB costs less than handing it to a thread. Larger ones go to a worker thread.

    A write that fails half way (a full disk) is cut back to the last complete line, so a
    reader never meets a partial line; the batch is retried (or spooled) by the worker. A
    file found ending in a partial line (a crash mid-write) is repaired the same way when
    opened, and the line is counted in ``partial_lines_removed``.

    With ``state_dir`` (the daemon's default file lives in the agent's state directory) the
    file and its rotations are opened and renamed through a checked descriptor of that
    directory, never following a link (``infersight.statefiles``).
    """

    def __init__(self, path: str, max_bytes: int = 256 << 20, backups: int = 3,
                 inline_bytes: int = INLINE_BYTES, state_dir: str | None = None) -> None:
        self.name = "file"
        self.inline_bytes = inline_bytes
        self.path = path
        self.state_dir = state_dir
        self._rel = os.path.relpath(os.path.abspath(path), os.path.abspath(state_dir)) if state_dir else ""
        self.max_bytes = max_bytes
        self.backups = backups
        self._fd: int | None = None
        self._size = 0
        self.lines = 0
        self.items = 0
        self.errors = 0
        self.rotations = 0
        self.partial_writes = 0  # writes cut back to the last complete line
        self.partial_lines_removed = 0  # partial lines found at open (records lost before)
        self.records_refused_uid_budget = 0  # records of a uid over its share whose write would push out another's
        self.last_error = ""
        # Bytes each uid wrote to the file (first) and to each rotation, newest first; what an earlier run left
        # there is read at the first open (``_count_earlier_run``).
        self._uid_bytes: deque[dict[int, int]] = deque([{}])
        self._counted_earlier_run = False

    async def start(self) -> None:
        import asyncio  # here, not at the top: launch's quick end writes without an event loop

        await asyncio.to_thread(self._open)

    def _open(self) -> None:
        if self._fd is None:
            flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            if self.state_dir is not None:
                # The agent's alone, whatever the umask: the state directory's group is the socket group
                # (every model server's), and only systemd's UMask=0077 made the file private before (an
                # agent run by hand made it 0644, and a member read another's spans). A file an older agent
                # or a looser umask left is narrowed, its rotated copies too.
                fd = open_state_file(self.state_dir, self._rel, flags, 0o600)
                mask = (current_umask() or 0) | PRIVATE_MASK
                _narrow_to_umask(fd, mask)
                rotations: list[dict[int, int] | None] = []
                for n in range(1, self.backups + 1):
                    try:
                        bfd = open_state_file(self.state_dir, "%s.%d" % (self._rel, n), os.O_RDONLY, 0)
                    except OSError:
                        rotations.append(None)
                        continue
                    try:
                        _narrow_to_umask(bfd, mask)
                        rotations.append(None if self._counted_earlier_run else read_owners(bfd))
                    finally:
                        os.close(bfd)
            else:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                own = os.path.abspath(self.path) in OWN_FILES  # launch's default, made exclusively
                fd = os.open(self.path, flags | (os.O_NOFOLLOW if own else 0), 0o666)
                if own:
                    try:
                        check_own_file(fd, self.path)
                    except OSError:
                        os.close(fd)
                        raise
                rotations = [] if self._counted_earlier_run else [
                    _path_owners("%s.%d" % (self.path, n)) for n in range(1, self.backups + 1)]
            try:
                self._size = self._repair(fd)
                if not self._counted_earlier_run:
                    self._count_earlier_run([read_owners(fd), *rotations])
            except OSError:
                os.close(fd)
                raise
            self._fd = fd

    def _count_earlier_run(self, owners: list[dict[int, int] | None]) -> None:
        """At the first open: what an earlier run (an agent before its restart) left in the file and its rotations
        (``owners``, newest first, None where a rotation is missing) counts for the uids that wrote it, as this
        run's writes do, so that a flood after a restart may not rotate out what was kept from before it, and a
        uid alone on the host stays alone (``read_owners``)."""
        self._counted_earlier_run = True
        chain: list[dict[int, int]] = []
        for o in owners:  # a rotation goes as far as the first missing file
            if o is None:
                break
            chain.append(o)
        self._uid_bytes = deque(chain or [{}])

    def _repair(self, fd: int) -> int:
        """Cut a trailing partial line; returns the size of the complete lines."""
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return size
        pos = size
        while pos > 0:
            start = max(0, pos - 65536)
            nl = os.pread(fd, pos - start, start).rfind(b"\n")
            if nl >= 0:
                pos = start + nl + 1
                break
            pos = start
        os.ftruncate(fd, pos)
        self.partial_lines_removed += 1
        log.warning("%s ended in a partial line (%d bytes, from an interrupted write): removed",
                    self.path, size - pos)
        return pos

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def _rotate(self) -> None:
        self._close()
        if self.state_dir is not None:
            subdir, name = os.path.split(self._rel)
            dfd: int | None = open_state_dir(self.state_dir, subdir)
        else:
            dfd, name = None, self.path
        try:
            for i in range(self.backups - 1, 0, -1):
                try:  # a rename never follows a link in either name
                    os.replace("%s.%d" % (name, i), "%s.%d" % (name, i + 1), src_dir_fd=dfd, dst_dir_fd=dfd)
                except FileNotFoundError:
                    pass
            if self.backups > 0:
                os.replace(name, name + ".1", src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
        finally:
            if dfd is not None:
                os.close(dfd)
        self.rotations += 1
        self._uid_bytes.appendleft({})
        while len(self._uid_bytes) > self.backups + 1:
            self._uid_bytes.pop()
        self._open()

    def _may_rotate(self, uid: int | None) -> bool:
        """Whether ``uid`` may write (and so, sooner or later, rotate the file). A rotation deletes the oldest
        file once every rotation exists: not for a uid that holds more than its share of what is kept, when that
        file holds another uid's records (a member's flood of logs rotated a victim's records out of every file
        within a second). A uid alone on the host, or under its share, writes as before."""
        if uid is None or len(self._uid_bytes) <= self.backups:
            return True
        if not any(n for u, n in self._uid_bytes[-1].items() if u != uid):
            return True
        held = sum(d.get(uid, 0) for d in self._uid_bytes)
        return held <= self.max_bytes * (self.backups + 1) // UID_SHARE

    def _write(self, parts: list[_Part]) -> None:
        """One write of every part, so that a batch is written whole or retried whole (never half of it
        twice). A part whose uid may not rotate the file (``_may_rotate``) is left out of every write, not only
        of the one that rotates: a flood that filled the file to the brim had the next write of anybody else
        (the agent's own items, every few seconds) rotate its victim's records out."""
        self._open()
        refused = [p for p in parts if not self._may_rotate(p.uid)]
        if refused:
            self.records_refused_uid_budget += sum(p.items for p in refused)
            parts = [p for p in parts if p not in refused]
            if not parts:
                return
        if self._size and self._size + sum(len(p.data) for p in parts) > self.max_bytes:
            self._rotate()
        assert self._fd is not None
        fd, start = self._fd, self._size
        data = parts[0].data if len(parts) == 1 else b"".join(p.data for p in parts)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            if len(view) < len(data):  # some of it went out: back to the last complete line
                self.partial_writes += 1
                os.ftruncate(fd, start)
            raise
        self._size += len(data)
        now = self._uid_bytes[0]
        for part in parts:
            self.lines += part.lines
            self.items += part.items
            if part.uid is not None:
                now[part.uid] = now.get(part.uid, 0) + len(part.data)

    def _encode_write(self, batch: Sequence[Item]) -> None:
        parts = encode_parts(batch)
        if parts:
            self._write(parts)

    async def export(self, batch: Sequence[Item]) -> None:
        import asyncio

        try:
            if len(batch) > INLINE_ITEMS or self._fd is None:  # large, or to be opened: off the loop
                await asyncio.to_thread(self._encode_write, batch)
            else:
                parts = encode_parts(batch)
                if not parts:
                    return
                if sum(len(p.data) for p in parts) < self.inline_bytes:
                    self._write(parts)
                else:
                    await asyncio.to_thread(self._write, parts)
        except OSError as exc:  # disk full, permissions: the worker counts and spools
            self.errors += 1
            self.last_error = str(exc)
            self._close()
            raise ExportError("cannot write %s: %s" % (self.path, exc)) from exc

    def write_now(self, batch: Sequence[Item]) -> None:
        """Write ``batch``, sync it and close, with no event loop (``launch``'s quick end).
        Raises OSError; a write that fails half way is cut back as in :meth:`export`."""
        try:
            self._encode_write(batch)
            if self._fd is not None:
                os.fsync(self._fd)
        finally:
            self._close()

    async def force_flush(self, timeout_s: float) -> bool:
        import asyncio

        def sync() -> None:
            if self._fd is not None:
                os.fsync(self._fd)

        try:
            await asyncio.wait_for(asyncio.to_thread(sync), timeout_s)
        except (OSError, TimeoutError):
            return False
        return True

    async def shutdown(self) -> None:
        await self.force_flush(5.0)
        self._close()

    def state(self) -> dict[str, int | float | str]:
        return {
            "path": self.path,
            "lines": self.lines,
            "items": self.items,
            "errors": self.errors,
            "rotations": self.rotations,
            "partial_writes": self.partial_writes,
            "partial_lines_removed": self.partial_lines_removed,
            "records_refused_uid_budget": self.records_refused_uid_budget,
            "last_error": self.last_error,
        }
