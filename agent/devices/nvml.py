"""NVML, wrapped once (nvidia-ml-py's ``pynvml`` module, never the deprecated PyPI ``pynvml``).

Rules of this module:

- NVML is initialised lazily, on the first call that needs it, and at most once.
- Every reading that is absent or unsupported is ``None`` ("not available").
- Nothing raises past the wrapper. A failed ``nvmlInit`` (``NVMLError_LibraryNotFound`` where no
  driver is installed) is logged once and kept in :meth:`Nvml.status`.
- ``NVMLError_GpuIsLost`` marks the device lost: its samples carry ``state="failed"`` and one
  ``gpu_lost`` :class:`DeviceEvent` is queued (:meth:`Nvml.pop_events`).
- NVML reports host PIDs. They are mapped to the PIDs of ``proc_root`` (configurable, so tests can
  use a fake ``/proc``) only when the agent shares the host PID namespace; otherwise each process
  says why it is unmapped.
- Per-process SM utilisation (``nvmlDeviceGetProcessUtilization``) joins the compute processes of a
  full sample; the busiest :data:`MAX_DETAILED_PROCESSES` mapped ones also get their uid and parent
  chain (``/proc``), which tell a device's other tenants from the processes a series' requests ran in.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from infersight.agent.errors import AgentError
from infersight.rules.device_rules import THROTTLE_REASONS

log = logging.getLogger(__name__)

HwState = Literal["ok", "degraded", "failed"]
HW_STATES: tuple[HwState, ...] = ("ok", "degraded", "failed")

_THROTTLE_BY_BIT = dict(THROTTLE_REASONS)

# nvml.h constants used here (kept local so this module imports without pynvml).
_ERROR_NOT_SUPPORTED = 3
_ERROR_NOT_FOUND = 6  # nvmlDeviceGetProcessUtilization: no sample newer than the timestamp given
_ERROR_LIBRARY_NOT_FOUND = 12
LIBRARY_NOT_FOUND = "NVMLError_LibraryNotFound: NVML Shared Library Not Found"  # pynvml's str() of it
NVML_LIBRARY = "libnvidia-ml.so.1"  # the name pynvml loads on Linux
_ERROR_TIMEOUT = 10
_ERROR_FUNCTION_NOT_FOUND = 13  # the driver's library lacks the symbol (an older driver)
_ERROR_GPU_IS_LOST = 15
# The clock-event (throttle) reasons: the name since NVML 12.2 (driver R535), then the older name
# of the same call and bits, which older drivers export alone (R470, R525 are still in fleets).
_CLOCK_EVENT_CALLS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
_CLOCK_SM = 1
_CLOCK_MEM = 2
_TEMPERATURE_GPU = 0
_ECC_CORRECTED = 0
_ECC_UNCORRECTED = 1
_VOLATILE_ECC = 0
_RETIRED_SBE = 0
_RETIRED_DBE = 1
_NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS in nvml.h 12.x (Hopper has 18)
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
# The init PID namespace has a fixed inode (PROC_PID_INIT_INO in the kernel).
_INIT_PIDNS = "pid:[4026531836]"
# Compute processes per device and sample that get their uid and parent chain read (the busiest by SM,
# then memory): a neighbour that starts thousands of processes costs at most this many /proc reads.
MAX_DETAILED_PROCESSES = 16
MAX_ANCESTRY = 8  # parents followed up from a GPU process (a worker of a worker of a server)


def busiest_mapped(procs: Sequence[GpuProcess]) -> list[int]:
    """The indexes of the processes whose PID was mapped, busiest first (SM use, then memory): the first
    :data:`MAX_DETAILED_PROCESSES` get their uid and parent chain read."""
    return sorted((i for i, g in enumerate(procs) if g.pid is not None),
                  key=lambda i: (-(procs[i].sm_pct or 0), -(procs[i].used_bytes or 0)))


def kept_in_window(s: DeviceSample, timing: Callable[[], Collection[int]] = frozenset) -> DeviceSample:
    """What a verdict window keeps of a sample: the busiest MAX_DETAILED_PROCESSES mapped processes (those
    whose uid and parents were read, which a verdict places by their parent chain) and those whose PID times
    requests (``timing()``, asked only for a sample that holds more: a verdict places them by PID alone, as a
    series' own or another model's server). The rest no verdict can place; a neighbour's hundreds of compute
    processes would otherwise be held for every sample of the window (300 to 3600 per device). The exported
    metrics read the whole sample before."""
    procs = s.processes
    if not procs or len(procs) <= MAX_DETAILED_PROCESSES:
        return s
    keep = set(busiest_mapped(procs)[:MAX_DETAILED_PROCESSES])
    pids = timing()
    keep.update(i for i, g in enumerate(procs) if g.pid is not None and g.pid in pids)
    return replace(s, processes=tuple(procs[i] for i in sorted(keep)))


def _library_loads() -> bool:
    """Whether the loader finds the NVML library as pynvml would load it (Linux; elsewhere
    pynvml decides). A dlopen that fails costs microseconds; importing pynvml, milliseconds."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return False
    return True


