"""How much of a file the page cache holds, from ``mincore`` (Linux; None where it cannot tell)."""

from __future__ import annotations

import ctypes
import mmap
import os

_PROT_READ = 1
_MAP_SHARED = 1
_MAP_FAILED = ctypes.c_void_p(-1).value
MAX_PAGES = 1 << 20  # counting past 4 GiB of 4 KiB pages reads a sample of the file's head only


class _Libc:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        self.mmap.restype = ctypes.c_void_p
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.munmap.restype = ctypes.c_int
        self.mincore = libc.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.mincore.restype = ctypes.c_int


_libc: _Libc | None = None


def _get_libc() -> _Libc | None:
    global _libc
    if _libc is None:
        try:
            _libc = _Libc()
        except (OSError, AttributeError):
            return None
    return _libc


def resident_ratio(path: str) -> float | None:
    """Share of ``path``'s pages resident in the page cache, or None when it cannot be told."""
    libc = _get_libc()
    if libc is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        page = mmap.PAGESIZE
        pages = min((size + page - 1) // page, MAX_PAGES)
        if pages == 0:
            return None
        length = pages * page
        addr = libc.mmap(None, length, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, length, vec) != 0:
                return None
            return sum(b & 1 for b in bytes(vec)) / pages
        finally:
            libc.munmap(addr, length)
    finally:
        os.close(fd)
