"""What the kernel knows about a file and about this process's reads of it (stdlib only).

- ``page_cache_ratio``: the share of a file's pages in the page cache, from ``mincore(2)`` on
  a fresh shared mapping of the file (it touches nothing); sampled in evenly spaced windows
  above ``SAMPLE_PAGES`` so that a probe stays under a millisecond on any file size;
- ``present_bytes``: how much of some address ranges this process has faulted in, from the
  present bit of ``/proc/self/pagemap`` (readable by any process for itself), sampled alike;
- ``mappings_of``: where this process maps a file (``/proc/self/maps``, by device and inode);
- ``read_bytes`` (``/proc/self/io``) and ``major_faults`` (``getrusage``).

Every probe answers None (or nothing) where the kernel does not say; none raises. ctypes is
imported at the first ``mincore``, never at import.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SAMPLE_PAGES = 1 << 13  # mincore/pagemap look at most at this many pages (32 MiB): under 1 ms
WINDOW_PAGES = 128  # above, in 64 evenly spaced windows of this many pages

_libc: Any = None


def read_bytes() -> Optional[int]:
    """``read_bytes`` of /proc/self/io: bytes this process made the storage layer fetch."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def major_faults() -> Optional[int]:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_majflt)
    except Exception:
        return None


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = (libc, ctypes)
    return _libc


def _windows(intervals: Sequence[Tuple[int, int]], cap: int = 0) -> Tuple[List[Tuple[int, int]], int]:
    """(page windows to look at, total pages): all of them up to ``cap``, else evenly spaced ones."""
    cap = cap or SAMPLE_PAGES
    total = sum(hi - lo for lo, hi in intervals)
    if total <= cap:
        return [(lo, hi) for lo, hi in intervals if hi > lo], total
    n = max(1, cap // WINDOW_PAGES)
    out: List[Tuple[int, int]] = []
    it = iter(intervals)
    lo, hi = next(it)
    base = 0  # pages of the intervals before (lo, hi)
    for k in range(n):
        g = k * total // n
        while g >= base + (hi - lo):
            base += hi - lo
            lo, hi = next(it)
        start = lo + g - base
        out.append((start, min(start + WINDOW_PAGES, hi)))
    return out, total


_ODD = bytes(b & 1 for b in range(256))
_HIGH = bytes(b >> 7 for b in range(256))


def resident_pages(path: str) -> Optional[Tuple[int, int]]:
    """(pages of ``path`` in the page cache, pages of ``path``) from mincore; sampled if huge."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        return resident_pages_fd(fd, os.fstat(fd).st_size)
    except Exception:
        return None
    finally:
        os.close(fd)


def resident_pages_fd(fd: int, size: int) -> Optional[Tuple[int, int]]:
    """``resident_pages`` of an open file of ``size`` bytes (None when it cannot be told)."""
    if size <= 0:
        return None
    try:
        libc, ctypes = _load_libc()
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: touches nothing
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            npages = (size + PAGE - 1) // PAGE
            windows, total = _windows([(0, npages)])
            seen = resident = 0
            vec = ctypes.create_string_buffer(max(hi - lo for lo, hi in windows))
            for lo, hi in windows:
                if libc.mincore(addr + lo * PAGE, (hi - lo) * PAGE, vec) != 0:
                    return None
                resident += vec.raw[:hi - lo].translate(_ODD).count(1)
                seen += hi - lo
            return (resident * total // seen if seen else 0), total
        finally:
            libc.munmap(addr, size)
    except Exception:
        return None


def page_cache_ratio(paths: Sequence[str]) -> Optional[float]:
    """Share of the files' pages resident in the page cache now (None if unknown)."""
    resident = total = 0
    for p in paths:
        r = resident_pages(p)
        if r is None:
            return None
        resident += r[0]
        total += r[1]
    return resident / total if total else None


def present_bytes(chunks: Sequence[Tuple[int, int]]) -> Optional[int]:
    """Bytes of the address ranges ``(addr, nbytes)`` that this process has faulted in (pagemap)."""
    intervals: List[Tuple[int, int]] = []
    for lo, hi in sorted((a // PAGE, (a + n + PAGE - 1) // PAGE) for a, n in chunks if n > 0):
        if intervals and lo <= intervals[-1][1]:
            intervals[-1] = (intervals[-1][0], max(hi, intervals[-1][1]))
        else:
            intervals.append((lo, hi))
    if not intervals:
        return 0
    windows, total = _windows(intervals)
    seen = present = 0
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            for lo, hi in windows:
                f.seek(lo * 8)
                data = f.read((hi - lo) * 8)
                present += data[7::8].translate(_HIGH).count(1)  # bit 63: page present
                seen += len(data) // 8
    except (OSError, ValueError):
        return None
    return (present * total // seen) * PAGE if seen else None


def file_key(path: str) -> Optional[Tuple[str, str]]:
    """(device as /proc/self/maps prints it, inode) of ``path``."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return "%02x:%02x" % (os.major(st.st_dev), os.minor(st.st_dev)), str(st.st_ino)


def mappings_of(keys: Sequence[Optional[Tuple[str, str]]]) -> Dict[Tuple[str, str], List[Tuple[int, int]]]:
    """Address ranges where this process maps each file ``key`` (device, inode): one maps read."""
    want = {k for k in keys if k is not None}
    out: Dict[Tuple[str, str], List[Tuple[int, int]]] = {k: [] for k in want}
    if not want:
        return out
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) >= 5 and (parts[3], parts[4]) in want:
                    lo, _, hi = parts[0].partition("-")
                    out[(parts[3], parts[4])].append((int(lo, 16), int(hi, 16)))
    except (OSError, ValueError):
        return {k: [] for k in want}
    return out


def file_mappings(key: Optional[Tuple[str, str]]) -> List[Tuple[int, int]]:
    return mappings_of([key]).get(key, []) if key is not None else []
