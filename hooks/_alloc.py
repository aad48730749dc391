"""Allocator telemetry in the served process: OOMs and memory_stats deltas (stdlib only).

torch is never imported here. ``install(torch)`` receives the module once the user has
imported it; the allocator hooks start only after the user's own code has initialised
CUDA (these calls would initialise it themselves), found by a daemon thread that polls
``torch.cuda.is_initialized()`` with a backoff (``notify_cuda_ready()`` wakes it at once).

What runs, and what it costs (docs/oom_live.md has the measured numbers):

- the OOM observer (``torch._C._cuda_attach_out_of_memory_observer``, native allocator
  only): nothing until an OOM; then memory_stats, a bounded snapshot summary and one
  event. It never raises: an exception from an observer replaces the OOM;
- ``sys.excepthook`` / ``threading.excepthook`` (chained) and ``report_oom(exc)``: the OOM
  text, only for exceptions that are OOMs;
- one sampler thread: ``memory_stats`` per used device every INFERSIGHT_MEM_INTERVAL_S
  (default 1 s; 0 turns it off), an event only when something changed;
- optional history ring (INFERSIGHT_MEMORY_HISTORY=N): ``_record_memory_history(context=None,
  max_entries=N)``, read only on OOM, tagged with the current stage when the PyTorch
  build has ``_set_memory_metadata``.

Event kinds (the agent's ``agent/oom/kind.py`` reads them):

- ``oom``: dev, uuid, req, total, free, allowed, stats{...}, snap{...}, alloc_conf, fraction,
  backend, text, sp, source ("observer" | "exception" | "report"), hist[...];
- ``mem``: dev, uuid, sp, s{stat: value}, ev[{n, count, bytes}].
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from . import _env, _runtime, _state

if TYPE_CHECKING:
    from ._state import Alloc

MIB = 1 << 20
DEFAULT_INTERVAL_S: float = _env.VARS["INFERSIGHT_MEM_INTERVAL_S"].default
MIN_INTERVAL_S = 0.05
DEFAULT_LARGE_ALLOC_BYTES: int = _env.VARS["INFERSIGHT_LARGE_ALLOC_BYTES"].default
MAX_TEXT = 16384
MAX_SEGMENTS = 4096  # snapshot summary: segments looked at
MAX_BLOCKS = 32768  # ... and blocks (about 3 us each in Python on a slow core)
TOP_ALLOCS = 8
HIST_TAIL = 32  # history entries sent with an OOM
WAIT_MIN_S = 0.01
WAIT_MAX_S = 1.0

# memory_stats keys (flattened) -> the short names on the wire.
STAT_KEYS = (
    ("allocated_bytes.all.current", "allocated"),
    ("allocated_bytes.all.peak", "allocated_peak"),
    ("reserved_bytes.all.current", "reserved"),
    ("reserved_bytes.all.peak", "reserved_peak"),
    ("active_bytes.all.current", "active"),
    ("active_bytes.all.peak", "active_peak"),
    ("inactive_split_bytes.all.current", "inactive_split"),
    ("num_alloc_retries", "retries"),
    ("num_device_alloc", "device_alloc"),
    ("num_device_free", "device_free"),
    ("num_ooms", "ooms"),
)


def state() -> Alloc:
    """This process's allocator state (a forked child gets a new one: ``_state``)."""
    return _state.current.alloc


def _current_span() -> Optional[str]:
    sp = _runtime.current_span.get()
    return sp or (_runtime.state().root_span_id or None)


def _main_thread_span() -> Optional[str]:
    """The main thread's current stage, from other threads."""
    return _state.current.main_span or _runtime.state().root_span_id or None


def status() -> Dict[str, Any]:
    """What started (for doctor and tests)."""
    return dict(state().status)


# -- install / start ----------------------------------------------------------------------


def install(torch: Any = None) -> None:
    """Call once torch is imported: exception capture now, allocator hooks once CUDA is up."""
    st = state()
    try:
        if torch is None:
            torch = sys.modules.get("torch")
        if torch is None or not _runtime.active():
            return
        with st.lock:
            st.torch = torch
            if st.installed:
                return
            st.installed = True
        _install_excepthooks()
        if not cuda_possible(torch):
            return  # no allocator to hook or sample: no thread polling for a CUDA that cannot come
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_child)
        _start_thread()
    except Exception as exc:
        _runtime.fail(exc)


