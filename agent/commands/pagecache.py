"""``launch --evict``: drop files from the page cache, without root, and say what happened.

``posix_fadvise(POSIX_FADV_DONTNEED)`` drops a file's clean cached pages. Dirty pages are
not dropped, so each file is ``fdatasync``-ed first (this works on a read-only fd).
Pages that stay resident anyway (tmpfs, a file mapped and locked by a running process)
are counted and reported, not hidden: residency is measured with ``mincore`` before
and after.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from infersight.bytesize import human_bytes
from infersight.hooks import _pagestate

PAGE = mmap.PAGESIZE


@dataclass
class Eviction:
    files: int = 0
    bytes: int = 0
    pages: int = 0
    resident_before: int = 0  # pages, -1 where mincore is unavailable
    resident_after: int = 0
    still_resident: list[str] = field(default_factory=list)  # files with pages left after eviction


def resident_pages(fd: int, size: int) -> int:
    """Pages of the file now in the page cache (mincore over a mapping that reads nothing); -1 if unknown."""
    if size == 0:
        return 0
    r = _pagestate.resident_pages_fd(fd, size)
    return -1 if r is None else r[0]


def walk_files(paths: Sequence[str]) -> Iterator[str]:
    """Regular files under paths: directories recursively, symlinks to files followed (a
    Hugging Face snapshot links to its blobs), symlinked directories below a path not entered."""
    for top in paths:
        st = os.stat(top)  # raises for a missing path: a usage error
        if stat.S_ISREG(st.st_mode):
            yield top
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        for dirpath, _dirs, names in os.walk(top, onerror=None):
            for name in sorted(names):
                yield os.path.join(dirpath, name)


def evict(paths: Sequence[str]) -> Eviction:
    ev = Eviction()
    seen: set[tuple[int, int]] = set()
    for path in walk_files(paths):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # a dangling link or an unreadable file in a tree: not ours to evict
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            # Since Linux 5.2, mincore reports the page cache only for a file we own or may
            # write; for others it counts our own mappings (none): unknown, not 0%.
            measurable = st.st_uid == os.geteuid() or os.access(path, os.W_OK)
            before = resident_pages(fd, st.st_size) if measurable else -1
            try:
                os.fdatasync(fd)  # dirty pages are not dropped: write them back first
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            after = resident_pages(fd, st.st_size) if measurable else -1
        finally:
            os.close(fd)
        ev.files += 1
        ev.bytes += st.st_size
        ev.pages += (st.st_size + PAGE - 1) // PAGE
        if before < 0 or after < 0 or ev.resident_before < 0:
            ev.resident_before = ev.resident_after = -1
        else:
            ev.resident_before += before
            ev.resident_after += after
        if after > 0:
            ev.still_resident.append(path)
    return ev


def describe(ev: Eviction) -> list[str]:
    line = "evicted %d file(s), %s, from the page cache" % (ev.files, human_bytes(ev.bytes))
    if ev.resident_before >= 0 and ev.pages:
        line += " (resident before: %d of %d pages, %.0f%%; after: %d, %.0f%%)" % (
            ev.resident_before, ev.pages, 100.0 * ev.resident_before / ev.pages,
            ev.resident_after, 100.0 * ev.resident_after / ev.pages)
    lines = [line]
    if ev.still_resident:
        shown = ", ".join(ev.still_resident[:3]) + (" ..." if len(ev.still_resident) > 3 else "")
        lines.append("%d file(s) kept pages in the cache (tmpfs, or mapped by a running process): %s"
                     % (len(ev.still_resident), shown))
    return lines
