"""The ``other_process`` cause: another process computing on a slow device, from NVML's per-process
SM utilisation and compute process list, judged per series (its producers' processes and their
children are its own).

The NVML libraries here are FAKES (``SimpleNamespace`` objects with the pynvml calls the wrapper
makes) and the ``/proc`` trees FAKE directories; neither is NVIDIA's NVML nor the kernel's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from infersight.agent.devices import heterogeneity
from infersight.agent.devices.heterogeneity import WindowState, causes, evaluate, summarize_samples
from infersight.agent.devices.nvml import MAX_DETAILED_PROCESSES, DeviceSample, GpuProcess, Nvml, kept_in_window
from infersight.latency import MAX_SERIES_PIDS, LatencyWindow, SeriesKey, SeriesStats
from infersight.rules.device_rules import CAUSES, DeviceThresholds, parse_device_rules

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from fake_nvml.helpers import add_fake_process, make_proc_root  # noqa: E402

TH = DeviceThresholds()
SERVER, WORKER, NEIGHBOUR, STRANGER = 100, 101, 4242, 4343


def _proc(pid: int | None, sm: int | None = None, *, parents: tuple[int, ...] | None = (), uid: int | None = 1001,
          name: str = "python3") -> GpuProcess:
    return GpuProcess(pid or 99999, 1 << 30, pid, name, None, sm_pct=sm, uid=uid, ancestors=parents)


def _sample(procs: tuple[GpuProcess, ...], read: bool = True, **kw: Any) -> DeviceSample:
    base: dict[str, Any] = {"time_ns": 0, "index": 0, "uuid": "GPU-c", "name": "FAKE GPU",
                            "utilization_gpu_pct": 90, "clock_sm_mhz": 1980, "clock_sm_max_mhz": 1980,
                            "throttle_mask": 0, "processes": procs, "process_util_read": read}  # fmt: skip
    base.update(kw)
    return DeviceSample(**base)


def _window(busy_with: int, busy_without: int, procs: tuple[GpuProcess, ...], read: bool = True,
            own: frozenset[int] | None = frozenset({SERVER})) -> WindowState:
    worker = _proc(WORKER, 50, parents=(SERVER,))
    samples = [_sample((worker, *procs), read) for _ in range(busy_with)]
    samples += [_sample((worker,), read) for _ in range(busy_without)]
    return summarize_samples(samples, TH, own)


def _slow(w: WindowState | None) -> tuple[str | None, tuple[str, ...], str]:
    series = [SeriesStats(SeriesKey(d, "m", "c", "FAKE GPU"), 1000, 0.1, p) for d, p in
              (("GPU-a", 0.1), ("GPU-b", 0.1), ("GPU-c", 0.3))]  # fmt: skip
    v = evaluate(series, {"GPU-c": w} if w is not None else {}, TH)[2]
    assert v.verdict == "slow"
    return v.cause, v.causes, v.detail


# ---- the pure core -------------------------------------------------------------------------


def test_a_busy_neighbour_is_the_cause_and_is_named() -> None:
    w = _window(48, 12, (_proc(NEIGHBOUR, 45, parents=(1200,)),))
    assert (w.busy_samples, w.other_process_samples, w.other_present_samples) == (60, 48, 0)
    cause, _, detail = _slow(w)
    assert cause == "other_process"
    assert "other processes used >= 20% SM in 48/60 busy samples" in detail
    assert "pid 4242 (uid 1001, python3) used 45% SM in 80% of busy samples" in detail
    assert "pid 101" not in detail  # the series' own worker computes too, and is not named


def test_the_series_own_worker_children_are_not_others() -> None:
    """An engine's worker (a child of the process that times the requests) computing at 50% is the
    series' own work; a grandchild too."""
    grandchild = _proc(102, 60, parents=(WORKER, SERVER, 1))
    w = _window(60, 0, (grandchild,))
    assert w.other_process_samples == 0
    assert _slow(w)[0] == "unknown"


def test_a_neighbour_below_the_sm_threshold_or_too_rarely_is_not_the_cause() -> None:
    light = _window(60, 0, (_proc(NEIGHBOUR, 10),))
    assert light.other_process_samples == 0
    assert _slow(light)[0] == "unknown"
    rare = _window(6, 54, (_proc(NEIGHBOUR, 90),))
    assert rare.other_process_samples == 6
    assert _slow(rare)[0] == "unknown"
    # two light neighbours together reach it: the share is of the other processes' SM, summed
    two = _window(60, 0, (_proc(NEIGHBOUR, 10), _proc(STRANGER, 12, uid=1002)))
    assert two.other_process_samples == 60
    assert _slow(two)[0] == "other_process"


