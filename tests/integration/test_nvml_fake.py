"""The NVML wrapper through nvidia-ml-py's real bindings and a FAKE libnvidia-ml.so.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from fake_nvml.helpers import build_fake_nvml, make_proc_root, run_driver  # noqa: E402

GIB = 1 << 30
SCENARIO = f"""\
# three fake devices: 0 throttled, 1 degraded PCIe link + NVLink down, 2 lost mid-run
count 3
0 name FAKE NVIDIA H100 80GB HBM3 (fake_nvml)
0 throttle 0x64
0 clk_sm 1410
0 temp 91
0 procs 4242:{GIB},77777:2097152
1 name FAKE NVIDIA H100 80GB HBM3 (fake_nvml)
1 pcie_gen 3
1 pcie_width 8
1 nvlinks 4
1 nvlink_down 0x2
1 ecc_corr 7
2 name FAKE NVIDIA A100 (fake_nvml)
2 util_gpu -
2 temp -
2 remap_corr -
2 retired_sbe 2
2 retired_dbe 1
2 lost_after 80
1 xid 48
"""



@pytest.fixture(scope="module")
def report(fake_libdir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("scenario")
    proc = make_proc_root(tmp / "proc", {4242: "python3"})
    return run_driver(fake_libdir, SCENARIO, tmp, "--rounds", "4", "--proc-root", str(proc), "--watch-ms", "2000")


def _dev(rnd: list[dict], index: int) -> dict:
    return next(s for s in rnd if s["index"] == index)


def test_status_and_identity(report: dict) -> None:
    st = report["status"]
    assert st["available"] is True
    assert st["reason"] is None
    assert st["device_count"] == 3
    assert st["driver_version"] == "0.0.fake"
    first = report["rounds"][0]
    assert [s["index"] for s in first] == [0, 1, 2]
    assert first[0]["uuid"] == "GPU-fa4e0000-0000-4000-8000-000000000000"
    assert first[0]["name"] == "FAKE NVIDIA H100 80GB HBM3 (fake_nvml)"
    assert all(s["vendor"] == "nvidia" for s in first)


def test_throttled_device_decoded_bit_by_bit(report: dict) -> None:
    d0 = _dev(report["rounds"][0], 0)
    assert d0["throttle_mask"] == 0x64
    assert d0["throttle_reasons"] == ["sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown"]
    assert (d0["clock_sm_mhz"], d0["clock_sm_max_mhz"]) == (1410, 1980)
    assert d0["temperature_c"] == 91
    assert d0["power_w"] == 300.0
    assert d0["power_limit_w"] == 700.0
    assert d0["memory_total_bytes"] == 80 * GIB
    assert d0["utilization_gpu_pct"] == 50
    assert d0["state"] == "ok"
    assert _dev(report["rounds"][0], 1)["throttle_reasons"] == []


def test_degraded_pcie_link_and_nvlink(report: dict) -> None:
    d1 = _dev(report["rounds"][0], 1)
    assert (d1["pcie_link_gen"], d1["pcie_link_gen_max"]) == (3, 5)
    assert (d1["pcie_link_width"], d1["pcie_link_width_max"]) == (8, 16)
    assert d1["nvlink_active"] == [True, False, True, True]
    assert d1["ecc_corrected_volatile"] == 7
    assert d1["ecc_uncorrected_volatile"] == 0
    assert _dev(report["rounds"][0], 0)["nvlink_active"] is None  # no NVLink on device 0


def test_unsupported_readings_are_none(report: dict) -> None:
    d2 = _dev(report["rounds"][0], 2)
    assert d2["utilization_gpu_pct"] is None
    assert d2["temperature_c"] is None
    assert d2["remapped_rows_corrected"] is None
    assert d2["remap_failure"] is None
    assert (d2["retired_pages_sbe"], d2["retired_pages_dbe"]) == (2, 1)
    d0 = _dev(report["rounds"][0], 0)
    assert d0["retired_pages_sbe"] is None
    assert d0["remapped_rows_corrected"] == 0


def test_processes_mapped_through_fake_proc(report: dict) -> None:
    procs = _dev(report["rounds"][0], 0)["processes"]
    assert procs[0] == {"host_pid": 4242, "used_bytes": GIB, "pid": 4242, "name": "python3", "unmapped_reason": None,
                        "sm_pct": 0, "uid": None, "ancestors": None}  # (no per-process sample: 0% SM; no stat)
    assert procs[1]["host_pid"] == 77777
    assert procs[1]["pid"] is None
    assert "no PID 77777" in procs[1]["unmapped_reason"]
    assert _dev(report["rounds"][0], 1)["processes"] == []


def test_gpu_lost_mid_run_fails_the_device_not_the_agent(report: dict) -> None:
    states = [_dev(r, 2)["state"] for r in report["rounds"]]
    assert states[0] == "ok"
    assert states[-1] == "failed"
    k = states.index("failed")
    assert all(s == "failed" for s in states[k:])
    lost = _dev(report["rounds"][k], 2)
    assert lost["lost"] is True
    assert lost["uuid"].startswith("GPU-")
    assert lost["clock_sm_mhz"] is None
    # the other devices keep sampling normally
    assert all(_dev(r, 0)["state"] == "ok" for r in report["rounds"])
    events = report["events"]
    assert len(events) == 1
    assert events[0]["kind"] == "gpu_lost"
    assert events[0]["index"] == 2
    assert events[0]["code"] == 15
    assert events[0]["uuid"] == lost["uuid"]


def test_lost_device_metrics_say_failed(report: dict) -> None:
    by = {m["name"]: m for m in report["metrics"]}
    status = [p for p in by["hw.status"]["points"] if p["attributes"]["infersight.device.index"] == 2]
    assert {p["attributes"]["hw.state"]: p["value"] for p in status} == {"ok": 0, "degraded": 0, "failed": 1}
    # a lost device exports hw.status only
    for name, m in by.items():
        if name != "hw.status":
            assert all(p["attributes"]["infersight.device.index"] != 2 for p in m["points"]), name


def test_metrics_through_fake(report: dict) -> None:
    by = {m["name"]: m for m in report["metrics"]}
    util = by["hw.gpu.utilization"]["points"][0]
    assert util["value"] == 0.5
    assert util["attributes"]["hw.type"] == "gpu"
    assert util["attributes"]["hw.id"] == "GPU-fa4e0000-0000-4000-8000-000000000000"
    assert util["attributes"]["hw.vendor"] == "nvidia"
    assert util["attributes"]["hw.name"].startswith("FAKE NVIDIA")
    throttle = {
        p["attributes"]["infersight.device.throttle.reason"]: p["value"]
        for p in by["infersight.device.throttle"]["points"]
        if p["attributes"]["infersight.device.index"] == 0
    }
    assert throttle["hw_thermal_slowdown"] == 1
    assert throttle["gpu_idle"] == 0
    assert sum(throttle.values()) == 3
    errors = by["hw.errors"]
    assert errors["monotonic"] is True
    assert any(p["attributes"]["error.type"] == "ecc_corrected" and p["value"] == 7 for p in errors["points"])
    nvlink = [p["value"] for p in by["infersight.device.nvlink.state"]["points"]]
    assert nvlink == [1, 0, 1, 1]
    procs = by["infersight.device.process.memory.usage"]["points"]
    assert {p["attributes"]["infersight.device.process.mapped"] for p in procs} == {True, False}


def test_xid_events_on_worker_thread(report: dict) -> None:
    assert report["watch_started"] is True
    assert report["watch_registered"] == [0, 1]  # device 2 is lost by then
    assert report["watch_running_after_stop"] is False
    xid = report["xid_events"]
    assert xid
    assert xid[0]["kind"] == "xid"
    assert xid[0]["code"] == 48
    assert xid[0]["index"] == 1


def test_nested_pid_namespace_marks_processes_unmapped(fake_libdir: Path, tmp_path: Path) -> None:
    proc = make_proc_root(tmp_path / "proc", {4242: "python3"}, host_pidns=False)
    rep = run_driver(fake_libdir, f"count 1\n0 procs 4242:{GIB}\n", tmp_path, "--proc-root", str(proc))
    (p,) = rep["rounds"][0][0]["processes"]
    assert p["pid"] is None
    assert "nested PID namespace" in p["unmapped_reason"]


def test_the_oom_contexts_light_read_has_the_samples_processes_and_memory(fake_libdir: Path, tmp_path: Path) -> None:
    """An engine's OOM context reads processes and memory only (``memory_view``), before the process exits."""
    proc = make_proc_root(tmp_path / "proc", {4242: "python3", 77: "sleep"})
    rep = run_driver(fake_libdir, f"count 2\n0 procs 4242:{GIB},77:{2 * GIB}\n", tmp_path, "--proc-root", str(proc))
    full, views = rep["rounds"][0], rep["memory_views"]
    assert len(views) == 2
    for s, v in zip(full, views, strict=True):
        nvml_said = ("host_pid", "used_bytes", "pid", "name", "unmapped_reason")  # (not the per-sample SM use)
        assert (v["uuid"], v["memory_total_bytes"]) == (s["uuid"], s["memory_total_bytes"])
        assert [{k: g[k] for k in nvml_said} for g in v["processes"]] == [{k: g[k] for k in nvml_said}
                                                                          for g in s["processes"]]
        assert all(g["sm_pct"] is None for g in v["processes"])  # the light read asks no utilisation
        assert v["power_w"] is None and v["clock_sm_mhz"] is None  # nothing else was read
    assert [p["pid"] for p in views[0]["processes"]] == [4242, 77]


