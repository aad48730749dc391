"""A slow device's cause needs evidence from NVML: a missed reading, an unread throttle mask or an
older driver must not invent a cause, nor hide the real one.

The NVML libraries here are FAKES (``SimpleNamespace`` objects with the pynvml calls the wrapper
makes); they are not NVIDIA's NVML and talk to no hardware.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml

from infersight.agent.devices.heterogeneity import causes, evaluate, summarize_samples
from infersight.agent.devices.nvml import DeviceSample, Nvml
from infersight.latency import SeriesKey, SeriesStats
from infersight.rules.device_rules import DeviceThresholds

TH = DeviceThresholds()


def _sample(i: int = 0, **kw: Any) -> DeviceSample:
    base: dict[str, Any] = {
        "time_ns": i, "index": 0, "uuid": "GPU-fake", "name": "FAKE GPU", "utilization_gpu_pct": 90,
        "clock_sm_mhz": 1980, "clock_sm_max_mhz": 1980, "throttle_mask": 0,
    }  # fmt: skip
    base.update(kw)
    return DeviceSample(**base)


def _slow_cause(samples: list[DeviceSample]) -> str | None:
    series = [SeriesStats(SeriesKey(d, "m", "c", "FAKE GPU"), 1000, 0.1, p) for d, p in
              (("GPU-a", 0.1), ("GPU-b", 0.1), ("GPU-fake", 0.3))]  # fmt: skip
    v = evaluate(series, {"GPU-fake": summarize_samples(samples, TH)}, TH)[2]
    assert v.verdict == "slow"
    return v.cause


def test_a_missed_ecc_reading_is_no_new_error() -> None:
    """1000 corrected errors since the driver loaded, unchanged; one read of the counter failed
    (None). That is no rise: the old fold took the gap for 0 and claimed 1000 new errors."""
    samples = [_sample(i, ecc_corrected_volatile=None if i == 5 else 1000, ecc_uncorrected_volatile=0)
               for i in range(10)]  # fmt: skip
    w = summarize_samples(samples, TH)
    assert w.ecc_errors == 0
    assert causes(w, TH) == [("unknown", "no NVML signal in the window explains it")]
    assert _slow_cause(samples) == "unknown"


def test_ecc_rise_is_the_increases_of_each_counter() -> None:
    corrected = [5, None, 7, 0, 2]  # +2, then the driver reloaded (counter reset), +2
    uncorrected = [None, 1, 1, None, 1]  # unchanged where read
    samples = [_sample(i, ecc_corrected_volatile=c, ecc_uncorrected_volatile=u)
               for i, (c, u) in enumerate(zip(corrected, uncorrected, strict=True))]  # fmt: skip
    assert summarize_samples(samples, TH).ecc_errors == 4
    rising = [_sample(i, ecc_corrected_volatile=10 + i, ecc_uncorrected_volatile=0) for i in range(4)]
    assert summarize_samples(rising, TH).ecc_errors == 3
    assert _slow_cause(rising) == "ecc_errors"


def test_low_clocks_with_unread_reasons_are_not_unexplained() -> None:
    """An SM clock at 60% of max while the throttle mask could not be read is no evidence of
    "no throttle reason": a thermally throttled GPU would be called clocks_below_max."""
    unread = [_sample(i, clock_sm_mhz=1200, throttle_mask=None) for i in range(10)]
    w = summarize_samples(unread, TH)
    assert w.clocks_below_max_samples == 0
    assert _slow_cause(unread) == "unknown"
    read = [_sample(i, clock_sm_mhz=1200, throttle_mask=0) for i in range(10)]
    assert summarize_samples(read, TH).clocks_below_max_samples == 10
    assert _slow_cause(read) == "clocks_below_max"


def test_pcie_detail_names_only_what_nvml_gave() -> None:
    samples = [_sample(i, pcie_link_gen=3, pcie_link_gen_max=5) for i in range(4)]  # width NotSupported
    w = summarize_samples(samples, TH)
    assert w.pcie_detail == "Gen3 of Gen5"
    (cause, detail), *_ = causes(w, TH)
    assert cause == "pcie_link_degraded"
    assert "None" not in detail


def _fake_lib(new_name: Any, old_name: Any = None) -> SimpleNamespace:
    """A FAKE pynvml module: one healthy-looking device whose clock-event reasons come from
    ``new_name`` (nvmlDeviceGetCurrentClocksEventReasons) and ``old_name`` (...ThrottleReasons)."""
    lib = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: object(),
        nvmlDeviceGetUUID=lambda h: "GPU-fake",
        nvmlDeviceGetName=lambda h: "FAKE GPU",
        nvmlDeviceGetClockInfo=lambda h, t: 1200,
        nvmlDeviceGetMaxClockInfo=lambda h, t: 1980,
        nvmlDeviceGetCurrentClocksEventReasons=new_name,
    )
    if old_name is not None:
        lib.nvmlDeviceGetCurrentClocksThrottleReasons = old_name
    return lib


def test_throttle_reasons_on_a_driver_before_r535() -> None:
    """Drivers before R535 (R470, R525) have no nvmlDeviceGetCurrentClocksEventReasons symbol:
    pynvml raises NVML_ERROR_FUNCTION_NOT_FOUND. The older name of the same call answers there;
    without it every sample had an unknown mask, thermal throttling was never a cause and the
    metrics had no throttle series."""
    calls = {"new": 0, "old": 0}

    def new(h: object) -> int:
        calls["new"] += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def old(h: object) -> int:
        calls["old"] += 1
        return 0x40  # hw_thermal_slowdown

    nv = Nvml(lib=_fake_lib(new, old), proc_root="/nonexistent")
    samples = [s for _ in range(5) for s in nv.sample_all()]
    assert [s.throttle_mask for s in samples] == [0x40] * 5
    assert samples[0].throttle_reasons == ("hw_thermal_slowdown",)
    assert calls == {"new": 1, "old": 5}  # the missing symbol is asked for once
    assert _slow_cause(samples) == "thermal_throttling"


def test_current_drivers_keep_the_new_call() -> None:
    calls = {"old": 0}

    def old(h: object) -> int:
        calls["old"] += 1
        return 0

    def not_supported(h: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    (s,) = Nvml(lib=_fake_lib(lambda h: 0x4, old)).sample_all()
    assert s.throttle_mask == 0x4
    (s,) = Nvml(lib=_fake_lib(not_supported, old)).sample_all()
    assert s.throttle_mask is None  # not supported by the device: not available, no fallback
    assert calls["old"] == 0