def cuda_possible(torch: Any) -> bool:
    """False for a torch built without CUDA or ROCm (``torch.version.cuda`` and ``.hip`` both
    None): ``torch.cuda`` can never be initialised there, and the allocator thread would wake
    up (10 ms, growing to 1 s) for the life of the process, each time taking the GIL from a
    busy main thread. True when unknown."""
    version = getattr(torch, "version", None)
    if version is None:
        return True
    return getattr(version, "cuda", "?") is not None or getattr(version, "hip", "?") is not None


def _start_thread() -> None:
    t = threading.Thread(target=_run, name="infersight-alloc", daemon=True)
    state().thread = t
    t.start()


def notify_cuda_ready() -> None:
    """CUDA was just initialised (e.g. from a ``torch.cuda._lazy_init`` wrapper): start now."""
    state().wake.set()


def _cuda_ready(torch: Any) -> bool:
    cuda = getattr(torch, "cuda", None)
    try:
        return cuda is not None and bool(cuda.is_initialized())
    except Exception:
        return False


def start_allocator_hooks() -> bool:
    """Attach the OOM observer (and the history ring) if CUDA is initialised. Idempotent."""
    st = state()
    torch = st.torch if st.torch is not None else sys.modules.get("torch")
    if torch is None or not _cuda_ready(torch):
        return False
    with st.lock:
        if st.started:
            return True
        st.started = True
    cuda = torch.cuda
    try:
        st.backend = str(cuda.get_allocator_backend()) if hasattr(cuda, "get_allocator_backend") else "native"
    except Exception:
        st.backend = "unknown"
    if st.backend != "native":
        st.status["reason"] = "allocator backend %r: exception capture and memory_stats only" % st.backend
        return True
    c = getattr(torch, "_C", None)
    attach = getattr(c, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        try:
            attach(_observer)
            st.observer_attached = True
            st.status["observer"] = True
        except Exception as exc:
            st.status["reason"] = "observer not attached: %r" % (exc,)
    else:
        st.status["reason"] = "this torch has no OOM observer: exception capture only"
    n = _env.get("INFERSIGHT_MEMORY_HISTORY")
    rec = getattr(getattr(cuda, "memory", None), "_record_memory_history", None)
    if n > 0 and rec is not None:
        try:
            rec("all", context=None, max_entries=n)
            st.history = n
            st.status["history"] = n
        except Exception as exc:
            st.status["reason"] = "history ring not started: %r" % (exc,)
    return True


def _run() -> None:
    """The allocator thread: wait for CUDA (backoff), start the hooks, then sample."""
    st = state()
    wait = WAIT_MIN_S
    try:
        while not st.stop and not st.started:
            if start_allocator_hooks():
                break
            st.wake.wait(wait)
            st.wake.clear()
            wait = min(WAIT_MAX_S, wait * 1.5)
        interval = _env.get("INFERSIGHT_MEM_INTERVAL_S")
        if interval <= 0 or st.stop:
            return
        interval = max(MIN_INTERVAL_S, interval)
        st.status["sampler"] = True
        sampler = Sampler(st.torch, _env.get("INFERSIGHT_LARGE_ALLOC_BYTES"))
        while not st.stop and _runtime.active():
            sampler.sample()
            if st.history:
                _tag_stage()
            time.sleep(interval)
    except Exception as exc:
        _runtime.fail(exc)


def _after_fork_child() -> None:
    """A forked child (after ``_runtime``'s handler gave it a fresh state): the allocator
    thread again, which attaches the hooks once the child initialises CUDA itself."""
    try:
        if state().installed:
            _start_thread()
    except Exception as exc:
        _runtime.fail(exc)


# -- memory_stats ---------------------------------------------------------------------------


def _flat_stats(torch: Any, dev: int) -> Dict[str, int]:
    """The STAT_KEYS subset of memory_stats(dev), from the nested dict (cheaper)."""
    cuda = torch.cuda
    nested = getattr(cuda, "memory_stats_as_nested_dict", None)
    out: Dict[str, int] = {}
    if nested is not None:
        raw = nested(dev)
        for key, short in STAT_KEYS:
            node: Any = raw
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, int):
                out[short] = node
        return out
    flat = cuda.memory_stats(dev)
    for key, short in STAT_KEYS:
        v = flat.get(key)
        if isinstance(v, int):
            out[short] = v
    return out