def test_an_idle_neighbour_is_no_cause_where_use_is_measured() -> None:
    """Present (it holds memory), measured idle: no evidence, neither measured nor by presence."""
    w = _window(60, 0, (_proc(NEIGHBOUR, 0),))
    assert (w.other_process_samples, w.other_present_samples) == (0, 0)
    assert _slow(w)[0] == "unknown"


@pytest.mark.parametrize("who", [
    _proc(None, 90),  # NVML's host PID not mapped (the agent in a nested PID namespace)
    _proc(NEIGHBOUR, 90, parents=None),  # its parents not read (gone, hidepid, past the busiest)
])
def test_a_process_that_cannot_be_placed_counts_for_no_side(who: GpuProcess) -> None:
    w = _window(60, 0, (who,))
    assert w.other_process_samples == 0
    assert _slow(w)[0] == "unknown"


def test_without_the_series_processes_nobody_is_called_other() -> None:
    w = _window(60, 0, (_proc(NEIGHBOUR, 90),), own=None)
    assert (w.other_process_samples, w.other_detail) == (0, None)
    assert _slow(w)[0] == "unknown"


def test_presence_alone_is_a_weaker_condition_said_as_such() -> None:
    """Where NVML gives no per-process utilisation, another compute process present in most busy
    samples is the cause, after clocks_below_max, and the detail says it was not measured."""
    w = _window(45, 15, (_proc(NEIGHBOUR, None),), read=False)
    assert (w.other_process_samples, w.other_present_samples) == (0, 45)
    cause, _, detail = _slow(w)
    assert cause == "other_process"
    assert "present in 45/60 busy samples" in detail
    assert "presence, not measured use" in detail
    assert "pid 4242 (uid 1001, python3) in 75% of busy samples" in detail
    assert "used" not in detail.split("present")[1]  # no claimed use
    rare = _window(20, 40, (_proc(NEIGHBOUR, None),), read=False)
    assert _slow(rare)[0] == "unknown"  # 33% < other_present_share
    slow_clocks = summarize_samples([_sample((_proc(NEIGHBOUR, None),), False, clock_sm_mhz=1200)] * 60, TH,
                                    frozenset({SERVER}))
    assert _slow(slow_clocks)[1] == ("clocks_below_max", "other_process")


def test_measured_use_outranks_presence_in_one_window() -> None:
    """Some samples read per-process use (the neighbour idle), others did not: presence is not
    taken for use the measurements contradict."""
    idle = _proc(NEIGHBOUR, 0)
    unread = _proc(NEIGHBOUR, None)
    samples = [_sample((idle,), True)] * 10 + [_sample((unread,), False)] * 50
    w = summarize_samples(samples, TH, frozenset({SERVER}))
    assert (w.other_process_samples, w.other_present_samples) == (0, 0)


def test_priority_between_ecc_and_clocks() -> None:
    assert CAUSES.index("ecc_errors") < CAUSES.index("other_process") < CAUSES.index("clocks_below_max")
    both = WindowState(samples=60, busy_samples=60, other_process_samples=60, clocks_below_max_samples=60,
                       ecc_errors=1)
    assert [c for c, _ in causes(both, TH)] == ["ecc_errors", "other_process", "clocks_below_max"]


def test_idle_samples_do_not_count() -> None:
    samples = [_sample((_proc(NEIGHBOUR, 90),), utilization_gpu_pct=5)] * 60
    w = summarize_samples(samples, TH, frozenset({SERVER}))
    assert (w.busy_samples, w.other_process_samples) == (0, 0)


def test_detail_is_bounded_and_sanitised() -> None:
    """A neighbour that starts thousands of processes and names them to forge log lines gets at most
    three named, a count of the rest, and its names cut to a safe alphabet."""
    many = tuple(_proc(5000 + i, 1 + i % 50, name="x\nWARN forged") for i in range(3000))
    w = summarize_samples([_sample(many)] * 3, TH, frozenset({SERVER}))
    assert w.other_detail is not None
    assert w.other_detail.count("pid ") == heterogeneity.MAX_NAMED_PIDS
    assert "\n" not in w.other_detail and "WARN forged" not in w.other_detail
    assert "x_WARN_forged" in w.other_detail
    assert w.other_detail.endswith(f", +{heterogeneity.MAX_TRACKED_PIDS - heterogeneity.MAX_NAMED_PIDS}+ more")
    few = summarize_samples([_sample(many[:4])] * 3, TH, frozenset({SERVER}))
    assert few.other_detail is not None and few.other_detail.endswith(", +1 more")