def decode_throttle(mask: int) -> tuple[str, ...]:
    """Names of the set bits of a clock-event mask, lowest bit first; unknown bits as ``bit<N>``."""
    names: list[str] = []
    bit = 0
    while mask >> bit:
        value = 1 << bit
        if mask & value:
            names.append(_THROTTLE_BY_BIT.get(value, f"bit{bit}"))
        bit += 1
    return tuple(names)


@dataclass(frozen=True, slots=True)
class NvmlStatus:
    """Whether NVML could be used; ``reason`` is the exact init failure when it could not."""

    available: bool
    reason: str | None = None  # e.g. "NVMLError_LibraryNotFound: NVML Shared Library Not Found"
    error_code: int | None = None  # the NVML return code, when there was one
    driver_version: str | None = None
    device_count: int = 0


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One compute process on a device, as NVML reports it (host PID) and as the agent sees it."""

    host_pid: int
    used_bytes: int | None
    pid: int | None  # the PID under proc_root; None when it cannot be mapped
    name: str | None  # /proc/<pid>/comm when mapped
    unmapped_reason: str | None = None
    # SM utilisation (%) since the previous full sample (nvmlDeviceGetProcessUtilization; 0: no
    # sample, the process did not compute); None when it was not read (not supported, a light read).
    sm_pct: int | None = None
    uid: int | None = None  # real uid from /proc/<pid>/status; None when not read
    # Parent, grandparent... (PIDs under proc_root, at most MAX_ANCESTRY, init excluded); None when
    # not read: unmapped, gone, hidden (hidepid), or past the MAX_DETAILED_PROCESSES busiest.
    ancestors: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One reading of one device. Every field but the identity may be None (not available)."""

    time_ns: int
    index: int
    uuid: str | None  # "GPU-<uuid>" exactly as NVML returns it; hw.id
    name: str | None
    vendor: str = "nvidia"
    state: HwState = "ok"
    lost: bool = False
    lost_reason: str | None = None  # what NVML said when it lost the GPU (lost samples only)
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    clock_sm_mhz: int | None = None
    clock_sm_max_mhz: int | None = None
    clock_memory_mhz: int | None = None
    clock_memory_max_mhz: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: int | None = None
    throttle_mask: int | None = None
    throttle_reasons: tuple[str, ...] = ()
    pcie_link_gen: int | None = None
    pcie_link_gen_max: int | None = None
    pcie_link_width: int | None = None
    pcie_link_width_max: int | None = None
    pcie_replay: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    nvlink_active: tuple[bool, ...] | None = None  # per link that exists; None without NVLink
    processes: tuple[GpuProcess, ...] | None = None
    process_util_read: bool = False  # the processes' sm_pct was read (else per-process use is unknown)


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    """Something that happened to a device: ``gpu_lost``, ``xid``, ``ecc_single_bit``,
    ``ecc_double_bit`` or ``watcher_error``."""

    time_ns: int
    kind: str
    index: int | None
    uuid: str | None
    code: int | None  # the Xid for "xid", the NVML return code for errors
    message: str


