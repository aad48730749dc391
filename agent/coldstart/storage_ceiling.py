"""The sequential-read ceiling of the storage that weights live on (cached per device).

A weights span's throughput means little alone: 1 GiB/s is excellent from a network
disk and poor from NVMe. We measure the device once with a bounded direct read
(``O_DIRECT``, so the page cache does not flatter it; buffered after ``POSIX_FADV_DONTNEED``
where the filesystem refuses ``O_DIRECT``), cache the figure per device (major:minor) in
``$XDG_CACHE_HOME/infersight/storage_ceiling.json``, and the hooks report the ratio to it
(``infersight.weights.ceiling_ratio``) for cold reads only: a read the page cache served
(``infersight.weights.page_cache_ratio`` >= 0.5) says nothing about the disk. ``infersight
doctor`` shows the cache and can measure a directory.

The hooks read the same file (``hooks/_recorder.storage_ceiling``, and
``hooks/_recorder.weights_attrs`` for ``weights_to_device``): keep the format.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from infersight.hooks import _contract, _paths

MAX_BYTES = 512 << 20
MAX_SECONDS = 3.0
BLOCK = 8 << 20
MIN_SAMPLE = 64 << 20  # smaller files say more about latency than about bandwidth (= weights_files.RAISES_CEILING)
SCHEMA = 1


@dataclass
class Measurement:
    nbytes: int
    seconds: float
    method: str  # "direct" or "buffered"

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


def cache_path(env: dict[str, str] | None = None) -> str:
    return _paths.storage_ceiling_file(env)


def device_key(path: str) -> str:
    st = os.stat(path)
    return "%d:%d" % (os.major(st.st_dev), os.minor(st.st_dev))


def load_cache(path: str | None = None) -> dict[str, dict[str, Any]]:
    try:
        with open(path or cache_path(), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    devices = data.get("devices") if isinstance(data, dict) else None
    return {k: v for k, v in devices.items() if isinstance(v, dict)} if isinstance(devices, dict) else {}


def save_cache(devices: dict[str, dict[str, Any]], path: str | None = None) -> None:
    path = path or cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"schema": SCHEMA, "devices": devices}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def lookup(path: str, cache: str | None = None) -> dict[str, Any] | None:
    try:
        return load_cache(cache).get(device_key(path))
    except OSError:
        return None


MAX_DEVICES = 64  # ceilings exported at most (the cache holds one per device measured)
_DEVICE_KEY = re.compile(r"\d{1,10}:\d{1,10}")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def device_label(key: str, sys_root: str = "/sys") -> str:
    """The block device's kernel name (``nvme0n1p1``, node_exporter's ``device`` label) of a
    ``major:minor`` key, from ``/sys/dev/block/<key>/uevent``; the key itself where there is
    none (overlay, tmpfs, NFS: no block device) or the name is not plain."""
    try:
        with open(os.path.join(sys_root, "dev", "block", key, "uevent"), encoding="ascii", errors="replace") as f:
            for line in f.read(4096).splitlines():
                name, _, value = line.partition("=")
                if name == "DEVNAME" and _DEVICE_NAME.fullmatch(value):
                    return value
    except OSError:
        pass
    return key


def known_ceilings(cache: str | None = None, sys_root: str = "/sys") -> dict[str, float]:
    """{device label: bytes/s} of every device the cache holds a usable ceiling for (the
    agent's measurement of its state directory, ``launch``'s of weights files): keys that
    are ``major:minor`` and finite positive rates only, at most :data:`MAX_DEVICES`."""
    out: dict[str, float] = {}
    for key, entry in sorted(load_cache(cache).items()):
        rate = entry.get("bytes_per_s")
        if not _DEVICE_KEY.fullmatch(key) or isinstance(rate, bool) or not isinstance(rate, (int, float)) \
                or not math.isfinite(rate) or rate <= 0:
            continue
        label = device_label(key, sys_root)
        out[label] = max(float(rate), out.get(label, 0.0))
        if len(out) >= MAX_DEVICES:
            break
    return out


def _open_direct(path: str) -> tuple[int, str]:
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), "direct"
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd, "buffered"


def measure_file(
    path: str, max_bytes: int = MAX_BYTES, max_seconds: float = MAX_SECONDS, block: int = BLOCK
) -> Measurement:
    """Read ``path`` sequentially (bounded in bytes and time) and time it."""
    fd, method = _open_direct(path)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    total = 0
    try:
        t0 = time.perf_counter()
        while total < max_bytes:
            try:
                n = os.readv(fd, [buf])
            except OSError:
                if method != "direct" or total:
                    raise
                os.close(fd)  # the filesystem accepted O_DIRECT at open but not at read
                fd = os.open(path, os.O_RDONLY)
                method = "buffered"
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                continue
            if n <= 0:
                break
            total += n
            if time.perf_counter() - t0 > max_seconds:
                break
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return Measurement(total, seconds, method)


def record(path: str, m: Measurement, cache: str | None = None) -> dict[str, Any]:
    """Cache ``m`` for the device of ``path`` unless a larger sample is cached already."""
    devices = load_cache(cache)
    key = device_key(path)
    old = devices.get(key)
    entry = {
        "device": key,
        "bytes_per_s": m.bytes_per_s,
        "method": m.method,
        "sample_bytes": m.nbytes,
        "seconds": m.seconds,
        "path": os.path.abspath(path),
        "measured_at": int(time.time()),
    }
    if old is None or int(old.get("sample_bytes", 0)) < m.nbytes:
        devices[key] = entry
        save_cache(devices, cache)
        return entry
    return old


def raise_to(path: str, bytes_per_s: float, nbytes: int, cache: str | None = None) -> bool:
    """A cold read of ``nbytes`` (at least ``MIN_SAMPLE``) from ``path`` ran at ``bytes_per_s``, faster than the
    cached ceiling of its device: that ceiling was measured low (a busy disk, an idle I/O class that waited), and
    this read's rate replaces it. True when the cache changed."""
    if nbytes < MIN_SAMPLE or not math.isfinite(bytes_per_s):
        return False
    try:
        devices = load_cache(cache)
        key = device_key(path)
        old = devices.get(key)
        if old is None or float(old.get("bytes_per_s") or 0.0) >= bytes_per_s:
            return False
        devices[key] = {**old, "bytes_per_s": bytes_per_s, "method": "cold read", "sample_bytes": int(nbytes),
                        "path": os.path.abspath(path), "measured_at": int(time.time()),
                        "raised_from": old.get("bytes_per_s")}
        save_cache(devices, cache)
        return True
    except (OSError, ValueError, TypeError):
        return False