def test_per_series_windows_judge_each_uids_neighbours() -> None:
    """Two users' servers on one GPU: each is the other's neighbour, never its own."""
    a, b = SeriesKey("GPU-c", "m", "c", "g", 1001), SeriesKey("GPU-c", "m", "c", "g", 1002)
    samples = [_sample((_proc(SERVER, 60), _proc(200, 60, uid=1002)))] * 60
    own = {a: frozenset({SERVER}), b: frozenset({200})}
    series = [SeriesStats(k, 1000, 0.1, 0.3) for k in (a, b)]
    series += [SeriesStats(SeriesKey(f"GPU-{d}", "m", "c", "g", uid), 1000, 0.1, 0.1)
               for d in "xy" for uid in (1001, 1002)]
    asked: list[SeriesKey] = []

    def window_of(k: SeriesKey) -> WindowState | None:
        asked.append(k)
        return summarize_samples(samples, TH, own[k]) if k in own else None

    v = {x.key: x for x in evaluate(series, window_of, TH)}
    assert v[a].cause == v[b].cause == "other_process"
    assert "pid 200 (uid 1002" in v[a].detail and "pid 100 " not in v[a].detail
    assert "pid 100 (uid 1001" in v[b].detail and "pid 200 " not in v[b].detail
    assert set(asked) == {a, b}  # asked for slow verdicts only


def test_rule_file_validates_the_new_thresholds() -> None:
    r = parse_device_rules('engine_version = "1.0"\n[thresholds]\nother_process_sm_pct = 35\n'
                           'other_process_share = 0.3\nother_present_share = 0.9\n')
    assert (r.thresholds.other_process_sm_pct, r.thresholds.other_process_share,
            r.thresholds.other_present_share) == (35, 0.3, 0.9)
    for bad in ("other_process_sm_pct = 0", "other_process_sm_pct = 2.5", "other_process_share = 1.5"):
        with pytest.raises(ValueError, match="<string>:3: other_process"):
            parse_device_rules(f'engine_version = "1.0"\n[thresholds]\n{bad}\n')


# ---- the series' processes -----------------------------------------------------------------


def test_latency_window_knows_the_series_processes() -> None:
    w = LatencyWindow(window_s=60)
    k = SeriesKey("GPU-c", "m", "c", "g", 1001)
    assert w.pids(k, 0.0) is None
    w.add(k, 0.1, 10.0, 100)
    w.add(k, 0.1, 20.0, 101)
    assert w.pids(k, 30.0) == {100, 101}
    assert w.pids(k, 75.0) == {101}  # 100's requests left the window
    w.add(k, 0.1, 76.0, None)  # a request from a producer the kernel did not name (spool, PID namespace)
    assert w.pids(k, 77.0) is None
    assert w.pids(k, 140.0) is None  # gone with its requests... and so is the series
    w2 = LatencyWindow(window_s=60)
    for pid in range(1, MAX_SERIES_PIDS + 2):
        w2.add(k, 0.1, 1.0, pid)
    assert w2.pids(k, 2.0) is None  # too many to name all: not all known
    w3 = LatencyWindow(window_s=60)
    w3.add(k, 0.1, 1.0, 0)  # SO_PEERCRED's 0: a process the agent cannot see
    assert w3.pids(k, 2.0) is None