def test_sample_cost_per_device(fake_libdir: Path, tmp_path: Path) -> None:
    """Reported, not asserted tightly: benchmarks live in bench/. A sanity bound only."""
    rep = run_driver(fake_libdir, "count 2\n", tmp_path, "--cost-rounds", "500")
    cost = rep["cost_us_per_device"]
    print(f"fake-driven sample() cost: {cost:.1f} us per device")
    assert 0 < cost < 50_000


def test_throttle_reasons_on_a_driver_before_r535(tmp_path: Path) -> None:
    """A FAKE library built as a driver before R535 exports the clock-event reasons only as
    nvmlDeviceGetCurrentClocksThrottleReasons: through the real bindings the mask still arrives,
    and the throttle metric and the thermal cause with it (they were absent, and a throttled GPU
    read as "SM clock below max with no throttle reason")."""
    from infersight.agent.devices.heterogeneity import causes, summarize_samples
    from infersight.agent.devices.nvml import DeviceSample
    from infersight.rules.device_rules import DeviceThresholds

    try:
        libdir = build_fake_nvml(tmp_path / "lib", pre_r535=True)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    scenario = "# FAKE NVML, R525-style\ncount 1\n0 name FAKE NVIDIA A100 (fake_nvml)\n0 throttle 0x40\n0 clk_sm 1200\n"
    rep = run_driver(libdir, scenario, tmp_path, "--rounds", "3")
    samples = [DeviceSample(**{**s, "throttle_reasons": tuple(s["throttle_reasons"])})
               for r in rep["rounds"] for s in r]  # fmt: skip
    assert [s.throttle_mask for s in samples] == [0x40] * 3
    assert samples[0].throttle_reasons == ("hw_thermal_slowdown",)
    throttle = [m for m in rep["metrics"] if m["name"] == "infersight.device.throttle"]
    assert throttle, "no throttle series"
    th = DeviceThresholds()
    assert causes(summarize_samples(samples, th), th)[0][0] == "thermal_throttling"


