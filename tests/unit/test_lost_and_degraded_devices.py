"""Lost and ECC-degraded GPUs, as the device job sees them through the real NVML wrapper (a FAKE pynvml
module): ``status`` names them (its text said healthy and "4 device(s)" while one had fallen off the bus,
``--json`` had nothing on failed or degraded devices), and a slow verdict on a lost GPU says so (it said
"no NVML signal in the window explains it" though the agent had logged ``gpu_lost``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml

from infersight.agent.commands.status import describe
from infersight.agent.devices.heterogeneity import WindowState, causes
from infersight.agent.devices.job import DeviceJob
from infersight.agent.devices.nvml import Nvml
from infersight.agent.devices.settings import load_thresholds
from infersight.agent.requests.kind import RequestStats, parse_req
from infersight.rules.device_rules import DeviceThresholds
from infersight.telemetry import Resource

UUIDS = ["GPU-fa4e0000-0000-4000-8000-00000000000%d" % i for i in range(4)]  # FAKE GPUs
NOW = 1_900_000_000.0
USER = Resource.of({"service.name": "llm", "process.pid": 10, "process.user.id": 1000})


class FakeLib(SimpleNamespace):
    """A FAKE pynvml module: four GPUs; ``lost`` ones answer every call with NVML_ERROR_GPU_IS_LOST (as a GPU that
    fell off the bus does), ``ecc`` ones count uncorrected volatile ECC errors."""

    def __init__(self) -> None:
        super().__init__(lost=set(), ecc=set())

    def _h(self, h: int) -> int:
        if h in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return h

    def nvmlInit(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return 4

    def nvmlSystemGetDriverVersion(self) -> str:
        return "0.0.fake"

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return self._h(i)

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return UUIDS[self._h(h)]

    def nvmlDeviceGetName(self, h: int) -> str:
        return "FAKE H100"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self._h(h)
        return SimpleNamespace(gpu=90, memory=50)

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return 2 if self._h(h) in self.ecc and kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0


def _job(lib: FakeLib, clock: list[int]) -> tuple[DeviceJob, Nvml, RequestStats]:
    nv = Nvml(lib=lib, proc_root="/nonexistent", clock=lambda: clock[0])
    stats = RequestStats()
    job = DeviceJob(requests=stats, thresholds=load_thresholds(None), nvml=nv)
    job._agent = SimpleNamespace(resource=Resource.of({}), hooked_pids=lambda uid: frozenset())
    return job, nv, stats


def _sample(job: DeviceJob, nv: Nvml, clock: list[int], t_s: float) -> None:
    clock[0] = int(t_s * 1e9)
    job._keep(nv.sample_all(), clock[0])


def test_status_names_lost_and_ecc_degraded_gpus() -> None:
    lib, clock = FakeLib(), [0]
    job, nv, _ = _job(lib, clock)
    job.status = nv.status()
    _sample(job, nv, clock, NOW - 2)
    assert job.health()["failed_devices"] == [] and job.health()["degraded_devices"] == []
    lib.lost.add(2)
    lib.ecc.add(3)
    _sample(job, nv, clock, NOW - 1)
    h = job.health()
    assert h["failed_devices"] == [UUIDS[2]]
    assert h["degraded_devices"] == [UUIDS[3]]
    assert h["devices"] == 4
    text = describe({"healthy": True, "nvml": {**h, "slow_devices": [UUIDS[1]]},
                     "oom": {"classified": 3, "duplicates": 0}})
    lines = text.splitlines()
    assert "  devices FAILED (lost)  %s" % UUIDS[2] in lines
    assert "  devices slow           %s" % UUIDS[1] in lines
    assert "  devices degraded (ECC) %s" % UUIDS[3] in lines
    assert "  ooms                   3 classified" in lines
    assert "healthy" in lines[0]  # the agent's pipeline is healthy: a GPU's state is shown, not its exit status


def test_status_of_healthy_devices_says_nothing_more() -> None:
    text = describe({"healthy": True, "nvml": {"available": True, "driver_version": "0.0.fake", "devices": 4,
                                               "slow_devices": [], "failed_devices": [], "degraded_devices": []}})
    assert "devices" not in text.replace("4 device(s)", "")
    assert "ooms" not in text  # (an agent without the OOM feature's section)


def _requests(stats: RequestStats, slow_device: str) -> None:
    for i in range(200):
        t = NOW - 200 + i
        for dev in UUIDS[:3]:
            dur = 0.500 if dev == slow_device else 0.050
            ev = parse_req({"s": int((t - dur) * 1e9), "dur": dur, "m": "llama", "h": dev, "hn": "FAKE H100"})
            stats.record("p", USER, ev, int(t * 1e9), 10)


def test_a_slow_verdict_on_a_lost_gpu_says_it_was_lost() -> None:
    """GPU 2 is read once, then lost: every sample of it in the window is a lost one. Its slow verdict's cause
    is gpu_lost, with what NVML said, not "no device samples" nor "no NVML signal explains it"."""
    lib, clock = FakeLib(), [0]
    job, nv, stats = _job(lib, clock)
    _sample(job, nv, clock, NOW - 400)  # read before the loss, out of the 300 s window by now
    lib.lost.add(2)
    for k in range(30):
        _sample(job, nv, clock, NOW - 30 + k)
    _requests(stats, UUIDS[2])
    for k in range(4):  # past the hysteresis
        job.evaluate(int((NOW + k) * 1e9))
    (v,) = [v for v in job.verdicts.values() if v.key.device == UUIDS[2]]
    assert v.verdict == "slow"
    assert v.cause == "gpu_lost"
    assert "GPU is lost" in v.detail and "no device samples" not in v.detail
    assert job.health()["failed_devices"] == [UUIDS[2]]


def test_the_lost_cause_comes_first_with_samples_before_the_loss() -> None:
    th = DeviceThresholds()
    w = WindowState(samples=40, busy_samples=40, thermal_samples=40, lost=True,
                    lost_detail="GPU is lost")
    found = causes(w, th)
    assert [c for c, _ in found] == ["gpu_lost", "thermal_throttling"]
    assert "GPU is lost" in found[0][1]
    assert causes(WindowState(lost=True), th)[0][0] == "gpu_lost"