def test_latency_window_names_the_uids_servers_of_other_models() -> None:
    w = LatencyWindow(window_s=60)
    m, n = SeriesKey("GPU-c", "m", "c", "g", 1001), SeriesKey("GPU-c", "n", "c", "g", 1001)
    w.add(m, 0.1, 10.0, 100)
    w.add(n, 0.1, 10.0, 200)
    w.add(SeriesKey("GPU-d", "n", "other class", "g", 1001), 0.1, 30.0, 201)
    w.add(SeriesKey("GPU-c", "n", "c", "g", 1002), 0.1, 10.0, 300)  # another uid's: a stranger anyway
    w.add(SeriesKey("GPU-c", "m", "c2", "g", 1001), 0.1, 10.0, 101)  # the same model: the same server
    w.add(n, 0.1, 10.0, None)  # an unnamed producer names no PID
    assert w.other_model_pids(m, 20.0) == {200, 201}
    assert w.other_model_pids(m, 75.0) == {201}  # 200's requests left the window
    w.add(n, 0.1, 20.0, 100)  # one process serving both models is the series' own
    assert w.other_model_pids(n, 30.0) == {101}  # m's other process; 100 is n's own too
    assert w.other_model_pids(m, 30.0) == {200, 201}  # not 100: m's own
    w.add(SeriesKey("GPU-d", "m", "c3", "g", 1001), 0.1, 20.0, 201)  # 201 times m too, in another class elsewhere
    assert w.other_model_pids(m, 30.0) == {200}  # a process that serves m is no other server of m's
    assert w.timing_pids() == {100, 101, 200, 201, 300}


def _two_servers_job(proc: Path, a: int, b: int, hooked: frozenset[int]) -> tuple[Any, SeriesKey, SeriesKey]:
    """A device job whose window holds uid 1001's requests of model m timed by ``a`` and of model n by ``b``,
    with ``hooked`` as that uid's live producers and a FAKE /proc at ``proc``."""
    from infersight.agent.devices.job import DeviceJob

    key_a, key_b = SeriesKey("GPU-c", "m", "c", "FAKE GPU", 1001), SeriesKey("GPU-c", "n", "c", "FAKE GPU", 1001)
    window = LatencyWindow(window_s=60)
    window.add(key_a, 0.1, 10.0, a)
    window.add(key_b, 0.1, 10.0, b)
    job = DeviceJob(requests=SimpleNamespace(window=window), thresholds=TH,  # type: ignore[arg-type]
                    nvml=Nvml(lib=_fake_lib([], None), proc_root=str(proc)))
    job._agent = SimpleNamespace(hooked_pids=lambda uid: hooked if uid == 1001 else frozenset())
    return job, key_a, key_b


def test_two_servers_under_one_hooked_supervisor_are_each_others_neighbours(tmp_path: Path) -> None:
    """One uid's supervisor (SUP, hooked) starts two model servers on one GPU: A times model m's requests
    and computes in its child A_GPU; B times model n's and computes in B_GPU. Their common hooked parent
    makes the supervisor's tree the series' own, but B and what it starts compute for another model:
    strangers to A's series, as A's are to B's. A helper of the supervisor's own (HELPER) stays own."""
    from collections import deque


    sup, a, a_gpu, b, b_gpu, helper = 400, 401, 402, 403, 404, 405
    proc = make_proc_root(tmp_path, {sup: "sup", a: "a", a_gpu: "a", b: "b", b_gpu: "b", helper: "h"},
                          parents={sup: 1, a: sup, a_gpu: a, b: sup, b_gpu: b, helper: sup})
    job, key_a, key_b = _two_servers_job(proc, a, b, hooked=frozenset({sup, a, b}))
    a_busy, b_busy = _proc(a_gpu, 60, parents=(a, sup)), _proc(b_gpu, 40, parents=(b, sup))
    job.samples["GPU-c"] = deque([_sample((a_busy, _proc(helper, 30, parents=(sup,))))] * 20
                                 + [_sample((a_busy, b_busy))] * 40)
    windows = job.series_windows(int(20e9))
    wa, wb = windows(key_a), windows(key_b)
    assert wa is not None and wa.other_process_samples == 40  # B's samples only: not the helper's
    assert f"pid {b_gpu} " in str(wa.other_detail) and f"pid {a_gpu} " not in str(wa.other_detail)
    assert f"pid {helper} " not in str(wa.other_detail)
    assert wb is not None and wb.other_process_samples == 60 and f"pid {a_gpu} " in str(wb.other_detail)
    assert f"pid {b_gpu} " not in str(wb.other_detail)


def test_another_servers_process_is_other_even_with_its_parents_unread() -> None:
    b = _proc(4500, 60, parents=None)  # its parent chain not read (hidepid): still known as B's own process
    w = summarize_samples([_sample((b,))] * 10, TH, frozenset({SERVER}))
    assert w.other_process_samples == 0  # unplaced without knowing it
    w = heterogeneity.with_neighbours(w, [_sample((b,))] * 10, TH, frozenset({SERVER}), frozenset({4500}))
    assert w.other_process_samples == 10