def test_per_process_utilisation_through_the_real_bindings(fake_libdir: Path, tmp_path: Path) -> None:
    """nvmlDeviceGetProcessUtilization of the FAKE library, through nvidia-ml-py's real two-call
    binding: the samples, then NVML_ERROR_NOT_FOUND (nothing newer than the timestamp passed back)
    read as "no use", and NVML_ERROR_NOT_SUPPORTED as "not read"; with the processes' uid and parents
    from a FAKE /proc."""
    proc = make_proc_root(tmp_path / "proc", {4242: "python3", 5151: "worker", 100: "server"},
                          parents={4242: 1, 5151: 100, 100: 1}, uids={4242: 1001, 5151: 1000})
    scenario = (f"count 3\n0 procs 4242:{GIB},5151:{GIB}\n0 procutil 4242:45:10,5151:30:5\n"
                f"1 procs 4242:{GIB}\n1 procutil 4242:70:1\n1 procutil_ts 123456\n"
                f"2 procs 4242:{GIB}\n2 procutil 4242:70:1\n2 procutil_ts -\n")
    rep = run_driver(fake_libdir, scenario, tmp_path, "--rounds", "2", "--proc-root", str(proc))
    first, second = rep["rounds"]
    d0 = {g["pid"]: g for g in _dev(first, 0)["processes"]}
    assert _dev(first, 0)["process_util_read"] is True
    assert (d0[4242]["sm_pct"], d0[4242]["uid"], d0[4242]["ancestors"]) == (45, 1001, [])
    assert (d0[5151]["sm_pct"], d0[5151]["uid"], d0[5151]["ancestors"]) == (30, 1000, [100])
    assert [g["sm_pct"] for g in _dev(second, 0)["processes"]] == [45, 30]  # newer samples each call
    assert [g["sm_pct"] for g in _dev(first, 1)["processes"]] == [70]
    assert [g["sm_pct"] for g in _dev(second, 1)["processes"]] == [0]  # NOT_FOUND: nothing since 123456
    assert _dev(second, 1)["process_util_read"] is True
    for rnd in (first, second):
        assert _dev(rnd, 2)["process_util_read"] is False  # NOT_SUPPORTED
        assert [g["sm_pct"] for g in _dev(rnd, 2)["processes"]] == [None]
