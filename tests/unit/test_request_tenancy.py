"""Request tables and verdicts between uids: one uid's requests never move another uid's
verdicts, a hw.id NVML does not list is not believed, coefficients stay plausible, and every
request table holds at most a quarter per uid (refusals counted per uid)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from infersight.agent.devices.job import DeviceJob
from infersight.agent.devices.settings import load_thresholds
from infersight.agent.requests.kind import RequestStats, parse_req
from infersight.latency import NvmlDevice
from infersight.telemetry import Resource

A = "GPU-aaaa0000-0000-4000-8000-000000000000"
B = "GPU-bbbb0000-0000-4000-8000-000000000001"
NOW = 1_900_000_000.0
VICTIM = Resource.of({"service.name": "llm", "process.pid": 10, "process.user.id": 1000})
PEER = Resource.of({"service.name": "llm", "process.pid": 11, "process.user.id": 1000})
EVIL = Resource.of({"service.name": "evil", "process.pid": 20, "process.user.id": 2000})


def _req(h: str | None, dur: float, t: float, m: str = "llama", d: str = "cuda:0") -> Any:
    data: dict[str, Any] = {"s": int((t - dur) * 1e9), "dur": dur, "m": m, "d": d}
    if h is not None:
        data.update(h=h, hn="NVIDIA H100")
    return parse_req(data)


def _victim(stats: RequestStats, n: int = 200) -> None:
    """The victim's two instances, identical 50 ms requests on GPUs A and B."""
    for i in range(n):
        t = NOW - n + i
        stats.record("v", VICTIM, _req(A, 0.050, t), int(t * 1e9))
        stats.record("w", PEER, _req(B, 0.050, t), int(t * 1e9))


def _job(stats: RequestStats) -> DeviceJob:
    job = DeviceJob(requests=stats, thresholds=load_thresholds(None), nvml=None, enabled=False)
    job._agent = SimpleNamespace(resource=Resource.of({}))
    return job


def _evaluate(job: DeviceJob, times: int = 4) -> None:
    for k in range(times):  # past the hysteresis' evaluations in a row
        job.evaluate(int((NOW + k) * 1e9))


def test_two_hostile_requests_do_not_make_the_victims_gpu_slow() -> None:
    stats = RequestStats()
    _victim(stats, 100)  # 2 more requests in a window of 100 are its nearest-rank P99
    job = _job(stats)
    for _ in range(2):
        stats.record("evil", EVIL, _req(A, 7 * 86400.0, NOW), int(NOW * 1e9))
    _evaluate(job)
    assert job.slow_devices() == {}
    assert job.states == {}
    victim = [v for k, v in job.verdicts.items() if k.uid == 1000]
    assert {v.verdict for v in victim} == {"ok"}
    assert all(v.coefficient is not None and v.coefficient < 1.2 for v in victim)


def test_a_uid_that_finds_a_device_slow_moves_only_its_own_routing() -> None:
    stats = RequestStats()
    _victim(stats)
    job = _job(stats)
    for i in range(200):  # the other uid's own (claimed) requests: slow on A, fast on B
        t = NOW - 200 + i
        stats.record("evil", EVIL, _req(A, 5.0, t), int(t * 1e9))
        stats.record("evil", EVIL, _req(B, 0.050, t), int(t * 1e9))
    _evaluate(job)
    assert A in job.slow_devices_of(2000)  # its own verdict, its own instances
    assert job.slow_devices_of(1000) == {}
    # Device-wide (hw.state, status), a slow verdict of any uid shows: another uid's ok cannot hide it.
    assert A in job.slow_devices()
    coefs = [v.coefficient for v in job.verdicts.values() if v.coefficient is not None]
    assert max(coefs) <= 100.0  # an implausible ratio is never published


def test_another_uids_ok_does_not_hide_a_device_your_requests_find_slow() -> None:
    """A neighbour's claimed fast requests naming your slow GPU and another one make its series find
    the GPU ok: the device-wide state still shows your slow verdict (it hid it)."""
    stats = RequestStats()
    for i in range(200):  # the victim's own requests: A five times slower than B
        t = NOW - 200 + i
        stats.record("v", VICTIM, _req(A, 0.5, t), int(t * 1e9))
        stats.record("w", PEER, _req(B, 0.1, t), int(t * 1e9))
    job = _job(stats)
    _evaluate(job)
    assert A in job.slow_devices()
    for i in range(200):  # uid 2000's claimed requests: identical on A and B
        t = NOW - 200 + i
        stats.record("evil", EVIL, _req(A, 0.01, t), int(t * 1e9))
        stats.record("evil", EVIL, _req(B, 0.01, t), int(t * 1e9))
    _evaluate(job)
    assert A in job.slow_devices() and A in job.slow_devices_of(1000)