def test_the_window_keeps_only_the_processes_a_verdict_can_place() -> None:
    """A neighbour with 400 compute processes on the device: each kept sample holds the busiest mapped ones
    (those the wrapper read parents for) and those that time requests (placed by PID: another model's server
    of the same uid, past the busiest, its parents unread), not 400; every verdict is the one the whole
    samples give."""
    from infersight.agent.devices.job import DeviceJob

    crowd = tuple(_proc(5000 + i, 0, parents=None) for i in range(400))  # idle, never detailed
    busy = tuple(_proc(6000 + i, 10 + i, parents=(1,)) for i in range(MAX_DETAILED_PROCESSES - 2))
    unmapped = GpuProcess(7000, 1 << 30, None, None, "another pid namespace", sm_pct=90)
    hidden = _proc(6500, 5, parents=None)  # among the busiest, its parents hidden (hidepid)
    worker = _proc(WORKER, 50, parents=(SERVER,))
    other_model = tuple(_proc(8000 + i, 4, parents=None) for i in range(4))  # model n's server: 16% SM in all
    samples = [_sample((*crowd, unmapped, *busy, hidden, worker, *other_model), time_ns=i) for i in range(30)]
    window = LatencyWindow(window_s=60)
    window.add(SeriesKey("GPU-c", "m", "c", "FAKE GPU", 1001), 0.1, 0.0, SERVER)
    for g in other_model:
        window.add(SeriesKey("GPU-c", "n", "c", "FAKE GPU", 1001), 0.1, 0.0, g.pid)
    job = DeviceJob(requests=SimpleNamespace(window=window, set_devices=lambda devices: None),  # type: ignore[arg-type]
                    thresholds=TH)
    job._keep(samples, 30)
    kept = list(job.samples["GPU-c"])
    assert len(kept) == 30
    assert {g.pid for g in kept[0].processes or ()} == {WORKER, 6500, *(g.pid for g in busy + other_model)}
    assert kept[0].utilization_gpu_pct == 90 and kept[0].process_util_read  # the rest of the sample as it was
    own, apart = frozenset({SERVER}), frozenset(g.pid for g in other_model)
    assert summarize_samples(kept, TH, own) == summarize_samples(samples, TH, own)
    whole = heterogeneity.with_neighbours(summarize_samples(samples, TH), samples, TH, own, apart)
    assert whole.other_process_samples == 30  # model n's server, placed by PID
    assert heterogeneity.with_neighbours(summarize_samples(kept, TH), kept, TH, own, apart) == whole
    few = _sample((worker,))
    def never() -> frozenset[int]:
        raise AssertionError("the request-timing PIDs are read only for a crowded sample")

    assert kept_in_window(few, never) is few  # a sample that holds no more than that is kept whole


def test_a_server_that_started_this_one_is_another_when_it_times_another_model(tmp_path: Path) -> None:
    """Server B (times model n, hooked) starts server A (times model m) on the same GPU: B is A's hooked
    ancestor, but it is another server: its GPU work is other to A's series as A's is to B's."""
    from collections import deque


    b, b_gpu, a, a_gpu = 500, 501, 502, 503
    proc = make_proc_root(tmp_path, {b: "b", b_gpu: "b", a: "a", a_gpu: "a"},
                          parents={b: 1, b_gpu: b, a: b, a_gpu: a})
    job, key_a, key_b = _two_servers_job(proc, a, b, hooked=frozenset({a, b}))
    job.samples["GPU-c"] = deque([_sample((_proc(a_gpu, 50, parents=(a, b)), _proc(b_gpu, 40, parents=(b,))))] * 20)
    windows = job.series_windows(int(20e9))
    wa, wb = windows(key_a), windows(key_b)
    assert wa is not None and wa.other_process_samples == 20 and f"pid {b_gpu} " in str(wa.other_detail)
    assert wb is not None and wb.other_process_samples == 20 and f"pid {a_gpu} " in str(wb.other_detail)