def _uuid(torch: Any, dev: int) -> Optional[str]:
    try:
        u = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    except Exception:
        return None
    if u is None:
        return None
    s = str(u)
    return s if s.startswith("GPU-") else "GPU-" + s


class Sampler:
    """memory_stats deltas per device; events for segment changes and large growth."""

    def __init__(self, torch: Any, large_bytes: int) -> None:
        self.torch = torch
        self.large = max(1, large_bytes)
        self.prev: Dict[int, Dict[str, int]] = {}
        self.uuids: Dict[int, Optional[str]] = {}

    def sample(self) -> int:
        """One pass over the devices; returns the number of events emitted."""
        n = 0
        try:
            count = int(self.torch.cuda.device_count())
        except Exception:
            return 0
        for dev in range(count):
            try:
                st = _flat_stats(self.torch, dev)
            except Exception:  # noqa: S112 - a device that cannot report is skipped
                continue
            prev = self.prev.get(dev)
            if prev is None and not st.get("device_alloc") and not st.get("reserved"):
                continue  # a device this process never used
            if prev == st:
                continue
            self.prev[dev] = st
            if dev not in self.uuids:
                self.uuids[dev] = _uuid(self.torch, dev)
            data: Dict[str, Any] = {"dev": dev, "s": st, "sp": _main_thread_span()}
            if self.uuids[dev]:
                data["uuid"] = self.uuids[dev]
            ev = self._events(prev or {}, st)
            if ev:
                data["ev"] = ev
            _runtime.emit("mem", data)
            n += 1
        return n

    def _events(self, prev: Dict[str, int], st: Dict[str, int]) -> List[Dict[str, Any]]:
        ev: List[Dict[str, Any]] = []
        d_res = st.get("reserved", 0) - prev.get("reserved", 0)
        for key, name, sign in (("device_alloc", "segment_alloc", 1), ("device_free", "segment_free", -1)):
            k = st.get(key, 0) - prev.get(key, 0)
            if k > 0:
                ev.append({"n": name, "count": k, "bytes": max(0, sign * d_res)})
        k = st.get("retries", 0) - prev.get("retries", 0)
        if k > 0:
            ev.append({"n": "alloc_retry", "count": k, "bytes": 0})
        grew = st.get("allocated", 0) - prev.get("allocated", 0)
        if grew >= self.large:
            # Between two samples: one allocation, or several, of at least this much in all.
            ev.append({"n": "large_alloc", "count": 1, "bytes": grew})
        return ev


# -- history ring ---------------------------------------------------------------------------


def _tag_stage() -> None:
    """Tag allocator history with the main thread's current span id."""
    sp = _main_thread_span()
    _set_meta("span=" + sp if sp else "")


def _set_meta(meta: str) -> None:
    st = state()
    if meta == st.meta:
        return
    fn = getattr(getattr(getattr(st.torch, "cuda", None), "memory", None), "_set_memory_metadata", None)
    if fn is None:
        return
    try:
        fn(meta)
        st.meta = meta
    except Exception:
        pass


def _history_tail(torch: Any, dev: int, large: int) -> List[Dict[str, Any]]:
    """The last HIST_TAIL entries of the ring: segment changes, OOMs and large allocations."""
    snap = torch.cuda.memory._snapshot(dev)
    traces = snap.get("device_traces") or []
    if not isinstance(traces, list) or dev >= len(traces):
        return []
    out: List[Dict[str, Any]] = []
    for te in reversed(traces[dev][-4096:]):
        action = te.get("action")
        size = int(te.get("size") or 0)
        if action in ("segment_alloc", "segment_free", "oom") or (action == "alloc" and size >= large):
            e: Dict[str, Any] = {"action": action, "size": size}
            meta = te.get("user_metadata")
            if meta:
                e["meta"] = str(meta)[:128]
            out.append(e)
            if len(out) >= HIST_TAIL:
                break
    out.reverse()
    return out