def ensure_for_file(path: str, min_bytes: int = MIN_SAMPLE, cache: str | None = None) -> dict[str, Any] | None:
    """The cached ceiling for ``path``'s device; measured now from ``path`` if absent and big enough."""
    try:
        cached = lookup(path, cache)
        if cached is not None:
            return cached
        if os.path.getsize(path) < min_bytes:
            return None
        return record(path, measure_file(path), cache)
    except OSError:
        return None


def ceiling_of(path: str, cache: str | None = None) -> float | None:
    """The cached ceiling (bytes/s) of ``path``'s device, if measured."""
    entry = lookup(path, cache)
    rate = entry.get("bytes_per_s") if entry is not None else None
    return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None


IOPRIO_CLASS_IDLE = 3
IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread only
IOPRIO_CLASS_SHIFT = 13


def idle_io_priority() -> bool:
    """Put the calling thread in the idle I/O class (``ioprio_set``): its reads and writes wait
    for everyone else's on schedulers that honour it (BFQ; mq-deadline does not). Best effort."""
    try:
        import ctypes
        import platform
        import threading

        nr = {"x86_64": 251, "aarch64": 30}.get(platform.machine())
        if nr is None:
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.syscall(nr, IOPRIO_WHO_PROCESS, threading.get_native_id(),
                                 IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT) == 0)
    except (OSError, AttributeError, ImportError):
        return False


def ensure_for_dir(directory: str, size: int = MIN_SAMPLE, cache: str | None = None) -> dict[str, Any] | None:
    """The cached ceiling of ``directory``'s device; measured now (a scratch file of ``size``
    bytes, written, synced and read back directly) when none is cached. The agent runs it at
    start, on a thread at low priority, so that the first cold load already has a ceiling."""
    try:
        os.makedirs(directory, exist_ok=True)
        cached = lookup(directory, cache)
        if cached is not None:
            return cached
        return measure_dir(directory, size, cache)
    except OSError:
        return None


def measure_dir(directory: str, size: int = 256 << 20, cache: str | None = None) -> dict[str, Any]:
    """Write a scratch file of ``size`` bytes in ``directory``, read it back directly, cache it."""
    import tempfile  # only where a ceiling is measured: not in every agent's start

    fd, scratch = tempfile.mkstemp(prefix=".infersight-ceiling-", dir=directory)
    try:
        chunk = os.urandom(1 << 20)
        with os.fdopen(fd, "wb") as f:
            for _ in range(size // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        return record(scratch, measure_file(scratch, max_bytes=size), cache)
    finally:
        try:
            os.unlink(scratch)
        except OSError:
            pass


def cold_files(req: dict[str, Any]) -> dict[str, float]:
    """{path: bytes/s} of the cold weights files that one OTLP JSON request's roots summarise
    (``weights_file`` events with a throughput and page_cache_ratio < 0.5)."""
    found: dict[str, float] = {}
    for rs in req.get("resourceSpans", []) or []:
        for ss in rs.get("scopeSpans", []) or []:
            for s in ss.get("spans", []) or []:
                for ev in s.get("events", []) or []:
                    if ev.get("name") != "weights_file":
                        continue
                    a = {kv["key"]: _value(kv.get("value", {})) for kv in ev.get("attributes", [])}
                    p, rate, ratio = a.get("path"), a.get("bytes_per_s"), a.get("page_cache_ratio")
                    if isinstance(p, str) and isinstance(rate, float) and rate > 0 and isinstance(ratio, float) \
                            and ratio < _contract.COLD_BELOW:
                        found[p] = rate
    return found


def _value(v: dict[str, Any]) -> object:
    if "stringValue" in v:
        return v["stringValue"]
    for k in ("doubleValue", "intValue"):
        if k in v:
            try:
                return float(v[k])
            except (TypeError, ValueError):
                return None
    return None


def measure_detached(path: str) -> int:
    """Measure ``path``'s device in a process of its own, in a new session at low priority,
    that outlives its caller (``launch`` does not hold the terminal for it); its pid, 0 if it
    could not start. It caches the figure as :func:`ensure_for_file` does."""
    import subprocess
    import sys

    code = ("import os, sys\ntry:\n    os.nice(19)\nexcept OSError:\n    pass\n"
            "from infersight.agent.coldstart import storage_ceiling\nstorage_ceiling.ensure_for_file(sys.argv[1])\n")
    try:
        p = subprocess.Popen([sys.executable, "-c", code, path], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError:
        return 0
    return p.pid