def test_a_ray_cluster_started_by_ray_start_is_the_replicas_own(tmp_path: Path) -> None:
    """``ray start`` (no hooked parent): a Serve replica times the requests on its GPU, vLLM's tensor-parallel
    actor computes beside it on another, both started by the raylet of the same uid. The actor is the series'
    own; another uid's raylet makes nothing its own, nor does a raylet process of another uid's name."""
    from collections import deque

    from infersight.agent.devices.job import DeviceJob

    raylet, replica, actor = 600, 601, 602
    proc = make_proc_root(tmp_path, {raylet: "raylet", replica: "ray::ServeRepl", actor: "ray::RayWorkerW",
                                     NEIGHBOUR: "python3"},
                          parents={raylet: 1, replica: raylet, actor: raylet, NEIGHBOUR: 1},
                          uids={raylet: 1001, replica: 1001, actor: 1001, NEIGHBOUR: 1002})
    key = SeriesKey("GPU-c", "m", "c", "FAKE GPU", 1001)
    window = LatencyWindow(window_s=60)
    window.add(key, 0.1, 10.0, replica)
    job = DeviceJob(requests=SimpleNamespace(window=window), thresholds=TH,  # type: ignore[arg-type]
                    nvml=Nvml(lib=_fake_lib([], None), proc_root=str(proc)))
    job._agent = SimpleNamespace(hooked_pids=lambda uid: frozenset({replica}) if uid == 1001 else frozenset())
    busy = _proc(actor, 80, parents=(raylet,))
    job.samples["GPU-c"] = deque([_sample((busy,))] * 30 + [_sample((busy, _proc(NEIGHBOUR, 50, uid=1002)))] * 30)
    w = job.series_windows(int(20e9))(key)
    assert w is not None and w.other_process_samples == 30 and f"pid {actor} " not in str(w.other_detail)
    other = SeriesKey("GPU-c", "m", "c", "FAKE GPU", 1003)  # a uid whose raylet this is not
    window.add(other, 0.1, 10.0, replica)
    w = job.series_windows(int(20e9))(other)
    assert w is not None and f"pid {actor} " in str(w.other_detail)


def test_an_ended_servers_pid_is_no_other_server_once_its_producer_is_gone(tmp_path: Path) -> None:
    """Model n's server ended within the window; its PID went to a new process of the series' own (a worker,
    not yet timing requests). Only a live producer's PID names another server: PID reuse hides a cause at
    worst, never invents one."""
    from collections import deque

    from infersight.agent.devices.job import DeviceJob

    proc = make_proc_root(tmp_path, {SERVER: "server", 5000: "python"}, parents={SERVER: 1, 5000: SERVER})
    key = SeriesKey("GPU-c", "m", "c", "FAKE GPU", 1001)
    window = LatencyWindow(window_s=60)
    window.add(key, 0.1, 10.0, SERVER)
    window.add(SeriesKey("GPU-c", "n", "c", "FAKE GPU", 1001), 0.1, 10.0, 5000)  # the ended server's
    job = DeviceJob(requests=SimpleNamespace(window=window), thresholds=TH,  # type: ignore[arg-type]
                    nvml=Nvml(lib=_fake_lib([], None), proc_root=proc))
    job.samples["GPU-c"] = deque([_sample((_proc(5000, 70, parents=(SERVER,)),))] * 20)
    job._agent = SimpleNamespace(hooked_pids=lambda uid: frozenset({SERVER}))  # 5000's producer is gone
    w = job.series_windows(int(20e9))(key)
    assert w is not None and w.other_process_samples == 0
    job._agent = SimpleNamespace(hooked_pids=lambda uid: frozenset({SERVER, 5000}))  # while it lived: another's
    w = job.series_windows(int(20e9))(key)
    assert w is not None and w.other_process_samples == 20


# ---- the NVML wrapper, against a FAKE pynvml -----------------------------------------------


def _sample_t(pid: int, sm: int, ts: int) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm, memUtil=1, encUtil=0, decUtil=0)


def _fake_lib(procs: list[int], util: Any) -> SimpleNamespace:
    """A FAKE pynvml module: one device with compute processes ``procs`` and per-process
    utilisation from ``util(handle, last_seen)``."""
    return SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: object(),
        nvmlDeviceGetUUID=lambda h: "GPU-fake",
        nvmlDeviceGetName=lambda h: "FAKE GPU",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in procs],
        nvmlDeviceGetProcessUtilization=util,
    )