# -- the OOM observer -----------------------------------------------------------------------


def snapshot_summary(segments: Any, top: int = TOP_ALLOCS) -> Dict[str, Any]:
    """Bounded summary of ``memory_snapshot()`` segments (pure; takes the list).

    At most MAX_SEGMENTS segments and MAX_BLOCKS blocks in all are looked at ("truncated"
    says so). ``inactive_split`` is PyTorch's inactive_split_bytes: free blocks that have a
    neighbour in their segment (Block::is_split()), as infersight.rules.snapshot counts it.
    """
    pools: Dict[str, Dict[str, int]] = {}
    live: List[int] = []
    inactive_split = 0
    private = 0
    nseg = nblk = 0
    truncated = False
    for seg in segments:
        if nseg >= MAX_SEGMENTS or nblk >= MAX_BLOCKS:
            truncated = True
            break
        nseg += 1
        kind = str(seg.get("segment_type") or "large")
        pool = pools.setdefault(kind, {"segments": 0, "reserved": 0, "free": 0, "largest_free": 0})
        total = int(seg.get("total_size") or 0)
        pool["segments"] += 1
        pool["reserved"] += total
        pid = seg.get("segment_pool_id")
        if isinstance(pid, (tuple, list)) and any(pid[:4]):
            private += total
        blocks = seg.get("blocks") or []
        split = len(blocks) > 1
        if len(blocks) > MAX_BLOCKS - nblk:
            truncated = True
            blocks = blocks[: MAX_BLOCKS - nblk]
        nblk += len(blocks)
        free_here = 0
        for b in blocks:
            size = int(b.get("size") or 0)
            state = b.get("state")
            if state == "inactive":
                free_here += size
                pool["largest_free"] = max(pool["largest_free"], size)
            elif state == "active_allocated":
                live.append(size)
                if len(live) > 4 * top:
                    live.sort(reverse=True)
                    del live[top:]
        pool["free"] += free_here
        if split:
            inactive_split += free_here
    live.sort(reverse=True)
    out: Dict[str, Any] = {
        "segments": nseg,
        "pools": pools,
        "inactive_split": inactive_split,
        "top": live[:top],
    }
    if private:
        out["private_pools"] = private
    if truncated:
        out["truncated"] = True
    return out


def _alloc_conf() -> str:
    parts = []
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        v = os.environ.get(k)
        if v:
            parts.append("%s=%s" % (k, v[:512]))
    return ";".join(parts)


def _fraction(torch: Any, dev: int) -> Optional[float]:
    fn = getattr(getattr(torch, "_C", None), "_cuda_getMemoryFraction", None)
    if fn is None:
        return None
    try:
        return float(fn(dev))
    except Exception:
        return None


def oom_data(torch: Any, device: int, alloc: int, allowed_or_total: int, device_free: int) -> Dict[str, Any]:
    """The ``oom`` event of an observer call. May raise; the observer catches."""
    st = state()
    sp = _current_span()
    data: Dict[str, Any] = {
        "source": "observer", "dev": int(device), "req": int(alloc), "free": int(device_free),
        "sp": sp, "alloc_conf": _alloc_conf(), "backend": st.backend or "native",
    }
    total: Optional[int] = None
    try:
        props = torch.cuda.get_device_properties(device)
        total = int(props.total_memory)
    except Exception:
        pass
    frac = _fraction(torch, device)
    if frac is not None:
        data["fraction"] = frac
    # The third argument is the cap when a memory fraction is set, else the device total
    # (PyTorch names it device_allocated).
    if total is None:
        if frac is None or frac >= 1.0:
            total = int(allowed_or_total)
    elif int(allowed_or_total) < total and (frac is None or frac < 1.0):
        data["allowed"] = int(allowed_or_total)
    if total is not None:
        data["total"] = total
    uuid = _uuid(torch, device)
    if uuid:
        data["uuid"] = uuid
    try:
        data["stats"] = _flat_stats(torch, device)
    except Exception:
        pass
    if _env.get("INFERSIGHT_OOM_SNAPSHOT"):
        try:
            try:
                segs = torch.cuda.memory_snapshot(include_traces=False)
            except TypeError:
                segs = torch.cuda.memory_snapshot()
            data["snap"] = snapshot_summary(s for s in segs if s.get("device", device) == device)
        except Exception:
            pass
    if st.history:
        try:
            data["hist"] = _history_tail(torch, device, _env.get("INFERSIGHT_LARGE_ALLOC_BYTES"))
        except Exception:
            pass
    return data


