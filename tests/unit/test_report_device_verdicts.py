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