def health_state(s: DeviceSample) -> HwState:
    """The sampler's own view: failed when lost; degraded on uncorrected ECC or a failed row remap.

    PCIe links below maximum do not degrade on their own: idle GPUs downtrain their link.
    """
    if s.lost:
        return "failed"
    if (s.ecc_uncorrected_volatile or 0) > 0 or s.remap_failure:
        return "degraded"
    return "ok"


_Lineage = tuple[bytes, int | None, tuple[int, ...] | None]  # start ticks, uid, parents


class _GpuLostError(AgentError):
    pass


def _handle_key(handle: Any) -> int:
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except Exception:
        return id(handle)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Nvml:
    """The one NVML wrapper. Thread-safe; cheap to construct (NVML initialises on first use).

    ``lib`` replaces the ``pynvml`` module (tests); ``proc_root`` replaces ``/proc``.
    """

    def __init__(
        self,
        *,
        proc_root: str | os.PathLike[str] = "/proc",
        lib: Any = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self._lib: Any = lib
        self._proc_root = Path(proc_root)
        self._proc_root_s = os.fspath(proc_root)
        self._clock = clock
        self._lock = threading.Lock()  # the handles, lost devices and events: held briefly, never over a driver call
        self._init_lock = threading.Lock()  # nvmlInit, which a driver that stopped answering holds for ever
        self._status: NvmlStatus | None = None
        self._handles: dict[int, Any] = {}
        self._ident: dict[int, tuple[str | None, str | None]] = {}
        self._nvlinks: dict[int, tuple[int, ...]] = {}
        self._lost: dict[int, str] = {}  # device index -> what NVML said when it was lost
        self._events: list[DeviceEvent] = []
        self._host_pidns: bool | None = None
        self._clock_event_call = _CLOCK_EVENT_CALLS[0]  # the older name once the driver lacks this one
        self._util_seen: dict[int, int] = {}  # device index -> newest per-process sample timestamp (us)
        self._util_unsupported: set[int] = set()  # devices whose per-process utilisation is not supported
        # device index -> PID -> (start ticks, uid, parents) of its detailed processes, read once per process
        self._lineage: dict[int, dict[int, _Lineage]] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def status(self) -> NvmlStatus:
        """Initialise NVML once; the result (success or the exact failure) is kept. Waits for an
        nvmlInit in progress; :meth:`pop_events` (the event loop's) does not."""
        st = self._status
        if st is not None:
            return st
        with self._init_lock:
            if self._status is None:
                self._status = self._init()
            return self._status

    def _init(self) -> NvmlStatus:
        if self._lib is None:
            import importlib.util

            if importlib.util.find_spec("pynvml") is None:
                return self._failed("nvidia-ml-py is not installed: No module named 'pynvml'", None)
            if not _library_loads():
                # What pynvml's nvmlInit says then, without importing pynvml (~15 ms of CPU,
                # paid by every launch on a host without a driver, while its command starts).
                return self._failed(LIBRARY_NOT_FOUND, _ERROR_LIBRARY_NOT_FOUND)
            try:
                import pynvml
            except ImportError as exc:
                return self._failed(f"nvidia-ml-py is not installed: {exc}", None)
            self._lib = pynvml
        try:
            self._lib.nvmlInit()
        except Exception as exc:
            return self._failed(f"{type(exc).__name__}: {exc}", getattr(exc, "value", None))
        self._host_pidns = self._detect_host_pidns()
        count = self._raw("nvmlDeviceGetCount")
        return NvmlStatus(
            available=True,
            driver_version=_text(self._raw("nvmlSystemGetDriverVersion")),
            device_count=int(count or 0),
        )

    @staticmethod
    def _failed(reason: str, code: int | None) -> NvmlStatus:
        log.warning("NVML not available: %s", reason)  # logged once: the status is kept
        return NvmlStatus(available=False, reason=reason, error_code=code)

    def close(self) -> None:
        """Shut NVML down if it was initialised. Safe to call more than once."""
        with self._init_lock:
            if self._status is not None and self._status.available:
                self._raw("nvmlShutdown")
                self._status = NvmlStatus(available=False, reason="closed")
            with self._lock:
                self._handles.clear()

    # -- raw calls -----------------------------------------------------------------------------

    def _raw(self, name: str, *args: Any) -> Any:
        """Call ``pynvml.<name>``; None on any error; a lost GPU raises _GpuLostError."""
        return self._call(name, *args)[1]

    def _call(self, name: str, *args: Any) -> tuple[bool, Any]:
        """(succeeded, result) of ``pynvml.<name>``; raises only _GpuLostError."""
        fn = getattr(self._lib, name, None)
        if fn is None:
            return False, None
        try:
            return True, fn(*args)
        except Exception as exc:
            if getattr(exc, "value", None) == _ERROR_GPU_IS_LOST:
                raise _GpuLostError(str(exc)) from None
            return False, None

    def _handle(self, index: int) -> Any:
        with self._lock:
            h = self._handles.get(index)
        if h is None:
            h = self._raw("nvmlDeviceGetHandleByIndex", index)
            if h is not None:
                with self._lock:
                    self._handles[index] = h
        return h

    def _identity(self, index: int, h: Any) -> tuple[str | None, str | None]:
        ident = self._ident.get(index)
        if ident is None or ident[0] is None:
            ident = (
                _text(self._raw("nvmlDeviceGetUUID", h)),
                _text(self._raw("nvmlDeviceGetName", h)),
            )
            self._ident[index] = ident
        return ident

    # -- sampling ------------------------------------------------------------------------------

    def device_count(self) -> int:
        st = self.status()
        return st.device_count if st.available else 0

    def sample_all(self) -> list[DeviceSample]:
        """One sample per device NVML lists; empty when NVML is not available."""
        out: list[DeviceSample] = []
        for i in range(self.device_count()):
            s = self.sample(i)
            if s is not None:
                out.append(s)
        return out

    def sample(self, index: int) -> DeviceSample | None:
        """Read every field of one device; None when NVML is unavailable or has no handle."""
        if not self.status().available:
            return None
        now = self._clock()
        if index in self._lost:
            return self._lost_sample(index, now)
        try:
            h = self._handle(index)
            if h is None:
                return None
            return self._read(index, h, now)
        except _GpuLostError as exc:
            self._mark_lost(index, now, str(exc))
            return self._lost_sample(index, now)

    def memory_view(self, index: int) -> DeviceSample | None:
        """The device's processes, then its memory, and nothing else (three NVML calls, the identity cached): what
        an OOM's context reads, at once, before the process that failed exits. The other fields are None."""
        if not self.status().available or index in self._lost:
            return None
        try:
            h = self._handle(index)
            if h is None:
                return None
            procs = self._processes(h)  # first: they go when the failed process exits
            mem = self._raw("nvmlDeviceGetMemoryInfo", h)
            uuid, name = self._identity(index, h)
        except _GpuLostError as exc:
            self._mark_lost(index, self._clock(), str(exc))
            return None
        return DeviceSample(time_ns=self._clock(), index=index, uuid=uuid, name=name,
                            memory_used_bytes=None if mem is None else int(mem.used),
                            memory_total_bytes=None if mem is None else int(mem.total), processes=procs)

    def _read(self, index: int, h: Any, now: int) -> DeviceSample:
        r = self._raw
        uuid, name = self._identity(index, h)
        util = r("nvmlDeviceGetUtilizationRates", h)
        mem = r("nvmlDeviceGetMemoryInfo", h)
        power_mw = r("nvmlDeviceGetPowerUsage", h)
        limit_mw = r("nvmlDeviceGetEnforcedPowerLimit", h)
        mask = self._clock_events(h)
        remap = r("nvmlDeviceGetRemappedRows", h)
        sbe = r("nvmlDeviceGetRetiredPages", h, _RETIRED_SBE)
        dbe = r("nvmlDeviceGetRetiredPages", h, _RETIRED_DBE)
        procs, util_read = self._processes_with_use(index, h)
        s = DeviceSample(
            time_ns=now,
            index=index,
            uuid=uuid,
            name=name,
            utilization_gpu_pct=None if util is None else int(util.gpu),
            utilization_memory_pct=None if util is None else int(util.memory),
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_total_bytes=None if mem is None else int(mem.total),
            clock_sm_mhz=r("nvmlDeviceGetClockInfo", h, _CLOCK_SM),
            clock_sm_max_mhz=r("nvmlDeviceGetMaxClockInfo", h, _CLOCK_SM),
            clock_memory_mhz=r("nvmlDeviceGetClockInfo", h, _CLOCK_MEM),
            clock_memory_max_mhz=r("nvmlDeviceGetMaxClockInfo", h, _CLOCK_MEM),
            power_w=None if power_mw is None else power_mw / 1000.0,
            power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
            temperature_c=r("nvmlDeviceGetTemperature", h, _TEMPERATURE_GPU),
            throttle_mask=mask,
            throttle_reasons=decode_throttle(mask) if mask is not None else (),
            pcie_link_gen=r("nvmlDeviceGetCurrPcieLinkGeneration", h),
            pcie_link_gen_max=r("nvmlDeviceGetMaxPcieLinkGeneration", h),
            pcie_link_width=r("nvmlDeviceGetCurrPcieLinkWidth", h),
            pcie_link_width_max=r("nvmlDeviceGetMaxPcieLinkWidth", h),
            pcie_replay=r("nvmlDeviceGetPcieReplayCounter", h),
            ecc_corrected_volatile=r("nvmlDeviceGetTotalEccErrors", h, _ECC_CORRECTED, _VOLATILE_ECC),
            ecc_uncorrected_volatile=r("nvmlDeviceGetTotalEccErrors", h, _ECC_UNCORRECTED, _VOLATILE_ECC),
            retired_pages_sbe=None if sbe is None else len(sbe),
            retired_pages_dbe=None if dbe is None else len(dbe),
            remapped_rows_corrected=None if remap is None else int(remap[0]),
            remapped_rows_uncorrected=None if remap is None else int(remap[1]),
            remap_pending=None if remap is None else bool(remap[2]),
            remap_failure=None if remap is None else bool(remap[3]),
            nvlink_active=self._nvlink(index, h),
            processes=procs,
            process_util_read=util_read,
        )
        state = health_state(s)
        return s if state == "ok" else replace(s, state=state)

    def _clock_events(self, h: Any) -> int | None:
        """The clock-event (throttle) reason mask. A driver before R535 has no
        ``nvmlDeviceGetCurrentClocksEventReasons`` (NVML_ERROR_FUNCTION_NOT_FOUND, and a binding
        may lack it too): from then on the older ``...ThrottleReasons`` answers, with the same bits."""
        name = self._clock_event_call
        fn = getattr(self._lib, name, None)
        if fn is not None:
            try:
                return int(fn(h))
            except Exception as exc:
                code = getattr(exc, "value", None)
                if code == _ERROR_GPU_IS_LOST:
                    raise _GpuLostError(str(exc)) from None
                if code != _ERROR_FUNCTION_NOT_FOUND:
                    return None
        if name == _CLOCK_EVENT_CALLS[-1]:
            return None
        self._clock_event_call = _CLOCK_EVENT_CALLS[-1]
        return self._clock_events(h)

    def _nvlink(self, index: int, h: Any) -> tuple[bool, ...] | None:
        links = self._nvlinks.get(index)
        if links is None:  # probe once which links exist; the set does not change
            links = tuple(
                k for k in range(_NVLINK_MAX_LINKS) if self._raw("nvmlDeviceGetNvLinkState", h, k) is not None
            )
            self._nvlinks[index] = links
        if not links:
            return None
        states = [self._raw("nvmlDeviceGetNvLinkState", h, k) for k in links]
        return tuple(bool(v) for v in states)

    def _processes(self, h: Any) -> tuple[GpuProcess, ...] | None:
        procs = self._raw("nvmlDeviceGetComputeRunningProcesses", h)
        if procs is None:
            return None
        return tuple(self._map(int(p.pid), p.usedGpuMemory) for p in procs)

    def _process_sm(self, index: int, h: Any) -> dict[int, int] | None:
        """Host PID -> mean SM % of its samples newer than the last ones read; {} when NVML has none
        (NVML_ERROR_NOT_FOUND; nvidia-ml-py also raises NVMLError(NVML_SUCCESS) for an empty first
        answer); None when not supported (some GPUs, MIG, vGPU: not asked again) or on another error."""
        if index in self._util_unsupported:
            return None
        fn = getattr(self._lib, "nvmlDeviceGetProcessUtilization", None)
        if fn is None:
            self._util_unsupported.add(index)
            return None
        try:
            samples = fn(h, self._util_seen.get(index, 0))
        except Exception as exc:
            code = getattr(exc, "value", None)
            if code == _ERROR_GPU_IS_LOST:
                raise _GpuLostError(str(exc)) from None
            if code in (_ERROR_NOT_FOUND, 0):
                return {}
            if code in (_ERROR_NOT_SUPPORTED, _ERROR_FUNCTION_NOT_FOUND):
                self._util_unsupported.add(index)
            return None
        sums: dict[int, list[int]] = {}
        newest = self._util_seen.get(index, 0)
        for u in samples:
            pid, ts = int(u.pid), int(u.timeStamp)
            newest = max(newest, ts)
            acc = sums.setdefault(pid, [0, 0])
            acc[0] += min(int(u.smUtil), 100)
            acc[1] += 1
        self._util_seen[index] = newest
        return {pid: total // n for pid, (total, n) in sums.items()}

    def _processes_with_use(self, index: int, h: Any) -> tuple[tuple[GpuProcess, ...] | None, bool]:
        """The compute processes with their SM use; the busiest mapped ones with uid and parents."""
        procs = self._processes(h)
        if not procs:  # (the utilisation of processes that hold no compute context is not asked)
            self._lineage.pop(index, None)
            return procs, False
        sm = self._process_sm(index, h)
        if sm is not None:
            procs = tuple(replace(g, sm_pct=sm.get(g.host_pid, 0)) for g in procs)
        busiest = busiest_mapped(procs)
        before = self._lineage.get(index, {})
        kept: dict[int, _Lineage] = {}
        detailed = list(procs)
        for i in busiest[:MAX_DETAILED_PROCESSES]:
            g = procs[i]
            assert g.pid is not None
            stat = self._stat(g.pid)
            if stat is None:
                continue
            known = before.get(g.pid)
            if known is None or known[0] != stat[1]:  # new, or the PID was reused
                known = (stat[1], self.uid_of(g.pid), self._ancestors(g.pid, stat[0]))
            kept[g.pid] = known
            detailed[i] = replace(g, uid=known[1], ancestors=known[2])
        self._lineage[index] = kept
        return tuple(detailed), sm is not None

    def _stat(self, pid: int) -> tuple[int, bytes] | None:
        """(parent PID, start ticks) from ``/proc/<pid>/stat`` (fields 4 and 22, after the
        parenthesised comm, which may hold anything); None when unreadable."""
        try:
            with open(f"{self._proc_root_s}/{pid}/stat", "rb") as f:
                raw = f.read(4096)
            fields = raw[raw.rindex(b")") + 2:].split()
            return int(fields[1]), fields[19]
        except (OSError, ValueError, IndexError):
            return None

    def ancestors_of(self, pid: int) -> tuple[int, ...] | None:
        """The parent chain of ``pid`` (under proc_root), as :meth:`_ancestors`; None when unreadable."""
        stat = self._stat(pid)
        return None if stat is None else self._ancestors(pid, stat[0])

    def _ancestors(self, pid: int, parent: int) -> tuple[int, ...] | None:
        """The parent chain of ``pid`` (whose parent is ``parent``) up to init, excluded, at most
        MAX_ANCESTRY; None when a link of it cannot be read (gone, or hidden: hidepid)."""
        out: list[int] = []
        while parent > 1 and parent != pid and parent not in out and len(out) < MAX_ANCESTRY:
            out.append(parent)
            stat = self._stat(parent)
            if stat is None:
                return None
            parent = stat[0]
        return tuple(out)

    def comm_of(self, pid: int) -> str | None:
        """``/proc/<pid>/comm`` under proc_root; None when it cannot be read."""
        try:
            with open(f"{self._proc_root_s}/{pid}/comm", encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def uid_of(self, pid: int) -> int | None:
        """The real uid of ``pid`` under proc_root; None when it cannot be read."""
        try:
            with open(f"{self._proc_root_s}/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return None

    # -- PID mapping ---------------------------------------------------------------------------

    def _detect_host_pidns(self) -> bool | None:
        try:
            return os.readlink(self._proc_root / "self" / "ns" / "pid") == _INIT_PIDNS
        except OSError:
            return None

    def _map(self, host_pid: int, used: int | None) -> GpuProcess:
        used_bytes = None if used is None else int(used)
        if self._host_pidns is False:
            return GpuProcess(
                host_pid, used_bytes, None, None,
                "agent is in a nested PID namespace: host PIDs are not visible "
                "(run it in the host PID namespace to map them)",
            )  # fmt: skip
        comm = self.comm_of(host_pid)
        if comm is None and not os.path.isdir(f"{self._proc_root_s}/{host_pid}"):
            return GpuProcess(host_pid, used_bytes, None, None, f"no PID {host_pid} under {self._proc_root}")
        return GpuProcess(host_pid, used_bytes, host_pid, comm)

    # -- lost devices and events ---------------------------------------------------------------

    def _mark_lost(self, index: int, now: int, reason: str) -> None:
        with self._lock:
            if index in self._lost:
                return
            self._lost[index] = reason
            uuid = self._ident.get(index, (None, None))[0]
            self._events.append(
                DeviceEvent(now, "gpu_lost", index, uuid, _ERROR_GPU_IS_LOST, f"GPU {index} lost: {reason}")
            )
        log.error("GPU %d (%s) is lost: %s", index, uuid, reason)

    def _lost_sample(self, index: int, now: int) -> DeviceSample:
        uuid, name = self._ident.get(index, (None, None))
        with self._lock:
            reason = self._lost.get(index)
        return DeviceSample(time_ns=now, index=index, uuid=uuid, name=name, state="failed", lost=True,
                            lost_reason=reason)

    def pop_events(self) -> list[DeviceEvent]:
        """Events raised while sampling (lost GPUs), oldest first; each is returned once."""
        with self._lock:
            out, self._events = self._events, []
        return out

    # used by XidWatcher
    def _index_of(self) -> dict[int, tuple[int, str | None]]:
        out: dict[int, tuple[int, str | None]] = {}
        for i in range(self.device_count()):
            try:
                h = self._handle(i)
                if h is not None:
                    out[_handle_key(h)] = (i, self._identity(i, h)[0])
            except _GpuLostError:
                continue
        return out


class XidWatcher:
    """Waits on an NVML event set on a worker thread and hands each event to ``callback``.

    ``nvmlEventSetWait`` blocks at most ``timeout_ms``, so :meth:`stop` returns within about that
    long. The callback runs on the worker thread; its exceptions are logged, never propagated.
    """

    def __init__(
        self,
        nvml: Nvml,
        callback: Callable[[DeviceEvent], None],
        *,
        timeout_ms: int = 1000,
        event_types: int = EVENT_XID | EVENT_DOUBLE_BIT_ECC | EVENT_SINGLE_BIT_ECC,
    ) -> None:
        self._nvml = nvml
        self._callback = callback
        self._timeout_ms = timeout_ms
        self._types = event_types
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set: Any = None
        self._devices: dict[int, tuple[int, str | None]] = {}
        self.registered: tuple[int, ...] = ()  # device indices whose events are watched

    def start(self) -> bool:
        """Create the event set and start the thread; False when no device can be watched."""
        if self._thread is not None:
            return True
        nv = self._nvml
        if not nv.status().available:
            return False
        self._set = nv._raw("nvmlEventSetCreate")
        if self._set is None:
            return False
        self._devices = nv._index_of()
        registered: list[int] = []
        for index, _uuid in self._devices.values():
            try:
                h = nv._handle(index)
                supported = nv._raw("nvmlDeviceGetSupportedEventTypes", h)
                mask = self._types & (supported if supported is not None else EVENT_XID)
                if mask and nv._call("nvmlDeviceRegisterEvents", h, mask, self._set)[0]:
                    registered.append(index)
            except _GpuLostError:
                continue
        self.registered = tuple(sorted(registered))
        self._thread = threading.Thread(target=self._run, name="infersight-nvml-events", daemon=True)
        self._thread.start()
        return True

    def request_stop(self) -> None:
        """Ask the thread to end, without waiting (nor needing it started: a start still in progress then
        starts a thread that ends at once)."""
        self._stop.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _emit(self, ev: DeviceEvent) -> None:
        try:
            self._callback(ev)
        except Exception:
            log.exception("device event callback failed")

    def _run(self) -> None:
        lib = self._nvml._lib
        reported: set[int] = set()
        try:
            while not self._stop.is_set():
                try:
                    data = lib.nvmlEventSetWait(self._set, self._timeout_ms)
                except Exception as exc:
                    code = getattr(exc, "value", None)
                    if code == _ERROR_TIMEOUT:
                        continue
                    key = code if isinstance(code, int) else -1
                    if key not in reported:  # report each kind of failure once, then back off
                        reported.add(key)
                        kind = "gpu_lost" if code == _ERROR_GPU_IS_LOST else "watcher_error"
                        msg = f"nvmlEventSetWait: {type(exc).__name__}: {exc}"
                        self._emit(DeviceEvent(time.time_ns(), kind, None, None, code, msg))
                    self._stop.wait(self._timeout_ms / 1000.0)
                    continue
                self._emit(self._to_event(data))
        finally:
            try:
                lib.nvmlEventSetFree(self._set)
            except Exception:
                log.debug("nvmlEventSetFree failed", exc_info=True)

    def _to_event(self, data: Any) -> DeviceEvent:
        index, uuid = self._devices.get(_handle_key(data.device), (None, None))
        etype = int(data.eventType)
        value = int(data.eventData)
        where = f"GPU {index}" if index is not None else "GPU ?"
        if etype & EVENT_XID:
            return DeviceEvent(time.time_ns(), "xid", index, uuid, value, f"{where}: Xid {value}")
        if etype & EVENT_DOUBLE_BIT_ECC:
            return DeviceEvent(time.time_ns(), "ecc_double_bit", index, uuid, None, f"{where}: DBE")
        if etype & EVENT_SINGLE_BIT_ECC:
            return DeviceEvent(time.time_ns(), "ecc_single_bit", index, uuid, None, f"{where}: SBE")
        return DeviceEvent(time.time_ns(), f"event_0x{etype:x}", index, uuid, value, f"{where}: event 0x{etype:x}")
