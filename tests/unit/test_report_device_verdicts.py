"""The report's device table says only what the records show about a verdict."""

from __future__ import annotations

from types import SimpleNamespace

from infersight.agent.report.gpu import Devices, devices
from infersight.agent.report.html import _devices
from infersight.agent.report.parse import HistSample, Sample, Telemetry
from infersight.agent.requests.kind import DURATION, DURATION_BOUNDS
from infersight.telemetry import HistogramPoint, LogItem, Resource

GPU = "GPU-fa4e0000-0000-4000-8000-00000000000%d"  # FAKE GPUs


def _hist(i: int, count: int, latency_s: float) -> HistSample:
    counts = [0] * (len(DURATION_BOUNDS) + 1)
    counts[next(k for k, b in enumerate(DURATION_BOUNDS) if latency_s <= b)] = count
    attrs = {"hw.type": "gpu", "hw.id": GPU % i, "hw.name": "FAKE H100", "infersight.device": "cuda:%d" % i,
             "infersight.model": "m", "infersight.request.class": "default"}
    point = HistogramPoint(list(DURATION_BOUNDS), counts, count, count * latency_s, latency_s, latency_s, attrs)
    return HistSample(Resource.of({"process.pid": 100 + i}), DURATION, "s", 1_000, point)


def test_histograms_without_a_verdict_are_not_called_peerless() -> None:
    """Two FAKE H100s serving one model, 50 requests each: below min_requests the agent publishes
    no coefficient and logs no verdict. They have a peer each; the page said no_peers."""
    rows = devices(Telemetry(histograms=[_hist(0, 50, 0.002), _hist(1, 50, 0.004)])).rows
    assert [r.device for r in rows] == [GPU % 0, GPU % 1]
    for r in rows:
        assert r.count == 50
        assert r.verdict == ""  # shown as "-"
        assert r.detail.startswith("no verdict in these records")
        assert r.coefficient is None


def test_a_published_coefficient_still_reads_ok() -> None:
    coef = Sample(Resource.of({}), "infersight.device.coefficient", "gauge", "1", 2_000, 1.02,
                  {"hw.type": "gpu", "hw.id": GPU % 0, "infersight.model": "m", "infersight.request.class": "default"})
    rows = devices(Telemetry(samples=[coef], histograms=[_hist(0, 500, 0.002)])).rows
    (row,) = rows
    assert (row.verdict, row.coefficient) == ("ok", 1.02)



def test_two_users_of_one_gpu_are_two_rows() -> None:
    """The agent's verdicts are per uid: two users serving the same model on one FAKE GPU get a row each, with
    their own requests and verdict (the rows were merged: counts added, the later user's verdict shown for both)."""
    hists = []
    for uid, count, latency in ((1001, 300, 0.002), (1002, 200, 0.02)):
        h = _hist(0, count, latency)
        hists.append(HistSample(Resource.of({"process.pid": uid, "process.user.id": uid}), h.name, h.unit, h.time_ns,
                                h.point))
    attrs = {"hw.type": "gpu", "hw.id": GPU % 0, "infersight.model": "m", "infersight.request.class": "default"}
    slow = LogItem(Resource.of({}), 3_000, 13, "WARN", "slow: P99 3.1x its peers'",
                   {**attrs, "process.user.id": 1002, "infersight.device.verdict": "slow",
                    "infersight.device.cause": "other_process"}, event_name="device")
    ok = LogItem(Resource.of({}), 4_000, 9, "INFO", "ok",
                 {**attrs, "process.user.id": 1001, "infersight.device.verdict": "ok"}, event_name="device")
    d = devices(Telemetry(histograms=hists, logs=[slow, ok]))
    assert [(r.user, r.count, r.verdict, r.cause) for r in d.rows] == [
        ("1001", 300, "ok", ""), ("1002", 200, "slow", "other_process")]
    html = _devices(SimpleNamespace(devices=d, t0_ns=0, t1_ns=1))  # type: ignore[arg-type]
    assert "uid 1001" in html and "uid 1002" in html
    # one user's rows name nobody
    (one,) = devices(Telemetry(histograms=hists[:1])).rows
    assert "uid" not in _devices(SimpleNamespace(devices=Devices([one], []), t0_ns=0, t1_ns=1))  # type: ignore[arg-type]


# -- the newest record says the figures (a review of the device path) ----------------------------------

ATTRS = {"hw.type": "gpu", "hw.id": GPU % 3, "infersight.model": "m", "infersight.request.class": "default"}


def _at(t_ns: int, count: int, latency_s: float = 0.06) -> HistSample:
    counts = [0] * (len(DURATION_BOUNDS) + 1)
    counts[next(k for k, b in enumerate(DURATION_BOUNDS) if latency_s <= b)] = count
    point = HistogramPoint(list(DURATION_BOUNDS), counts, count, count * latency_s, latency_s, latency_s,
                           {**ATTRS, "infersight.device": "cuda:0"})
    return HistSample(Resource.of({"process.pid": 100}), DURATION, "s", t_ns, point)