def test_wrapper_reads_per_process_use_since_the_last_reading(tmp_path: Path) -> None:
    proc = make_proc_root(tmp_path, {NEIGHBOUR: "python3", SERVER: "server"}, parents={NEIGHBOUR: 1, SERVER: 1},
                          uids={NEIGHBOUR: 1001})
    seen: list[int] = []

    def util(h: object, last: int) -> list[SimpleNamespace]:
        seen.append(last)
        if last >= 2000:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)  # nothing newer
        return [_sample_t(NEIGHBOUR, 40, 1000), _sample_t(NEIGHBOUR, 60, 2000), _sample_t(SERVER, 10, 1500)]

    nv = Nvml(lib=_fake_lib([SERVER, NEIGHBOUR], util), proc_root=proc)
    (first,) = nv.sample_all()
    (second,) = nv.sample_all()
    assert seen == [0, 2000]  # the newest timestamp read is asked from next time
    assert first.process_util_read and second.process_util_read
    by_pid = {g.pid: g for g in first.processes or ()}
    assert by_pid[NEIGHBOUR].sm_pct == 50  # the mean of its samples
    assert by_pid[SERVER].sm_pct == 10
    assert (by_pid[NEIGHBOUR].uid, by_pid[NEIGHBOUR].ancestors) == (1001, ())
    assert {g.pid: g.sm_pct for g in second.processes or ()} == {SERVER: 0, NEIGHBOUR: 0}  # read: idle


def test_wrapper_where_per_process_use_is_not_supported() -> None:
    calls = []

    def util(h: object, last: int) -> list[SimpleNamespace]:
        calls.append(last)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    nv = Nvml(lib=_fake_lib([NEIGHBOUR], util), proc_root="/nonexistent")
    samples = [s for _ in range(3) for s in nv.sample_all()]
    assert len(calls) == 1  # not asked again
    assert not any(s.process_util_read for s in samples)
    assert all(g.sm_pct is None for s in samples for g in s.processes or ())


def test_wrapper_empty_answer_and_no_processes() -> None:
    """nvidia-ml-py raises NVMLError(NVML_SUCCESS) when the first (sizing) call finds no sample;
    with no compute process the call is not made at all."""
    calls = []

    def util(h: object, last: int) -> list[SimpleNamespace]:
        calls.append(last)
        raise pynvml.NVMLError(0)

    (s,) = Nvml(lib=_fake_lib([NEIGHBOUR], util), proc_root="/nonexistent").sample_all()
    assert s.process_util_read
    assert [g.sm_pct for g in s.processes or ()] == [0]
    (s,) = Nvml(lib=_fake_lib([], util), proc_root="/nonexistent").sample_all()
    assert (s.processes, s.process_util_read, len(calls)) == ((), False, 1)


def test_wrapper_reads_parents_of_the_busiest_only_and_once(tmp_path: Path) -> None:
    """A neighbour's thousand processes cost /proc reads for the MAX_DETAILED_PROCESSES busiest; a
    process's parents are read once (again only when its PID is reused)."""
    pids = list(range(6000, 7000))
    proc = make_proc_root(tmp_path, dict.fromkeys(pids, "spawn"), parents=dict.fromkeys(pids, SERVER))
    add_fake_process(proc, SERVER, "server", parent=1)
    busy = {6500: 90, 6501: 80}
    nv = Nvml(lib=_fake_lib(pids, lambda h, last: [_sample_t(p, sm, 10 + last) for p, sm in busy.items()]),
              proc_root=proc)
    (s,) = nv.sample_all()
    detailed = [g for g in s.processes or () if g.ancestors is not None]
    assert len(detailed) == MAX_DETAILED_PROCESSES
    assert {6500, 6501} <= {g.pid for g in detailed}
    assert all(g.ancestors == (SERVER,) for g in detailed)
    add_fake_process(proc, 6500, "spawn", parent=4242)  # same start ticks: the same process, not read again
    (s,) = nv.sample_all()
    assert next(g for g in s.processes or () if g.pid == 6500).ancestors == (SERVER,)
    add_fake_process(proc, 6500, "reused", parent=4242, start_ticks=9999)  # a new process under an old PID
    add_fake_process(proc, 4242, "bash", parent=1)
    (s,) = nv.sample_all()
    assert next(g for g in s.processes or () if g.pid == 6500).ancestors == (4242,)