def _observer(device: int, alloc: int, allowed_or_total: int, device_free: int) -> None:
    # Never raises: an exception here would replace the OutOfMemoryError.
    st = state()
    try:
        if not _runtime.active():
            return
        data = oom_data(st.torch, device, alloc, allowed_or_total, device_free)
        st.last_obs[threading.get_ident()] = (time.monotonic(), data.get("sp"), int(alloc))
        if len(st.last_obs) > 256:
            st.last_obs.clear()
        _runtime.emit_urgent("oom", data)
    except BaseException:  # nothing may escape an allocator observer
        pass


# -- exceptions -----------------------------------------------------------------------------


def _oom_classes() -> Tuple[type, ...]:
    st = state()
    torch = st.torch if st.torch is not None else sys.modules.get("torch")
    out: List[type] = []
    for owner in (torch, getattr(torch, "cuda", None)):
        cls = getattr(owner, "OutOfMemoryError", None)
        if isinstance(cls, type) and cls not in out:
            out.append(cls)
    return tuple(out)


def find_oom(exc: Optional[BaseException]) -> Optional[BaseException]:
    """``exc`` or the OOM in its cause/context chain (bounded), else None."""
    classes = _oom_classes()
    seen = 0
    while exc is not None and seen < 8:
        if (classes and isinstance(exc, classes)) or type(exc).__name__ == "OutOfMemoryError":
            return exc
        if isinstance(exc, RuntimeError) and "out of memory" in str(exc)[:4096].lower():
            return exc  # PyTorch < 1.13 raised a plain RuntimeError
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _mark(exc: BaseException) -> bool:
    """True the first time ``exc`` is reported."""
    st = state()
    if getattr(exc, "_infersight_reported", False) or id(exc) in st.reported:
        return False
    try:
        exc._infersight_reported = True  # type: ignore[attr-defined]
    except Exception:
        st.reported.append(id(exc))
        del st.reported[:-64]
    return True


def report_oom(exc: Optional[BaseException] = None, source: str = "report") -> bool:
    """Report a caught OutOfMemoryError (default: the one being handled). Never raises.

    Call it where the server catches the OOM, inside the request: the event is linked to
    the current span. Returns True when an OOM was reported.
    """
    st = state()
    try:
        if exc is None:
            exc = sys.exc_info()[1]
        if not _runtime.active():
            return False
        oom = find_oom(exc)
        if oom is None or not _mark(oom):
            return False
        if not st.started and st.torch is not None:
            start_allocator_hooks()
        sp = _runtime.current_span.get()
        last = st.last_obs.get(threading.get_ident())
        if sp is None and last is not None and time.monotonic() - last[0] < 60:
            sp = last[1]  # unwound past the stage: link to where the observer saw it
        data: Dict[str, Any] = {
            "source": source, "text": str(oom)[:MAX_TEXT], "sp": sp or _runtime.state().root_span_id or None,
            "type": type(oom).__name__, "alloc_conf": _alloc_conf(),
        }
        if st.backend:
            data["backend"] = st.backend
        _runtime.emit_urgent("oom", data)
        return True
    except BaseException:  # called from except blocks and excepthooks
        return False


def _sys_excepthook(tp: Any, value: Any, tb: Any) -> None:
    st = state()
    report_oom(value, "exception")
    prev = st.prev_sys_hook or sys.__excepthook__
    prev(tp, value, tb)


def _thread_excepthook(args: Any) -> None:
    st = state()
    report_oom(getattr(args, "exc_value", None), "exception")
    prev = st.prev_thread_hook or threading.__excepthook__
    prev(args)


def _install_excepthooks() -> None:
    st = state()
    if sys.excepthook is not _sys_excepthook:
        st.prev_sys_hook = sys.excepthook
        sys.excepthook = _sys_excepthook
    if threading.excepthook is not _thread_excepthook:
        st.prev_thread_hook = threading.excepthook
        threading.excepthook = _thread_excepthook