def _slow(t_ns: int) -> LogItem:
    return LogItem(Resource.of({}), t_ns, 13, "WARN", "slow", {
        **ATTRS, "infersight.device.verdict": "slow", "infersight.device.cause": "thermal_throttling",
        "infersight.request.count": 181, "infersight.request.p50_s": 0.0367, "infersight.request.p99_s": 0.0616,
        "infersight.device.coefficient": 1.78}, event_name="device")


def _coef(t_ns: int, value: float) -> Sample:
    return Sample(Resource.of({}), "infersight.device.coefficient", "gauge", "1", t_ns, value, dict(ATTRS))


def test_a_newer_coefficient_wins_over_the_slow_log() -> None:
    """The agent logs only on change: a slow log (181 requests, P99 0.0616, 1.78) from early on overwrote the
    coefficient and histogram published since (2000 requests, 3.0). The verdict and its cause still hold."""
    (row,) = devices(Telemetry(samples=[_coef(9_000, 3.0)], histograms=[_at(9_000, 2000)], logs=[_slow(2_000)])).rows
    assert (row.verdict, row.cause) == ("slow", "thermal_throttling")
    assert row.coefficient == 3.0 and row.count == 2000 and row.source == "histogram"
    assert row.p99_s is not None and row.p99_s != 0.0616


def test_the_slow_log_of_the_same_evaluation_gives_its_window() -> None:
    (row,) = devices(Telemetry(samples=[_coef(2_000, 1.78)], histograms=[_at(9_000, 2000)], logs=[_slow(2_000)])).rows
    assert (row.verdict, row.coefficient, row.count, row.p99_s, row.source) == ("slow", 1.78, 181, 0.0616, "verdict")


def test_insufficient_data_after_slow_shows_no_coefficient() -> None:
    aged = LogItem(Resource.of({}), 5_000, 9, "INFO", "no longer slow", {
        **ATTRS, "infersight.device.verdict": "insufficient_data", "infersight.request.count": 66,
        "infersight.request.p50_s": 0.0079, "infersight.request.p99_s": 0.015}, event_name="device")
    (row,) = devices(Telemetry(samples=[_coef(1_000, 1.5)], logs=[_slow(2_000), aged])).rows
    assert row.verdict == "insufficient_data" and row.coefficient is None and row.cause == ""
    # and a coefficient published after that says the series has peers and enough requests again: ok
    (row,) = devices(Telemetry(samples=[_coef(7_000, 1.01)], logs=[_slow(2_000), aged])).rows
    assert (row.verdict, row.coefficient, row.cause) == ("ok", 1.01, "")


def test_requests_with_no_device_are_no_device_row() -> None:
    """The ASGI middleware times every HTTP request with no device: infersight.device "unknown". The table listed
    `unknown | - | http` as a device."""
    http = _hist(0, 400, 0.03)
    attrs = {"infersight.device": "unknown", "infersight.request.class": "http"}
    http = HistSample(http.resource, http.name, http.unit, http.time_ns, HistogramPoint(
        http.point.bounds, http.point.bucket_counts, 400, 12.0, 0.03, 0.03, attrs))
    rows = devices(Telemetry(histograms=[http, _hist(1, 300, 0.002)])).rows
    assert [r.device for r in rows] == [GPU % 1]


def test_points_of_the_earlier_bounds_add_up_with_the_finer_ones() -> None:
    """Two producers of one series, one recorded by an agent with the earlier (coarser) request-duration bounds,
    one by an agent with the finer ones: both count (the second was dropped, its requests gone from the row)."""
    earlier = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
               40.96, 81.92]
    old_counts = [0] * (len(earlier) + 1)
    old_counts[earlier.index(0.04)] = 100  # (0.02, 0.04]
    new = _hist(0, 300, 0.03)  # (0.0283, 0.0336]
    old = HistSample(Resource.of({"process.pid": 99}), DURATION, "s", 500, HistogramPoint(
        earlier, old_counts, 100, 3.0, 0.03, 0.03, dict(new.point.attributes)))
    (row,) = devices(Telemetry(histograms=[old, new])).rows
    assert row.count == 400
    assert row.p50_s is not None and 0.02 <= row.p50_s <= 0.04


def test_collapse_adds_the_fine_buckets_into_the_coarse_ones() -> None:
    from infersight.agent.report.gpu import collapse

    assert collapse([1.0, 2.0, 3.0, 4.0], [1, 2, 3, 4, 5], [2.0, 4.0]) == [3, 7, 5]
    assert collapse([1.0, 2.0], [1, 2, 3], []) == [6]
    assert collapse([1.0, 2.0], [1, 2, 3], [1.0, 2.0]) == [1, 2, 3]
