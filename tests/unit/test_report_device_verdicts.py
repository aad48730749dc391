"""The report's device table says only what the records show about a verdict."""

from __future__ import annotations

from infersight.agent.report.gpu import devices
from infersight.agent.report.parse import HistSample, Sample, Telemetry
from infersight.agent.requests.kind import DURATION, DURATION_BOUNDS
from infersight.telemetry import HistogramPoint, Resource

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