def test_wrapper_a_broken_parent_chain_places_nobody(tmp_path: Path) -> None:
    proc = make_proc_root(tmp_path, {NEIGHBOUR: "python3"}, parents={NEIGHBOUR: 777})  # 777 unreadable
    nv = Nvml(lib=_fake_lib([NEIGHBOUR], lambda h, last: [_sample_t(NEIGHBOUR, 90, 1)]), proc_root=proc)
    (s,) = nv.sample_all()
    (g,) = s.processes or ()
    assert (g.sm_pct, g.ancestors) == (90, None)
    assert summarize_samples([s] * 10, TH, frozenset({SERVER})).other_process_samples == 0


def test_the_request_handler_windows_the_producers_kernel_pid() -> None:
    """A ``req`` event's series learns the PID the kernel gave for its producer's connection
    (``Producer.peer_pid``, SO_PEERCRED); a producer known from a spool file only names none."""
    from infersight.agent.daemon.assemble import Producer
    from infersight.agent.requests.kind import RequestStats
    from infersight.telemetry import Origin, Resource

    stats = RequestStats(window_s=60)
    res = Resource.of({"process.user.id": 1001, "process.pid": 7})
    live = Producer("p-live", {"pid": 7}, res, uid=1001, peer_pid=4321)
    spooled = Producer("p-spool", {"pid": 8}, res, uid=1001)
    ev = {"d": "cuda:0", "m": "m", "s": 1, "dur": 0.01, "h": "GPU-c"}
    stats.handle(live, Origin("p-live", 1), 10_000_000_000, ev, [])
    (key,) = [s.key for s in stats.window.stats(10.0)]
    assert stats.window.pids(key, 10.0) == {4321}  # the kernel's word, not the hello's pid 7
    stats.handle(spooled, Origin("p-spool", 1), 11_000_000_000, ev, [])
    assert stats.window.pids(key, 11.0) is None


def test_baseline_judges_each_device_on_its_own_run() -> None:
    """The baseline runs devices one after another: a neighbour busy on GPU 3 while GPU 0 ran does
    not count against GPU 3; the samples of GPU 3's own run (and one interval after) do."""
    from infersight.agent.commands import baseline

    second = 1_000_000_000
    after = int(baseline.SAMPLE_INTERVAL_S * second)
    times = (0, 5 * second, 10 * second, 15 * second, 20 * second + after, 20 * second + after + 1)
    samples = [_sample((), time_ns=t) for t in times]
    assert [s.time_ns for s in baseline._during(samples, (10 * second, 20 * second))] == list(times[2:5])


def test_an_engine_started_beside_the_request_timing_processes_is_its_own(tmp_path: Path) -> None:
    """vLLM with --api-server-count 2: `vllm serve` (MAIN, hooked) starts the API servers that time the requests
    (API) and the engine core that computes (ENGINE), siblings; Ray's workers hang off the driver's raylet the
    same way. The engine is the series' own through their hooked common parent; a stranger stays other."""
    from collections import deque

    from infersight.agent.devices.job import DeviceJob

    main, api, engine = 300, 301, 302
    proc = make_proc_root(tmp_path, {main: "vllm", api: "api", engine: "engine", NEIGHBOUR: "python3"},
                          parents={main: 1, api: main, engine: main, NEIGHBOUR: 1})
    key = SeriesKey("GPU-c", "m", "c", "FAKE GPU", 1001)
    window = LatencyWindow(window_s=60)
    window.add(key, 0.1, 10.0, api)
    job = DeviceJob(requests=SimpleNamespace(window=window), thresholds=TH,  # type: ignore[arg-type]
                    nvml=Nvml(lib=_fake_lib([], None), proc_root=proc))
    busy = _proc(engine, 80, parents=(main,))
    job.samples["GPU-c"] = deque([_sample((busy,))] * 30 + [_sample((busy, _proc(NEIGHBOUR, 50)))] * 30)
    hooked = {1001: frozenset({main, api}), 1002: frozenset({9})}
    job._agent = SimpleNamespace(hooked_pids=lambda uid: hooked.get(uid, frozenset()))
    w = job.series_windows(int(20e9))(key)
    assert w is not None and w.other_process_samples == 30  # the neighbour's samples only
    detail = str(w.other_detail)
    assert f"pid {NEIGHBOUR} " in detail and f"pid {engine} " not in detail
    # a common parent that is no hooked producer of the series' uid makes nothing its own
    job._agent = SimpleNamespace(hooked_pids=lambda uid: frozenset({api}))
    w = job.series_windows(int(20e9))(key)
    assert w is not None and w.other_process_samples == 60 and f"pid {engine} " in str(w.other_detail)
