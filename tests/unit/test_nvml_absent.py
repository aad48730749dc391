"""No NVML at all: the wrapper reports NVMLError_LibraryNotFound once and returns nothing."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pynvml
import pytest

from infersight.agent.devices.metrics import device_metrics
from infersight.agent.devices.nvml import Nvml, XidWatcher
from infersight.telemetry import Resource

REASON = "NVMLError_LibraryNotFound: NVML Shared Library Not Found"


class _NoLibrary(SimpleNamespace):
    calls = 0

    def nvmlInit(self) -> None:  # noqa: N802
        type(self).calls += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


def test_library_not_found_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    lib = _NoLibrary()
    nv = Nvml(lib=lib)
    with caplog.at_level(logging.WARNING, logger="infersight.agent.devices.nvml"):
        for _ in range(3):
            st = nv.status()
            assert nv.sample_all() == []
            assert nv.sample(0) is None
            assert nv.device_count() == 0
    assert st.available is False
    assert st.reason == REASON
    assert st.error_code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert _NoLibrary.calls == 1  # initialised lazily, tried once
    warnings = [r for r in caplog.records if "NVML not available" in r.getMessage()]
    assert len(warnings) == 1
    assert REASON in warnings[0].getMessage()
    assert nv.pop_events() == []
    assert XidWatcher(nv, lambda e: None).start() is False
    assert device_metrics([], resource=Resource.of({}), start_ns=0) == []
    nv.close()  # harmless


def test_unexpected_errors_never_escape() -> None:
    """Any exception from a binding (not only NVMLError) becomes a not-available value."""

    def boom(*_a: object) -> None:
        raise RuntimeError("binding bug")

    lib = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: object(),
        nvmlDeviceGetUUID=lambda h: "GPU-x",
        nvmlDeviceGetName=lambda h: b"stub",
        nvmlDeviceGetUtilizationRates=boom,
        nvmlDeviceGetCurrentClocksEventReasons=boom,
        nvmlDeviceGetComputeRunningProcesses=boom,
    )
    nv = Nvml(lib=lib, proc_root="/nonexistent")
    (s,) = nv.sample_all()
    assert (s.uuid, s.name, s.state) == ("GPU-x", "stub", "ok")
    assert s.utilization_gpu_pct is None
    assert s.throttle_mask is None
    assert s.processes is None
    assert s.clock_sm_mhz is None  # binding absent from the module: not available


def test_event_watcher_reports_a_failing_wait_once() -> None:
    """nvmlEventSetWait failing (here: GPU lost) gives one event, then backs off; no crash."""
    import threading
    import time

    waits = []

    def wait(_set: object, _ms: int) -> None:
        waits.append(1)
        if len(waits) < 3:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    freed = threading.Event()
    lib = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: object(),
        nvmlDeviceGetUUID=lambda h: "GPU-x",
        nvmlDeviceGetName=lambda h: "stub",
        nvmlEventSetCreate=object,
        nvmlDeviceGetSupportedEventTypes=lambda h: 0xFF,
        nvmlDeviceRegisterEvents=lambda h, m, s: None,
        nvmlEventSetWait=wait,
        nvmlEventSetFree=lambda s: freed.set(),
    )
    got: list = []
    w = XidWatcher(Nvml(lib=lib), got.append, timeout_ms=10)
    assert w.start() is True
    assert w.registered == (0,)
    deadline = time.monotonic() + 30  # the watcher's thread: late on a loaded machine
    while len(waits) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    w.stop()
    assert not w.running
    assert freed.is_set()
    assert [e.kind for e in got] == ["gpu_lost"]
    assert got[0].code == pynvml.NVML_ERROR_GPU_IS_LOST