def test_an_implausible_coefficient_is_bounded_within_one_uid() -> None:
    stats = RequestStats()
    for i in range(200):
        t = NOW - 200 + i
        stats.record("v", VICTIM, _req(A, 7 * 86400.0 if i % 2 else 0.001, t), int(t * 1e9))
        stats.record("w", PEER, _req(B, 0.001, t), int(t * 1e9))
    job = _job(stats)
    _evaluate(job)
    (coef,) = job.evaluate(int((NOW + 9) * 1e9))[0]
    assert job.slow_devices() == {A: 100.0}
    assert max(p.value for p in coef.points) == 100.0


def test_a_hw_id_nvml_does_not_list_is_not_believed() -> None:
    stats = RequestStats()
    stats.set_devices([NvmlDevice(0, A, "NVIDIA H100"), NvmlDevice(1, B, "NVIDIA H100")])
    forged = _req("GPU-ffff0000-0000-4000-8000-00000000000f", 0.05, NOW, d="cuda:7")
    assert stats.resolve(forged) == (None, None)
    claimed = parse_req({"s": 1, "dur": 0.05, "d": "cuda:0", "h": A, "hn": "a name of its own"})
    assert stats.resolve(claimed) == (A, "NVIDIA H100")  # listed: NVML's name, not the hook's
    assert RequestStats().resolve(forged)[0] == "GPU-ffff0000-0000-4000-8000-00000000000f"  # no NVML view


def test_one_uid_cannot_take_every_histogram_series() -> None:
    stats = RequestStats()
    for i in range(4096):
        stats.record("evil", EVIL, _req(None, 0.01, NOW, m="m%d" % i), int(NOW * 1e9))
    stats.record("victim", VICTIM, _req(None, 0.01, NOW), int(NOW * 1e9))
    items = stats.collect(int(NOW * 1e9), everything=True)
    victim = [it for it in items if it.resource == VICTIM and it.name == "infersight.request.duration"]
    assert len(victim) == 1
    evil = [it for it in items if it.resource == EVIL and it.name == "infersight.request.duration"]
    assert sum(len(it.points) for it in evil) == 1024  # a quarter of 4096
    refused = stats.stats()["refused"]
    assert refused["histogram_series"] == {"2000": 4096 - 1024}


def test_the_verdict_window_is_bounded_per_uid_and_in_all() -> None:
    stats = RequestStats()
    for i in range(5000):
        stats.record("evil", EVIL, _req(None, 0.01, NOW, m="x%d" % i), int(NOW * 1e9))
    _victim(stats, 10)
    series = stats.window.stats(NOW)
    assert sum(1 for s in series if s.key.uid == 2000) == 1024 // 4
    assert sum(1 for s in series if s.key.uid == 1000) == 2  # the victim's still fit
    assert stats.stats()["refused"]["window_series"] == {"2000": 5000 - 256}
    # A uid's samples: a quarter of the window's in all; the series it holds keep sliding.
    for i in range(200_000):
        stats.record("evil", EVIL, _req(None, 0.01, NOW, m="x%d" % (i % 256)), int(NOW * 1e9))
    held = sum(s.count for s in stats.window.stats(NOW) if s.key.uid == 2000)
    assert held <= (1 << 19) // 4


def test_without_nvml_another_uids_device_name_never_names_yours() -> None:
    """Without NVML a request's hw.name is the hook's word. A hook that gives none used to take the first name
    any uid had claimed for that hw.id: another user could name your GPU in your series and verdicts."""
    stats = RequestStats()
    attacker = Resource.of({"service.name": "a", "process.user.id": 1001})
    victim = Resource.of({"service.name": "v", "process.user.id": 1002})
    claim = parse_req({"s": 1, "dur": 0.05, "m": "llama", "d": "cuda:0", "h": "GPU-a", "hn": "Broken GPU"})
    stats.record("att", attacker, claim, 2)
    unnamed = parse_req({"s": 1, "dur": 0.05, "m": "llama", "d": "cuda:0", "h": "GPU-a"})
    assert stats.resolve(unnamed, 1002) == ("GPU-a", None)
    assert stats.resolve(unnamed, 1001) == ("GPU-a", "Broken GPU")  # the claimer's own series keep its word
    stats.record("vic", victim, unnamed, 2)
    assert stats.name_of(1002, "GPU-a") is None and stats.name_of(1001, "GPU-a") == "Broken GPU"
    stats.set_devices([NvmlDevice(0, "GPU-a", "NVIDIA H100")])  # NVML's word wins for everyone
    assert stats.name_of(1001, "GPU-a") == "NVIDIA H100"
